//! Writing back: the owner's changed mappings reach the file at the end of each batch of
//! jobs (changed L2 slices gathered into runs and written together through io_uring),
//! and become durable with the refcounts of the clusters they no longer use dropped, in
//! the order `write.rs`'s comment gives. A failed `fdatasync` fails the writer for good.

use std::io;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{eio, Writer, SLICE_DEPTH};
use crate::bounce::AlignedBuf;
use crate::engine::Op;
use crate::qcow2::entry::{encode_l2, Mapping};
use crate::qcow2::fileio::FileIo;
use crate::qcow2::owner::Owner;
use crate::qcow2::table::Entry;

/// The most L2 bytes written in one write.
const MAX_RUN: usize = 1 << 20;

/// Where each run of L2 entries starts in the staging buffer: a multiple of this.
const STAGING_ALIGN: usize = 4096;
/// The largest staging buffer kept between batches.
const MAX_KEPT_STAGING: usize = 4 << 20;

/// Mappings kept in memory before they are written back regardless of time.
const MAX_PENDING: usize = 16384;

impl Writer {
    /// Write the runs `write_slices` gathered: together through `slice_io`, or one by
    /// one through `src` without it (or after it failed: it is then given up). Returns
    /// once all are in the file (or one failed).
    fn write_runs(&mut self, src: &FileIo<'_>) -> io::Result<()> {
        let Some(engine) = self.slice_io.as_mut() else {
            for &(at, start, len) in &self.l2runs {
                src.write_all_at(&self.l2buf[start..start + len], at)?;
            }
            return Ok(());
        };
        let need: usize = self
            .l2runs
            .iter()
            .map(|r| r.2.next_multiple_of(STAGING_ALIGN))
            .sum();
        if self.staging.as_ref().is_none_or(|(_, len)| *len < need) {
            self.staging = Some((AlignedBuf::new(need, STAGING_ALIGN)?, need));
        }
        let Some((buf, _)) = self.staging.as_ref() else {
            return Err(eio());
        };
        let base = buf.as_mut_ptr();
        let mut iovs: Vec<libc::iovec> = Vec::with_capacity(self.l2runs.len());
        let mut off = 0usize;
        for &(_, start, len) in &self.l2runs {
            // SAFETY: [off, off + len) lies inside the `need` bytes of the buffer, which
            // nothing else uses while the owner runs this.
            unsafe {
                std::ptr::copy_nonoverlapping(self.l2buf.as_ptr().add(start), base.add(off), len)
            };
            iovs.push(libc::iovec {
                // SAFETY: as above.
                iov_base: unsafe { base.add(off) }.cast(),
                iov_len: len,
            });
            off += len.next_multiple_of(STAGING_ALIGN);
        }
        let mut result = Ok(());
        let mut next = 0usize;
        let mut out = 0usize;
        let runs = &self.l2runs;
        let failed = (|| -> io::Result<()> {
            while next < iovs.len() || out > 0 {
                while next < iovs.len() && out < SLICE_DEPTH as usize {
                    let op = Op::Write {
                        offset: runs[next].0,
                        iov: &iovs[next],
                        iovcnt: 1,
                        durable: false,
                    };
                    // SAFETY: `iovs` and the staging buffer they point into are neither
                    // changed nor dropped while a write is out: this loop ends when none
                    // is, and on an error the engine is dropped (which waits for them)
                    // before they are.
                    if unsafe { engine.push(next as u64, op) }.is_err() {
                        if out == 0 {
                            // Refused with nothing of ours out: it never will take it.
                            return Err(eio());
                        }
                        break;
                    }
                    next += 1;
                    out += 1;
                }
                engine.submit()?;
                let mut done = 0;
                engine.reap(&mut |c| {
                    done += 1;
                    let want = iovs.get(c.token as usize).map_or(0, |v| v.iov_len as u64);
                    match c.result {
                        Ok(n) if n == want => {}
                        Ok(_) => result = Err(eio()),
                        Err(e) => result = Err(e),
                    }
                });
                out -= done;
                if done == 0 && out > 0 {
                    // Submits again what the kernel refused for now (EAGAIN), too.
                    engine.wait()?;
                }
            }
            Ok(())
        })();
        // A large batch (a discard over much of a disk) does not keep its buffer.
        if need > MAX_KEPT_STAGING {
            self.staging = None;
        }
        if let Err(e) = failed.and(result) {
            // Writes may still be out: the engine waits for them as it goes. Then all of
            // them again, one at a time (writing a run twice is harmless); a device that
            // fails them fails these too.
            log::error!(
                "qcow2: a metadata write through io_uring failed ({e}): one at a time from now on"
            );
            self.slice_io = None;
            return self.write_runs(src);
        }
        Ok(())
    }

