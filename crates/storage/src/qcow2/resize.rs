//! Growing a writable qcow2 image while it is served (the owner's part; `vblk disk
//! resize`, QEMU's `block_resize`). Shrinking is refused: the clusters past the new end
//! would have to be freed while the guest may still use them, and QEMU shrinks only with
//! `qemu-img resize --shrink` on an image nobody serves.
//!
//! A larger size that the L1 table covers is one write of the header's size field. One
//! it does not cover needs a larger L1 table, moved as QEMU moves it
//! (`qcow2_grow_l1_table`), so that a crash at any point leaves a consistent image that
//! leaks the new or the old table's clusters at most:
//! 1. the new table (the old entries, then zeroes) is written into clusters at the end
//!    of the file, counted (refcount 1) and made durable;
//! 2. the header's L1 size and offset are changed in one 12-byte write, then its virtual
//!    size, and made durable;
//! 3. the old table's clusters are given back (refcount 0).
//!
//! The new space reads as zeroes, as QEMU makes it (`bdrv_co_truncate` asks for a zero
//! write where the backing file is longer than the old size): over a backing file that
//! reaches past the old end, its clusters are made zero clusters, durably, before the
//! header says the image is larger. A version 2 image has no zero clusters, and QEMU
//! refuses to grow it there; so does vblk. The old size must be whole clusters (its last
//! cluster's tail was never the guest's; `Backend::resize` refuses that).

use std::io;

use super::fileio::FileIo;
use super::header::MAX_L1_BYTES;
use super::meta::Source;
use super::owner::Owner;

/// Where the header keeps the virtual size, and the L1 table's size and offset (QEMU's
/// `QCowHeader`: `size` at 24, `l1_size` at 36, `l1_table_offset` at 40).
const SIZE_FIELD: u64 = 24;
const L1_FIELDS: u64 = 36;

/// How often the run of clusters for a new L1 table starts again after a gap (each gap
/// is a refcount table grown on the way, which doubles it).
const MAX_RESTARTS: u32 = 8;

/// The most clusters made zero clusters at once when the new space lies over a backing
/// file.
const ZERO_PIECE: u64 = 65536;

fn refuse(why: String) -> io::Error {
    io::Error::other(why)
}

impl Owner {
    /// Make the image `size` bytes (a multiple of 512, not smaller than it is).
    pub(crate) fn grow(&mut self, src: &FileIo<'_>, size: u64) -> io::Result<()> {
        let h = self.meta.header().clone();
        if self.writer.is_none() {
            return Err(refuse("it is served read-only".into()));
        }
        if self.inactive {
            return Err(refuse(
                "it is handed over to another daemon (a live migration)".into(),
            ));
        }
        if size < h.size {
            return Err(refuse(format!(
                "{size} bytes is smaller than its {} bytes: vblk grows qcow2 images only (shrink one nobody serves with `qemu-img resize --shrink`)",
                h.size
            )));
        }
        if !size.is_multiple_of(512) {
            return Err(refuse(format!("{size} bytes is not a multiple of 512")));
        }
        if size == h.size {
            return Ok(());
        }
        let per_entry = h.l2_entries() * h.cluster_size();
        let entries = size.div_ceil(per_entry);
        if entries * 8 > MAX_L1_BYTES {
            return Err(refuse(format!(
                "{size} bytes needs an L1 table of {} bytes, more than the {MAX_L1_BYTES} QEMU reads",
                entries * 8
            )));
        }
        let backing = self.writer.as_ref().map_or(0, |w| w.backing_size());
        let over_backing = backing > h.size;
        if over_backing && !h.size.is_multiple_of(h.cluster_size()) {
            return Err(refuse(format!(
                "its size ({} bytes) is not a whole number of its {}-byte clusters, and its backing file is larger",
                h.size,
                h.cluster_size()
            )));
        }
        if over_backing && h.version < 3 {
            return Err(refuse(format!(
                "its backing file ({backing} bytes) is larger than it ({} bytes), and a version 2 image has no zero clusters to hide the backing file's bytes in the new space (QEMU refuses this too); `qemu-img amend -f qcow2 -o compat=1.1` makes it version 3",
                h.size
            )));
        }
        if entries > u64::from(h.l1_entries) {
            self.move_l1(src, &h, entries as u32)?;
        }
        // The owner looks past the old end from here on (to make zero clusters there);
        // the header says so once they are durable, and the guest sees the new size only
        // after that. Any failure puts the old size back.
        self.meta.resized(size, None);
        let grown = self.write_size(src, &h, size, over_backing.then_some(backing));
        if grown.is_err() {
            self.meta.resized(h.size, None);
        }
        grown
    }

