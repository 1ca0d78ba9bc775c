//! The backstop against a frontend that shrinks its memory under the device.
//!
//! Guest memory is a file (a memfd, usually) that the frontend maps and passes to us. The
//! device checks at map time that every region lies inside its file (`memory.rs`), but a
//! frontend can `ftruncate` the file afterwards: the next access to a page past the new
//! end raises SIGBUS, whose default action kills the daemon. QEMU's
//! `memory-backend-memfd` seals its memfds against shrinking (`F_SEAL_SHRINK`), so a well
//! behaved frontend never does this; a hostile or buggy one must not be able to take the
//! daemon (and every other disk it serves) down with it.
//!
//! A SIGBUS at an address inside a registered guest mapping is answered by mapping a
//! fresh anonymous page over the faulting page (`MAP_FIXED`): the faulting access is
//! retried and sees zeroes, and the owner's poison flag is raised. The session that owns
//! the mapping sees the flag and ends the connection. A SIGBUS anywhere else (a real bug)
//! gets the default action. Accesses made by the kernel on our behalf (io_uring reading a
//! truncated page) do not raise SIGBUS: they fail with EFAULT and the request gets IOERR.
//!
//! What remains: a hugetlbfs mapping cannot be patched with a 4 KiB page; a fault there
//! still kills the daemon (hugetlbfs files cannot be shrunk below mapped pages in use by
//! the frontend's own guest without it crashing first, so this is a frontend that is
//! already broken).

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Once};

/// Registered mappings at most (QEMU uses a handful; 509 memory slots per session).
const SLOTS: usize = 2048;

struct Entry {
    start: AtomicUsize,
    end: AtomicUsize,
    flag: AtomicPtr<AtomicBool>,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Entry = Entry {
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
    flag: AtomicPtr::new(std::ptr::null_mut()),
};

static TABLE: [Entry; SLOTS] = [EMPTY; SLOTS];
static INSTALL: Once = Once::new();

/// A registered mapping; unregistered on drop.
#[derive(Debug)]
pub(crate) struct Registration {
    slot: usize,
    // Keeps the flag the handler may write alive while registered.
    _flag: Arc<AtomicBool>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let e = &TABLE[self.slot];
        e.end.store(0, Ordering::SeqCst);
        e.start.store(0, Ordering::SeqCst);
        e.flag.store(std::ptr::null_mut(), Ordering::SeqCst);
    }
}

/// Register `len` bytes at `start` as guest memory whose SIGBUS raises `flag` instead of
/// killing the process. None when the table is full (then a SIGBUS there kills).
pub(crate) fn register(start: *mut u8, len: usize, flag: &Arc<AtomicBool>) -> Option<Registration> {
    install();
    let start = start as usize;
    let end = start.checked_add(len)?;
    for (slot, e) in TABLE.iter().enumerate() {
        if e.flag
            .compare_exchange(
                std::ptr::null_mut(),
                Arc::as_ptr(flag).cast_mut(),
                Ordering::SeqCst,
                Ordering::SeqCst,
            )
            .is_ok()
        {
            e.start.store(start, Ordering::SeqCst);
            e.end.store(end, Ordering::SeqCst);
            return Some(Registration {
                slot,
                _flag: flag.clone(),
            });
        }
    }
    log::warn!("SIGBUS guard table full ({SLOTS} mappings): a truncated guest memory file there would kill the daemon");
    None
}

fn install() {
    INSTALL.call_once(|| {
        // SAFETY: a zeroed sigaction is a valid "no flags, empty mask" value; the handler
        // has the SA_SIGINFO signature and only uses async-signal-safe operations
        // (atomics and mmap).
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigbus as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut sa.sa_mask);
            if libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut()) != 0 {
                log::warn!(
                    "cannot install the SIGBUS guard: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    });
}

extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers; si_addr is the
    // faulting address for SIGBUS.
    let addr = unsafe { (*info).si_addr() } as usize;
    for e in TABLE.iter() {
        let flag = e.flag.load(Ordering::SeqCst);
        if flag.is_null() {
            continue;
        }
        let (start, end) = (e.start.load(Ordering::SeqCst), e.end.load(Ordering::SeqCst));
        if addr < start || addr >= end {
            continue;
        }
        let page = addr & !4095;
        // SAFETY: `page` lies inside a guest mapping this process made (registered above
        // and not yet unregistered); replacing one page of it with anonymous memory only
        // changes what that shared view shows, and no Rust reference into guest memory
        // exists (all guest accesses are raw-pointer copies).
        let r = unsafe {
            libc::mmap(
                page as *mut libc::c_void,
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if r != libc::MAP_FAILED {
            // SAFETY: the Registration holding this slot keeps the flag's Arc alive.
            unsafe { (*flag).store(true, Ordering::SeqCst) };
            return;
        }
        break;
    }
    // Not guest memory (or it could not be patched): die as SIGBUS would have.
    // SAFETY: restoring the default disposition; the faulting access is retried on return
    // and raises SIGBUS again, now fatal.
    unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A memfd mapped past its end, touched: the guard patches the page and raises the
    /// flag instead of the process dying.
    #[test]
    fn truncated_mapping_is_patched_and_flagged() {
        // SAFETY: plain syscalls on a memfd this test owns; the mapping is unmapped below.
        unsafe {
            let fd = libc::memfd_create(c"sigbus-test".as_ptr(), libc::MFD_CLOEXEC);
            assert!(fd >= 0);
            assert_eq!(libc::ftruncate(fd, 8192), 0);
            let p = libc::mmap(
                std::ptr::null_mut(),
                8192,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            ) as *mut u8;
            assert_ne!(p as *mut libc::c_void, libc::MAP_FAILED);
            let flag = Arc::new(AtomicBool::new(false));
            let reg = register(p, 8192, &flag).unwrap();
            p.write_volatile(7);
            assert_eq!(libc::ftruncate(fd, 4096), 0);
            assert_eq!(p.read_volatile(), 7, "the first page is still backed");
            assert!(!flag.load(Ordering::SeqCst));
            assert_eq!(p.add(4096).read_volatile(), 0, "patched page reads zero");
            assert!(flag.load(Ordering::SeqCst));
            drop(reg);
            libc::munmap(p.cast(), 8192);
            libc::close(fd);
        }
    }
}
