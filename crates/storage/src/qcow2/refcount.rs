//! Refcounts, for the writer (the metadata owner): the refcount table loaded whole (and
//! grown, moved to the end of the file, when the file outgrows it), a few refcount
//! blocks cached, 16-bit refcounts (QEMU's default; other widths are refused for writing
//! at open). Clusters are allocated at the end of the file, never reused in a
//! session: a cluster freed while a worker may still hold its old mapping is never handed
//! out again here, so no grace period is needed.
//!
//! Order (QEMU's, so that a crash at any point only leaks clusters): a new cluster's
//! content is written before its refcount, a new refcount block before the refcount
//! table entry that points at it, and a refcount is dropped only after the mapping that
//! used the cluster is durably gone (the writer's job).

use std::collections::HashSet;
use std::io;

use super::fileio::FileIo;
use super::header::Header;
use super::meta::Source;

/// Where the header keeps the refcount table's offset (8 bytes) and size in clusters
/// (4 bytes, right after).
const REFTABLE_FIELDS: u64 = 48;
/// Refcount blocks kept in memory.
const CACHED_BLOCKS: usize = 8;
/// Clusters `reserve` looks at before it gives up on finding a free one.
const RESERVE_TRIES: u32 = 1 << 20;

pub(crate) struct Refcounts {
    cluster_bits: u32,
    reftable_offset: u64,
    /// Host offsets of the refcount blocks (0: none yet).
    reftable: Vec<u64>,
    per_block: u64,
    /// (block index, its refcounts, changed since written), most recently used last.
    /// Changes are written when a block leaves the cache and at `flush` (the writer's
    /// writeback, before its first fdatasync): QEMU's refcount cache.
    cache: Vec<(u64, Vec<u16>, bool)>,
    /// The next cluster index to try for an allocation.
    next_free: u64,
    /// Clusters holding metadata (header, L1 table, refcount table and blocks, L2
    /// tables): never written with guest data, never freed.
    metadata: HashSet<u64>,
}

fn enospc(why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::StorageFull, why.to_owned())
}

impl Refcounts {
    /// Load the refcount table of the image `h` describes, in a file of `file_size`
    /// bytes.
    /// `l2_tables`: where the L1 table says the L2 tables are.
    pub(crate) fn open(
        io: &FileIo<'_>,
        h: &Header,
        file_size: u64,
        l2_tables: impl Iterator<Item = u64>,
    ) -> Result<Refcounts, String> {
        Refcounts::check_width(h)?;
        let cluster = h.cluster_size();
        let bytes = u64::from(h.reftable_clusters) * cluster;
        let mut raw = vec![0u8; bytes as usize];
        io.read_exact_at(&mut raw, h.reftable_offset)
            .map_err(|e| format!("reading the refcount table: {e}"))?;
        let mut reftable = Vec::with_capacity(raw.len() / 8);
        for (i, e) in raw.chunks_exact(8).enumerate() {
            let e = u64::from_be_bytes(e.try_into().unwrap_or([0; 8]));
            if e & 511 != 0 || e % cluster != 0 || (e != 0 && e + cluster > file_size) {
                return Err(format!(
                    "refcount table entry {i} is {e:#x}: reserved bits, an unaligned block or one past the end of the file (`qemu-img check` tells more)"
                ));
            }
            // A refcount block where the header, the L1 table or the refcount table is
            // would have vblk write refcounts over them.
            let l1 = (h.l1_offset, h.l1_offset + u64::from(h.l1_entries) * 8);
            let rt = (h.reftable_offset, h.reftable_offset + bytes);
            let over = |(a, b): (u64, u64)| e < b && e + cluster > a;
            if e != 0 && (e < cluster || over(l1) || over(rt)) {
                return Err(format!(
                    "refcount table entry {i} puts a refcount block at {e:#x}, over the image's header, L1 table or refcount table (`qemu-img check` tells more)"
                ));
            }
            reftable.push(e);
        }
        let bits = h.cluster_bits;
        let clusters = |a: u64, len: u64| (a >> bits)..(a + len).div_ceil(cluster);
        let mut metadata: HashSet<u64> = HashSet::new();
        metadata.insert(0);
        metadata.extend(clusters(h.reftable_offset, bytes));
        let l1 = clusters(h.l1_offset, u64::from(h.l1_entries) * 8);
        if l1.clone().any(|c| metadata.contains(&c)) {
            return Err(
                "its L1 table and refcount table overlap (`qemu-img check` tells more)".into(),
            );
        }
        metadata.extend(l1);
        let mut tables = HashSet::new();
        for t in l2_tables {
            if !tables.insert(t >> bits) {
                return Err(format!(
                    "two L1 entries point at the L2 table at {t:#x} (`qemu-img check` tells more)"
                ));
            }
        }
        for &e in reftable.iter().filter(|&&e| e != 0) {
            if tables.contains(&(e >> bits)) || !metadata.insert(e >> bits) {
                return Err(format!(
                    "a refcount block at {e:#x} lies on other metadata (`qemu-img check` tells more)"
                ));
            }
        }
        metadata.extend(tables);
        Ok(Refcounts {
            metadata,
            cluster_bits: h.cluster_bits,
            reftable_offset: h.reftable_offset,
            reftable,
            per_block: cluster / 2,
            cache: Vec::with_capacity(CACHED_BLOCKS),
            next_free: file_size.div_ceil(cluster),
        })
    }

