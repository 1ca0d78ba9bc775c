//! The seccomp layer: an allow-list of the system calls `vblk serve` makes once set up,
//! built with rust-vmm's `seccompiler`, installed on every thread at once (TSYNC).
//!
//! The list was taken from the daemon's own calls under the whole test suite (run with
//! `--seccomp log`, collecting the kernel's audit lines) and is checked the same way:
//! the suite runs with `--seccomp kill`, so a call missing from the list fails CI.
//! Some calls are allowed only with certain arguments:
//! - `socket`: AF_UNIX, and AF_INET/AF_INET6 only when an NBD disk is reached over TCP;
//! - `ioctl`: the block-device requests the daemon uses (size, sector size, discard,
//!   zero-out) and FIONBIO;
//! - `clone`: threads only (CLONE_THREAD); `clone3` answers ENOSYS (its flags are in
//!   memory, where seccomp cannot look), so glibc falls back to `clone`;
//! - `mmap`, `mprotect`: never PROT_EXEC (no code is loaded after set-up);
//! - `prctl`: naming threads, and a worker thread's timer slack (its timed sleeps end
//!   within a µs of their deadline, not the default 50 µs after it).
//!
//! What a call outside the list does ([`SeccompMode`]): `kill` ends the process
//! (SECCOMP_RET_KILL_PROCESS, the default), `trap` reports the call and the thread's name
//! on stderr and exits (SIGSYS), `log` lets it through and the kernel logs it, `off`
//! installs nothing.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use seccompiler::{
    apply_filter_all_threads, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp,
    SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};

use super::{Needs, SandboxError};

/// What a system call outside the allow-list does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SeccompMode {
    /// The kernel kills the process.
    #[default]
    Kill,
    /// The call is reported (its name, the thread's name) and the process exits.
    Trap,
    /// The call goes through and the kernel logs it.
    Log,
    /// No filter.
    Off,
}

impl FromStr for SeccompMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "kill" => Ok(SeccompMode::Kill),
            "trap" => Ok(SeccompMode::Trap),
            "log" => Ok(SeccompMode::Log),
            "off" | "none" => Ok(SeccompMode::Off),
            _ => Err(format!("{s:?}: expected kill, trap, log or off")),
        }
    }
}

impl fmt::Display for SeccompMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SeccompMode::Kill => "kill",
            SeccompMode::Trap => "trap",
            SeccompMode::Log => "log",
            SeccompMode::Off => "off",
        })
    }
}

