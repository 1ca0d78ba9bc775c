//! `noop`: first in, first out, with merging (Linux's `none`).

use std::collections::VecDeque;

use crate::path::request::{Merge, Rq, Rqs};

/// Requests a merge looks back at (Linux tries the last 8 of a software queue).
const MERGE_LOOKBACK: usize = 8;

/// The FIFO.
#[derive(Debug, Default)]
pub(crate) struct Noop {
    fifo: VecDeque<u32>,
}

impl Noop {
    pub(crate) fn insert(&mut self, id: u32) {
        self.fifo.push_back(id);
    }

    pub(crate) fn find_merge(
        &self,
        rqs: &Rqs,
        probe: &Rq,
        ok: &dyn Fn(&Rq) -> bool,
    ) -> Option<(u32, Merge)> {
        self.fifo
            .iter()
            .rev()
            .take(MERGE_LOOKBACK)
            .find(|&&id| ok(rqs.get(id)))
            .map(|&id| {
                let rq = rqs.get(id);
                let side = if rq.end() == probe.sector {
                    Merge::Back
                } else {
                    Merge::Front
                };
                (id, side)
            })
    }

    pub(crate) fn dispatch(&mut self) -> Option<u32> {
        self.fifo.pop_front()
    }

    pub(crate) fn len(&self) -> usize {
        self.fifo.len()
    }
}
