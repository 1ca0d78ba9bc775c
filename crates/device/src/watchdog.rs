//! The backstop for a system call on a descriptor the frontend shares with us.
//!
//! Some notifications can only be sent with `write(2)` on an eventfd the frontend created
//! (call and error eventfds: Linux has no per-call "don't block" flag for an eventfd
//! write, and `O_NONBLOCK` lives in the open file description, which the frontend shares
//! and can clear again). A frontend that clears it and saturates the counter makes that
//! write block until it reads — which a hostile frontend never does.
//!
//! Such calls run inside [`guarded`]: the thread marks itself "in a guarded call" (a
//! sequence number it makes odd on entry and even on exit: two stores to a line only it
//! writes). One watchdog thread per process looks at every guard every
//! [`PERIOD`]; a guard found odd with the same sequence number twice in a row (the call
//! has lasted at least one period) gets a signal sent to its thread. The signal's handler
//! does nothing and is installed without `SA_RESTART`, so the blocked call returns
//! `EINTR`, and the caller treats the descriptor as wedged (the session is ended).
//!
//! The watchdog thread starts with the first guard and sleeps between looks; it costs one
//! wake-up per period for the whole process.

use std::cell::OnceCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once, Weak};
use std::time::Duration;

/// How often the watchdog looks; a guarded call is interrupted after one to two periods.
pub(crate) const PERIOD: Duration = Duration::from_millis(500);

/// One thread's guard.
#[derive(Debug)]
struct Guard {
    /// Odd while the thread is inside a guarded call.
    seq: AtomicU64,
    /// The thread's kernel id (for `tgkill`).
    tid: libc::pid_t,
}

static GUARDS: Mutex<Vec<Weak<Guard>>> = Mutex::new(Vec::new());
static START: Once = Once::new();

thread_local! {
    static MINE: OnceCell<Arc<Guard>> = const { OnceCell::new() };
}

/// The signal that interrupts a stuck call: a real-time signal no one else in vblk uses.
fn signal() -> libc::c_int {
    libc::SIGRTMIN() + 4
}

extern "C" fn interrupt(_sig: libc::c_int) {}

fn start() {
    START.call_once(|| {
        // SAFETY: a zeroed sigaction is "no flags, empty mask"; the handler is an empty
        // extern "C" fn, async-signal-safe. No SA_RESTART: the interrupted call returns
        // EINTR.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = interrupt as *const () as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            if libc::sigaction(signal(), &sa, std::ptr::null_mut()) != 0 {
                log::warn!(
                    "cannot install the watchdog's signal handler: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
        let spawned = std::thread::Builder::new()
            .name("vblk-watchdog".into())
            .spawn(watch);
        if let Err(e) = spawned {
            log::warn!("cannot start the watchdog thread: {e}");
        }
    });
}

fn watch() {
    // (guard, sequence number seen last time)
    let mut seen: Vec<(Weak<Guard>, u64)> = Vec::new();
    loop {
        std::thread::sleep(PERIOD);
        {
            let guards = GUARDS.lock().unwrap_or_else(|p| p.into_inner());
            seen.retain(|(w, _)| w.strong_count() > 0);
            for g in guards.iter() {
                if !seen.iter().any(|(w, _)| w.ptr_eq(g)) {
                    seen.push((g.clone(), 0));
                }
            }
        }
        for (w, last) in seen.iter_mut() {
            let Some(g) = w.upgrade() else { continue };
            let now = g.seq.load(Ordering::Acquire);
            if now % 2 == 1 && now == *last {
                // SAFETY: tgkill only sends a signal; the handler does nothing.
                unsafe {
                    libc::syscall(libc::SYS_tgkill, libc::getpid(), g.tid, signal());
                }
            }
            *last = now;
        }
        GUARDS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|w| w.strong_count() > 0);
    }
}

fn mine<T>(f: impl FnOnce(&Guard) -> T) -> T {
    MINE.with(|cell| {
        let g = cell.get_or_init(|| {
            start();
            let g = Arc::new(Guard {
                seq: AtomicU64::new(0),
                // SAFETY: gettid has no preconditions.
                tid: unsafe { libc::gettid() },
            });
            GUARDS
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(Arc::downgrade(&g));
            g
        });
        f(g)
    })
}

/// Run `call` (one system call on a descriptor the frontend shares) so that it is
/// interrupted with `EINTR` if it blocks for more than a watchdog period or two.
pub(crate) fn guarded<T>(call: impl FnOnce() -> T) -> T {
    mine(|g| {
        let s = g.seq.load(Ordering::Relaxed);
        g.seq.store(s.wrapping_add(1), Ordering::Release);
        let r = call();
        g.seq.store(s.wrapping_add(2), Ordering::Release);
        r
    })
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;
    use std::time::Instant;

    use super::*;

    /// An eventfd write that would block for ever (the counter is saturated and the fd is
    /// blocking) is interrupted by the watchdog.
    #[test]
    fn a_blocked_eventfd_write_is_interrupted() {
        let efd = vmm_sys_util::eventfd::EventFd::new(0).unwrap();
        efd.write(u64::MAX - 1).unwrap();
        let t0 = Instant::now();
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live local to an eventfd this test owns.
        let r = guarded(|| unsafe { libc::write(efd.as_raw_fd(), one.as_ptr().cast(), 8) });
        let e = std::io::Error::last_os_error();
        assert_eq!(r, -1);
        assert_eq!(e.raw_os_error(), Some(libc::EINTR), "{e}");
        assert!(t0.elapsed() >= PERIOD, "it did block first");
        // A call that does not block is not interrupted.
        assert_eq!(efd.read().unwrap(), u64::MAX - 1);
        // SAFETY: as above.
        let r = guarded(|| unsafe { libc::write(efd.as_raw_fd(), one.as_ptr().cast(), 8) });
        assert_eq!(r, 8);
    }
}
