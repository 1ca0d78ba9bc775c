//! Writing a qcow2 image: the metadata owner's part. Workers write in place to clusters
//! the table calls owned (refcount 1, mapping durable in the file); everything else comes
//! here: a first write to a cluster (allocation, with the cluster's old bytes copied from
//! the backing file, a compressed cluster or a shared one), writes to clusters whose
//! mapping is not durable yet, discards, write-zeroes and flushes.
//!
//! Every change of a mapping is in the file (written, not yet synced) before the request
//! that made it completes, so a daemon killed with SIGKILL loses nothing it acknowledged:
//! the kernel still has what it wrote, and the next daemon reads it. The order on the
//! disk, so that a power failure at any point only leaks clusters (`qemu-img check`
//! exit 3), never maps a cluster that is not counted or whose bytes are not there:
//! 1. clusters are counted before they are handed out: the owner takes a batch at the
//!    end of the file, writes their refcounts (1) and makes them durable (one
//!    `fdatasync` per batch); a mapping may then reach the disk in any order after;
//! 2. a new cluster is a hole until written, and reads as zeroes; a mapping to it may
//!    reach the disk before its bytes when the cluster read as zeroes before (a first
//!    write to an unallocated or zero cluster); a copy-on-write's bytes (the backing
//!    file's, a compressed or shared cluster's) are made durable before its mapping is
//!    written, as QEMU flushes before it writes such an L2 table;
//! 3. a cluster no longer mapped has its refcount dropped only after the change is
//!    durable (the next FLUSH, a write-through write, or a second after a change);
//! 4. at a clean close the batch's unused clusters are given back (refcount 0).
//!
//! A write acknowledged without a FLUSH may still be lost by a power failure, as any
//! write on a disk with a volatile cache; a FLUSH makes it durable.

mod batch;
mod writeback;

pub(crate) use batch::Until;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::entry::Mapping;
use super::fileio::FileIo;
use super::iov;
use super::owner::Owner;
use super::refcount::Refcounts;
use super::table::Entry;
use crate::backend::Backend;
use crate::bounce::AlignedBuf;
use crate::engine::{Engine, Op};

/// How many bytes of clusters are counted at once, ahead of their use, at first: a
/// batch taken within a second of the one before is twice as large, up to
/// [`MAX_BATCH_BYTES`] or a sixteenth of the disk's size if that is less (but not below
/// the first size): each batch costs an `fdatasync`, and a crash leaks what the last
/// one had not handed out yet, which must not be the size of a small disk. Between 16
/// and 65,536 clusters.
const BATCH_BYTES: u64 = 8 << 20;
const MAX_BATCH_BYTES: u64 = 256 << 20;

/// The most L2 writes in flight at once (a batch of 64 jobs changes at most 128 slices).
const SLICE_DEPTH: u32 = 64;