    /// Refuse refcounts of a width vblk does not write.
    pub(crate) fn check_width(h: &Header) -> Result<(), String> {
        if h.refcount_order != 4 {
            return Err(format!(
                "its refcounts are {} bits wide; vblk writes 16-bit refcounts only (`qemu-img amend -o refcount_bits=16` converts it), or serve it read-only",
                1u32 << h.refcount_order.min(31)
            ));
        }
        Ok(())
    }

    /// Refcounts not read yet: an image opened inactive (a migration destination) loads
    /// them when it takes the image over (qcow2/handoff.rs); the owner writes nothing
    /// before.
    pub(crate) fn unloaded(h: &Header) -> Refcounts {
        Refcounts {
            metadata: HashSet::new(),
            cluster_bits: h.cluster_bits,
            reftable_offset: h.reftable_offset,
            reftable: Vec::new(),
            per_block: h.cluster_size() / 2,
            cache: Vec::new(),
            next_free: u64::MAX,
        }
    }

    /// The cache index of block `b`, loaded if needed; None when it does not exist.
    fn block(&mut self, io: &FileIo<'_>, b: u64) -> io::Result<Option<usize>> {
        if let Some(i) = self.cache.iter().position(|(k, ..)| *k == b) {
            let e = self.cache.remove(i);
            self.cache.push(e);
            return Ok(Some(self.cache.len() - 1));
        }
        let at = match self.reftable.get(b as usize) {
            Some(&at) if at != 0 => at,
            _ => return Ok(None),
        };
        let mut raw = vec![0u8; (self.per_block * 2) as usize];
        io.read_exact_at(&mut raw, at)?;
        let counts = raw
            .chunks_exact(2)
            .map(|c| u16::from_be_bytes([c[0], c[1]]))
            .collect();
        self.make_room(io)?;
        self.cache.push((b, counts, false));
        Ok(Some(self.cache.len() - 1))
    }

    /// Room for one more block in the cache: the least recently used goes, written
    /// first if it changed.
    fn make_room(&mut self, io: &FileIo<'_>) -> io::Result<()> {
        if self.cache.len() < CACHED_BLOCKS {
            return Ok(());
        }
        let (b, counts, dirty) = self.cache.remove(0);
        if dirty {
            if let Err(e) = self.write_block(io, b, &counts) {
                // Kept, still changed: a count is never dropped because its block could
                // not be written (the cache holds one block more until it can).
                self.cache.insert(0, (b, counts, true));
                return Err(e);
            }
        }
        Ok(())
    }

    fn write_block(&self, io: &FileIo<'_>, b: u64, counts: &[u16]) -> io::Result<()> {
        let raw: Vec<u8> = counts.iter().flat_map(|c| c.to_be_bytes()).collect();
        io.write_all_at(&raw, self.reftable[b as usize])
    }