    /// Whether anything waits to be written back.
    pub(crate) fn pending(&self) -> bool {
        !self.pending_l2.is_empty() || !self.pending_free.is_empty()
    }

    /// Whether an `fdatasync` is in flight on `batch_io` (a batch's, a writeback's).
    pub(crate) fn io_out(&self) -> bool {
        !self.coming.is_empty() || self.writeback_out
    }

    /// Whether the writeback is due: `after` since the first change, or too many.
    pub(crate) fn due(&self, after: Duration) -> bool {
        self.since.is_some_and(|s| s.elapsed() >= after) || self.pending_l2.len() >= MAX_PENDING
    }

    /// A mapping changed: the writeback comes due from the first change on ([`Writer::due`]).
    pub(super) fn changed(&mut self) {
        self.since.get_or_insert_with(Instant::now);
    }

    /// The clusters `old` held, to be freed once its replacement is durable (never a
    /// metadata cluster a hostile mapping names: `unref` leaves those alone).
    pub(super) fn free(&mut self, old: Mapping, bits: u32) {
        match old {
            Mapping::Data { host, .. } | Mapping::Zero { host: Some(host) } => {
                self.pending_free.push(host >> bits)
            }
            Mapping::Compressed { host, bytes } if bytes > 0 => {
                let first = (host & !511) >> bits;
                let last = (host + bytes - 1) >> bits;
                self.pending_free.extend(first..=last);
            }
            _ => {}
        }
    }
}

impl Owner {
    /// Write the slices of L2 entries changed since the last call into the file (after
    /// an `fdatasync` if a copy-on-write's bytes must be durable first): a cached slice
    /// as the cache has it, another read and patched with the unsynced mappings; slices
    /// next to each other in one write. A failure is for good, as a failed sync's.
    pub(crate) fn flush_mappings(&mut self, src: &FileIo<'_>) -> io::Result<()> {
        match self.writer.as_ref() {
            Some(w) if w.dirty.is_empty() => return Ok(()),
            Some(w) if w.failed => return Err(eio()),
            Some(_) => {}
            None => return Ok(()),
        }
        self.hold.pause();
        if self.writer.as_ref().is_some_and(|w| w.sync_first) {
            self.sync(src)?;
        }
        let r = self.write_slices(src);
        let Owner {
            writer,
            meta,
            table,
            ..
        } = self;
        let Some(w) = writer.as_mut() else {
            return r;
        };
        w.sync_first = false;
        w.dirty.clear();
        let unwritten = std::mem::take(&mut w.unwritten);
        if let Err(e) = &r {
            self.fail_for_good(&format!("writing L2 entries failed ({e})"));
            return r;
        }
        // In the file now: the workers may write these clusters in place (fresh: the
        // mapping is not durable yet).
        let (cluster, file_size) = (meta.header().cluster_size(), meta.file_size());
        for gc in unwritten {
            if let Some(m) = w.pending_mapping(gc) {
                table.set(gc, w.entry(gc, m, cluster, file_size));
            }
        }
        r
    }

    /// No mapping is written from now on; every write, discard and flush fails (see
    /// `Writer::failed`). Logged once, with `why`.
    pub(super) fn fail_for_good(&mut self, why: &str) {
        let Some(w) = self.writer.as_mut() else {
            return;
        };
        if !w.failed {
            log::error!(
                "{}: {why}: writes may be lost; from now on every write and flush fails (restart the daemon after `qemu-img check`)",
                self.name
            );
        }
        w.failed = true;
        // Clusters whose mappings may not be in the file are no longer written in place
        // by the workers: their writes go to the owner, which fails them.
        for &gc in w.pending_l2.keys() {
            self.table.set(gc, Entry::Slow);
        }
    }

