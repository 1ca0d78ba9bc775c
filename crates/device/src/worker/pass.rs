//! The data path: one pass of a worker over its queues. It admits requests QoS held
//! back, pops and checks every available chain, hands the payload to the engine (no
//! copy), submits, reaps, writes status bytes and publishes each queue's completions;
//! before the thread sleeps, kicks are re-armed.

use std::time::{Duration, Instant};

use log::{error, warn};
use proto::wire::status;
use proto::{Rejected, RequestKind};
use storage::Engine;

use super::queue::{token, untoken, Queue, RateLimit};
use super::request::{complete, keep_or_shrink, to_op, write_id, LogView};
use super::throttled::Parked;
use super::Worker;
use crate::memory::GuestMemory;
use crate::stats::bump;
use crate::throttle::{self, Dir};

impl Worker {
    /// One pass over every queue. True if anything was popped or completed.
    pub(super) fn pass(&mut self, now: Instant) -> bool {
        self.now = now;
        self.now_ticks = throttle::ticks(now);
        self.lift_fences();
        let mut progress = false;
        if self.throttle.is_some() {
            progress |= self.admit_parked();
        }
        if !self.queues.is_empty() {
            let limits = self.blk.limits();
            let durable = self.blk.write_through();
            for qi in 0..self.queues.len() {
                progress |= self.drain(qi, &limits, durable);
            }
        }
        if let Some(t) = &mut self.throttle {
            t.update_waiting(self.now_ticks);
            if t.idle() {
                self.throttle = None;
                self.throttle_wake = None;
            }
        }
        self.batch.flush(&mut *self.engine, &mut self.io_log);
        progress |= self.reap();
        for q in &mut self.queues {
            q.publish(self.log.as_deref());
            q.store_in_flight();
        }
        if self.in_flight == 0 && !self.retired.is_empty() {
            self.retired.clear();
        }
        progress
    }

    /// Let waiting requests go that the limiters now admit, in order per direction; those
    /// of a queue that no longer serves (stopping, broken, disabled) go at once. True if
    /// any went.
    fn admit_parked(&mut self) -> bool {
        let Some(t) = self.throttle.as_deref_mut() else {
            return false;
        };
        let now = self.now_ticks;
        let durable = self.blk.write_through();
        let mut went = false;
        let mut wake: Option<u64> = None;
        for dir in [Dir::Read, Dir::Write] {
            while let Some(&p) = t.parked[dir as usize].front() {
                let found = self
                    .queues
                    .iter_mut()
                    .chain(self.zombies.iter_mut())
                    .find(|q| q.index == p.queue && q.slots[usize::from(p.head)].busy);
                let Some(q) = found else {
                    error!(
                        "worker {}: a waiting request (queue {}, head {}) lost its queue",
                        self.id, p.queue, p.head
                    );
                    t.parked[dir as usize].pop_front();
                    continue;
                };
                let h = usize::from(p.head);
                if q.serving() {
                    let wait = t.admit(dir, q.slots[h].req.len, now);
                    if wait != 0 {
                        wake = Some(wake.map_or(wait, |w| w.min(wait)));
                        break;
                    }
                }
                let slot = &mut q.slots[h];
                let op = to_op(&slot.req, durable);
                // SAFETY: as in `drain`: the iovecs live in the busy slot, which is neither
                // moved nor reused until its completion is reaped; they point into guest
                // memory that `self.mem` or `self.retired` keeps mapped until then.
                match unsafe { self.engine.push(token(q.index, q.gen, p.head), op) } {
                    Ok(()) => {
                        t.parked[dir as usize].pop_front();
                        t.waited(Duration::from_nanos(throttle::ticks_to_ns(
                            self.now_ticks.saturating_sub(slot.taken),
                        )));
                        went = true;
                        self.batch.pushed_one(&mut *self.engine, &mut self.io_log);
                    }
                    // The engine is full: it waits a little longer.
                    Err(_) => break,
                }
            }
        }
        self.throttle_wake = wake.map(throttle::instant);
        went
    }

