//! Clusters counted ahead of their use (rule 1 of `write.rs`'s order): a batch at the end
//! of the file gets its refcounts (1) written, the file grown over it (holes) and one
//! `fdatasync`, and only then are its clusters handed out. That sync waits for every write
//! in flight on the image and for the disk's cache: tens to hundreds of milliseconds under
//! allocating writes. So the next batch is counted while the current one still lasts, its
//! sync in flight on an io_uring of its own, and the owner goes on handing out the
//! clusters counted before; it waits only if they run out first (or counts synchronously,
//! as for the first batch, when it has no io_uring).
//!
//! What is counted and not handed out is what a crash leaks: the current batch's rest and
//! the next batch together never exceed the cap on one batch (256 MiB, or a sixteenth of
//! a smaller disk, 8 MiB at least). So does what was handed to the allocating writes in
//! flight and not mapped yet (a data cluster and perhaps a new L2 table each).

use std::io;
use std::time::{Duration, Instant};

use super::{eio, BATCH_BYTES, MAX_BATCH_BYTES};
use crate::engine::Op;
use crate::qcow2::fileio::FileIo;
use crate::qcow2::owner::Owner;

/// The tokens of the `fdatasync`s on `batch_io`: a batch's, the periodic writeback's.
const SYNC_TOKEN: u64 = 1;
pub(super) const WRITEBACK_TOKEN: u64 = 2;

/// What [`Owner::poll_io`] waits for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Until {
    /// Nothing: take what has completed.
    Now,
    /// The batch counted ahead.
    Batch,
    /// Everything in flight.
    Idle,
}

impl Owner {
    /// The most bytes of clusters counted and not handed out at once.
    fn batch_cap(&self) -> u64 {
        (self.meta.header().size / 16).clamp(BATCH_BYTES, MAX_BATCH_BYTES)
    }

    /// A cluster for data or an L2 table, counted (refcount 1) and durable: from the
    /// batch, from the next one once its sync is done, or from a new batch at the end of
    /// the file (the file grown over it: holes). Starts counting the next batch when this
    /// one is half used.
    pub(super) fn take_cluster(&mut self, src: &FileIo<'_>) -> io::Result<u64> {
        self.poll_io(src, Until::Now)?;
        let w = self.writer.as_mut().ok_or_else(eio)?;
        let c = match w.reserved.pop_front() {
            Some(c) => c,
            None if !w.coming.is_empty() => {
                self.poll_io(src, Until::Batch)?;
                let w = self.writer.as_mut().ok_or_else(eio)?;
                w.reserved.pop_front().ok_or_else(eio)?
            }
            None => self.take_batch(src)?,
        };
        self.count_ahead(src);
        Ok(c)
    }

    /// Count a batch and make it durable now; the first of its clusters.
    fn take_batch(&mut self, src: &FileIo<'_>) -> io::Result<u64> {
        let bytes = self.next_batch_bytes(self.batch_cap());
        let batch = self.count_batch(src, bytes)?;
        if let Err(e) = self.sync(src) {
            // Not counted durably: never used. Their counts are dropped again (a crash may
            // leak them, never more).
            self.uncount(src, &batch);
            return Err(e);
        }
        let w = self.writer.as_mut().ok_or_else(eio)?;
        w.reserved.extend(batch);
        w.reserved.pop_front().ok_or_else(eio)
    }

    /// The size of the batch to count now, within `room` bytes: allocating fast (the last
    /// batch within a second), twice the last; idle a while, small again.
    fn next_batch_bytes(&mut self, room: u64) -> u64 {
        let cap = self.batch_cap();
        let Some(w) = self.writer.as_mut() else {
            return BATCH_BYTES;
        };
        w.batch_bytes = match w.last_batch {
            Some(t) if t.elapsed() < Duration::from_secs(1) => (w.batch_bytes * 2).min(cap),
            _ => BATCH_BYTES,
        };
        w.last_batch = Some(Instant::now());
        w.batch_bytes.min(room)
    }

    /// If the batch is half used and nothing is counted ahead yet: count the next one and
    /// start its `fdatasync` on `batch_io`. A failure here is left for the synchronous
    /// count to meet (and report) when the clusters run out.
    fn count_ahead(&mut self, src: &FileIo<'_>) {
        let bits = self.cluster_bits();
        let cap = self.batch_cap();
        let Some(w) = self.writer.as_ref() else {
            return;
        };
        let left = (w.reserved.len() as u64) << bits;
        if w.failed || w.batch_io.is_none() || !w.coming.is_empty() || left * 2 > w.batch_bytes {
            return;
        }
        let room = cap.saturating_sub(left);
        if room >> bits < 16 {
            return;
        }
        let bytes = self.next_batch_bytes(room);
        let Ok(batch) = self.count_batch(src, bytes) else {
            return;
        };
        let Some(w) = self.writer.as_mut() else {
            return;
        };
        let started = match w.batch_io.as_mut() {
            // SAFETY: a flush names no buffer.
            Some(e) => unsafe { e.push(SYNC_TOKEN, Op::Flush) }
                .map_err(|_| eio())
                .and_then(|()| e.submit()),
            None => Err(eio()),
        };
        match started {
            Ok(()) => w.coming = batch,
            Err(e) => {
                log::warn!(
                    "{}: counting clusters ahead ({e}): counted when needed from now on",
                    self.name
                );
                w.batch_io = None;
                self.uncount(src, &batch);
            }
        }
    }

