//! Confining `vblk serve` once its disk, sockets and NBD connections are open, so that a
//! bug in the code that parses guest memory and frontend messages all day is a crash, not
//! the host's root.
//!
//! Four layers, applied in this order by [`confine`] on the main thread before any other
//! long-lived thread starts (threads started later inherit all four):
//!
//! 1. **no_new_privs**, always: no exec can gain privileges (and seccomp and Landlock may
//!    then be used without CAP_SYS_ADMIN).
//! 2. **Capabilities**: every capability is dropped (bounding set, ambient, permitted,
//!    effective, inheritable): after set-up the daemon needs none.
//! 3. **Filesystem** ([`fs`]): a Landlock ruleset that handles every filesystem access
//!    right the kernel knows and grants only: removing the daemon's own socket files at
//!    exit, and reading /proc (to name the holder of an image lock). Nothing else can be
//!    opened, created, written, truncated or executed. With Landlock's network rights
//!    (ABI 4), TCP connects are allowed only to the NBD server's port, and binds never.
//!    Without Landlock in the kernel this layer is reported missing, loudly.
//! 4. **seccomp** ([`seccomp`]): an allow-list of the system calls the daemon makes after
//!    set-up, some with their arguments checked (sockets of the families in use, the
//!    ioctls of block devices, threads only), on every thread (TSYNC).
//!
//! io_uring submissions are not system calls seccomp can see; the io_uring engine
//! restricts its own rings instead (storage's `uring_engine`).

pub mod fs;
pub mod seccomp;
mod selftest;

use std::fmt;
use std::io;
use std::path::PathBuf;

pub use seccomp::SeccompMode;
pub use selftest::selftest;

/// How the daemon is confined.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SandboxConfig {
    /// The seccomp filter's action on a system call outside the allow-list.
    pub seccomp: SeccompMode,
    /// Confine the filesystem with Landlock.
    pub landlock: bool,
    /// Drop every capability.
    pub drop_caps: bool,
}

impl SandboxConfig {
    /// What `vblk serve` does unless told otherwise: every layer, seccomp killing.
    pub fn daemon() -> SandboxConfig {
        SandboxConfig {
            seccomp: SeccompMode::Kill,
            landlock: true,
            drop_caps: true,
        }
    }

    /// Nothing: the device runs in a process that is not its own (the embedded device of
    /// `vblk bench`, tests, a library user), which it must not confine.
    pub fn none() -> SandboxConfig {
        SandboxConfig {
            seccomp: SeccompMode::Off,
            landlock: false,
            drop_caps: false,
        }
    }

    fn is_none(&self) -> bool {
        *self == SandboxConfig::none()
    }
}

impl Default for SandboxConfig {
    /// [`SandboxConfig::none`]: a library default must not confine the caller's process;
    /// `vblk serve` asks for [`SandboxConfig::daemon`].
    fn default() -> Self {
        SandboxConfig::none()
    }
}

/// What the sandbox must leave open.
#[derive(Clone, Debug, Default)]
pub struct Needs {
    /// Socket files the daemon made and removes at exit.
    pub removable: Vec<PathBuf>,
    /// NBD servers over TCP: their ports (sockets of AF_INET/AF_INET6 and TCP connects to
    /// these ports are allowed; none otherwise).
    pub tcp_ports: Vec<u16>,
}

/// What was applied, for the log.
#[derive(Debug, Default)]
pub struct Report {
    /// One line per layer.
    pub lines: Vec<String>,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.lines.join("; "))
    }
}

/// Why the sandbox could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// A system call of the set-up failed.
    #[error("sandbox: {what}: {source}")]
    Sys {
        /// What was being done.
        what: &'static str,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Landlock refused the ruleset.
    #[error("sandbox: landlock: {0}")]
    Landlock(String),
    /// The seccomp filter could not be built or installed.
    #[error("sandbox: seccomp: {0}")]
    Seccomp(String),
}

/// Apply every layer `config` asks for, on this thread and (seccomp) every other one.
pub fn confine(config: &SandboxConfig, needs: &Needs) -> Result<Report, SandboxError> {
    let mut report = Report::default();
    if config.is_none() {
        report
            .lines
            .push("none (the process is not the daemon's own)".into());
        return Ok(report);
    }
    no_new_privs()?;
    report.lines.push("no_new_privs".into());
    if config.drop_caps {
        report.lines.push(drop_capabilities()?);
    }
    if config.landlock {
        report.lines.push(fs::confine(needs)?);
    } else {
        report
            .lines
            .push("filesystem not confined (--sandbox-fs off)".into());
    }
    report.lines.push(seccomp::install(config.seccomp, needs)?);
    Ok(report)
}

fn no_new_privs() -> Result<(), SandboxError> {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(SandboxError::Sys {
            what: "prctl(PR_SET_NO_NEW_PRIVS)",
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// The capability header and data `capget`/`capset` take (version 3: two 32-bit words).
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// The process's (inheritable, permitted, effective) capability sets, from /proc.
fn held_capabilities() -> Option<[u64; 3]> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
    };
    Some([field("CapInh:")?, field("CapPrm:")?, field("CapEff:")?])
}

/// Drop every capability: the bounding set (when we may), the ambient set, and the
/// permitted, effective and inheritable sets. A process that holds none (an ordinary
/// user, or a service manager that cleared them) has nothing to drop, and its service
/// manager may forbid `capset` itself.
fn drop_capabilities() -> Result<String, SandboxError> {
    if held_capabilities() == Some([0, 0, 0]) {
        return Ok("no capabilities held".to_string());
    }
    let last = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(63);
    let mut bounding = 0;
    for cap in 0..=last {
        // SAFETY: prctl with integer arguments only.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) } == 0 {
            bounding += 1;
        }
    }
    // SAFETY: prctl with integer arguments only.
    unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    };
    let mut hdr = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let data = [CapData::default(); 2];
    // SAFETY: capset reads a version-3 header and two data structs, all live locals.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &mut hdr, data.as_ptr()) };
    if rc != 0 {
        return Err(SandboxError::Sys {
            what: "capset (drop every capability)",
            source: io::Error::last_os_error(),
        });
    }
    Ok(if bounding > 0 {
        "capabilities dropped (all, bounding set too)".to_string()
    } else {
        "capabilities dropped (all)".to_string()
    })
}