pub(crate) struct Writer {
    pub(crate) refs: Refcounts,
    /// Guest cluster → its mapping, changed, in the file and not yet synced.
    pending_l2: BTreeMap<u64, Mapping>,
    /// Clusters no longer mapped, whose refcount drops once that is durable.
    pending_free: Vec<u64>,
    /// Clusters counted (refcount 1, durable) and not handed out yet, in order.
    reserved: VecDeque<u64>,
    /// The size of the next batch, and when the last was taken.
    batch_bytes: u64,
    last_batch: Option<Instant>,
    /// The next batch, counted ahead while `reserved` still lasts (batch.rs): its
    /// refcounts are in the file, their `fdatasync` is in flight on `batch_io`; handed out
    /// once it completed.
    coming: Vec<u64>,
    /// An io_uring engine on the image file for that `fdatasync` and the periodic
    /// writeback's (writeback.rs). None if it could not be set up or failed once: both
    /// are then done when needed, synchronously.
    batch_io: Option<Box<dyn Engine>>,
    /// The periodic writeback's `fdatasync` is in flight on `batch_io`, and what it makes
    /// durable (None once a synchronous writeback covered it).
    writeback_out: bool,
    syncing: Option<writeback::Syncing>,
    /// L2 slices (their keys: the first guest cluster each maps) changed since they
    /// were last written: written at the end of the owner's batch of jobs, before the
    /// jobs are answered.
    dirty: BTreeSet<u64>,
    /// Guest clusters given a cluster of their own since the slices were last written:
    /// the table lets the workers write them in place only once their mapping is in the
    /// file (`Owner::flush_mappings`). Until then their writes come to the owner, which
    /// answers them after the mapping is written, so that no write a worker acknowledged
    /// lands in a cluster a SIGKILL would leave unmapped.
    unwritten: BTreeSet<u64>,
    /// A copy-on-write's bytes were written in this batch: synced before its mapping.
    sync_first: bool,
    /// L2 entries on their way to the file (kept for its capacity), and where each run
    /// of them goes: (file offset, start in `l2buf`, length).
    l2buf: Vec<u8>,
    l2runs: Vec<(u64, usize, usize)>,
    /// The runs, each at a 4 KiB boundary (O_DIRECT's memory alignment at most), for
    /// `slice_io`; grown as needed.
    staging: Option<(AlignedBuf, usize)>,
    /// An io_uring engine on the image file: a batch's changed slices are written
    /// together, one device round trip rather than one per slice (random allocations
    /// change a different slice each). None if it could not be set up: then one by one.
    slice_io: Option<Box<dyn Engine>>,
    since: Option<Instant>,
    /// A `sync` engine on the backing file, for copy-on-write.
    backing: Option<Box<dyn Engine>>,
    backing_size: u64,
    /// The image file's backend: its size grows with allocations (engines check bounds
    /// against it).
    container: Arc<Backend>,
    version: u32,
    zeros: Vec<u8>,
    /// An `fdatasync` failed: the kernel may have dropped the writes it was about, and a
    /// second one would not say so. No mapping is written after that; every write,
    /// discard and flush fails with EIO from then on.
    failed: bool,
}

fn eio() -> io::Error {
    io::Error::from_raw_os_error(libc::EIO)
}

impl Writer {
    pub(crate) fn new(
        refs: Refcounts,
        backing: Option<Box<dyn Engine>>,
        backing_size: u64,
        container: Arc<Backend>,
        version: u32,
        cluster: u64,
    ) -> Writer {
        Writer {
            refs,
            pending_l2: BTreeMap::new(),
            pending_free: Vec::new(),
            reserved: VecDeque::new(),
            batch_bytes: BATCH_BYTES,
            last_batch: None,
            coming: Vec::new(),
            batch_io: container.engine(crate::EngineKind::IoUring, 2).ok(),
            writeback_out: false,
            syncing: None,
            dirty: BTreeSet::new(),
            unwritten: BTreeSet::new(),
            sync_first: false,
            l2buf: Vec::new(),
            l2runs: Vec::new(),
            staging: None,
            slice_io: match container.engine(crate::EngineKind::IoUring, SLICE_DEPTH) {
                Ok(e) => Some(e),
                Err(e) => {
                    log::warn!("qcow2: no io_uring for the metadata writes ({e}): one at a time");
                    None
                }
            },
            since: None,
            backing,
            backing_size,
            container,
            version,
            zeros: vec![0; cluster as usize],
            failed: false,
        }
    }

    /// Start again on the refcounts `refs`, read again from the file after another
    /// daemon wrote it (qcow2/handoff.rs; nothing is pending once the image was handed
    /// over).
    pub(crate) fn reset(&mut self, refs: Refcounts) {
        self.refs = refs;
        self.pending_l2.clear();
        self.pending_free.clear();
        self.reserved.clear();
        self.coming.clear();
        self.syncing = None;
        self.batch_bytes = BATCH_BYTES;
        self.last_batch = None;
        self.dirty.clear();
        self.unwritten.clear();
        self.sync_first = false;
        self.since = None;
    }

    /// The backing file's size (0 without one).
    pub(crate) fn backing_size(&self) -> u64 {
        self.backing_size
    }

