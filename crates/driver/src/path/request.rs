//! The request path: plug, merge, elevator, dispatch within a queue depth.
//!
//! An I/O becomes a request ([`Rq`]). While the submitter holds the plug (from its first
//! submission until it unplugs or waits, or the plug is full) requests gather in it, and an
//! I/O adjacent to the plug's last request, of the same kind, merges into it (back or
//! front) when the result fits one virtio request (`seg_max`, `size_max`) and
//! `max_sectors_kb`. When the plug is flushed its requests go to the elevator, which may
//! merge later I/Os into them too and decides the order they leave in; at most
//! `queue_depth` requests are on the ring at once, the rest wait in the elevator.
//!
//! Ordering kept on every elevator: a flush is dispatched only after everything submitted
//! before it, and nothing submitted after it is dispatched before it (later I/Os wait
//! behind it in `held`). FUA writes never merge (Linux's REQ_NOMERGE) and complete only
//! after their post-flush (the in-flight table).
//!
//! Requests live in a slab with a free list and the elevators keep indices in vectors
//! reserved up front: once warm, nothing is allocated per I/O.

use std::collections::VecDeque;
use std::time::Instant;

use crate::dispatch::Core;
use crate::io::Op;
use crate::path::bfq::Bfq;
use crate::path::deadline::Deadline;
use crate::path::noop::Noop;
use crate::path::{ElevatorKind, RequestOptions};
use crate::table::NONE;

/// One request of the request path: one or more contiguous I/Os of the same kind, linked
/// from `first` to `last` through the in-flight table.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rq {
    pub first: u32,
    pub last: u32,
    pub op: Op,
    pub sector: u64,
    pub bytes: u64,
    pub pieces: u32,
    pub flow: u16,
    /// When it entered the elevator (ns since the path's epoch).
    pub at: u64,
    /// Never merge into it (FUA, or too big already).
    pub nomerge: bool,
    /// Distinguishes this use of the slab slot from earlier ones.
    pub seq: u64,
}

impl Rq {
    pub(crate) fn end(&self) -> u64 {
        self.sector + self.bytes / 512
    }

    /// 0 for reads, 1 for writes (discard and write-zeroes are writes).
    pub(crate) fn dir(&self) -> usize {
        usize::from(self.op != Op::Read)
    }
}

/// The slab of requests.
#[derive(Debug, Default)]
pub(crate) struct Rqs {
    slab: Vec<Rq>,
    free: Vec<u32>,
    seq: u64,
}

impl Rqs {
    pub(crate) fn get(&self, id: u32) -> &Rq {
        &self.slab[id as usize]
    }

    pub(crate) fn get_mut(&mut self, id: u32) -> &mut Rq {
        &mut self.slab[id as usize]
    }

    pub(crate) fn alloc(&mut self, mut rq: Rq) -> u32 {
        self.seq += 1;
        rq.seq = self.seq;
        match self.free.pop() {
            Some(i) => {
                self.slab[i as usize] = rq;
                i
            }
            None => {
                self.slab.push(rq);
                (self.slab.len() - 1) as u32
            }
        }
    }

    pub(crate) fn release(&mut self, id: u32) {
        self.slab[id as usize].seq = 0;
        self.free.push(id);
    }
}

/// Where an I/O joins a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Merge {
    /// At the end.
    Back,
    /// At the start.
    Front,
}

/// What the elevators have in common (enum dispatch: no virtual call per I/O).
#[derive(Debug)]
pub(crate) enum Sched {
    Noop(Noop),
    Deadline(Deadline),
    Bfq(Bfq),
}

impl Sched {
    fn new(opts: &RequestOptions) -> Sched {
        match opts.elevator {
            ElevatorKind::Noop => Sched::Noop(Noop::default()),
            ElevatorKind::Deadline => Sched::Deadline(Deadline::new(opts)),
            ElevatorKind::Bfq => Sched::Bfq(Bfq::default()),
        }
    }

    pub(crate) fn insert(&mut self, rqs: &Rqs, id: u32) {
        match self {
            Sched::Noop(s) => s.insert(id),
            Sched::Deadline(s) => s.insert(rqs, id),
            Sched::Bfq(s) => s.insert(rqs, id),
        }
    }

    /// A queued request the I/O `probe` (not yet a request) may merge into.
    fn find_merge(&self, rqs: &Rqs, probe: &Rq, ok: &dyn Fn(&Rq) -> bool) -> Option<(u32, Merge)> {
        match self {
            Sched::Noop(s) => s.find_merge(rqs, probe, ok),
            Sched::Deadline(s) => s.find_merge(rqs, probe, ok),
            Sched::Bfq(s) => s.find_merge(rqs, probe, ok),
        }
    }

