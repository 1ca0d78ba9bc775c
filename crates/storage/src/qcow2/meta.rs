//! An image's mapping metadata: the L1 table loaded whole at open (QEMU keeps it in
//! memory too; at most 32 MiB), and L2 tables read in 4 KiB slices (512 entries) into a
//! bounded cache, every entry kept as the file's 8-byte entry and checked as it is used
//! (a corrupt one fails its own cluster) (4 KiB a slice, as QEMU's cache: a 64 GiB image with 64 KiB clusters
//! needs 8 MiB to be held whole). The cache is found through a hash index and evicts with
//! the clock algorithm, so neither a lookup nor a miss scans it. A lookup answers where a
//! guest range's bytes are, as runs of one [`Mapping`] kind, never longer than the rest
//! of the cluster.
//!
//! The writer (write.rs) changes cached entries as it maps clusters ([`Meta::set_l2`]),
//! writes whole cached slices ([`Meta::cached_slice`]), and makes new L2 tables
//! ([`Meta::new_table`]), whose slices are all zeroes: put in the cache without a read.
//!
//! Checks beyond the entries' own (entry.rs): an L2 table or a data cluster must not
//! overlap the header, the L1 table or the refcount table, and an L2 table must lie
//! inside the file. Data clusters past the end of the file are reported as such (a read
//! of them is zeroes, as the file's hole would be; vblk never writes there).
//!
//! This is the metadata owner's view (docs/design-notes.md, "qcow2"): it blocks on
//! `pread`, so it runs on the owner's thread, never on a worker.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use super::entry::{self, EntryError, Mapping};
use super::header::Header;

/// Where metadata is read from: the image file as it is, or through aligned buffers when
/// it is open with O_DIRECT (qcow2/owner.rs).
pub trait Source {
    /// Fill `buf` from `offset`, or fail (a short file is an error).
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// The file's size in bytes.
    fn size(&self) -> io::Result<u64>;
}

impl Source for File {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        FileExt::read_exact_at(self, buf, offset)
    }

    fn size(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }
}

/// Entries per L2 slice: 4 KiB of 8-byte entries, as QEMU's default l2-cache slices.
pub const SLICE_ENTRIES: u64 = 512;
const SLICE_BYTES: usize = SLICE_ENTRIES as usize * 8;

/// Why a lookup failed.
#[derive(Debug)]
pub enum MetaError {
    /// Reading the image failed.
    Io(io::Error),
    /// A table entry is wrong: the image is corrupt there.
    Entry {
        /// "L1" or "L2".
        table: &'static str,
        /// The entry's index in the table's address space.
        index: u64,
        /// What is wrong with it.
        error: EntryError,
    },
    /// A table or cluster the metadata points at is where it cannot be.
    Placement {
        /// What was found there.
        what: &'static str,
        /// Its offset in the file.
        offset: u64,
        /// What is wrong.
        why: &'static str,
    },
    /// A guest offset beyond the virtual size.
    OutOfRange {
        /// The offset asked for.
        offset: u64,
        /// The virtual size.
        size: u64,
    },
}

impl std::fmt::Display for MetaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MetaError::Io(e) => write!(f, "reading the image's metadata: {e}"),
            MetaError::Entry {
                table,
                index,
                error,
            } => write!(f, "{table} entry {index}: {error}"),
            MetaError::Placement { what, offset, why } => {
                write!(f, "{what} at offset {offset:#x}: {why}")
            }
            MetaError::OutOfRange { offset, size } => {
                write!(f, "guest offset {offset} is past the virtual size {size}")
            }
        }
    }
}

impl std::error::Error for MetaError {}

impl From<io::Error> for MetaError {
    fn from(e: io::Error) -> Self {
        MetaError::Io(e)
    }
}

/// One run of a lookup: `len` bytes from the guest offset asked for, all mapped alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// How the run's bytes are mapped.
    pub mapping: Mapping,
    /// Where in the host cluster the run starts (for Data; 0 otherwise).
    pub host_offset: u64,
    /// The run's length in bytes.
    pub len: u64,
    /// A data cluster that lies past the end of the file (reads as zeroes).
    pub past_eof: bool,
}

