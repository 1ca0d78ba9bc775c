//! `deadline`: the mq-deadline algorithm (Linux `block/mq-deadline.c`), one priority level.
//!
//! Per direction (reads; writes, discards and write-zeroes) requests are kept sorted by
//! sector and in a FIFO with an expiry time. Dispatch continues the current batch in sector
//! order from where the last request ended, up to `fifo_batch` requests; then a direction
//! is chosen (reads, unless writes have waited `writes_starved` read batches) and the batch
//! starts at the FIFO's head if it expired (or nothing lies ahead in sector order), else at
//! the next request in sector order.
//!
//! FIFO entries are removed lazily (a request dispatched in sector order leaves a stale
//! FIFO entry, recognised by its sequence number); the sorted vectors are kept exact.

use std::collections::VecDeque;

use crate::path::request::{Merge, Rq, Rqs};
use crate::path::RequestOptions;

const READ: usize = 0;
const WRITE: usize = 1;
/// Requests a back-merge lookup steps back over (requests may overlap).
const LOOKBACK: usize = 8;

#[derive(Debug)]
pub(crate) struct Deadline {
    sorted: [Vec<(u64, u32)>; 2],
    fifo: [VecDeque<(u32, u64)>; 2],
    expire: [u64; 2],
    fifo_batch: u32,
    writes_starved: u32,
    latest_pos: [u64; 2],
    batching: u32,
    last_dir: usize,
    starved: u32,
    count: usize,
}