    /// Pop and start the available chains of queue `qi`. True if any was popped.
    fn drain(&mut self, qi: usize, limits: &proto::Limits, durable: bool) -> bool {
        let q = &mut self.queues[qi];
        if !q.serving() {
            return false;
        }
        if !q.quiet {
            q.set_kicks(false, self.log.as_deref());
            q.quiet = true;
        }
        match q.ring.refresh() {
            Ok(0) if q.resubmit.is_empty() => return false,
            Ok(_) => {}
            Err(e) => {
                q.stop_broken(format_args!("{e}"));
                return false;
            }
        }
        q.ring
            .prefetch(&self.mem, self.depth.saturating_sub(self.in_flight));
        let mem: &GuestMemory = &self.mem;
        let mut popped = false;
        while self.in_flight < self.depth {
            let (head, resubmitted) = match q.resubmit.front() {
                Some(&h) => {
                    q.resubmit.pop_front();
                    (h, true)
                }
                None => match q.ring.pop() {
                    Some(h) => (h, false),
                    None => break,
                },
            };
            popped = true;
            self.work += 1;
            let give_back = |q: &mut Queue| {
                if resubmitted {
                    q.resubmit.push_front(head);
                } else {
                    q.ring.unpop();
                }
            };
            let size = q.ring.size();
            if head >= size {
                give_back(q);
                q.stop_broken(format_args!(
                    "the available ring names head {head}, outside the queue of size {size}"
                ));
                break;
            }
            let h = usize::from(head);
            if q.slots[h].busy {
                give_back(q);
                q.stop_broken(format_args!(
                    "head {head} was made available again while still in flight"
                ));
                break;
            }
            q.slots[h].taken = self.now_ticks;
            let parsed = self
                .parser
                .parse(mem, q.info, head, limits, &mut q.slots[h].req);
            let answer = match parsed {
                Ok(()) => {
                    let slot = &mut q.slots[h];
                    match slot.req.kind {
                        RequestKind::GetId => {
                            write_id(&slot.req, &self.blk.serial);
                            Some((status::OK, slot.req.used_len_ok()))
                        }
                        RequestKind::In
                        | RequestKind::Out
                        | RequestKind::Discard
                        | RequestKind::WriteZeroes { .. }
                            if self.throttle.as_deref_mut().is_some_and(|t| {
                                let dir = direction(&slot.req.kind);
                                t.queued(dir)
                                    || t.admit_arriving(dir, slot.req.len, self.now_ticks) != 0
                            }) =>
                        {
                            // It waits for the disk's limits (throttled.rs); it holds its
                            // slot and counts as in flight meanwhile.
                            if let Some(t) = self.throttle.as_deref_mut() {
                                t.park(
                                    direction(&slot.req.kind),
                                    Parked {
                                        queue: q.index,
                                        head,
                                    },
                                );
                            }
                            slot.busy = true;
                            q.in_flight += 1;
                            self.in_flight += 1;
                            None
                        }
                        _ => {
                            let op = to_op(&slot.req, durable);
                            // SAFETY: the iovecs live in the slot, which is neither moved
                            // nor reused while busy (the slot vector is never resized; a
                            // busy head is refused above); they point into guest memory
                            // that `self.mem` or `self.retired` keeps mapped until the
                            // completion is reaped.
                            match unsafe { self.engine.push(token(q.index, q.gen, head), op) } {
                                Ok(()) => {
                                    slot.busy = true;
                                    q.in_flight += 1;
                                    self.in_flight += 1;
                                    self.batch.pushed_one(&mut *self.engine, &mut self.io_log);
                                    None
                                }
                                Err(_) => {
                                    // The engine is full after all: leave the chain in
                                    // the ring.
                                    give_back(q);
                                    break;
                                }
                            }
                        }
                    }
                }
                Err(Rejected::Answer { status_ptr, error }) => {
                    q.log_bad(format_args!("request {head}: {error}"));
                    bump(&q.stats.rejected, 1);
                    // SAFETY: the parser translated status_ptr from a device-writable byte
                    // inside guest memory, which `self.mem` keeps mapped.
                    unsafe { status_ptr.write_volatile(error.status()) };
                    if let Some(log) = &self.log {
                        let view = LogView {
                            log,
                            mem: &self.mem,
                            retired: &self.retired,
                        };
                        view.mark_status(status_ptr);
                    }
                    Some((error.status(), 1))
                }
                Err(Rejected::Unanswerable(error)) => {
                    give_back(q);
                    bump(&q.stats.rejected, 1);
                    q.stop_broken(format_args!("request {head} cannot be answered: {error}"));
                    break;
                }
            };
            if !resubmitted {
                if let Some(iq) = &mut q.inflight {
                    iq.taken(head);
                }
            }
            if let Some((st, used_len)) = answer {
                if st == status::OK {
                    // SAFETY: as above, status_ptr is a checked byte of guest memory.
                    unsafe { q.slots[h].req.status_ptr.write_volatile(status::OK) };
                    if let Some(log) = &self.log {
                        let view = LogView {
                            log,
                            mem: &self.mem,
                            retired: &self.retired,
                        };
                        view.mark_request(&q.slots[h].req);
                    }
                }
                q.used.push((head, used_len));
                if st == status::OK {
                    q.count_completed(head, self.now_ticks);
                } else {
                    bump(&q.stats.completed, 1);
                }
                keep_or_shrink(&mut q.slots[h], (&mut self.big_slots, self.big_slots_max));
            }
        }
        popped
    }

