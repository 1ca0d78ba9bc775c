//! What the control thread asks of a worker, and its queues' lives: starts, stops (the
//! GET_VRING_BASE drain and its answer), new kick fds and memory tables, fences after a
//! reset, retirement into zombies, and ending the session when the frontend truncates
//! guest memory or wedges a descriptor it handed over.

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{error, info, warn};
use vmm_sys_util::epoll::{ControlOperation, EpollEvent};

use super::queue::{Queue, QueueStart, Stopping};
use super::throttled::Throttled;
use super::{nanos, watch_kick, Command, Worker};
use crate::fence::fetch_max;
use crate::memory::GuestMemory;

impl Worker {
    /// Carry out the commands the control thread posted, in the order it posted them.
    pub(super) fn handle_commands(&mut self) {
        for cmd in self.mailbox.take() {
            match cmd {
                Command::Start(start) => self.start(*start),
                Command::Stop { queue, reply } => {
                    let drain = self.drain_timeout;
                    match self.queues.iter_mut().find(|q| q.index == queue) {
                        Some(q) => {
                            // Whatever the frontend stops a ring for (a reset, a reboot,
                            // `stop`, a shutdown, a migration), the requests it sent
                            // finish first: a write from before must not land after the
                            // next start's, nor a read fill memory the guest reuses.
                            let now = Instant::now();
                            q.stopping = Some(Stopping {
                                deadline: now + drain,
                                since: now,
                                reply,
                            })
                        }
                        None => {
                            warn!(
                                "worker {}: stop for queue {queue}, which it does not hold",
                                self.id
                            );
                            let _ = reply.send(0);
                        }
                    }
                }
                Command::Enable { queue, enabled } => {
                    if let Some(q) = self.queue_mut(queue) {
                        q.enabled = enabled;
                    }
                }
                Command::SetCall { queue, fd } => {
                    if let Some(q) = self.queue_mut(queue) {
                        q.call = fd;
                    }
                }
                Command::SetErr { queue, fd } => {
                    if let Some(q) = self.queue_mut(queue) {
                        q.err = fd;
                    }
                }
                Command::SetKick { queue, fd } => self.set_kick(queue, fd),
                Command::Memory { mem, reply } => {
                    self.set_memory(mem);
                    let _ = reply.send(());
                }
                Command::Log { log, reply } => {
                    self.log = log;
                    // Rings written before logging began are logged now, so that no
                    // used-ring write from before escapes the migration's copy.
                    for q in &self.queues {
                        q.log_used_ring(self.log.as_deref());
                    }
                    let _ = reply.send(());
                }
                Command::Throttle(setup) => match (&mut self.throttle, setup) {
                    (Some(t), setup) => t.replace(setup.map(|b| *b)),
                    (None, Some(setup)) => {
                        self.throttle = Some(Box::new(Throttled::new(*setup, self.depth)));
                    }
                    (None, None) => {}
                },
                Command::LogRing {
                    queue,
                    used_gpa,
                    reply,
                } => {
                    if let Some(q) = self.queues.iter_mut().find(|q| q.index == queue) {
                        q.log_used = used_gpa;
                        q.log_used_ring(self.log.as_deref());
                    }
                    let _ = reply.send(());
                }
                #[cfg(test)]
                Command::Panic => panic!("worker {}: panic asked for by a test", self.id),
                Command::Exit => self.exit = true,
            }
        }
    }

    fn queue_mut(&mut self, index: usize) -> Option<&mut Queue> {
        self.queues.iter_mut().find(|q| q.index == index)
    }

    fn start(&mut self, start: QueueStart) {
        let gen = self.new_gen(start.index);
        let old = self.fence.old();
        if let Some(stale) = self.queues.iter().position(|q| q.index == start.index) {
            // The session starts a queue only once it answered its stop; a queue still
            // held here was stopped as broken and never asked for: it ends now.
            let q = self.queues.swap_remove(stale);
            self.retire(q, "started again");
        }
        let mut q = Queue::new(start, gen, old > 0);
        if old > 0 {
            info!(
                "queue {}: started while {old} requests from before a reset are still out; it takes nothing until they end",
                q.index
            );
        }
        if let Err(e) = watch_kick(&self.epoll, self.key, &mut q) {
            error!("queue {}: cannot watch its kick fd: {e}", q.index);
        }
        self.queues.push(q);
    }

    /// A generation for a new start of queue `index` that no zombie of that index holds:
    /// a late completion can never be taken for a request of the new start, however many
    /// starts come and go while it is out.
    fn new_gen(&mut self, index: usize) -> u32 {
        loop {
            let gen = self.next_gen;
            self.next_gen = self.next_gen.wrapping_add(1);
            let taken = |q: &Queue| q.index == index && q.gen == gen;
            if !self.zombies.iter().any(taken) && !self.queues.iter().any(taken) {
                return gen;
            }
        }
    }

    fn set_kick(&mut self, index: usize, fd: crate::vring_fd::VringFd) {
        let Some(q) = self.queues.iter_mut().find(|q| q.index == index) else {
            return;
        };
        let _ = self.epoll.ctl(
            ControlOperation::Delete,
            q.kick.file().as_raw_fd(),
            EpollEvent::default(),
        );
        q.kick = fd;
        if let Err(e) = watch_kick(&self.epoll, self.key, q) {
            error!("queue {index}: cannot watch its new kick fd: {e}");
        }
    }