struct Slot {
    /// The slice's first entry's index in the L2 address space (l1 index * entries per
    /// table + slice start).
    key: u64,
    /// The entries as the file has them (or as the writer changed them), checked.
    raw: Box<[u64; SLICE_ENTRIES as usize]>,
    /// Used since the clock hand last passed.
    referenced: bool,
}

/// The mapping metadata of one image.
pub struct Meta {
    header: Header,
    file_size: u64,
    l1: Vec<Option<u64>>,
    slots: Vec<Slot>,
    /// Slice key → its slot.
    index: HashMap<u64, usize>,
    /// The most slots.
    capacity: usize,
    /// The clock's hand: the next slot considered for eviction.
    hand: usize,
    /// Metadata ranges a mapping must not overlap: [start, end).
    reserved: Vec<(u64, u64, &'static str)>,
    buf: Box<[u8; SLICE_BYTES]>,
    /// A slice's entries being checked, swapped into the slot they go to.
    spare: Box<[u64; SLICE_ENTRIES as usize]>,
    /// Slices read from the file (for tests and statistics).
    pub loads: u64,
}

impl Meta {
    /// Load the L1 table of the image `header` describes, with room for `slots` L2
    /// slices of 4 KiB (at least one; taken as slices are loaded).
    pub fn open(file: &impl Source, header: Header, slots: usize) -> Result<Meta, MetaError> {
        let file_size = file.size()?;
        let mut raw = vec![0u8; header.l1_entries as usize * 8];
        file.read_exact_at(&mut raw, header.l1_offset)?;
        let cluster = header.cluster_size();
        let mut reserved = vec![
            (0, cluster, "the header"),
            (
                header.l1_offset,
                header.l1_offset + u64::from(header.l1_entries) * 8,
                "the L1 table",
            ),
            (
                header.reftable_offset,
                header.reftable_offset + u64::from(header.reftable_clusters) * cluster,
                "the refcount table",
            ),
        ];
        reserved.retain(|&(a, b, _)| b > a);
        let mut l1 = Vec::with_capacity(header.l1_entries as usize);
        for (i, e) in raw.chunks_exact(8).enumerate() {
            let e = u64::from_be_bytes(e.try_into().unwrap_or([0; 8]));
            let l2 = entry::l1(e, header.cluster_bits).map_err(|error| MetaError::Entry {
                table: "L1",
                index: i as u64,
                error,
            })?;
            if let Some(off) = l2 {
                check_placement(&reserved, "an L2 table", off, cluster)?;
                if off + cluster > file_size {
                    return Err(MetaError::Placement {
                        what: "an L2 table",
                        offset: off,
                        why: "past the end of the file",
                    });
                }
            }
            l1.push(l2);
        }
        Ok(Meta {
            header,
            file_size,
            l1,
            slots: Vec::new(),
            index: HashMap::new(),
            capacity: slots.max(1),
            hand: 0,
            reserved,
            buf: Box::new([0; SLICE_BYTES]),
            spare: Box::new([0; SLICE_ENTRIES as usize]),
            loads: 0,
        })
    }