/// The system calls allowed with any arguments.
pub const ALLOWED: &[(&str, i64)] = &[
    ("accept4", libc::SYS_accept4),
    ("brk", libc::SYS_brk),
    ("clock_gettime", libc::SYS_clock_gettime),
    ("clock_nanosleep", libc::SYS_clock_nanosleep),
    ("close", libc::SYS_close),
    ("connect", libc::SYS_connect),
    ("dup", libc::SYS_dup),
    ("epoll_create1", libc::SYS_epoll_create1),
    ("epoll_ctl", libc::SYS_epoll_ctl),
    ("epoll_pwait", libc::SYS_epoll_pwait),
    ("epoll_pwait2", libc::SYS_epoll_pwait2),
    ("epoll_wait", libc::SYS_epoll_wait),
    ("eventfd2", libc::SYS_eventfd2),
    ("exit", libc::SYS_exit),
    ("exit_group", libc::SYS_exit_group),
    ("fadvise64", libc::SYS_fadvise64),
    ("fallocate", libc::SYS_fallocate),
    ("fcntl", libc::SYS_fcntl),
    ("fdatasync", libc::SYS_fdatasync),
    ("fgetxattr", libc::SYS_fgetxattr),
    ("fsetxattr", libc::SYS_fsetxattr),
    ("fstat", libc::SYS_fstat),
    ("fstatfs", libc::SYS_fstatfs),
    ("fsync", libc::SYS_fsync),
    ("ftruncate", libc::SYS_ftruncate),
    ("futex", libc::SYS_futex),
    ("getdents64", libc::SYS_getdents64),
    ("getpid", libc::SYS_getpid),
    ("getrandom", libc::SYS_getrandom),
    ("getsockopt", libc::SYS_getsockopt),
    ("gettid", libc::SYS_gettid),
    ("io_destroy", libc::SYS_io_destroy),
    ("io_getevents", libc::SYS_io_getevents),
    ("io_setup", libc::SYS_io_setup),
    ("io_submit", libc::SYS_io_submit),
    ("io_uring_enter", libc::SYS_io_uring_enter),
    ("io_uring_register", libc::SYS_io_uring_register),
    ("io_uring_setup", libc::SYS_io_uring_setup),
    ("lseek", libc::SYS_lseek),
    ("madvise", libc::SYS_madvise),
    ("memfd_create", libc::SYS_memfd_create),
    ("mremap", libc::SYS_mremap),
    ("munmap", libc::SYS_munmap),
    ("nanosleep", libc::SYS_nanosleep),
    ("newfstatat", libc::SYS_newfstatat),
    ("openat", libc::SYS_openat),
    ("poll", libc::SYS_poll),
    ("ppoll", libc::SYS_ppoll),
    ("pread64", libc::SYS_pread64),
    ("preadv", libc::SYS_preadv),
    ("preadv2", libc::SYS_preadv2),
    ("pwrite64", libc::SYS_pwrite64),
    ("pwritev", libc::SYS_pwritev),
    ("pwritev2", libc::SYS_pwritev2),
    ("read", libc::SYS_read),
    ("readlink", libc::SYS_readlink),
    ("readlinkat", libc::SYS_readlinkat),
    ("readv", libc::SYS_readv),
    ("recvfrom", libc::SYS_recvfrom),
    ("recvmsg", libc::SYS_recvmsg),
    ("restart_syscall", libc::SYS_restart_syscall),
    ("rseq", libc::SYS_rseq),
    ("rt_sigaction", libc::SYS_rt_sigaction),
    ("rt_sigprocmask", libc::SYS_rt_sigprocmask),
    ("rt_sigreturn", libc::SYS_rt_sigreturn),
    ("rt_sigtimedwait", libc::SYS_rt_sigtimedwait),
    ("sched_getaffinity", libc::SYS_sched_getaffinity),
    ("sched_setaffinity", libc::SYS_sched_setaffinity),
    ("sched_yield", libc::SYS_sched_yield),
    ("sendmsg", libc::SYS_sendmsg),
    ("sendto", libc::SYS_sendto),
    ("set_robust_list", libc::SYS_set_robust_list),
    ("setsockopt", libc::SYS_setsockopt),
    ("shutdown", libc::SYS_shutdown),
    ("sigaltstack", libc::SYS_sigaltstack),
    ("statx", libc::SYS_statx),
    ("tgkill", libc::SYS_tgkill),
    ("timerfd_create", libc::SYS_timerfd_create),
    ("timerfd_settime", libc::SYS_timerfd_settime),
    ("unlink", libc::SYS_unlink),
    ("unlinkat", libc::SYS_unlinkat),
    ("write", libc::SYS_write),
    ("writev", libc::SYS_writev),
];

/// The system calls allowed with some arguments only (see the module doc).
pub const CONDITIONAL: &[(&str, i64)] = &[
    ("clone", libc::SYS_clone),
    ("clone3", libc::SYS_clone3),
    ("ioctl", libc::SYS_ioctl),
    ("mmap", libc::SYS_mmap),
    ("mprotect", libc::SYS_mprotect),
    ("prctl", libc::SYS_prctl),
    ("socket", libc::SYS_socket),
];

/// Block-device ioctls: BLKGETSIZE64, BLKSSZGET, BLKDISCARD, BLKZEROOUT.
const IOCTLS: &[u64] = &[0x8008_1272, 0x1268, 0x1277, 0x127f, libc::FIONBIO];