    /// `n` consecutive clusters from those counted ahead of use, if there is such a run;
    /// the first. They are counted already (refcount 1, durable).
    pub(crate) fn take_run(&mut self, n: u64) -> Option<u64> {
        let n = usize::try_from(n).ok()?;
        let r = &self.reserved;
        let start =
            (0..r.len().checked_sub(n - 1)?).find(|&i| r[i + n - 1] == r[i] + (n as u64 - 1))?;
        let first = r[start];
        self.reserved.drain(start..start + n);
        Some(first)
    }

    /// Guest cluster `gc`'s mapping, if the writer changed it and the file does not say
    /// so yet.
    pub(crate) fn pending_mapping(&self, gc: u64) -> Option<Mapping> {
        self.pending_l2.get(&gc).copied()
    }

    /// The table entry for guest cluster `gc` mapped as `m`: a cluster whose mapping is
    /// not synced yet is fresh (written in place by the workers except write-through),
    /// one whose mapping is not even in the file yet is read in place only (its writes
    /// go to the owner).
    pub(crate) fn entry(&self, gc: u64, m: Mapping, cluster: u64, file_size: u64) -> Entry {
        match Entry::of(m, cluster, file_size) {
            Entry::Owned(h) if self.unwritten.contains(&gc) => Entry::Data(h),
            Entry::Owned(h) if self.pending_l2.contains_key(&gc) => Entry::Fresh(h),
            e => e,
        }
    }

    /// Whether the cluster at `host` may take guest data in place: inside the file,
    /// counted once, and not metadata (a COPIED flag alone is the image's word).
    pub(crate) fn in_place(
        &mut self,
        src: &FileIo<'_>,
        host: u64,
        bits: u32,
        file_size: u64,
    ) -> io::Result<bool> {
        let c = host >> bits;
        Ok(host + (1u64 << bits) <= file_size
            && !self.refs.is_metadata(c)
            && self.refs.get(src, c)? == 1)
    }
}

/// What a new cluster is filled with: `self.cluster` whole, `self.cluster[..len]` at
/// `at` (the rest a hole), or nothing yet (the engine writes it).
#[derive(Clone, Copy)]
enum Fill {
    Whole,
    Part(u64, u64),
    Nothing,
}

/// Where the bytes of a write come from.
#[derive(Clone, Copy)]
enum From {
    Guest(*const libc::iovec, u32),
    Zeroes,
}

fn fill(buf: &mut [u8], from: From) {
    match from {
        // SAFETY: the job's buffers, lent to the owner until it answers.
        From::Guest(iov, n) => unsafe { iov::copy_out(iov, n, 0, buf) },
        From::Zeroes => buf.fill(0),
    }
}

impl Owner {
    fn cluster_bits(&self) -> u32 {
        self.meta.header().cluster_bits
    }

    /// The file now reaches `end`: the metadata and the engines' bounds follow.
    pub(crate) fn grew(&mut self, end: u64) {
        self.meta.grow(end);
        if let Some(w) = self.writer.as_ref() {
            w.container.grow_to(end);
        }
    }

    /// A write job: guest bytes `[offset, offset + len)`, inside one cluster. Done
    /// here (None), or, for the first write to a cluster that reads as zeroes, only
    /// allocated: `Some(host)`, where the engine writes the data itself, in parallel
    /// with other allocations (the rest of the new cluster is a hole, zeroes).
    pub(crate) fn write_job(
        &mut self,
        src: &FileIo<'_>,
        offset: u64,
        len: u64,
        iov: *const libc::iovec,
        iovcnt: u32,
        durable: bool,
    ) -> io::Result<Option<u64>> {
        if !durable {
            if let Some(host) = self.place(src, offset)? {
                return Ok(Some(host + (offset & ((1u64 << self.cluster_bits()) - 1))));
            }
        }
        self.write_piece(src, offset, len, From::Guest(iov, iovcnt))?;
        self.counters.owner_writes.fetch_add(1, Ordering::Relaxed);
        if durable {
            self.flush_job(src)?;
        }
        Ok(None)
    }

