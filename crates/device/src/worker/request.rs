//! A parsed request as the engine sees it ([`to_op`]), GET_ID answered on the spot, a
//! finished request's status and used element ([`complete`]), and the dirty-log marks of
//! what a request wrote into guest memory ([`LogView`]).

use std::sync::Arc;

use std::io;

use log::warn;
use proto::wire::{status, ID_BYTES};
use proto::{Request, RequestKind};
use storage::Op;

#[cfg(doc)]
use super::queue::BIG_SLOTS;
use super::queue::{Queue, RateLimit, SLOT_IOVECS};
use crate::dirty_log::DirtyLog;
use crate::memory::GuestMemory;
use crate::stats::bump;

/// The engine operation for `req`. `durable`: the disk is write-through (the guest turned
/// its write cache off, or cannot flush), so writes, discards and write-zeroes complete
/// only once stable.
pub(crate) fn to_op(req: &Request, durable: bool) -> Op {
    let iov = req.iov.as_ptr();
    let iovcnt = req.iov.len() as u32;
    match req.kind {
        RequestKind::In => Op::Read {
            offset: req.offset(),
            iov,
            iovcnt,
        },
        RequestKind::Out => Op::Write {
            offset: req.offset(),
            iov,
            iovcnt,
            durable,
        },
        RequestKind::Flush | RequestKind::GetId => Op::Flush,
        RequestKind::Discard => Op::Discard {
            offset: req.offset(),
            len: req.len,
            durable,
        },
        RequestKind::WriteZeroes { unmap } => Op::WriteZeroes {
            offset: req.offset(),
            len: req.len,
            unmap,
            durable,
        },
    }
}

/// Copy the ID into the request's payload buffers (`req.len` bytes, at most 20).
pub(crate) fn write_id(req: &Request, serial: &[u8; ID_BYTES]) {
    let mut src = &serial[..req.len as usize];
    for v in &req.iov {
        let n = v.iov_len.min(src.len());
        for (i, b) in src[..n].iter().enumerate() {
            // SAFETY: the iovec was translated by the parser from a device-writable guest
            // buffer of at least `iov_len` bytes that the worker's memory view keeps mapped.
            unsafe { v.iov_base.cast::<u8>().add(i).write_volatile(*b) };
        }
        src = &src[n..];
    }
}

/// A worker's dirty log with the memory views that translate host pointers back to guest
/// physical addresses (the current one, and older ones requests in flight still use).
pub(crate) struct LogView<'a> {
    pub log: &'a DirtyLog,
    pub mem: &'a GuestMemory,
    pub retired: &'a [Arc<GuestMemory>],
}

impl LogView<'_> {
    fn mark_host(&self, p: *const u8, len: usize) {
        let gpa = self
            .mem
            .gpa_of(p)
            .or_else(|| self.retired.iter().find_map(|m| m.gpa_of(p)));
        if let Some(gpa) = gpa {
            self.log.mark(gpa, len as u64);
        }
    }

    /// Mark what `req` wrote: its status byte, and its payload if the device writes it
    /// (a read or GET_ID, whether it succeeded or not: a failed read may have written part).
    pub(crate) fn mark_request(&self, req: &Request) {
        if matches!(req.kind, RequestKind::In | RequestKind::GetId) {
            for v in &req.iov {
                self.mark_host(v.iov_base.cast(), v.iov_len);
            }
        }
        self.mark_host(req.status_ptr, 1);
    }

    /// Mark one status byte (a request answered without reaching the engine).
    pub(crate) fn mark_status(&self, status: *const u8) {
        self.mark_host(status, 1);
    }
}

/// Finish request `head` of `q` with the engine's `result` at `now` (ticks); `publish`:
/// write the status and queue the used element (false for a queue the frontend has
/// already stopped), and mark what the request wrote in `log` while a migration runs.
/// `big` is the worker's count of grown iovec vectors and its budget (see [`BIG_SLOTS`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn complete(
    q: &mut Queue,
    head: u16,
    result: io::Result<u64>,
    log: &mut RateLimit,
    publish: bool,
    now: u64,
    big: (&mut usize, usize),
    dirty: Option<&LogView<'_>>,
) {
    let Some(slot) = q.slots.get_mut(usize::from(head)) else {
        return;
    };
    if !slot.busy {
        log::error!(
            "queue {}: completion for head {head}, which is not in flight",
            q.index
        );
        return;
    }
    slot.busy = false;
    q.in_flight -= 1;
    let (st, used_len) = match &result {
        Ok(_) => (status::OK, slot.req.used_len_ok()),
        Err(e) => {
            bump(&q.stats.failed, 1);
            if log.allow() {
                warn!(
                    "queue {}: {:?} of {} bytes at sector {} failed: {e}",
                    q.index, slot.req.kind, slot.req.len, slot.req.sector
                );
            }
            (status::IOERR, 1)
        }
    };
    if publish {
        // SAFETY: status_ptr is a checked byte of guest memory, kept mapped by the
        // worker's memory view or its retired views while the request was in flight.
        unsafe { slot.req.status_ptr.write_volatile(st) };
        if let Some(dirty) = dirty {
            dirty.mark_request(&slot.req);
        }
        q.used.push((head, used_len));
        q.count_completed(head, now);
    } else if let Some(dirty) = dirty {
        // A stopped queue's request: its payload may have landed (the engine wrote it),
        // which a migration must copy too.
        dirty.mark_request(&slot.req);
    }
    keep_or_shrink(&mut q.slots[usize::from(head)], big);
}

/// A slot whose request is done keeps a grown iovec vector while the worker's budget
/// allows, and gives it back otherwise.
pub(crate) fn keep_or_shrink(slot: &mut super::queue::Slot, big: (&mut usize, usize)) {
    let (held, max) = big;
    if slot.big || slot.req.iov.capacity() <= SLOT_IOVECS {
        return;
    }
    if *held < max {
        slot.big = true;
        *held += 1;
    } else {
        slot.req.iov = Vec::with_capacity(SLOT_IOVECS);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Write-through: every request that changes the disk is durable, not only writes.
    #[test]
    fn write_through_makes_writes_discards_and_write_zeroes_durable() {
        let mut req = Request::with_capacity(SLOT_IOVECS);
        for durable in [true, false] {
            req.kind = RequestKind::Out;
            assert!(matches!(to_op(&req, durable), Op::Write { durable: d, .. } if d == durable));
            req.kind = RequestKind::Discard;
            assert!(matches!(to_op(&req, durable), Op::Discard { durable: d, .. } if d == durable));
            req.kind = RequestKind::WriteZeroes { unmap: true };
            assert!(matches!(
                to_op(&req, durable),
                Op::WriteZeroes { durable: d, unmap: true, .. } if d == durable
            ));
        }
    }
}