    /// Write every changed block.
    pub(crate) fn flush(&mut self, io: &FileIo<'_>) -> io::Result<()> {
        for i in 0..self.cache.len() {
            if self.cache[i].2 {
                let (b, counts) = (self.cache[i].0, &self.cache[i].1);
                self.write_block(io, b, counts)?;
                self.cache[i].2 = false;
            }
        }
        Ok(())
    }

    /// Cluster `c`'s refcount (0 where no block covers it).
    pub(crate) fn get(&mut self, io: &FileIo<'_>, c: u64) -> io::Result<u16> {
        let b = c / self.per_block;
        Ok(match self.block(io, b)? {
            Some(i) => self.cache[i].1[(c % self.per_block) as usize],
            None => 0,
        })
    }

    /// Set cluster `c`'s refcount, making its refcount block if there is none.
    pub(crate) fn set(&mut self, io: &FileIo<'_>, c: u64, v: u16) -> io::Result<()> {
        let b = c / self.per_block;
        if b as usize >= self.reftable.len() {
            self.grow_table(io, b + 1)?;
        }
        let i = match self.block(io, b)? {
            Some(i) => i,
            None => self.new_block(io, b)?,
        };
        // `new_block` may have loaded other blocks: find block b again.
        let i = if self.cache.get(i).is_some_and(|(k, ..)| *k == b) {
            i
        } else {
            self.block(io, b)?
                .ok_or_else(|| enospc("refcount block vanished"))?
        };
        self.cache[i].1[(c % self.per_block) as usize] = v;
        self.cache[i].2 = true;
        Ok(())
    }

    /// Make refcount block `b`: in a free cluster, counting itself if it covers itself,
    /// written before the table entry that points at it.
    fn new_block(&mut self, io: &FileIo<'_>, b: u64) -> io::Result<usize> {
        let r = self.reserve(io)?;
        let mut counts = vec![0u16; self.per_block as usize];
        let own = r / self.per_block == b;
        if own {
            counts[(r % self.per_block) as usize] = 1;
        }
        let raw: Vec<u8> = counts.iter().flat_map(|c| c.to_be_bytes()).collect();
        let at = r << self.cluster_bits;
        io.write_all_at(&raw, at)?;
        if !own {
            // Counted in another block, which is written now, not when it leaves the
            // cache: the table must not point at an uncounted block.
            self.set(io, r, 1)?;
            self.flush(io)?;
        }
        // The block, its count and the file's growth to hold it are durable before the
        // table points at it (QEMU flushes here too).
        io.sync()?;
        io.write_all_at(&at.to_be_bytes(), self.reftable_offset + b * 8)?;
        self.metadata.insert(r);
        self.reftable[b as usize] = at;
        self.make_room(io)?;
        self.cache.push((b, counts, false));
        Ok(self.cache.len() - 1)
    }

    /// A free cluster at or past the end of the file, for the caller to fill and then
    /// count with `set(c, 1)`; its index.
    pub(crate) fn reserve(&mut self, io: &FileIo<'_>) -> io::Result<u64> {
        for _ in 0..RESERVE_TRIES {
            let c = self.next_free;
            if c / self.per_block >= self.reftable.len() as u64 {
                // Past what the table covers: a larger one (and the clusters it takes
                // are skipped).
                self.grow_table(io, c / self.per_block + 1)?;
                continue;
            }
            self.next_free += 1;
            if self.get(io, c)? == 0 && !self.metadata.contains(&c) {
                return Ok(c);
            }
        }
        Err(enospc("no free cluster past the end of the file"))
    }

