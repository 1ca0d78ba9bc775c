//! `bfq`: proportional share of the device between flows (submitters), by weight.
//!
//! The scheduling is B-WF2Q+, as BFQ schedules its queues, with the service counted in
//! bytes: each backlogged flow has a virtual start and finish time; the flow served next is
//! the eligible one (start not after the system's virtual time) with the earliest finish;
//! serving `L` bytes advances the flow by `L / weight` and the system by `L / (sum of the
//! backlogged weights)`. Over any interval in which two flows stay backlogged, the bytes
//! they are served are in the ratio of their weights, within one request of each.
//!
//! Left out, and why: BFQ's idling (waiting a few ms for a sync flow's next request
//! instead of serving another flow) trades throughput for isolation on rotational disks;
//! without it a flow that keeps too few requests queued gets less than its share. Within a
//! flow requests go in arrival order.

use std::collections::VecDeque;

use crate::path::request::{Merge, Rq, Rqs};

/// BFQ's default weight (ioprio class BE, level 4).
pub(crate) const DEFAULT_WEIGHT: u32 = 100;
/// Virtual time is counted in bytes × SCALE / weight.
const SCALE: u128 = 1 << 20;
const LOOKBACK: usize = 8;

#[derive(Debug, Default)]
struct Flow {
    weight: u32,
    queue: VecDeque<u32>,
    start: u128,
    finish: u128,
}

#[derive(Debug, Default)]
pub(crate) struct Bfq {
    flows: Vec<Flow>,
    vtime: u128,
    busy_weight: u128,
    count: usize,
}

impl Bfq {
    fn flow_mut(&mut self, flow: u16) -> &mut Flow {
        let i = usize::from(flow);
        if i >= self.flows.len() {
            self.flows.resize_with(i + 1, || Flow {
                weight: DEFAULT_WEIGHT,
                ..Flow::default()
            });
        }
        &mut self.flows[i]
    }