    /// Request `id` grew at its front; it started at `old_sector`.
    fn front_merged(&mut self, rqs: &Rqs, id: u32, old_sector: u64) {
        if let Sched::Deadline(s) = self {
            s.front_merged(rqs, id, old_sector)
        }
    }

    pub(crate) fn dispatch(&mut self, rqs: &Rqs, now: u64) -> Option<u32> {
        match self {
            Sched::Noop(s) => s.dispatch(),
            Sched::Deadline(s) => s.dispatch(rqs, now),
            Sched::Bfq(s) => s.dispatch(rqs),
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Sched::Noop(s) => s.len(),
            Sched::Deadline(s) => s.len(),
            Sched::Bfq(s) => s.len(),
        }
    }
}

/// Counters of the request path, for reports and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct RequestStats {
    /// I/Os that joined the end of a request.
    pub back_merges: u64,
    /// I/Os that joined the start of a request.
    pub front_merges: u64,
    /// Requests dispatched to the ring.
    pub dispatched: u64,
    /// Times the plug was flushed to the elevator.
    pub plug_flushes: u64,
    /// Flushes that waited for earlier requests before they were dispatched.
    pub barriers: u64,
}

/// The request path of one queue.
#[derive(Debug)]
pub(crate) struct RequestPath {
    pub(crate) opts: RequestOptions,
    rqs: Rqs,
    plug: Vec<u32>,
    sched: Sched,
    /// I/Os behind a flush that waits for the elevator to empty (the first is a flush).
    held: VecDeque<u32>,
    epoch: Instant,
    max_bytes: u64,
    pub stats: RequestStats,
}

impl RequestPath {
    pub(crate) fn new(opts: RequestOptions, ring_size: u16) -> RequestPath {
        let n = usize::from(ring_size);
        RequestPath {
            max_bytes: u64::from(opts.max_sectors_kb) * 1024,
            plug: Vec::with_capacity(usize::from(opts.plug_count) + 1),
            sched: Sched::new(&opts),
            held: VecDeque::with_capacity(n),
            rqs: Rqs::default(),
            epoch: Instant::now(),
            opts,
            stats: RequestStats::default(),
        }
    }

    /// Weight of `flow` for the bfq elevator (ignored by the others).
    pub(crate) fn set_flow_weight(&mut self, flow: u16, weight: u32) {
        if let Sched::Bfq(b) = &mut self.sched {
            b.set_weight(flow, weight);
        }
    }

