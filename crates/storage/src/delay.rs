//! A testing aid: an engine wrapper that holds every Nth completion back for a while, so
//! that completions come out of order and some requests stay in flight for long. It is
//! how the device's out-of-order paths (inflight recovery after a crash, stopping a ring
//! with requests in flight, guests' timeouts) are exercised with real I/O.
//!
//! The wrapper's completion fd is an epoll set holding the wrapped engine's fd and a
//! timerfd armed for the earliest held completion, so a worker sleeping on it wakes for
//! either.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use crate::engine::{Completion, Engine, Full, Op};

/// Hold every `every`-th completion back by `by`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Delay {
    /// Which completions: every this many (1: all).
    pub every: u32,
    /// For how long.
    pub by: Duration,
}

impl std::str::FromStr for Delay {
    type Err = String;

    /// `N:MS`, e.g. `4:50`: every 4th completion 50 ms late.
    fn from_str(s: &str) -> Result<Delay, String> {
        let bad = || format!("{s:?}: expected N:MS, e.g. 4:50 (every 4th request 50 ms late)");
        let (n, ms) = s.split_once(':').ok_or_else(bad)?;
        let every: u32 = n.parse().map_err(|_| bad())?;
        let ms: u64 = ms.parse().map_err(|_| bad())?;
        if every == 0 || ms > 60_000 {
            return Err(format!("{s:?}: N must be at least 1 and MS at most 60000"));
        }
        Ok(Delay {
            every,
            by: Duration::from_millis(ms),
        })
    }
}

/// The wrapper.
pub(crate) struct DelayEngine {
    inner: Box<dyn Engine>,
    delay: Delay,
    seen: u64,
    held: VecDeque<(Instant, Completion)>,
    timer: OwnedFd,
    epoll: OwnedFd,
}