/// The name of system call `nr`, if it is one the lists (or a few notable others) name.
pub fn name_of(nr: i64) -> &'static str {
    const NOTABLE: &[(&str, i64)] = &[
        ("execve", libc::SYS_execve),
        ("execveat", libc::SYS_execveat),
        ("open", libc::SYS_open),
        ("ptrace", libc::SYS_ptrace),
        ("fork", libc::SYS_fork),
        ("vfork", libc::SYS_vfork),
        ("mount", libc::SYS_mount),
        ("bind", libc::SYS_bind),
        ("listen", libc::SYS_listen),
        ("kill", libc::SYS_kill),
        ("setuid", libc::SYS_setuid),
        ("chmod", libc::SYS_chmod),
        ("mkdir", libc::SYS_mkdir),
    ];
    ALLOWED
        .iter()
        .chain(CONDITIONAL)
        .chain(NOTABLE)
        .find(|(_, n)| *n == nr)
        .map_or("?", |(name, _)| name)
}

fn cond(arg: u8, op: SeccompCmpOp, value: u64) -> Result<SeccompCondition, SandboxError> {
    SeccompCondition::new(arg, SeccompCmpArgLen::Qword, op, value)
        .map_err(|e| SandboxError::Seccomp(e.to_string()))
}

fn rule(conds: Vec<SeccompCondition>) -> Result<SeccompRule, SandboxError> {
    SeccompRule::new(conds).map_err(|e| SandboxError::Seccomp(e.to_string()))
}

/// The allow-list filter, with `mismatch` for everything else.
fn allow_list(needs: &Needs, mismatch: SeccompAction) -> Result<BpfProgram, SandboxError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for &(_, nr) in ALLOWED {
        rules.insert(nr, Vec::new());
    }
    let mut families = vec![libc::AF_UNIX];
    if !needs.tcp_ports.is_empty() {
        families.extend([libc::AF_INET, libc::AF_INET6]);
    }
    rules.insert(
        libc::SYS_socket,
        families
            .iter()
            .map(|&f| rule(vec![cond(0, SeccompCmpOp::Eq, f as u64)?]))
            .collect::<Result<_, _>>()?,
    );
    rules.insert(
        libc::SYS_ioctl,
        IOCTLS
            .iter()
            .map(|&r| rule(vec![cond(1, SeccompCmpOp::Eq, r)?]))
            .collect::<Result<_, _>>()?,
    );
    let thread = libc::CLONE_THREAD as u64;
    rules.insert(
        libc::SYS_clone,
        vec![rule(vec![cond(
            0,
            SeccompCmpOp::MaskedEq(thread),
            thread,
        )?])?],
    );
    // Allowed here, answered ENOSYS by the second filter (the stricter action wins).
    rules.insert(libc::SYS_clone3, Vec::new());
    let exec = libc::PROT_EXEC as u64;
    for nr in [libc::SYS_mmap, libc::SYS_mprotect] {
        rules.insert(
            nr,
            vec![rule(vec![cond(2, SeccompCmpOp::MaskedEq(exec), 0)?])?],
        );
    }
    rules.insert(
        libc::SYS_prctl,
        [
            libc::PR_SET_NAME,
            libc::PR_GET_NAME,
            libc::PR_SET_TIMERSLACK,
        ]
        .iter()
        .map(|&op| rule(vec![cond(0, SeccompCmpOp::Eq, op as u64)?]))
        .collect::<Result<_, _>>()?,
    );
    let arch = TargetArch::x86_64;
    SeccompFilter::new(rules, mismatch, SeccompAction::Allow, arch)
        .and_then(BpfProgram::try_from)
        .map_err(|e| SandboxError::Seccomp(e.to_string()))
}

/// The second filter: clone3 answers ENOSYS, everything else goes on to the first.
fn clone3_enosys() -> Result<BpfProgram, SandboxError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    rules.insert(libc::SYS_clone3, Vec::new());
    SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        TargetArch::x86_64,
    )
    .and_then(BpfProgram::try_from)
    .map_err(|e| SandboxError::Seccomp(e.to_string()))
}

