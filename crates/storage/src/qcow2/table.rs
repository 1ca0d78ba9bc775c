//! The translation table the workers read: a bounded, direct-mapped cache of L2 slices
//! whose entries the metadata owner decoded and checked before it stored them. A worker's
//! lookup is three loads and no store, and takes no lock: each slot is a sequence lock
//! (the owner makes its sequence odd while it rewrites the slot; a reader that sees it
//! odd, or changed across its reads, takes the miss path and asks the owner).
//!
//! Only the owner thread writes (`put`); any number of workers read (`get`).

use std::sync::atomic::{fence, AtomicU64, Ordering};

use super::entry::Mapping;

/// One guest cluster, as a worker needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Entry {
    /// Not in this image: the backing file's bytes, or zeroes without one.
    Unallocated,
    /// Reads as zeroes.
    Zero,
    /// In the image file at this host offset (cluster-aligned), wholly inside the file.
    Data(u64),
    /// As `Data`, and the cluster may be written in place: its refcount is 1 and the
    /// mapping is durable in the file.
    Owned(u64),
    /// A cluster the writer just allocated (refcount 1), whose mapping is in the file but
    /// not durable yet: written in place except by write-through writes (which must make
    /// the mapping durable too, so they go to the owner). Until its mapping is in the
    /// file, the table calls it `Data`: read in place, written by way of the owner.
    Fresh(u64),
    /// Needs the owner: a compressed cluster, or a data cluster that reaches past the end
    /// of the file (the part past it reads as zeroes).
    Slow,
    /// The slice's metadata is corrupt: reads fail with EIO.
    Corrupt,
}

const KIND_MASK: u64 = 7;
const UNALLOCATED: u64 = 0;
const ZERO: u64 = 1;
const DATA: u64 = 2;
const SLOW: u64 = 3;
const CORRUPT: u64 = 4;
const OWNED: u64 = 5;
const FRESH: u64 = 6;

impl Entry {
    /// The entry for a checked mapping in an image file of `file_size` bytes with
    /// clusters of `cluster` bytes.
    pub(crate) fn of(m: Mapping, cluster: u64, file_size: u64) -> Entry {
        match m {
            Mapping::Unallocated => Entry::Unallocated,
            Mapping::Zero { .. } => Entry::Zero,
            Mapping::Data { host, copied } if host.saturating_add(cluster) <= file_size => {
                if copied {
                    Entry::Owned(host)
                } else {
                    Entry::Data(host)
                }
            }
            Mapping::Data { .. } | Mapping::Compressed { .. } => Entry::Slow,
        }
    }

    fn encode(self) -> u64 {
        match self {
            Entry::Unallocated => UNALLOCATED,
            Entry::Zero => ZERO,
            // Host offsets are cluster-aligned (at least 512), so the low bits are free.
            Entry::Data(host) => host | DATA,
            Entry::Owned(host) => host | OWNED,
            Entry::Fresh(host) => host | FRESH,
            Entry::Slow => SLOW,
            Entry::Corrupt => CORRUPT,
        }
    }

    fn decode(v: u64) -> Entry {
        match v & KIND_MASK {
            UNALLOCATED => Entry::Unallocated,
            ZERO => Entry::Zero,
            DATA => Entry::Data(v & !KIND_MASK),
            OWNED => Entry::Owned(v & !KIND_MASK),
            FRESH => Entry::Fresh(v & !KIND_MASK),
            SLOW => Entry::Slow,
            _ => Entry::Corrupt,
        }
    }
}

struct Slot {
    /// Odd while the owner rewrites the slot.
    seq: AtomicU64,
    /// The slice held, or `u64::MAX`.
    key: AtomicU64,
    entries: Box<[AtomicU64]>,
}

/// The table: `slots` slices of `per_slice` entries, slice `k` in slot `k % slots`.
pub(crate) struct Table {
    slots: Box<[Slot]>,
    per_slice: u64,
}

impl Table {
    /// A table of `slots` (rounded up to a power of two, at least 16) slices of
    /// `per_slice` clusters each.
    pub(crate) fn new(slots: usize, per_slice: u64) -> Table {
        let n = slots.max(16).next_power_of_two();
        Table {
            slots: (0..n)
                .map(|_| Slot {
                    seq: AtomicU64::new(0),
                    key: AtomicU64::new(u64::MAX),
                    entries: (0..per_slice).map(|_| AtomicU64::new(0)).collect(),
                })
                .collect(),
            per_slice,
        }
    }

    /// Guest clusters per slice.
    pub(crate) fn per_slice(&self) -> u64 {
        self.per_slice
    }

    fn slot(&self, slice: u64) -> &Slot {
        &self.slots[(slice & (self.slots.len() as u64 - 1)) as usize]
    }

