//! A testing aid: an engine wrapper that holds every Nth operation back for a while, so
//! that completions come out of order and some requests stay in flight for long. It is
//! how the device's out-of-order paths (inflight recovery after a crash, stopping a ring
//! with requests in flight, guests' timeouts) are exercised with real I/O.
//!
//! Two ways of holding: the completion (the operation reaches the disk at once, its
//! completion is handed out late), or the operation itself (it reaches the disk only when
//! its time is up: a write held so is one that can land after later writes — what slow or
//! reordering storage does, and what a reset must not let happen).
//!
//! The wrapper's completion fd is an epoll set holding the wrapped engine's fd and a
//! timerfd armed for the earliest held operation or completion, so a worker sleeping on it
//! wakes for either.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use crate::engine::{Completion, Engine, Full, Op};

/// Hold every Nth operation (or its completion) back by `by`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Delay {
    /// Which operations: every this many (1: all).
    pub every: u32,
    /// For how long.
    pub by: Duration,
    /// What is held.
    pub hold: Hold,
}

/// What a [`Delay`] holds back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Hold {
    /// The completion: the operation reaches the disk at once (`N:MS`).
    #[default]
    Completion,
    /// Every Nth operation itself, before it reaches the disk (`N:MS:hold`).
    Operation,
    /// Every Nth write itself; other operations go through at once (`N:MS:hold-writes`).
    Write,
}

impl std::str::FromStr for Delay {
    type Err = String;

    /// `N:MS[:hold|:hold-writes]`, e.g. `4:50`: every 4th completion 50 ms late.
    fn from_str(s: &str) -> Result<Delay, String> {
        let bad = || {
            format!(
                "{s:?}: expected N:MS, N:MS:hold or N:MS:hold-writes, e.g. 4:50 (every 4th request's completion 50 ms late)"
            )
        };
        let mut parts = s.split(':');
        let (Some(n), Some(ms)) = (parts.next(), parts.next()) else {
            return Err(bad());
        };
        let hold = match parts.next() {
            None => Hold::Completion,
            Some("hold") => Hold::Operation,
            Some("hold-writes") => Hold::Write,
            Some(_) => return Err(bad()),
        };
        if parts.next().is_some() {
            return Err(bad());
        }
        let every: u32 = n.parse().map_err(|_| bad())?;
        let ms: u64 = ms.parse().map_err(|_| bad())?;
        if every == 0 || ms > 60_000 {
            return Err(format!("{s:?}: N must be at least 1 and MS at most 60000"));
        }
        Ok(Delay {
            every,
            by: Duration::from_millis(ms),
            hold,
        })
    }
}

