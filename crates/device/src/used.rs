//! Publishing completions: the used elements of a pass are written, then the used index
//! is stored once (Release), then the driver's wish to be notified is read — `used_event`
//! with EVENT_IDX, the avail ring's NO_INTERRUPT flag without it — so the driver is
//! interrupted at most once per batch and never when it asked not to be.

use std::sync::atomic::{fence, Ordering};

use virtio_queue::{Queue, QueueT};
use vm_memory::{Address, Bytes, GuestAddress};

use crate::worker::Mem;

/// Avail ring flag: the driver does not want interrupts (without EVENT_IDX).
const AVAIL_F_NO_INTERRUPT: u16 = 1;

/// Completions of one queue gathered during a pass.
#[derive(Debug)]
pub(crate) struct UsedBatch {
    pending: Vec<(u16, u32)>,
}

impl UsedBatch {
    /// Room for `size` completions (a queue never has more outstanding).
    pub(crate) fn new(size: usize) -> UsedBatch {
        UsedBatch {
            pending: Vec::with_capacity(size),
        }
    }

    pub(crate) fn push(&mut self, head: u16, len: u32) {
        self.pending.push((head, len));
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Write the gathered elements and the new used index. Returns whether the driver
    /// wants to be notified, or a message if the rings lie outside guest memory.
    pub(crate) fn publish(&mut self, queue: &mut Queue, mem: &Mem) -> Result<bool, String> {
        if self.pending.is_empty() {
            return Ok(false);
        }
        let size = queue.size();
        let used = GuestAddress(queue.used_ring());
        let old = queue.next_used();
        let mut idx = old;
        for (head, len) in self.pending.drain(..) {
            let at = used
                .checked_add(4 + 8 * u64::from(idx % size))
                .ok_or("used ring address overflows")?;
            let mut elem = [0u8; 8];
            elem[..4].copy_from_slice(&u32::from(head).to_le_bytes());
            elem[4..].copy_from_slice(&len.to_le_bytes());
            mem.write_slice(&elem, at)
                .map_err(|e| format!("cannot write the used ring: {e}"))?;
            idx = idx.wrapping_add(1);
        }
        let idx_at = used.checked_add(2).ok_or("used ring address overflows")?;
        // Release: the elements above are visible no later than the index covering them.
        mem.store(idx.to_le(), idx_at, Ordering::Release)
            .map_err(|e| format!("cannot write the used index: {e}"))?;
        queue.set_next_used(idx);
        // SeqCst: the index store above must be ordered before reading the driver's
        // notification request below (pairs with the driver's fence after writing it).
        fence(Ordering::SeqCst);
        let avail = GuestAddress(queue.avail_ring());
        if queue.event_idx_enabled() {
            let at = avail
                .checked_add(4 + 2 * u64::from(size))
                .ok_or("avail ring address overflows")?;
            let event = u16::from_le(
                mem.load::<u16>(at, Ordering::Relaxed)
                    .map_err(|e| format!("cannot read used_event: {e}"))?,
            );
            Ok(idx.wrapping_sub(event).wrapping_sub(1) < idx.wrapping_sub(old))
        } else {
            let flags = u16::from_le(
                mem.load::<u16>(avail, Ordering::Relaxed)
                    .map_err(|e| format!("cannot read the avail flags: {e}"))?,
            );
            Ok(flags & AVAIL_F_NO_INTERRUPT == 0)
        }
    }
}