impl DelayEngine {
    pub(crate) fn new(inner: Box<dyn Engine>, delay: Delay) -> io::Result<DelayEngine> {
        // SAFETY: plain syscalls creating new descriptors, owned right below.
        let (timer, epoll) = unsafe {
            let t = libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            );
            if t < 0 {
                return Err(io::Error::last_os_error());
            }
            let timer = OwnedFd::from_raw_fd(t);
            let e = libc::epoll_create1(libc::EPOLL_CLOEXEC);
            if e < 0 {
                return Err(io::Error::last_os_error());
            }
            (timer, OwnedFd::from_raw_fd(e))
        };
        let add = |fd: RawFd| {
            let mut ev = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: fd as u64,
            };
            // SAFETY: adds a live descriptor to our own epoll set; `ev` is a live struct.
            if unsafe { libc::epoll_ctl(epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) } != 0
            {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        };
        add(timer.as_raw_fd())?;
        if let Some(fd) = inner.notify_fd() {
            add(fd)?;
        }
        Ok(DelayEngine {
            inner,
            delay,
            seen: 0,
            held: VecDeque::new(),
            timer,
            epoll,
        })
    }

    /// Arm the timer for the earliest held completion (or disarm it).
    fn arm(&self) {
        let mut spec: libc::itimerspec =
            // SAFETY: itimerspec is plain data; all-zero disarms.
            unsafe { std::mem::zeroed() };
        if let Some((due, _)) = self.held.front() {
            let left = due
                .saturating_duration_since(Instant::now())
                .max(Duration::from_micros(1));
            spec.it_value.tv_sec = left.as_secs() as libc::time_t;
            spec.it_value.tv_nsec = libc::c_long::from(left.subsec_nanos() as i32);
        }
        // SAFETY: our own timerfd and a live itimerspec.
        unsafe { libc::timerfd_settime(self.timer.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
    }

    fn clear_timer(&self) {
        let mut buf = [0u8; 8];
        // SAFETY: reads 8 bytes into a local buffer from our non-blocking timerfd.
        unsafe { libc::read(self.timer.as_raw_fd(), buf.as_mut_ptr().cast(), 8) };
    }
}

impl Engine for DelayEngine {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    unsafe fn push(&mut self, token: u64, op: Op) -> Result<(), Full> {
        // SAFETY: the caller's contract, forwarded; held completions keep it (the caller
        // does not see them before they are handed over).
        unsafe { self.inner.push(token, op) }
    }

    fn submit(&mut self) -> io::Result<()> {
        self.inner.submit()
    }

    fn reap(&mut self, f: &mut dyn FnMut(Completion)) -> usize {
        let now = Instant::now();
        let every = u64::from(self.delay.every);
        let by = self.delay.by;
        let mut n = 0;
        let held = &mut self.held;
        let seen = &mut self.seen;
        self.inner.reap(&mut |c| {
            *seen += 1;
            if (*seen).is_multiple_of(every) {
                held.push_back((now + by, c));
            } else {
                f(c);
                n += 1;
            }
        });
        self.clear_timer();
        while self.held.front().is_some_and(|(due, _)| *due <= now) {
            if let Some((_, c)) = self.held.pop_front() {
                f(c);
                n += 1;
            }
        }
        self.arm();
        n
    }

    fn wait(&mut self) -> io::Result<()> {
        if self.inner.in_flight() > 0 {
            return self.inner.wait();
        }
        if let Some((due, _)) = self.held.front() {
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
        }
        Ok(())
    }

    fn notify_fd(&self) -> Option<RawFd> {
        Some(self.epoll.as_raw_fd())
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight() + self.held.len()
    }

    fn backlog(&self) -> usize {
        self.inner.backlog()
    }
}

/// `engine`, with every `delay.every`-th completion held back by `delay.by`.
pub fn delayed(engine: Box<dyn Engine>, delay: Delay) -> io::Result<Box<dyn Engine>> {
    Ok(Box::new(DelayEngine::new(engine, delay)?))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{Backend, DiskSpec, EngineKind, OpenOptions};

    #[test]
    fn every_second_completion_comes_late() {
        assert_eq!(
            "4:50".parse::<Delay>(),
            Ok(Delay {
                every: 4,
                by: Duration::from_millis(50)
            })
        );
        assert!("0:50".parse::<Delay>().is_err());
        assert!("4".parse::<Delay>().is_err());
        let target = concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/tmp");
        std::fs::create_dir_all(target).unwrap();
        let dir = tempfile::tempdir_in(target).unwrap();
        let path = dir.path().join("d.img");
        std::fs::write(&path, vec![7u8; 65536]).unwrap();
        let b = Arc::new(Backend::open(&DiskSpec::File(path), &OpenOptions::default()).unwrap());
        for kind in [EngineKind::Sync, EngineKind::IoUring] {
            let inner = b.engine(kind, 8).unwrap();
            let mut e = delayed(
                inner,
                Delay {
                    every: 2,
                    by: Duration::from_millis(80),
                },
            )
            .unwrap();
            let mut bufs = vec![vec![0u8; 512]; 4];
            let iovs: Vec<libc::iovec> = bufs
                .iter_mut()
                .map(|b| libc::iovec {
                    iov_base: b.as_mut_ptr().cast(),
                    iov_len: 512,
                })
                .collect();
            for (i, v) in iovs.iter().enumerate() {
                // SAFETY: the buffers outlive every completion, all reaped below.
                unsafe {
                    e.push(
                        i as u64,
                        Op::Read {
                            offset: 512 * i as u64,
                            iov: v,
                            iovcnt: 1,
                        },
                    )
                }
                .unwrap();
            }
            e.submit().unwrap();
            let t0 = Instant::now();
            let mut got = Vec::new();
            while got.len() < 2 {
                e.wait().unwrap();
                e.reap(&mut |c| got.push(c.token));
            }
            assert_eq!(got.len(), 2, "{kind}: two on time");
            assert_eq!(e.in_flight(), 2);
            let fd = e.notify_fd().unwrap();
            let mut p = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one live pollfd.
            let ready = unsafe { libc::poll(&mut p, 1, 2000) };
            assert_eq!(ready, 1, "{kind}: woken by the timer");
            while got.len() < 4 {
                e.wait().unwrap();
                e.reap(&mut |c| got.push(c.token));
            }
            assert!(t0.elapsed() >= Duration::from_millis(80), "{kind}");
            got.sort();
            assert_eq!(got, vec![0, 1, 2, 3]);
            assert!(bufs.iter().all(|b| b.iter().all(|&x| x == 7)));
        }
    }
}