    /// The rest of [`Owner::grow`]: the new space over a backing file made zero clusters
    /// (whole clusters: the tail past the new size is no one's to read), then the header's
    /// size, durably.
    fn write_size(
        &mut self,
        src: &FileIo<'_>,
        h: &super::header::Header,
        size: u64,
        backing: Option<u64>,
    ) -> io::Result<()> {
        if let Some(backing) = backing {
            let end = size.min(backing).next_multiple_of(h.cluster_size());
            self.zero_new_space(src, h.size, end)?;
            log::info!(
                "{}: the new space over the backing file ({} to {end}) reads zeroes",
                self.name,
                h.size
            );
        }
        src.write_all_at(&size.to_be_bytes(), SIZE_FIELD)?;
        self.sync(src)?;
        log::info!(
            "{}: grown from {} to {size} bytes (virtual)",
            self.name,
            h.size
        );
        Ok(())
    }

    /// Make guest bytes `[from, end)` (whole clusters) read zeroes, durably: zero
    /// clusters over the backing file (version 3). In pieces of at most [`ZERO_PIECE`]
    /// clusters, each made durable before the next, so that the mappings waiting for the
    /// file stay few.
    fn zero_new_space(&mut self, src: &FileIo<'_>, from: u64, end: u64) -> io::Result<()> {
        let piece = ZERO_PIECE << self.meta.header().cluster_bits;
        let mut at = from;
        while at < end {
            let n = piece.min(end - at);
            self.zero_job(src, at, n, true, false, true)?;
            at += n;
        }
        Ok(())
    }

    /// A new L1 table of `entries` entries at the end of the file, the header pointing at
    /// it, the old one given back.
    fn move_l1(
        &mut self,
        src: &FileIo<'_>,
        h: &super::header::Header,
        entries: u32,
    ) -> io::Result<()> {
        let bits = h.cluster_bits;
        let cluster = h.cluster_size();
        let n = (u64::from(entries) * 8).div_ceil(cluster);
        let w = self
            .writer
            .as_mut()
            .ok_or_else(|| refuse("read-only".into()))?;
        // Consecutive clusters: from those counted ahead of use (already counted and
        // durable), else new ones past the end of the file, where nothing is in the way
        // but what reserving makes itself (a larger refcount table): the run starts
        // again after it, and the clusters skipped stay free.
        let (first, counted) = match w.take_run(n) {
            Some(first) => (first, true),
            None => {
                let mut first = w.refs.reserve(src)?;
                let (mut len, mut restarts) = (1, 0);
                while len < n {
                    let c = w.refs.reserve(src)?;
                    if c == first + len {
                        len += 1;
                        continue;
                    }
                    restarts += 1;
                    if restarts > MAX_RESTARTS {
                        return Err(refuse(format!(
                            "no room for the new L1 table ({n} clusters) in one piece at the end of the file"
                        )));
                    }
                    (first, len) = (c, 1);
                }
                (first, false)
            }
        };
        let old_bytes = u64::from(h.l1_entries) * 8;
        let mut table = vec![0u8; (n * cluster) as usize];
        src.read_exact_at(&mut table[..old_bytes as usize], h.l1_offset)?;
        let end = (first + n) << bits;
        src.grow_to(end)?;
        self.grew(end);
        src.write_all_at(&table, first << bits)?;
        let w = self
            .writer
            .as_mut()
            .ok_or_else(|| refuse("read-only".into()))?;
        for c in first..first + n {
            if !counted {
                w.refs.set(src, c, 1)?;
            }
            w.refs.mark_metadata(c);
        }
        w.refs.flush(src)?;
        self.sync(src)?;
        let mut fields = [0u8; 12];
        fields[..4].copy_from_slice(&entries.to_be_bytes());
        fields[4..].copy_from_slice(&(first << bits).to_be_bytes());
        src.write_all_at(&fields, L1_FIELDS)?;
        self.sync(src)?;
        self.meta.resized(h.size, Some((first << bits, entries)));
        // The old table's clusters: no longer pointed at, durably.
        let w = self
            .writer
            .as_mut()
            .ok_or_else(|| refuse("read-only".into()))?;
        let old_first = h.l1_offset >> bits;
        let old_end = (h.l1_offset + old_bytes).div_ceil(cluster);
        for c in old_first..old_end {
            w.refs.set(src, c, 0)?;
        }
        w.refs.flush(src)?;
        log::info!(
            "{}: L1 table moved to {:#x} ({entries} entries, was {} at {:#x})",
            self.name,
            first << bits,
            h.l1_entries,
            h.l1_offset
        );
        Ok(())
    }
}