    /// The most L2 slices the cache holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The image's header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Where the guest bytes at `offset` are: a run of at most `len` bytes, never past
    /// the end of `offset`'s cluster.
    pub fn lookup(&mut self, file: &impl Source, offset: u64, len: u64) -> Result<Run, MetaError> {
        let size = self.header.size;
        if offset >= size {
            return Err(MetaError::OutOfRange { offset, size });
        }
        let cluster = self.header.cluster_size();
        let in_cluster = offset & (cluster - 1);
        let len = len.min(cluster - in_cluster).min(size - offset);
        let guest_cluster = offset >> self.header.cluster_bits;
        let per_table = self.header.l2_entries();
        let l1_index = guest_cluster / per_table;
        let l2_index = guest_cluster % per_table;
        let Some(Some(table)) = self.l1.get(l1_index as usize).copied() else {
            return Ok(Run {
                mapping: Mapping::Unallocated,
                host_offset: 0,
                len,
                past_eof: false,
            });
        };
        let slice_start = l2_index / SLICE_ENTRIES * SLICE_ENTRIES;
        let key = l1_index * per_table + slice_start;
        let slot = self.slot(file, key, table + slice_start * 8, slice_start)?;
        let raw = self.slots[slot].raw[(l2_index - slice_start) as usize];
        let mapping = self.checked(raw, l1_index * per_table + l2_index)?;
        let (host_offset, past_eof) = match mapping {
            Mapping::Data { host, .. } => (host + in_cluster, host + cluster > self.file_size),
            _ => (0, false),
        };
        Ok(Run {
            mapping,
            host_offset,
            len,
            past_eof,
        })
    }

    /// The image file's size as far as the metadata knows: when it was opened, or as
    /// [`Meta::grow`] said since.
    pub fn file_size(&self) -> u64 {
        self.file_size
    }

    /// The file grew to `size` bytes (the writer allocated clusters at its end).
    pub fn grow(&mut self, size: u64) {
        self.file_size = self.file_size.max(size);
    }

    /// The image was grown to `size` bytes (qcow2/resize.rs), and its L1 table moved to
    /// `(offset, entries)` if given (the new entries are empty).
    pub fn resized(&mut self, size: u64, l1: Option<(u64, u32)>) {
        self.header.size = size;
        if let Some((offset, entries)) = l1 {
            self.header.l1_offset = offset;
            self.header.l1_entries = entries;
            self.l1.resize(entries as usize, None);
            let end = offset + u64::from(entries) * 8;
            for r in &mut self.reserved {
                if r.2 == "the L1 table" {
                    *r = (offset, end, r.2);
                }
            }
        }
    }

    /// The L2 table of L1 entry `index`, if it has one.
    pub fn l1_entry(&self, index: u64) -> Option<u64> {
        self.l1.get(index as usize).copied().flatten()
    }

    /// Where the L2 tables are.
    pub fn l2_tables(&self) -> impl Iterator<Item = u64> + '_ {
        self.l1.iter().filter_map(|&e| e)
    }

    /// The writer gave L1 entry `index` a table at `table`.
    pub fn set_l1(&mut self, index: u64, table: u64) {
        if let Some(e) = self.l1.get_mut(index as usize) {
            *e = Some(table);
        }
    }

    /// The writer changed guest cluster `cluster`'s mapping: the cached slice holding it,
    /// if any, says so from now on.
    pub fn set_l2(&mut self, cluster: u64, m: Mapping) {
        let (key, k) = self.slice_key(cluster);
        if let Some(&i) = self.index.get(&key) {
            self.slots[i].raw[k] = entry::encode_l2(m);
        }
    }

    /// The writer gave L1 entry `index` a new L2 table at `table`, all zeroes: its
    /// slices go into the cache as they are (the first 64 of a large table), without a
    /// read.
    pub fn new_table(&mut self, index: u64, table: u64) {
        self.set_l1(index, table);
        let per_table = self.header.l2_entries();
        let n = self.slice_clusters();
        for start in (0..per_table).step_by(n as usize).take(64) {
            let key = index * per_table + start;
            if let Some(&i) = self.index.get(&key) {
                self.slots[i].raw.fill(0);
                continue;
            }
            self.spare.fill(0);
            self.install(key);
        }
    }

    /// Slice `key` (as [`Meta::slice_key`] gives) if it is cached: its entries as the
    /// file has them, with the writer's changes.
    pub fn cached_slice(&self, key: u64) -> Option<&[u64]> {
        let n = self.slice_clusters() as usize;
        self.index.get(&key).map(|&i| &self.slots[i].raw[..n])
    }

