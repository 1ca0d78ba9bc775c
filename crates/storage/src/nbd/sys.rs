//! The few system calls the NBD engine makes besides socket I/O: its epoll set and its
//! timerfd.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// The last OS error.
pub(crate) fn os_err() -> io::Error {
    io::Error::last_os_error()
}

/// `epoll_ctl(op)` for `fd` with `events`, tagged `data`.
pub(crate) fn epoll_ctl(
    epoll: &OwnedFd,
    op: i32,
    fd: RawFd,
    events: u32,
    data: u64,
) -> io::Result<()> {
    let mut ev = libc::epoll_event { events, u64: data };
    // SAFETY: a valid epoll descriptor and a live event struct.
    if unsafe { libc::epoll_ctl(epoll.as_raw_fd(), op, fd, &mut ev) } != 0 {
        return Err(os_err());
    }
    Ok(())
}

/// Arms the timerfd to fire once in `d` (zero disarms it).
pub(crate) fn settime(timer: &OwnedFd, d: Duration) -> io::Result<()> {
    let spec = libc::itimerspec {
        it_interval: libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        },
        it_value: libc::timespec {
            tv_sec: d.as_secs() as libc::time_t,
            tv_nsec: libc::c_long::from(d.subsec_nanos() as i32),
        },
    };
    // SAFETY: a valid itimerspec on a timerfd we own; the old value is not wanted.
    if unsafe { libc::timerfd_settime(timer.as_raw_fd(), 0, &spec, std::ptr::null_mut()) } != 0 {
        return Err(os_err());
    }
    Ok(())
}