/// The wrapper.
pub(crate) struct DelayEngine {
    inner: Box<dyn Engine>,
    delay: Delay,
    seen: u64,
    held: VecDeque<(Instant, Completion)>,
    /// Operations held before they reach the disk (Hold::Operation, Hold::Write).
    pending: VecDeque<(Instant, u64, Op)>,
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
            pending: VecDeque::new(),
            timer,
            epoll,
        })
    }

    /// The earliest held operation or completion's time.
    fn first_due(&self) -> Option<Instant> {
        let held = self.held.front().map(|(d, _)| *d);
        let pending = self.pending.front().map(|(d, _, _)| *d);
        held.into_iter().chain(pending).min()
    }

    /// Arm the timer for the earliest held operation or completion (or disarm it).
    fn arm(&self) {
        let mut spec: libc::itimerspec =
            // SAFETY: itimerspec is plain data; all-zero disarms.
            unsafe { std::mem::zeroed() };
        if let Some(due) = self.first_due() {
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
        let selected = match self.delay.hold {
            Hold::Completion => false,
            Hold::Operation => true,
            Hold::Write => matches!(op, Op::Write { .. }),
        };
        if selected {
            self.seen += 1;
            if self.seen.is_multiple_of(u64::from(self.delay.every)) {
                // The worker never has more than the engine's depth out, so the inner
                // engine has room for every held operation when its time comes.
                self.pending
                    .push_back((Instant::now() + self.delay.by, token, op));
                self.arm();
                return Ok(());
            }
        }
        // SAFETY: the caller's contract, forwarded; held operations and completions keep
        // it (the caller does not see them before they are handed over).
        unsafe { self.inner.push(token, op) }
    }

    fn submit(&mut self) -> io::Result<()> {
        self.inner.submit()
    }

    fn reap(&mut self, f: &mut dyn FnMut(Completion)) -> usize {
        let now = Instant::now();
        if self.delay.hold != Hold::Completion {
            // Held operations whose time is up go to the disk now.
            let mut released = false;
            while self.pending.front().is_some_and(|(due, _, _)| *due <= now) {
                let Some((_, token, op)) = self.pending.pop_front() else {
                    break;
                };
                // SAFETY: the contract the caller gave for this operation at push still
                // holds: it has not seen its completion.
                if unsafe { self.inner.push(token, op) }.is_err() {
                    f(Completion {
                        token,
                        result: Err(io::Error::from_raw_os_error(libc::EBUSY)),
                    });
                    continue;
                }
                released = true;
            }
            if released {
                let _ = self.inner.submit();
            }
            let n = self.inner.reap(f);
            self.clear_timer();
            self.arm();
            return n;
        }
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
        if let Some(due) = self.first_due() {
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
        }
        Ok(())
    }

    fn notify_fd(&self) -> Option<RawFd> {
        Some(self.epoll.as_raw_fd())
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight() + self.held.len() + self.pending.len()
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
                by: Duration::from_millis(50),
                hold: Hold::Completion,
            })
        );
        assert_eq!(
            "3:10:hold-writes".parse::<Delay>().map(|d| d.hold),
            Ok(Hold::Write)
        );
        assert_eq!(
            "3:10:hold".parse::<Delay>().map(|d| d.hold),
            Ok(Hold::Operation)
        );
        assert!("0:50".parse::<Delay>().is_err());
        assert!("4".parse::<Delay>().is_err());
        assert!("4:5:later".parse::<Delay>().is_err());
        assert!("4:5:hold:x".parse::<Delay>().is_err());
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
                    hold: Hold::Completion,
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

    /// With `hold-writes` a held write reaches the disk only when its time is up: a later
    /// write to the same place lands first and is overwritten (the reordering a reset
    /// must never let through), and reads are not held.
    #[test]
    fn a_held_write_lands_after_a_later_one() {
        let target = concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/tmp");
        std::fs::create_dir_all(target).unwrap();
        let dir = tempfile::tempdir_in(target).unwrap();
        let path = dir.path().join("h.img");
        std::fs::write(&path, vec![0u8; 65536]).unwrap();
        let b = Arc::new(
            Backend::open(&DiskSpec::File(path.clone()), &OpenOptions::default()).unwrap(),
        );
        let mut e = delayed(
            b.engine(EngineKind::IoUring, 8).unwrap(),
            // Held long enough that the first write is surely reaped before the held one's time
            // is up, however slow the machine's disk or scheduler.
            "2:2000:hold-writes".parse().unwrap(),
        )
        .unwrap();
        let mut first = vec![1u8; 512];
        let mut second = vec![2u8; 512];
        let mut third = vec![3u8; 512];
        let iov = |b: &mut Vec<u8>| libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: 512,
        };
        let (v1, v2, v3) = (iov(&mut first), iov(&mut second), iov(&mut third));
        let w = |v: &libc::iovec| Op::Write {
            offset: 0,
            iov: v,
            iovcnt: 1,
            durable: false,
        };
        let t0 = Instant::now();
        let mut got = Vec::new();
        // SAFETY: the buffers outlive every completion, all reaped below.
        unsafe { e.push(1, w(&v1)) }.unwrap();
        // SAFETY: as above.
        unsafe { e.push(2, w(&v2)) }.unwrap(); // the 2nd write: held
        e.submit().unwrap();
        while got.is_empty() {
            e.wait().unwrap();
            e.reap(&mut |c| got.push(c.token));
        }
        assert_eq!(got, vec![1]);
        // SAFETY: as above.
        unsafe { e.push(3, w(&v3)) }.unwrap(); // the 3rd: not held, lands before the 2nd
        e.submit().unwrap();
        while got.len() < 3 {
            e.wait().unwrap();
            e.reap(&mut |c| got.push(c.token));
        }
        assert_eq!(got, vec![1, 3, 2], "the held write completes last");
        assert!(t0.elapsed() >= Duration::from_millis(2000));
        assert_eq!(
            std::fs::read(&path).unwrap()[..512],
            [2u8; 512],
            "and lands last"
        );
    }
}
