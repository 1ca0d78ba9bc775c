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

use std::io;

use super::fileio::FileIo;
use super::header::MAX_L1_BYTES;
use super::meta::Source;
use super::owner::Owner;

/// Where the header keeps the virtual size, and the L1 table's size and offset (QEMU's
/// `QCowHeader`: `size` at 24, `l1_size` at 36, `l1_table_offset` at 40).
const SIZE_FIELD: u64 = 24;
const L1_FIELDS: u64 = 36;

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
        if entries > u64::from(h.l1_entries) {
            self.move_l1(src, &h, entries as u32)?;
        }
        src.write_all_at(&size.to_be_bytes(), SIZE_FIELD)?;
        self.sync(src)?;
        self.meta.resized(size, None);
        log::info!(
            "{}: grown from {} to {size} bytes (virtual)",
            self.name,
            h.size
        );
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
        // durable), else new ones past the end of the file, where nothing is in the way.
        let (first, counted) = match w.take_run(n) {
            Some(first) => (first, true),
            None => {
                let first = w.refs.reserve(src)?;
                for k in 1..n {
                    if w.refs.reserve(src)? != first + k {
                        return Err(refuse(
                            "no room for the new L1 table in one piece at the end of the file"
                                .into(),
                        ));
                    }
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