impl Deadline {
    pub(crate) fn new(opts: &RequestOptions) -> Deadline {
        Deadline {
            sorted: [Vec::with_capacity(256), Vec::with_capacity(256)],
            fifo: [VecDeque::with_capacity(256), VecDeque::with_capacity(256)],
            expire: [
                opts.read_expire.as_nanos() as u64,
                opts.write_expire.as_nanos() as u64,
            ],
            fifo_batch: opts.fifo_batch.max(1),
            writes_starved: opts.writes_starved,
            latest_pos: [0; 2],
            // No batch in progress: the first dispatch chooses a direction.
            batching: opts.fifo_batch.max(1),
            last_dir: READ,
            starved: 0,
            count: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.count
    }

    fn key(rq: &Rq, id: u32) -> (u64, u32) {
        (rq.sector, id)
    }

    fn sorted_insert(&mut self, dir: usize, key: (u64, u32)) {
        let v = &mut self.sorted[dir];
        let at = v.partition_point(|k| *k < key);
        v.insert(at, key);
    }

    fn sorted_remove(&mut self, dir: usize, key: (u64, u32)) {
        let v = &mut self.sorted[dir];
        let at = v.partition_point(|k| *k < key);
        if v.get(at) == Some(&key) {
            v.remove(at);
        } else {
            debug_assert!(false, "request {key:?} not in the sorted list");
        }
    }

    pub(crate) fn insert(&mut self, rqs: &Rqs, id: u32) {
        let rq = rqs.get(id);
        let dir = rq.dir();
        self.sorted_insert(dir, Self::key(rq, id));
        self.fifo[dir].push_back((id, rq.seq));
        self.count += 1;
    }

    pub(crate) fn front_merged(&mut self, rqs: &Rqs, id: u32, old_sector: u64) {
        let rq = rqs.get(id);
        let dir = rq.dir();
        self.sorted_remove(dir, (old_sector, id));
        self.sorted_insert(dir, Self::key(rq, id));
    }

    pub(crate) fn find_merge(
        &self,
        rqs: &Rqs,
        probe: &Rq,
        ok: &dyn Fn(&Rq) -> bool,
    ) -> Option<(u32, Merge)> {
        let v = &self.sorted[probe.dir()];
        // Back: a request ending where the probe starts starts before it.
        let at = v.partition_point(|&(s, _)| s < probe.sector);
        for &(_, id) in v[..at].iter().rev().take(LOOKBACK) {
            let rq = rqs.get(id);
            if rq.end() == probe.sector && ok(rq) {
                return Some((id, Merge::Back));
            }
        }
        // Front: a request starting where the probe ends.
        let end = probe.end();
        let at = v.partition_point(|&(s, _)| s < end);
        for &(s, id) in &v[at..] {
            if s != end {
                break;
            }
            if ok(rqs.get(id)) {
                return Some((id, Merge::Front));
            }
        }
        None
    }

    /// The next request in sector order from where the last one in `dir` ended.
    fn next_from_pos(&self, dir: usize) -> Option<u32> {
        let v = &self.sorted[dir];
        let pos = self.latest_pos[dir];
        let at = v.partition_point(|&(s, _)| s < pos);
        v.get(at).map(|&(_, id)| id)
    }

    /// The oldest request of `dir` still queued.
    fn fifo_head(&mut self, rqs: &Rqs, dir: usize) -> Option<u32> {
        while let Some(&(id, seq)) = self.fifo[dir].front() {
            if rqs.get(id).seq == seq {
                return Some(id);
            }
            self.fifo[dir].pop_front();
        }
        None
    }

    fn expired(&mut self, rqs: &Rqs, dir: usize, now: u64) -> bool {
        self.fifo_head(rqs, dir)
            .is_some_and(|id| rqs.get(id).at.saturating_add(self.expire[dir]) <= now)
    }

    pub(crate) fn dispatch(&mut self, rqs: &Rqs, now: u64) -> Option<u32> {
        if self.count == 0 {
            return None;
        }
        if self.batching < self.fifo_batch {
            if let Some(id) = self.next_from_pos(self.last_dir) {
                return Some(self.take(rqs, id));
            }
        }
        let dir = if !self.sorted[READ].is_empty() {
            let writes_wait = !self.sorted[WRITE].is_empty() && {
                let s = self.starved;
                self.starved += 1;
                s >= self.writes_starved
            };
            if writes_wait {
                self.starved = 0;
                WRITE
            } else {
                READ
            }
        } else {
            self.starved = 0;
            WRITE
        };
        let next = self.next_from_pos(dir);
        let id = if self.expired(rqs, dir, now) || next.is_none() {
            self.fifo_head(rqs, dir)?
        } else {
            next?
        };
        self.last_dir = dir;
        self.batching = 0;
        Some(self.take(rqs, id))
    }

    fn take(&mut self, rqs: &Rqs, id: u32) -> u32 {
        let rq = rqs.get(id);
        let dir = rq.dir();
        self.sorted_remove(dir, Self::key(rq, id));
        self.latest_pos[dir] = rq.end();
        self.batching += 1;
        self.count -= 1;
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::Op;
    use std::time::Duration;

    fn rq(op: Op, sector: u64, at: u64) -> Rq {
        Rq {
            first: 0,
            last: 0,
            op,
            sector,
            bytes: 4096,
            pieces: 1,
            flow: 0,
            at,
            nomerge: false,
            seq: 0,
        }
    }

    fn drain(d: &mut Deadline, rqs: &mut Rqs, now: u64) -> Vec<u64> {
        let mut out = Vec::new();
        while let Some(id) = d.dispatch(rqs, now) {
            out.push(rqs.get(id).sector);
            rqs.release(id);
        }
        out
    }

    fn opts(fifo_batch: u32, read_ms: u64) -> RequestOptions {
        RequestOptions {
            fifo_batch,
            read_expire: Duration::from_millis(read_ms),
            ..RequestOptions::default()
        }
    }

    #[test]
    fn batches_go_in_sector_order_from_the_last_position() {
        let mut rqs = Rqs::default();
        let mut d = Deadline::new(&opts(16, 500));
        for s in [800, 8, 400, 16, 1600] {
            let id = rqs.alloc(rq(Op::Read, s, 0));
            d.insert(&rqs, id);
        }
        // Nothing expired: start at the lowest sector after position 0 and sweep up.
        assert_eq!(drain(&mut d, &mut rqs, 1), vec![8, 16, 400, 800, 1600]);
    }

    #[test]
    fn an_expired_read_is_served_first_at_the_next_batch() {
        let mut rqs = Rqs::default();
        let mut d = Deadline::new(&opts(2, 10));
        let ms = 1_000_000;
        // An old request far away, then newer ones near the head position.
        let far = rqs.alloc(rq(Op::Read, 1_000_000, 0));
        d.insert(&rqs, far);
        for s in [8, 16, 24, 32] {
            let id = rqs.alloc(rq(Op::Read, s, 5 * ms));
            d.insert(&rqs, id);
        }
        // At 5 ms nothing has expired: the sweep starts at sector 8.
        let first = d.dispatch(&rqs, 5 * ms).unwrap();
        assert_eq!(rqs.get(first).sector, 8);
        rqs.release(first);
        let second = d.dispatch(&rqs, 5 * ms).unwrap();
        assert_eq!(rqs.get(second).sector, 16);
        rqs.release(second);
        // The batch of 2 is over and the far read is 11 ms old: it goes next, though
        // sector 24 lies ahead.
        let third = d.dispatch(&rqs, 11 * ms).unwrap();
        assert_eq!(third, far);
    }

    #[test]
    fn writes_are_served_after_writes_starved_read_batches() {
        let mut rqs = Rqs::default();
        let mut d = Deadline::new(&RequestOptions {
            fifo_batch: 1,
            writes_starved: 2,
            ..RequestOptions::default()
        });
        let w = rqs.alloc(rq(Op::Write, 0, 0));
        d.insert(&rqs, w);
        for s in [100, 200, 300, 400] {
            let id = rqs.alloc(rq(Op::Read, s, 0));
            d.insert(&rqs, id);
        }
        let order: Vec<Op> = (0..5)
            .map(|_| {
                let id = d.dispatch(&rqs, 0).unwrap();
                let op = rqs.get(id).op;
                rqs.release(id);
                op
            })
            .collect();
        // Two read batches pass the waiting write, the third choice serves it.
        assert_eq!(
            order,
            vec![Op::Read, Op::Read, Op::Write, Op::Read, Op::Read]
        );
    }

    #[test]
    fn merges_find_the_neighbours_and_front_merges_keep_the_order() {
        let mut rqs = Rqs::default();
        let mut d = Deadline::new(&RequestOptions::default());
        let a = rqs.alloc(rq(Op::Write, 64, 0));
        d.insert(&rqs, a);
        let ok = |_: &Rq| true;
        // Ends at 72: a probe at 72 merges at its back, one ending at 64 at its front.
        assert_eq!(
            d.find_merge(&rqs, &rq(Op::Write, 72, 0), &ok),
            Some((a, Merge::Back))
        );
        assert_eq!(
            d.find_merge(&rqs, &rq(Op::Write, 56, 0), &ok),
            Some((a, Merge::Front))
        );
        assert_eq!(d.find_merge(&rqs, &rq(Op::Read, 72, 0), &ok), None);
        rqs.get_mut(a).sector = 56;
        rqs.get_mut(a).bytes = 8192;
        d.front_merged(&rqs, a, 64);
        assert_eq!(drain(&mut d, &mut rqs, 0), vec![56]);
    }
}