    /// Where the engine may write guest offset `offset`'s cluster itself: the cluster it
    /// has of its own, or, if it reads as zeroes and has none, a new one (a hole), given
    /// now; the data is the caller's. A crash before that data lands leaves the cluster
    /// reading as it did.
    fn place(&mut self, src: &FileIo<'_>, offset: u64) -> io::Result<Option<u64>> {
        match self.writer.as_ref() {
            None => return Err(io::Error::from_raw_os_error(libc::EBADF)),
            Some(w) if w.failed => return Err(eio()),
            Some(_) => {}
        }
        let bits = self.cluster_bits();
        let gc = offset >> bits;
        let old = self.current(src, gc)?;
        if let Mapping::Data { host, copied: true } = old {
            // Its own cluster already: given in this batch (the writes queued behind a
            // first write to a cluster come here, their table entry not yet saying so),
            // or before it. The engine writes it, in parallel with the others, once the
            // mapping is in the file.
            let file_size = self.meta.file_size();
            let w = self.writer.as_mut().ok_or_else(eio)?;
            if w.in_place(src, host, bits, file_size)? {
                return Ok(Some(host));
            }
        }
        let backed = self
            .writer
            .as_ref()
            .is_some_and(|w| w.backing_size > gc << bits);
        let zeroes = match old {
            Mapping::Zero { host: None } => true,
            Mapping::Unallocated => !backed,
            _ => false,
        };
        if !zeroes {
            return Ok(None);
        }
        self.allocate(src, gc, old, Fill::Nothing, false).map(Some)
    }

    /// Write `[offset, offset + len)` (inside one cluster) from `from`.
    fn write_piece(
        &mut self,
        src: &FileIo<'_>,
        offset: u64,
        len: u64,
        from: From,
    ) -> io::Result<()> {
        match self.writer.as_ref() {
            None => return Err(io::Error::from_raw_os_error(libc::EBADF)),
            Some(w) if w.failed => return Err(eio()),
            Some(_) => {}
        }
        let bits = self.cluster_bits();
        let cluster = 1u64 << bits;
        let (gc, in_c) = (offset >> bits, offset & (cluster - 1));
        if in_c + len > cluster {
            return Err(eio());
        }
        let old = self.current(src, gc)?;
        if let Mapping::Data { host, copied: true } = old {
            let file_size = self.meta.file_size();
            let w = self.writer.as_mut().ok_or_else(eio)?;
            if w.in_place(src, host, bits, file_size)? {
                let buf = &mut self.cluster[..len as usize];
                fill(buf, from);
                src.write_all_at(buf, host + in_c)?;
                return Ok(());
            }
        }
        // A zero cluster that keeps a cluster of its own (a write-zeroes without unmap
        // over an allocated cluster makes them) is written where it is, as QEMU does, not
        // given a new one: all of it (zeroes around the new bytes: it reads as zeroes,
        // whatever the cluster holds), durable before the mapping that makes it data.
        if let Mapping::Zero { host: Some(h) } = old {
            let file_size = self.meta.file_size();
            let w = self.writer.as_mut().ok_or_else(eio)?;
            if w.in_place(src, h, bits, file_size)? {
                self.cluster.fill(0);
                fill(&mut self.cluster[in_c as usize..][..len as usize], from);
                src.write_all_at(&self.cluster, h)?;
                self.writer.as_mut().ok_or_else(eio)?.sync_first = true;
                // Its own cluster stays: nothing is freed.
                let data = Mapping::Data {
                    host: h,
                    copied: true,
                };
                return self.remap(gc, data, Mapping::Unallocated);
            }
        }
        // A cluster that reads as zeroes (unmapped with nothing below it, or a zero
        // cluster) needs only the new bytes written: the rest of a new cluster at the end
        // of the file is a hole, and reads as zeroes too.
        let backed = self
            .writer
            .as_ref()
            .is_some_and(|w| w.backing_size > gc << bits);
        let zeroes =
            matches!(old, Mapping::Zero { .. }) || (matches!(old, Mapping::Unallocated) && !backed);
        if zeroes && len < cluster {
            fill(&mut self.cluster[..len as usize], from);
            return self
                .allocate(src, gc, old, Fill::Part(in_c, len), false)
                .map(drop);
        }
        // Copy on write: the cluster's bytes as they read now (unless all are new), the
        // new ones over them; the old ones durable before the mapping that moves them.
        let copied = len < cluster;
        if copied {
            self.old_bytes(src, gc, old)?;
        }
        fill(&mut self.cluster[in_c as usize..][..len as usize], from);
        self.allocate(src, gc, old, Fill::Whole, copied).map(drop)
    }