    /// I/Os and requests waiting in the path (plug, elevator, behind a flush).
    pub(crate) fn staged(&self) -> usize {
        self.plug.len() + self.sched.len() + self.held.len()
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    fn depth(&self, core: &Core) -> u32 {
        match self.opts.queue_depth {
            0 => u32::from(core.ring.size()),
            d => u32::from(d),
        }
    }

    /// Take I/O `id` (admitted to the table).
    pub(crate) fn submit(&mut self, core: &mut Core, id: u32) {
        let op = core.table.get(id).op;
        if op == Op::Flush {
            self.flush_plug();
            if self.held.is_empty() && self.sched.len() == 0 {
                self.send_io(core, id);
                core.publish();
            } else {
                self.stats.barriers += 1;
                self.held.push_back(id);
                self.run(core);
            }
            return;
        }
        if !self.held.is_empty() {
            self.held.push_back(id);
            return;
        }
        self.stage(core, id);
    }

    /// Plug (or merge) I/O `id`; flush the plug when it is full.
    fn stage(&mut self, core: &mut Core, id: u32) {
        let e = core.table.get(id);
        let probe = Rq {
            first: id,
            last: id,
            op: e.op,
            sector: e.sector,
            bytes: e.bytes,
            pieces: e.pieces,
            flow: e.flow,
            at: 0,
            nomerge: e.fua
                || !matches!(e.op, Op::Read | Op::Write)
                || e.pieces > core.per_request
                || e.bytes > self.max_bytes,
            seq: 0,
        };
        if !probe.nomerge && self.opts.nomerges < 2 && self.try_merge(core, &probe) {
            return;
        }
        if let Some(&last) = self.plug.last() {
            let full = self.plug.len() >= usize::from(self.opts.plug_count)
                || self.rqs.get(last).bytes >= u64::from(self.opts.plug_flush_bytes);
            if full {
                self.flush_plug();
                self.run(core);
            }
        }
        let rq = self.rqs.alloc(probe);
        self.plug.push(rq);
    }

    /// Merge `probe` into the plug's last request or a request in the elevator.
    fn try_merge(&mut self, core: &mut Core, probe: &Rq) -> bool {
        let per_request = core.per_request;
        let max_bytes = self.max_bytes;
        let front_ok = self.opts.front_merges;
        let fits = |rq: &Rq| {
            !rq.nomerge
                && rq.op == probe.op
                && rq.flow == probe.flow
                && rq.pieces + probe.pieces <= per_request
                && rq.bytes + probe.bytes <= max_bytes
        };
        let side = |rq: &Rq| {
            if rq.end() == probe.sector {
                Some(Merge::Back)
            } else if front_ok && probe.end() == rq.sector {
                Some(Merge::Front)
            } else {
                None
            }
        };
        let mut found = None;
        if let Some(&last) = self.plug.last() {
            let rq = self.rqs.get(last);
            if fits(rq) {
                found = side(rq).map(|m| (last, m, false));
            }
        }
        if found.is_none() && self.opts.nomerges == 0 {
            let ok = |rq: &Rq| fits(rq) && side(rq).is_some();
            found = self
                .sched
                .find_merge(&self.rqs, probe, &ok)
                .map(|(id, m)| (id, m, true));
        }
        let Some((id, side, queued)) = found else {
            return false;
        };
        let rq = *self.rqs.get(id);
        let io = probe.first;
        match side {
            Merge::Back => {
                core.table.get_mut(rq.last).next = io;
                core.table.get_mut(io).next = NONE;
                let r = self.rqs.get_mut(id);
                r.last = io;
                r.bytes += probe.bytes;
                r.pieces += probe.pieces;
                self.stats.back_merges += 1;
            }
            Merge::Front => {
                core.table.get_mut(io).next = rq.first;
                let r = self.rqs.get_mut(id);
                r.first = io;
                r.sector = probe.sector;
                r.bytes += probe.bytes;
                r.pieces += probe.pieces;
                self.stats.front_merges += 1;
                if queued {
                    self.sched.front_merged(&self.rqs, id, rq.sector);
                }
            }
        }
        true
    }

    /// Move the plug's requests to the elevator.
    fn flush_plug(&mut self) {
        if self.plug.is_empty() {
            return;
        }
        self.stats.plug_flushes += 1;
        let now = self.now();
        for i in 0..self.plug.len() {
            let id = self.plug[i];
            self.rqs.get_mut(id).at = now;
            self.sched.insert(&self.rqs, id);
        }
        self.plug.clear();
    }

    /// The submitter unplugs (or is about to wait): everything it submitted may go.
    pub(crate) fn unplug(&mut self, core: &mut Core) {
        self.flush_plug();
        self.run(core);
    }

    /// Dispatch from the elevator while the queue depth allows, release what waited
    /// behind a flush once everything before the flush is out, and publish.
    pub(crate) fn run(&mut self, core: &mut Core) {
        let depth = self.depth(core);
        let before = self.stats.dispatched;
        loop {
            let now = self.now();
            while core.requests < depth {
                let Some(rq) = self.sched.dispatch(&self.rqs, now) else {
                    break;
                };
                self.send_rq(core, rq);
            }
            if self.sched.len() > 0 || self.held.is_empty() {
                break;
            }
            // The elevator is empty: the flush at the front of `held` may go, and what
            // follows it up to the next flush is staged as if submitted now.
            let Some(flush) = self.held.pop_front() else {
                break;
            };
            self.send_io(core, flush);
            while let Some(&id) = self.held.front() {
                if core.table.get(id).op == Op::Flush {
                    break;
                }
                self.held.pop_front();
                self.stage(core, id);
            }
            self.flush_plug();
        }
        if self.stats.dispatched != before || core.ring.unpublished() > 0 {
            core.publish();
        }
    }

    fn send_rq(&mut self, core: &mut Core, id: u32) {
        let rq = *self.rqs.get(id);
        self.rqs.release(id);
        self.stats.dispatched += 1;
        if rq.first == rq.last {
            self.send_io(core, rq.first);
        } else {
            // Members fail together inside if it cannot be sent.
            let _ = core.send_merged(rq.first);
        }
    }

    /// Send one I/O whose submission already returned: a failure completes it.
    fn send_io(&mut self, core: &mut Core, id: u32) {
        if core.table.get(id).op == Op::Flush {
            self.stats.dispatched += 1;
        }
        if let Err(e) = core.send(id) {
            core.table.fail(id, e.kind());
        }
    }

    /// Everything staged goes to the ring, whatever the depth (the queue is going away);
    /// on a device that is gone, it fails.
    pub(crate) fn drain(&mut self, core: &mut Core) {
        let depth = self.opts.queue_depth;
        self.opts.queue_depth = u16::MAX;
        self.unplug(core);
        self.opts.queue_depth = depth;
        debug_assert_eq!(self.staged(), 0);
    }
}