    pub(crate) fn set_weight(&mut self, flow: u16, weight: u32) {
        let w = weight.max(1);
        let f = self.flow_mut(flow);
        let old = f.weight;
        let busy = !f.queue.is_empty();
        f.weight = w;
        if busy {
            self.busy_weight = self.busy_weight - u128::from(old) + u128::from(w);
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.count
    }

    fn cost(bytes: u64, weight: u32) -> u128 {
        u128::from(bytes.max(512)) * SCALE / u128::from(weight)
    }

    pub(crate) fn insert(&mut self, rqs: &Rqs, id: u32) {
        let rq = rqs.get(id);
        let vtime = self.vtime;
        let f = self.flow_mut(rq.flow);
        let was_idle = f.queue.is_empty();
        f.queue.push_back(id);
        if was_idle {
            f.start = f.start.max(vtime).max(f.finish);
            f.finish = f.start + Self::cost(rq.bytes, f.weight);
            let w = u128::from(f.weight);
            self.busy_weight += w;
        }
        self.count += 1;
    }

    pub(crate) fn find_merge(
        &self,
        rqs: &Rqs,
        probe: &Rq,
        ok: &dyn Fn(&Rq) -> bool,
    ) -> Option<(u32, Merge)> {
        let f = self.flows.get(usize::from(probe.flow))?;
        // Not the head: its finish time was computed from its size.
        f.queue
            .iter()
            .skip(1)
            .rev()
            .take(LOOKBACK)
            .find(|&&id| ok(rqs.get(id)))
            .map(|&id| {
                let side = if rqs.get(id).end() == probe.sector {
                    Merge::Back
                } else {
                    Merge::Front
                };
                (id, side)
            })
    }

    pub(crate) fn dispatch(&mut self, rqs: &Rqs) -> Option<u32> {
        if self.count == 0 {
            return None;
        }
        // The system's virtual time never lags the earliest start of a backlogged flow.
        let min_start = self
            .flows
            .iter()
            .filter(|f| !f.queue.is_empty())
            .map(|f| f.start)
            .min()?;
        self.vtime = self.vtime.max(min_start);
        let vtime = self.vtime;
        let i = self
            .flows
            .iter()
            .enumerate()
            .filter(|(_, f)| !f.queue.is_empty() && f.start <= vtime)
            .min_by_key(|(_, f)| f.finish)
            .map(|(i, _)| i)?;
        let busy = self.busy_weight.max(1);
        let f = &mut self.flows[i];
        let id = f.queue.pop_front()?;
        let bytes = rqs.get(id).bytes;
        f.start = f.finish;
        if let Some(&next) = f.queue.front() {
            f.finish = f.start + Self::cost(rqs.get(next).bytes, f.weight);
        } else {
            self.busy_weight -= u128::from(f.weight);
        }
        self.vtime += u128::from(bytes.max(512)) * SCALE / busy;
        self.count -= 1;
        Some(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::Op;

    fn rq(flow: u16, sector: u64, bytes: u64) -> Rq {
        Rq {
            first: 0,
            last: 0,
            op: Op::Read,
            sector,
            bytes,
            pieces: 1,
            flow,
            at: 0,
            nomerge: false,
            seq: 0,
        }
    }

    /// Serve `n` requests with both flows kept backlogged; bytes served per flow.
    fn serve(weights: [u32; 2], sizes: [u64; 2], n: usize) -> [u64; 2] {
        let mut rqs = Rqs::default();
        let mut b = Bfq::default();
        b.set_weight(1, weights[0]);
        b.set_weight(2, weights[1]);
        let mut served = [0u64; 2];
        let mut sector = 0;
        for _ in 0..4 {
            for (f, &size) in sizes.iter().enumerate() {
                sector += 64;
                let id = rqs.alloc(rq(f as u16 + 1, sector, size));
                b.insert(&rqs, id);
            }
        }
        for _ in 0..n {
            let id = b.dispatch(&rqs).unwrap();
            let r = *rqs.get(id);
            rqs.release(id);
            let f = usize::from(r.flow) - 1;
            served[f] += r.bytes;
            sector += 64;
            let id = rqs.alloc(rq(r.flow, sector, sizes[f]));
            b.insert(&rqs, id);
        }
        served
    }

    #[test]
    fn backlogged_flows_share_by_weight() {
        let s = serve([300, 100], [4096, 4096], 4000);
        let ratio = s[0] as f64 / s[1] as f64;
        assert!((ratio - 3.0).abs() < 0.05, "{s:?} ratio {ratio}");
    }

    #[test]
    fn the_share_is_of_bytes_not_requests() {
        // Equal weights, one flow's requests 16 times larger: equal bytes.
        let s = serve([100, 100], [65536, 4096], 4000);
        let ratio = s[0] as f64 / s[1] as f64;
        assert!((ratio - 1.0).abs() < 0.05, "{s:?} ratio {ratio}");
    }

    #[test]
    fn a_flow_that_returns_gets_no_credit_for_its_idle_time() {
        let mut rqs = Rqs::default();
        let mut b = Bfq::default();
        for i in 0..100 {
            let id = rqs.alloc(rq(1, i * 8, 4096));
            b.insert(&rqs, id);
            let id = b.dispatch(&rqs).unwrap();
            rqs.release(id);
        }
        // Flow 2 arrives late; from now on the two alternate instead of flow 2 catching up.
        let mut order = Vec::new();
        for i in 0..10 {
            for f in [1, 2] {
                let id = rqs.alloc(rq(f, 10_000 + i * 8, 4096));
                b.insert(&rqs, id);
            }
        }
        for _ in 0..10 {
            let id = b.dispatch(&rqs).unwrap();
            order.push(rqs.get(id).flow);
            rqs.release(id);
        }
        let twos = order.iter().filter(|&&f| f == 2).count();
        assert!((4..=6).contains(&twos), "{order:?}");
    }
}