    /// Fill `self.cluster` with what guest cluster `gc`, mapped as `m`, reads now.
    fn old_bytes(&mut self, src: &FileIo<'_>, gc: u64, m: Mapping) -> io::Result<()> {
        let bits = self.cluster_bits();
        match m {
            Mapping::Data { host, .. } => src.read_or_zero(&mut self.cluster, host),
            Mapping::Compressed { host, bytes } => self.inflate(src, host, bytes),
            Mapping::Zero { .. } => {
                self.cluster.fill(0);
                Ok(())
            }
            Mapping::Unallocated => {
                self.cluster.fill(0);
                let Owner {
                    writer, cluster, ..
                } = self;
                let Some(w) = writer.as_mut() else {
                    return Ok(());
                };
                let start = gc << bits;
                if start >= w.backing_size {
                    return Ok(());
                }
                let Some(b) = w.backing.as_mut() else {
                    // Its engine was given up after a failed read: never zeroes instead.
                    return Err(eio());
                };
                let n = (w.backing_size - start).min(cluster.len() as u64);
                let v = libc::iovec {
                    iov_base: cluster.as_mut_ptr().cast(),
                    iov_len: n as usize,
                };
                let op = Op::Read {
                    offset: start,
                    iov: &v,
                    iovcnt: 1,
                };
                // SAFETY: `v` and the buffer it names live until the read is reaped
                // below (the loop does not return before that but on error, and then
                // the engine is not used again for this buffer: `wait` failing leaves
                // the read in flight, so we drop the engine, which waits for it).
                if unsafe { b.push(0, op) }.is_err() {
                    return Err(eio());
                }
                let result = (|| loop {
                    b.submit()?;
                    let mut got = None;
                    b.reap(&mut |c| got = Some(c.result));
                    if let Some(r) = got {
                        return r;
                    }
                    b.wait()?;
                })();
                if b.in_flight() > 0 {
                    w.backing = None;
                }
                match result {
                    Ok(got) if got == n => Ok(()),
                    Ok(_) => Err(eio()),
                    Err(e) => Err(e),
                }
            }
        }
    }

    /// Give guest cluster `gc` (was `old`) a new cluster, making its L2 table first if it
    /// has none, and fill it as `fill` says; its host offset. A cluster that read as
    /// zeroes needs only its new bytes (`Part`) or none (`Nothing`): a new cluster is a
    /// hole, which reads as zeroes. `ordered`: the bytes written hold old ones copied
    /// from elsewhere, durable before the mapping is written.
    fn allocate(
        &mut self,
        src: &FileIo<'_>,
        gc: u64,
        old: Mapping,
        fill: Fill,
        ordered: bool,
    ) -> io::Result<u64> {
        let bits = self.cluster_bits();
        self.ensure_table(src, gc)?;
        let c = self.take_cluster(src)?;
        match fill {
            Fill::Whole => src.write_all_at(&self.cluster, c << bits)?,
            Fill::Part(at, len) => {
                src.write_all_at(&self.cluster[..len as usize], (c << bits) + at)?
            }
            Fill::Nothing => {}
        }
        if ordered {
            // Before the mapping is written (at the end of the batch).
            self.writer.as_mut().ok_or_else(eio)?.sync_first = true;
        }
        let host = c << bits;
        self.remap(gc, Mapping::Data { host, copied: true }, old)?;
        self.counters.allocated.fetch_add(1, Ordering::Relaxed);
        Ok(host)
    }