    /// A larger refcount table, of at least `entries` entries (twice the old one at
    /// least), as QEMU grows it: at the end of the file, the new table and the refcount
    /// blocks that count it (and themselves) are written and synced, then the header
    /// points at the table (its offset and size in one 12-byte write) and is synced, then
    /// the old table's clusters are given back. A crash before the header write leaks the
    /// new clusters, after it the old table's.
    fn grow_table(&mut self, io: &FileIo<'_>, entries: u64) -> io::Result<()> {
        let bits = self.cluster_bits;
        let cluster = 1u64 << bits;
        let per_cluster = cluster / 8;
        let (pb, old_len) = (self.per_block, self.reftable.len() as u64);
        let mut want = entries.max(old_len * 2).div_ceil(per_cluster) * per_cluster;
        let start = self.next_free;
        // The table's clusters, then the new blocks the area needs: one for each block
        // index the area reaches that has none yet. Grown until the table can point at
        // them all.
        let (tc, blocks) = loop {
            if want * 8 > super::header::MAX_REFTABLE_BYTES {
                log::error!(
                    "qcow2: the refcount table would need {} bytes, more than QEMU reads ({}): the image cannot grow further",
                    want * 8,
                    super::header::MAX_REFTABLE_BYTES
                );
                return Err(enospc("the refcount table is full"));
            }
            let tc = want / per_cluster;
            let mut blocks: Vec<u64> = Vec::new();
            loop {
                let end = start + tc + blocks.len() as u64;
                let missing: Vec<u64> = (start / pb..=(end - 1) / pb)
                    .filter(|&b| self.reftable.get(b as usize).is_none_or(|&e| e == 0))
                    .collect();
                if missing.len() == blocks.len() {
                    blocks = missing;
                    break;
                }
                blocks = missing;
            }
            let end = start + tc + blocks.len() as u64;
            if (end - 1) / pb < want {
                break (tc, blocks);
            }
            want += per_cluster;
        };
        let end = start + tc + blocks.len() as u64;
        // The new blocks, each counting the area's clusters it covers.
        let mut table = vec![0u64; want as usize];
        table[..old_len as usize].copy_from_slice(&self.reftable);
        for (k, &b) in blocks.iter().enumerate() {
            let at = start + tc + k as u64;
            let mut counts = vec![0u8; cluster as usize];
            for c in (b * pb).max(start)..((b + 1) * pb).min(end) {
                let i = ((c - b * pb) * 2) as usize;
                counts[i..i + 2].copy_from_slice(&1u16.to_be_bytes());
            }
            io.write_all_at(&counts, at << bits)?;
            table[b as usize] = at << bits;
        }
        let raw: Vec<u8> = table.iter().flat_map(|e| e.to_be_bytes()).collect();
        io.write_all_at(&raw, start << bits)?;
        // Area clusters under blocks that exist already are counted there.
        self.next_free = end;
        for c in start..end {
            if !blocks.contains(&(c / pb)) {
                self.set(io, c, 1)?;
            }
        }
        self.flush(io)?;
        io.sync()?;
        let mut fields = [0u8; 12];
        fields[..8].copy_from_slice(&(start << bits).to_be_bytes());
        fields[8..].copy_from_slice(&(tc as u32).to_be_bytes());
        io.write_all_at(&fields, REFTABLE_FIELDS)?;
        // The header may point at the new table from here on: so does the memory.
        let (old_offset, old_clusters) = (self.reftable_offset, old_len / per_cluster);
        self.reftable = table;
        self.reftable_offset = start << bits;
        self.metadata.extend(start..end);
        io.sync()?;
        for c in (old_offset >> bits)..(old_offset >> bits) + old_clusters {
            self.set(io, c, 0)?;
        }
        log::info!(
            "qcow2: refcount table grown to {want} entries ({tc} clusters at {:#x}, was {old_len} at {old_offset:#x}), {} new refcount blocks",
            start << bits,
            blocks.len()
        );
        Ok(())
    }

    /// Whether cluster `c` holds metadata.
    pub(crate) fn is_metadata(&self, c: u64) -> bool {
        self.metadata.contains(&c)
    }

    /// Cluster `c` holds metadata from now on (a new L2 table).
    pub(crate) fn mark_metadata(&mut self, c: u64) {
        self.metadata.insert(c);
    }

    /// Drop one reference to cluster `c`.
    pub(crate) fn unref(&mut self, io: &FileIo<'_>, c: u64) -> io::Result<()> {
        if self.is_metadata(c) {
            log::error!("qcow2: a mapping named metadata cluster {c} as data; its refcount is left alone (`qemu-img check`)");
            return Ok(());
        }
        match self.get(io, c)? {
            0 => {
                log::error!("qcow2: cluster {c} is freed with a refcount of 0 already (the image's refcounts are wrong; `qemu-img check`)");
                Ok(())
            }
            v => self.set(io, c, v - 1),
        }
    }
}