    /// Guest cluster `cluster`'s entry, or None when its slice is not in the table.
    pub(crate) fn get(&self, cluster: u64) -> Option<Entry> {
        let slice = cluster / self.per_slice;
        let s = self.slot(slice);
        let seq = s.seq.load(Ordering::Acquire);
        if seq & 1 == 1 || s.key.load(Ordering::Relaxed) != slice {
            return None;
        }
        let v = s.entries[(cluster % self.per_slice) as usize].load(Ordering::Relaxed);
        // Orders the loads above before the check below: if the sequence is unchanged,
        // no rewrite overlapped them.
        fence(Ordering::Acquire);
        (s.seq.load(Ordering::Relaxed) == seq).then(|| Entry::decode(v))
    }

    /// Whether slice `slice` is in the table.
    pub(crate) fn holds(&self, slice: u64) -> bool {
        let s = self.slot(slice);
        s.seq.load(Ordering::Acquire) & 1 == 0 && s.key.load(Ordering::Relaxed) == slice
    }

    /// Change guest cluster `cluster`'s entry, if its slice is in the table (the owner
    /// only).
    pub(crate) fn set(&self, cluster: u64, e: Entry) {
        let slice = cluster / self.per_slice;
        let s = self.slot(slice);
        if s.key.load(Ordering::Relaxed) != slice {
            return;
        }
        let seq = s.seq.load(Ordering::Relaxed);
        s.seq.store(seq.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        s.entries[(cluster % self.per_slice) as usize].store(e.encode(), Ordering::Relaxed);
        s.seq.store(seq.wrapping_add(2), Ordering::Release);
    }

    /// Forget every slice (the owner only, while no request uses the table: the image was
    /// handed back after another daemon wrote it).
    pub(crate) fn clear(&self) {
        for s in self.slots.iter() {
            let seq = s.seq.load(Ordering::Relaxed);
            s.seq.store(seq.wrapping_add(1), Ordering::Relaxed);
            fence(Ordering::Release);
            s.key.store(u64::MAX, Ordering::Relaxed);
            s.seq.store(seq.wrapping_add(2), Ordering::Release);
        }
    }

    /// Store slice `slice` (the owner only; `entries` has at most `per_slice` entries,
    /// the rest of the slot reads as unallocated).
    pub(crate) fn put(&self, slice: u64, entries: impl Iterator<Item = Entry>) {
        let s = self.slot(slice);
        let seq = s.seq.load(Ordering::Relaxed);
        s.seq.store(seq.wrapping_add(1), Ordering::Relaxed);
        // Readers that see any store below also see the odd sequence.
        fence(Ordering::Release);
        s.key.store(slice, Ordering::Relaxed);
        let mut entries = entries;
        for e in s.entries.iter() {
            e.store(
                entries.next().unwrap_or(Entry::Unallocated).encode(),
                Ordering::Relaxed,
            );
        }
        s.seq.store(seq.wrapping_add(2), Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_slices_replace_each_other() {
        let t = Table::new(16, 512);
        assert_eq!(t.get(5), None);
        t.put(
            0,
            [
                Entry::Data(0x30000),
                Entry::Zero,
                Entry::Slow,
                Entry::Corrupt,
            ]
            .into_iter(),
        );
        assert_eq!(t.get(0), Some(Entry::Data(0x30000)));
        assert_eq!(t.get(1), Some(Entry::Zero));
        assert_eq!(t.get(2), Some(Entry::Slow));
        assert_eq!(t.get(3), Some(Entry::Corrupt));
        assert_eq!(t.get(4), Some(Entry::Unallocated));
        assert!(t.holds(0) && !t.holds(16));
        // Slice 16 shares slice 0's slot.
        t.put(16, std::iter::once(Entry::Zero));
        assert_eq!(t.get(0), None);
        assert_eq!(t.get(16 * 512), Some(Entry::Zero));
        t.set(16 * 512 + 1, Entry::Owned(0x20000));
        assert_eq!(t.get(16 * 512 + 1), Some(Entry::Owned(0x20000)));
        t.set(5, Entry::Zero); // slice 0 is not in the table: nothing changes
        assert_eq!(t.get(5), None);
        t.clear();
        assert_eq!(t.get(16 * 512 + 1), None);
        assert!(!t.holds(16));
    }

    #[test]
    fn a_data_cluster_past_the_end_of_the_file_takes_the_slow_path() {
        let data = |host| Mapping::Data { host, copied: true };
        assert_eq!(
            Entry::of(data(0x10000), 0x10000, 0x20000),
            Entry::Owned(0x10000)
        );
        let shared = Mapping::Data {
            host: 0x10000,
            copied: false,
        };
        assert_eq!(Entry::of(shared, 0x10000, 0x20000), Entry::Data(0x10000));
        assert_eq!(Entry::of(data(0x18000), 0x10000, 0x20000), Entry::Slow);
        assert_eq!(Entry::of(data(!0xffff), 0x10000, 0x20000), Entry::Slow);
    }
}