    fn set_memory(&mut self, mem: Arc<GuestMemory>) {
        let old = std::mem::replace(&mut self.mem, mem);
        if self.in_flight > 0 {
            self.retired.push(old);
        }
        for q in &mut self.queues {
            if !q.ring_ok {
                continue;
            }
            if let Err(e) = q.ring.bind(&self.mem) {
                q.ring_ok = false;
                q.stop_broken(format_args!("after the new memory table, {e}"));
            }
        }
    }

    /// Guest memory was truncated under us: stop everything and end the session.
    pub(super) fn poisoned(&mut self) {
        for q in &mut self.queues {
            q.ring_ok = false;
            q.stop_broken(format_args!(
                "the frontend truncated guest memory under the device (SIGBUS caught); the session ends"
            ));
        }
        if let Some(kill) = self.kill.take() {
            kill();
        }
    }

    /// A call, error or kick descriptor the frontend wedged (a write the watchdog had to
    /// interrupt): stop its queues and end the session, so the next frontend is served.
    pub(super) fn check_wedged(&mut self) {
        if !self.queues.iter().any(|q| q.wedged) {
            return;
        }
        for q in self.queues.iter_mut().filter(|q| q.wedged) {
            q.wedged = false;
            q.call = None;
            q.err = None;
            q.stop_broken(format_args!(
                "the frontend wedged its call or error descriptor (a write to it blocked until the watchdog interrupted it)"
            ));
        }
        if let Some(kill) = self.kill.take() {
            self.lifecycle.wedged_fds.fetch_add(1, Ordering::Relaxed);
            error!(
                "worker {}: ending the session: the frontend wedged a descriptor it handed over",
                self.id
            );
            kill();
        }
    }

    /// Let fenced queues go once no request from before a reset is out.
    pub(super) fn lift_fences(&mut self) {
        if !self.queues.iter().any(|q| q.fenced.is_some()) || self.fence.old() > 0 {
            return;
        }
        for q in &mut self.queues {
            if let Some(since) = q.fenced.take() {
                let waited = since.elapsed();
                self.fence.lifted(waited);
                info!(
                    "queue {}: the requests from before the reset ended; it waited {:.1} ms for them",
                    q.index,
                    waited.as_secs_f64() * 1e3
                );
            }
        }
    }

    /// Answer the GET_VRING_BASEs whose queues have nothing left in flight (or that waited
    /// too long).
    pub(super) fn finish_stops(&mut self) {
        // Every round of every worker comes here: read no clock unless a ring is stopping
        // (with many disks on a thread, a clock read per worker per round was a third of
        // the thread's CPU).
        if !self.queues.iter().any(|q| q.stopping.is_some()) {
            return;
        }
        let now = Instant::now();
        let mut i = 0;
        while i < self.queues.len() {
            let q = &self.queues[i];
            let Some(stop) = &q.stopping else {
                i += 1;
                continue;
            };
            if q.in_flight > 0 && now < stop.deadline {
                i += 1;
                continue;
            }
            let mut q = self.queues.swap_remove(i);
            let _ = self.epoll.ctl(
                ControlOperation::Delete,
                q.kick.file().as_raw_fd(),
                EpollEvent::default(),
            );
            q.publish(self.log.as_deref());
            let next = q.ring.next_avail();
            let waited = q.stopping.as_ref().map(|s| now - s.since);
            // Answered once the requests still out are counted in the fence (`retire`):
            // the session hands the image over at a switchover only when the fence holds
            // nothing, and must not read it before.
            let reply = q.stopping.take().map(|s| s.reply);
            let l = &self.lifecycle;
            l.stops.fetch_add(1, Ordering::Relaxed);
            if let Some(waited) = waited.filter(|w| !w.is_zero()) {
                l.drains.fetch_add(1, Ordering::Relaxed);
                fetch_max(&l.drain_wait_ns_max, nanos(waited));
            }
            if q.in_flight > 0 {
                l.drains_timed_out.fetch_add(1, Ordering::Relaxed);
                error!(
                    "queue {}: {} requests still in flight after {:?}; the ring is stopped at available index {next}; they are fenced: no request taken after this stop runs until they end, and nothing of them is published{}",
                    q.index,
                    q.in_flight,
                    self.drain_timeout,
                    if q.inflight.is_some() {
                        " (the inflight region keeps them for a restart on the same region)"
                    } else {
                        ""
                    }
                );
            } else if let Some(w) = waited.filter(|w| *w >= Duration::from_millis(1)) {
                info!(
                    "queue {}: stopped at available index {next} after waiting {:.1} ms for its requests",
                    q.index,
                    w.as_secs_f64() * 1e3
                );
            } else {
                info!("queue {}: stopped at available index {next}", q.index);
            }
            self.retire(q, "stopped");
            if let Some(reply) = reply {
                let _ = reply.send(next);
            }
        }
    }

    /// Let go of a queue the frontend no longer runs. Requests still out make it a zombie:
    /// kept (their iovecs live in its slots) until the engine hands them back, counted in
    /// the fence, never published.
    fn retire(&mut self, mut q: Queue, why: &str) {
        if q.in_flight == 0 {
            self.big_slots -= q.slots.iter().filter(|s| s.big).count();
            return;
        }
        if why != "stopped" {
            warn!(
                "queue {}: {why} with {} requests in flight; they are fenced",
                q.index, q.in_flight
            );
        }
        q.ring_ok = false;
        q.used.clear();
        self.fenced_here += q.in_flight;
        self.fence.hold(q.in_flight);
        self.zombies.push(q);
    }
}