    /// Give guest cluster `gc` an L2 table if it has none: a zeroed, counted cluster,
    /// with the L1 entry pointing at it written at once (the table reads as zeroes
    /// whichever reaches the disk first).
    fn ensure_table(&mut self, src: &FileIo<'_>, gc: u64) -> io::Result<()> {
        let bits = self.cluster_bits();
        let per_table = self.meta.header().l2_entries();
        let index = gc / per_table;
        if index >= u64::from(self.meta.header().l1_entries) {
            return Err(eio());
        }
        if self.meta.l1_entry(index).is_none() {
            let t = self.take_cluster(src)?;
            let l1_offset = self.meta.header().l1_offset;
            let w = self.writer.as_mut().ok_or_else(eio)?;
            src.write_all_at(&w.zeros, t << bits)?;
            w.refs.mark_metadata(t);
            let e = (t << bits) | super::entry::COPIED;
            src.write_all_at(&e.to_be_bytes(), l1_offset + index * 8)?;
            w.changed();
            self.meta.new_table(index, t << bits);
        }
        Ok(())
    }

    /// Guest cluster `gc` is mapped as `new` from now on (it was `old`): the caches say
    /// so, and its slice is written at the end of the batch ([`Owner::flush_mappings`]),
    /// before the job is answered.
    fn remap(&mut self, gc: u64, new: Mapping, old: Mapping) -> io::Result<()> {
        let bits = self.cluster_bits();
        let cluster = 1u64 << bits;
        let (key, _) = self.meta.slice_key(gc);
        let file_size = self.meta.file_size();
        let w = self.writer.as_mut().ok_or_else(eio)?;
        w.pending_l2.insert(gc, new);
        w.dirty.insert(key);
        if matches!(new, Mapping::Data { copied: true, .. }) {
            w.unwritten.insert(gc);
        } else {
            w.unwritten.remove(&gc);
        }
        w.free(old, bits);
        w.changed();
        let e = w.entry(gc, new, cluster, file_size);
        self.meta.set_l2(gc, new);
        self.table.set(gc, e);
        Ok(())
    }

    /// A discard (`discard`) or write-zeroes job over `[offset, offset + len)`.
    pub(crate) fn zero_job(
        &mut self,
        src: &FileIo<'_>,
        offset: u64,
        len: u64,
        unmap: bool,
        discard: bool,
        durable: bool,
    ) -> io::Result<u64> {
        let Some(w) = self.writer.as_ref() else {
            return Err(io::Error::from_raw_os_error(libc::EBADF));
        };
        if w.failed {
            return Err(eio());
        }
        let (backing_size, v3) = (w.backing_size, w.version >= 3);
        let backed = backing_size > 0;
        let bits = self.cluster_bits();
        let cluster = 1u64 << bits;
        let end = offset.checked_add(len).ok_or_else(eio)?;
        let mut at = offset;
        while at < end {
            let in_c = at & (cluster - 1);
            let n = (cluster - in_c).min(end - at);
            let gc = at >> bits;
            if n == cluster && (unmap || discard) {
                // A whole cluster: unmapped (reads zeroes without a backing file), or the
                // zero flag over a backing file (version 3).
                let new = if !backed {
                    Some(Mapping::Unallocated)
                } else if v3 {
                    Some(Mapping::Zero { host: None })
                } else {
                    None
                };
                if let Some(new) = new {
                    let old = self.current(src, gc)?;
                    if old != new {
                        // Unallocated where there is no table needs none; the zero flag
                        // needs its entry.
                        self.ensure_table(src, gc)?;
                        self.remap(gc, new, old)?;
                    }
                    at += n;
                    continue;
                }
            }
            if !discard {
                // A cluster that reads as zeroes already stays as it is (allocated or
                // not: write-zeroes without unmap must not deallocate, and need not
                // allocate).
                let old = self.current(src, gc)?;
                let reads_zeroes = matches!(old, Mapping::Zero { .. })
                    || (matches!(old, Mapping::Unallocated) && backing_size <= gc << bits);
                if !reads_zeroes {
                    self.write_piece(src, at, n, From::Zeroes)?;
                }
            }
            at += n;
        }
        if durable {
            self.flush_job(src)?;
        }
        Ok(len)
    }
}