    /// Complete every finished operation. True if any finished.
    fn reap(&mut self) -> bool {
        if self.in_flight == 0 {
            return false;
        }
        self.done.clear();
        let done = &mut self.done;
        let n = self.engine.reap(&mut |c| done.push(c));
        if n == 0 {
            return false;
        }
        self.in_flight -= n;
        self.work += n as u64;
        // Completion latency ends here, not at the start of the pass: a request taken
        // and done by the disk within one pass (a page-cache write, a synchronous read)
        // took time. A RAM or null disk's is done in memory as it is taken: its pass's
        // clock will do.
        let now = if self.engine.completes_in_memory() {
            self.now_ticks
        } else {
            throttle::ticks(Instant::now())
        };
        let mut old_done = 0;
        let view = self.log.as_deref().map(|log| LogView {
            log,
            mem: &self.mem,
            retired: &self.retired,
        });
        for c in self.done.drain(..) {
            let (index, gen, head) = untoken(c.token);
            // A running queue's request, or an old one of a zombie's (never published).
            let live = self.queues.iter_mut().map(|q| (q, true));
            let old = self.zombies.iter_mut().map(|q| (q, false));
            let found = live
                .chain(old)
                .find(|(q, _)| q.index == index && q.gen == gen);
            if let Some((q, publish)) = found {
                let big = (&mut self.big_slots, self.big_slots_max);
                let log = view.as_ref();
                complete(q, head, c.result, &mut self.io_log, publish, now, big, log);
                if !publish {
                    old_done += 1;
                }
            } else {
                error!(
                    "worker {}: completion for unknown request {:#x}",
                    self.id, c.token
                );
            }
        }
        if old_done > 0 {
            self.fenced_here -= old_done;
            self.fence.release(old_done);
            let big = &mut self.big_slots;
            self.zombies.retain(|q| {
                if q.in_flight == 0 {
                    *big -= q.slots.iter().filter(|s| s.big).count();
                }
                q.in_flight > 0
            });
        }
        true
    }

    /// Re-enable kicks before sleeping. True if chains arrived meanwhile that can be
    /// popped now.
    pub(super) fn rearm(&mut self) -> bool {
        let room = self.in_flight < self.depth;
        let mut more = false;
        for q in &mut self.queues {
            if !q.quiet || !q.serving() {
                continue;
            }
            q.quiet = false;
            more |= q.set_kicks(true, self.log.as_deref());
        }
        more && room
    }
}

/// Pushes to the engine not handed to the kernel yet: one submit call per `every` pushes
/// (`--submit-batch`), and one at the end of a pass for the rest.
pub(super) struct SubmitBatch {
    every: usize,
    unsubmitted: usize,
    /// Something was pushed since the last submit, or the engine holds work the kernel
    /// refused for now.
    pushed: bool,
}

impl SubmitBatch {
    /// `batch` pushes per submit call (0: once per pass).
    pub(super) fn new(batch: u32) -> SubmitBatch {
        SubmitBatch {
            every: if batch == 0 {
                usize::MAX
            } else {
                batch as usize
            },
            unsubmitted: 0,
            pushed: false,
        }
    }

    /// One request went to `engine`: submit if that fills the batch.
    fn pushed_one(&mut self, engine: &mut dyn Engine, log: &mut RateLimit) {
        self.pushed = true;
        self.unsubmitted += 1;
        if self.unsubmitted >= self.every {
            self.submit(engine, log);
        }
    }

    /// Hand everything pushed to the kernel.
    fn flush(&mut self, engine: &mut dyn Engine, log: &mut RateLimit) {
        if self.pushed {
            self.submit(engine, log);
        }
    }

    /// Submit, logging a failure (rate-limited).
    fn submit(&mut self, engine: &mut dyn Engine, log: &mut RateLimit) {
        if let Err(e) = engine.submit() {
            if log.allow() {
                warn!("engine {}: submit failed: {e}", engine.name());
            }
        }
        self.unsubmitted = 0;
        self.pushed = engine.backlog() > 0;
    }
}

/// Which limits a request counts against: reads, or writes (with discards and
/// write-zeroes, by their length, as QEMU's throttle filter counts them).
fn direction(kind: &RequestKind) -> Dir {
    match kind {
        RequestKind::In => Dir::Read,
        _ => Dir::Write,
    }
}