    /// The key of the slice holding guest cluster `cluster`, and the cluster's index in
    /// it.
    pub fn slice_key(&self, cluster: u64) -> (u64, usize) {
        let per_table = self.header.l2_entries();
        let (l1_index, l2_index) = (cluster / per_table, cluster % per_table);
        let slice_start = l2_index / SLICE_ENTRIES * SLICE_ENTRIES;
        (
            l1_index * per_table + slice_start,
            (l2_index - slice_start) as usize,
        )
    }

    /// Guest clusters per slice: 512, or all of an L2 table when it holds fewer.
    pub fn slice_clusters(&self) -> u64 {
        SLICE_ENTRIES.min(self.header.l2_entries())
    }

    /// The checked mappings of slice `slice` (guest clusters `slice * slice_clusters()`
    /// onwards; the last slice may reach past the virtual size) into `out`, each checked
    /// on its own: a corrupt entry is an error for its cluster only. Clusters whose L2
    /// table is absent are unallocated. An error of the slice's own (it cannot be read,
    /// its L2 table is misplaced) fails all of it.
    pub fn slice(
        &mut self,
        file: &impl Source,
        slice: u64,
        out: &mut Vec<Result<Mapping, MetaError>>,
    ) -> Result<(), MetaError> {
        out.clear();
        let n = self.slice_clusters();
        let first = slice.saturating_mul(n);
        let per_table = self.header.l2_entries();
        let (l1_index, slice_start) = (first / per_table, first % per_table);
        if first
            .checked_mul(self.header.cluster_size())
            .is_none_or(|o| o >= self.header.size)
        {
            return Err(MetaError::OutOfRange {
                offset: first.saturating_mul(self.header.cluster_size()),
                size: self.header.size,
            });
        }
        let Some(Some(table)) = self.l1.get(l1_index as usize).copied() else {
            out.extend((0..n).map(|_| Ok(Mapping::Unallocated)));
            return Ok(());
        };
        let key = l1_index * per_table + slice_start;
        let slot = self.slot(file, key, table + slice_start * 8, slice_start)?;
        for k in 0..n {
            let raw = self.slots[slot].raw[k as usize];
            out.push(self.checked(raw, key + k));
        }
        Ok(())
    }

    /// A cached entry as a mapping, checked: its bits (entry.rs), and that a data
    /// cluster lies on no metadata and compressed data starts inside the file. An
    /// entry the writer made passes; one read from a corrupt image fails here, for its
    /// own cluster only.
    fn checked(&self, raw: u64, index: u64) -> Result<Mapping, MetaError> {
        let (bits, version) = (self.header.cluster_bits, self.header.version);
        let m = entry::l2(raw, bits, version).map_err(|error| MetaError::Entry {
            table: "L2",
            index,
            error,
        })?;
        match m {
            Mapping::Data { host, .. } | Mapping::Zero { host: Some(host) } => {
                check_placement(
                    &self.reserved,
                    "a data cluster",
                    host,
                    self.header.cluster_size(),
                )?;
            }
            // Compressed data may end past the end of the file (the reader reads what is
            // there, as QEMU does); it must start inside it.
            Mapping::Compressed { host, .. } if host >= self.file_size => {
                return Err(MetaError::Placement {
                    what: "a compressed cluster",
                    offset: host,
                    why: "past the end of the file",
                });
            }
            _ => {}
        }
        Ok(m)
    }

    /// The cache slot holding slice `key`, read from `at` if it is not resident (into a
    /// free slot, or the first the clock finds unused since its last pass).
    fn slot(
        &mut self,
        file: &impl Source,
        key: u64,
        at: u64,
        slice_start: u64,
    ) -> Result<usize, MetaError> {
        if let Some(&i) = self.index.get(&key) {
            self.slots[i].referenced = true;
            return Ok(i);
        }
        // An L2 table of a small cluster holds fewer entries than a slice.
        let n = (self.header.l2_entries() - slice_start).min(SLICE_ENTRIES) as usize;
        file.read_exact_at(&mut self.buf[..n * 8], at)?;
        self.loads += 1;
        // Entries are checked one by one as they are used (`checked`): one bad entry
        // makes its own cluster fail, not the slice's other clusters.
        for (k, e) in self.buf[..n * 8].chunks_exact(8).enumerate() {
            self.spare[k] = u64::from_be_bytes(e.try_into().unwrap_or([0; 8]));
        }
        Ok(self.install(key))
    }