    /// Take the completed `fdatasync`s of `batch_io`: the batch counted ahead joins
    /// `reserved`, the periodic writeback's mappings become durable (writeback.rs); wait
    /// for what `until` says. A failed sync fails the writer for good (as every failed
    /// sync of the image does).
    pub(crate) fn poll_io(&mut self, src: &FileIo<'_>, until: Until) -> io::Result<()> {
        let mut first_err = None;
        loop {
            let Some(w) = self.writer.as_mut() else {
                return Ok(());
            };
            let waiting = match until {
                Until::Now => false,
                Until::Batch => !w.coming.is_empty(),
                Until::Idle => !w.coming.is_empty() || w.writeback_out,
            };
            if w.coming.is_empty() && !w.writeback_out {
                break;
            }
            let Some(e) = w.batch_io.as_mut() else {
                return Err(eio());
            };
            let mut done: [Option<io::Result<u64>>; 2] = [None, None];
            e.reap(&mut |c| {
                if let Some(slot) = done.get_mut((c.token as usize).wrapping_sub(1)) {
                    *slot = Some(c.result);
                }
            });
            let [batch, writeback] = done;
            if batch.is_none() && writeback.is_none() {
                if !waiting {
                    break;
                }
                e.wait()?;
                continue;
            }
            if let Some(r) = batch {
                let coming = std::mem::take(&mut w.coming);
                match r {
                    Ok(_) => w.reserved.extend(coming),
                    Err(e) => {
                        // Its clusters stay counted and are never used: leaked, as by a
                        // crash.
                        self.fail_for_good(&format!("fdatasync failed ({e})"));
                        first_err.get_or_insert(e);
                    }
                }
            }
            if let Some(r) = writeback {
                if let Err(e) = self.writeback_synced(src, r) {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Count a batch of about `bytes` of clusters at the end of the file: refcounts set
    /// and written, the file grown over them. Not durable yet. A failure partway (no
    /// room for a new refcount block, no free cluster) keeps what was counted.
    fn count_batch(&mut self, src: &FileIo<'_>, bytes: u64) -> io::Result<Vec<u64>> {
        let bits = self.cluster_bits();
        let w = self.writer.as_mut().ok_or_else(eio)?;
        let n = (bytes >> bits).clamp(16, 65536);
        let mut batch = Vec::with_capacity(n as usize);
        let mut end = 0;
        let mut stopped = None;
        for _ in 0..n {
            let counted = w
                .refs
                .reserve(src)
                .and_then(|c| w.refs.set(src, c, 1).map(|()| c));
            match counted {
                Ok(c) => {
                    batch.push(c);
                    end = end.max((c + 1) << bits);
                }
                Err(e) => {
                    stopped = Some(e);
                    break;
                }
            }
        }
        if batch.is_empty() {
            return Err(stopped.unwrap_or_else(eio));
        }
        let made = w
            .refs
            .flush(src)
            .and_then(|()| src.grow_to(end))
            .map(|()| self.grew(end));
        if let Err(e) = made {
            self.uncount(src, &batch);
            return Err(e);
        }
        Ok(batch)
    }

    /// Drop the counts of clusters never handed out (best effort: a crash may leak them).
    fn uncount(&mut self, src: &FileIo<'_>, batch: &[u64]) {
        if let Some(w) = self.writer.as_mut() {
            for &c in batch {
                let _ = w.refs.set(src, c, 0);
            }
        }
    }

    /// Give the counted, unused clusters back (refcount 0), at a clean close or a
    /// hand-over; the batch counted ahead too, once its sync is done (and a periodic
    /// writeback's sync in flight is waited for).
    pub(crate) fn release_reserved(&mut self, src: &FileIo<'_>) -> io::Result<()> {
        let waited = self.poll_io(src, Until::Idle);
        let Some(w) = self.writer.as_mut() else {
            return Ok(());
        };
        while let Some(c) = w.reserved.pop_front() {
            w.refs.set(src, c, 0)?;
        }
        w.refs.flush(src)?;
        waited
    }
}