    /// After a job: if any `fdatasync` on the image failed during it (the refcounts sync
    /// on their own to order a new block or table before what points at it), the writer
    /// fails for good, as after a failed sync of its own. Without this a later sync
    /// would succeed over the dropped writes and the daemon go on as if nothing was lost.
    pub(crate) fn check_sync(&mut self, src: &FileIo<'_>) {
        if src.sync_failed() && self.writer.as_ref().is_some_and(|w| !w.failed) {
            self.fail_for_good("an fdatasync of the image failed");
        }
    }

    /// Gather the changed slices into runs of adjacent entries, each slice as the cache
    /// has it or as the file has it patched with the unsynced mappings, and write them.
    fn write_slices(&mut self, src: &FileIo<'_>) -> io::Result<()> {
        let per_table = self.meta.header().l2_entries();
        let Owner { writer, meta, .. } = self;
        let Some(w) = writer.as_mut() else {
            return Ok(());
        };
        let n = meta.slice_clusters();
        let run = &mut w.l2buf;
        run.clear();
        w.l2runs.clear();
        let mut run_at = 0u64;
        let mut run_start = 0usize;
        for &key in &w.dirty {
            let table = meta.l1_entry(key / per_table).ok_or_else(eio)?;
            let at = table + (key % per_table) * 8;
            let len = run.len() - run_start;
            if len > 0 && (run_at + len as u64 != at || len >= MAX_RUN) {
                w.l2runs.push((run_at, run_start, len));
                run_start = run.len();
            }
            if run.len() == run_start {
                run_at = at;
            }
            // A cached slice may have been evicted and read again from the file since
            // the change: the unsynced mappings go into it first.
            for (&gc, &m) in w.pending_l2.range(key..key + n) {
                meta.set_l2(gc, m);
            }
            match meta.cached_slice(key) {
                Some(raw) => run.extend(raw.iter().flat_map(|e| e.to_be_bytes())),
                None => {
                    let start = run.len();
                    run.resize(start + n as usize * 8, 0);
                    src.read_or_zero(&mut run[start..], at)?;
                    for (&gc, &m) in w.pending_l2.range(key..key + n) {
                        let i = start + (gc - key) as usize * 8;
                        run[i..i + 8].copy_from_slice(&encode_l2(m).to_be_bytes());
                    }
                }
            }
        }
        if run.len() > run_start {
            w.l2runs.push((run_at, run_start, run.len() - run_start));
        }
        w.write_runs(src)
    }

    /// A guest FLUSH: every completed write durable, with its mapping.
    pub(crate) fn flush_job(&mut self, src: &FileIo<'_>) -> io::Result<()> {
        if self.writer.as_ref().is_some_and(|w| w.failed) {
            return Err(eio());
        }
        if self.writer.as_ref().is_some_and(|w| w.pending()) {
            // Ends with an fdatasync, after the writes the FLUSH covers.
            self.writeback(src)
        } else {
            self.sync(src)
        }
    }

    /// `fdatasync`; a failure is for good (see `Writer::failed`).
    pub(crate) fn sync(&mut self, src: &FileIo<'_>) -> io::Result<()> {
        let r = src.sync();
        if let Err(e) = &r {
            self.fail_for_good(&format!("fdatasync failed ({e})"));
        }
        r
    }