    /// Put `self.spare` into the cache as slice `key` (not cached): into a free slot, or
    /// the first the clock finds unused since its last pass. Its slot.
    fn install(&mut self, key: u64) -> usize {
        if self.slots.len() < self.capacity {
            let raw = std::mem::replace(&mut self.spare, Box::new([0; SLICE_ENTRIES as usize]));
            self.slots.push(Slot {
                key,
                raw,
                referenced: true,
            });
            let i = self.slots.len() - 1;
            self.index.insert(key, i);
            return i;
        }
        let victim = loop {
            let i = self.hand;
            self.hand = (self.hand + 1) % self.slots.len();
            if !std::mem::take(&mut self.slots[i].referenced) {
                break i;
            }
        };
        let s = &mut self.slots[victim];
        self.index.remove(&s.key);
        std::mem::swap(&mut s.raw, &mut self.spare);
        s.key = key;
        s.referenced = true;
        self.index.insert(key, victim);
        victim
    }
}

/// How an image's clusters are mapped, counted over its L2 tables (`vblk info`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Allocation {
    /// Guest clusters: the virtual size in clusters.
    pub clusters: u64,
    /// Mapped to data in the image file.
    pub data: u64,
    /// Reading as zeroes by their entry, with no cluster kept for them.
    pub zero: u64,
    /// Reading as zeroes by their entry, with a cluster kept for them (allocated, as
    /// `qemu-img check` counts it).
    pub zero_allocated: u64,
    /// Compressed.
    pub compressed: u64,
    /// Whose entries are corrupt.
    pub corrupt: u64,
}

impl Meta {
    /// Count how every guest cluster is mapped: one pass over the L2 tables, through the
    /// cache. Clusters not counted are unallocated (the backing file's, or zeroes).
    pub fn allocation(&mut self, file: &impl Source) -> Result<Allocation, MetaError> {
        let cluster = self.header.cluster_size();
        let clusters = self.header.size.div_ceil(cluster);
        let per_slice = self.slice_clusters();
        let mut a = Allocation {
            clusters,
            ..Allocation::default()
        };
        let mut out = Vec::new();
        for slice in 0..clusters.div_ceil(per_slice) {
            let left = (clusters - slice * per_slice).min(per_slice);
            match self.slice(file, slice, &mut out) {
                Ok(()) => {}
                // A slice that cannot be read is an error; one whose L2 table is
                // misplaced counts as corrupt, and the rest is still counted.
                Err(MetaError::Io(e)) => return Err(MetaError::Io(e)),
                Err(_) => {
                    a.corrupt += left;
                    continue;
                }
            }
            for m in out.iter().take(left as usize) {
                match m {
                    Ok(Mapping::Data { .. }) => a.data += 1,
                    Ok(Mapping::Zero { host: Some(_) }) => a.zero_allocated += 1,
                    Ok(Mapping::Zero { host: None }) => a.zero += 1,
                    Ok(Mapping::Compressed { .. }) => a.compressed += 1,
                    Ok(Mapping::Unallocated) => {}
                    Err(_) => a.corrupt += 1,
                }
            }
        }
        Ok(a)
    }
}

/// Refuse `what` at `[offset, offset + len)` if it overlaps a metadata range.
fn check_placement(
    reserved: &[(u64, u64, &'static str)],
    what: &'static str,
    offset: u64,
    len: u64,
) -> Result<(), MetaError> {
    for &(a, b, name) in reserved {
        if offset < b && offset + len > a {
            return Err(MetaError::Placement {
                what,
                offset,
                why: match name {
                    "the header" => "it overlaps the header",
                    "the L1 table" => "it overlaps the L1 table",
                    _ => "it overlaps the refcount table",
                },
            });
        }
    }
    Ok(())
}