/// Install the filters on every thread; a line for the report.
pub(crate) fn install(mode: SeccompMode, needs: &Needs) -> Result<String, SandboxError> {
    let mismatch = match mode {
        SeccompMode::Off => return Ok("seccomp off".into()),
        SeccompMode::Kill => SeccompAction::KillProcess,
        SeccompMode::Trap => {
            install_sigsys_reporter()?;
            SeccompAction::Trap
        }
        SeccompMode::Log => SeccompAction::Log,
    };
    // seccompiler sets no_new_privs with prctl before it installs a filter: the
    // allow-list, which does not let that prctl through, goes last.
    let filters = [clone3_enosys()?, allow_list(needs, mismatch)?];
    for f in &filters {
        apply_filter_all_threads(f).map_err(|e| SandboxError::Seccomp(e.to_string()))?;
    }
    Ok(format!(
        "seccomp: {} system calls allowed, {} with their arguments checked; others: {mode}",
        ALLOWED.len(),
        CONDITIONAL.len()
    ))
}

fn install_sigsys_reporter() -> Result<(), SandboxError> {
    // SAFETY: a zeroed sigaction is "no flags, empty mask"; the handler only uses
    // async-signal-safe calls (prctl, write, _exit) on stack buffers.
    let rc = unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigsys as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGSYS, &sa, std::ptr::null_mut())
    };
    if rc != 0 {
        return Err(SandboxError::Sys {
            what: "sigaction(SIGSYS)",
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Append `s` to `buf` at `*at` (bounded), for the SIGSYS report.
fn put(buf: &mut [u8], at: &mut usize, s: &[u8]) {
    let n = s.len().min(buf.len() - *at);
    buf[*at..*at + n].copy_from_slice(&s[..n]);
    *at += n;
}

extern "C" fn on_sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // siginfo for SIGSYS: after signo, errno, code and padding (16 bytes) come the
    // calling address (8) and the system call number (4).
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers, at least 128
    // bytes; offset 24 is `si_syscall` for SIGSYS.
    let nr = unsafe { info.cast::<u8>().add(24).cast::<i32>().read_unaligned() };
    let mut thread = [0u8; 17];
    // SAFETY: PR_GET_NAME writes at most 16 bytes and a NUL into the 17-byte buffer.
    unsafe { libc::prctl(libc::PR_GET_NAME, thread.as_mut_ptr(), 0, 0, 0) };
    let tlen = thread.iter().position(|&b| b == 0).unwrap_or(16);
    let mut msg = [0u8; 256];
    let mut at = 0;
    put(&mut msg, &mut at, b"vblk: seccomp: thread ");
    put(&mut msg, &mut at, &thread[..tlen]);
    put(&mut msg, &mut at, b" made system call ");
    let mut digits = [0u8; 12];
    let mut n = i64::from(nr).unsigned_abs();
    let mut d = digits.len();
    loop {
        d -= 1;
        digits[d] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    put(&mut msg, &mut at, &digits[d..]);
    put(&mut msg, &mut at, b" (");
    put(&mut msg, &mut at, name_of(i64::from(nr)).as_bytes());
    put(
        &mut msg,
        &mut at,
        b"), which the sandbox does not allow; exiting (--seccomp trap)\n",
    );
    // SAFETY: write of a live stack buffer to stderr, then _exit: both async-signal-safe.
    unsafe {
        libc::write(2, msg.as_ptr().cast(), at);
        libc::_exit(159);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lists_name_each_call_once() {
        let mut all: Vec<i64> = ALLOWED.iter().chain(CONDITIONAL).map(|(_, n)| *n).collect();
        let n = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n, "a system call listed twice");
        assert_eq!(name_of(libc::SYS_execve), "execve");
        assert_eq!(name_of(libc::SYS_io_uring_enter), "io_uring_enter");
        assert!("kill".parse::<SeccompMode>().is_ok());
        assert!("nope".parse::<SeccompMode>().is_err());
    }

    #[test]
    fn the_filters_compile() {
        let needs = Needs::default();
        assert!(allow_list(&needs, SeccompAction::KillProcess).is_ok());
        assert!(clone3_enosys().is_ok());
    }
}