    /// Make the changed mappings durable (the order in `write.rs`'s comment): they are
    /// in the file already; after the `fdatasync` the workers may write their clusters
    /// in place, and the clusters no longer mapped have their refcounts dropped.
    pub(crate) fn writeback(&mut self, src: &FileIo<'_>) -> io::Result<()> {
        match self.writer.as_ref() {
            Some(w) if w.failed => return Err(eio()),
            Some(w) if w.pending() => {}
            _ => return Ok(()),
        }
        self.flush_mappings(src)?;
        if let Some(w) = self.writer.as_mut() {
            w.refs.flush(src)?;
        }
        self.sync(src)?;
        let bits = self.cluster_bits();
        let Owner {
            writer,
            meta,
            table,
            ..
        } = self;
        let Some(w) = writer.as_mut() else {
            return Ok(());
        };
        // A periodic writeback's sync still in flight is covered by this one: what it
        // was to free is freed now (its mappings are still pending, granted below).
        if let Some(sy) = w.syncing.take() {
            w.pending_free.extend(sy.free);
        }
        // Durable now: owned clusters may be written in place by the workers.
        let file_size = meta.file_size();
        for (&gc, &m) in &w.pending_l2 {
            if let Mapping::Data { host, copied: true } = m {
                if host + (1u64 << bits) <= file_size {
                    table.set(gc, Entry::Owned(host));
                }
            }
        }
        w.pending_l2.clear();
        // The mappings that used them are durably gone: a crash from here on leaks
        // these clusters at most.
        for c in std::mem::take(&mut w.pending_free) {
            w.refs.unref(src, c)?;
        }
        w.refs.flush(src)?;
        w.since = None;
        self.counters.writebacks.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// The periodic writeback (a second after a change, or many changes): the changed
    /// mappings are in the file already (each batch writes them); what makes them durable
    /// is an `fdatasync`, which under writes takes tens to hundreds of milliseconds. It
    /// goes out on `batch_io` and the owner goes on serving meanwhile; what it made
    /// durable is taken up when it completes ([`Owner::writeback_synced`]). Without
    /// `batch_io`, or if it refuses, synchronously ([`Owner::writeback`]).
    pub(crate) fn writeback_soon(&mut self, src: &FileIo<'_>) -> io::Result<()> {
        match self.writer.as_ref() {
            Some(w) if w.failed => return Err(eio()),
            Some(w) if w.writeback_out => return Ok(()),
            Some(w) if w.batch_io.is_some() && w.pending() => {}
            Some(w) if w.pending() => return self.writeback(src),
            _ => return Ok(()),
        }
        self.flush_mappings(src)?;
        let w = self.writer.as_mut().ok_or_else(eio)?;
        w.refs.flush(src)?;
        let started = match w.batch_io.as_mut() {
            // SAFETY: a flush names no buffer.
            Some(e) => unsafe { e.push(super::batch::WRITEBACK_TOKEN, Op::Flush) }
                .map_err(|_| eio())
                .and_then(|()| e.submit()),
            None => Err(eio()),
        };
        if started.is_err() {
            return self.writeback(src);
        }
        w.syncing = Some(Syncing {
            mappings: w.pending_l2.iter().map(|(&gc, &m)| (gc, m)).collect(),
            free: std::mem::take(&mut w.pending_free),
        });
        w.writeback_out = true;
        w.since = None;
        Ok(())
    }

    /// The periodic writeback's `fdatasync` completed with `result`: its mappings are
    /// durable (those not changed since become owned: written in place by write-through
    /// writes too) and the clusters they no longer use have their refcounts dropped.
    pub(super) fn writeback_synced(
        &mut self,
        src: &FileIo<'_>,
        result: io::Result<u64>,
    ) -> io::Result<()> {
        let bits = self.cluster_bits();
        let Owner {
            writer,
            meta,
            table,
            counters,
            ..
        } = self;
        let Some(w) = writer.as_mut() else {
            return Ok(());
        };
        w.writeback_out = false;
        // None: a synchronous writeback since covered it.
        let Some(sy) = w.syncing.take() else {
            return Ok(());
        };
        if let Err(e) = result {
            self.fail_for_good(&format!("fdatasync failed ({e})"));
            return Err(e);
        }
        let file_size = meta.file_size();
        for (gc, m) in sy.mappings {
            if w.pending_l2.get(&gc) != Some(&m) {
                continue;
            }
            w.pending_l2.remove(&gc);
            if let Mapping::Data { host, copied: true } = m {
                if host + (1u64 << bits) <= file_size {
                    table.set(gc, Entry::Owned(host));
                }
            }
        }
        for c in sy.free {
            w.refs.unref(src, c)?;
        }
        w.refs.flush(src)?;
        counters.writebacks.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// What a periodic writeback's `fdatasync` in flight makes durable: the mappings pending
/// when it went out, and the clusters they no longer use.
pub(super) struct Syncing {
    mappings: Vec<(u64, Mapping)>,
    free: Vec<u64>,
}
