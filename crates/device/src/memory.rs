//! Guest memory as the frontend describes it (SET_MEM_TABLE, ADD_MEM_REG, REM_MEM_REG):
//! each region checked, mapped and registered with the SIGBUS guard; an immutable snapshot
//! ([`GuestMemory`]) that workers hold while requests point into it.
//!
//! A region is refused, with the numbers, when it is empty or overflows; when its file is
//! not a memfd or a file on tmpfs, hugetlbfs or ramfs, or a character device (DAX) — a file
//! on another file system can stall every access to it (a FUSE server the frontend runs,
//! an NFS mount), and the workers touch guest memory directly; when it reaches past
//! the end of its file (`fstat`: mapping it would let any access there kill the daemon with
//! SIGBUS); when its offset is not page aligned; when it overlaps another region in guest
//! physical or frontend virtual addresses; or when there are more than
//! [`MAX_MEM_SLOTS`] of them.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{
    Address, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
    GuestRegionMmap,
};

use proto::GuestRam;

use crate::sigbus;

/// Memory regions one session may have (the answer to GET_MAX_MEM_SLOTS).
pub(crate) const MAX_MEM_SLOTS: usize = 509;

/// Why a region or a memory table is refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum MemError {
    #[error(
        "region at guest address {gpa:#x}: size {size:#x} is zero or makes an address overflow"
    )]
    BadSize { gpa: u64, size: u64 },
    #[error("region at guest address {gpa:#x}: mmap offset {offset:#x} is not a multiple of the page size")]
    Unaligned { gpa: u64, offset: u64 },
    #[error("region at guest address {gpa:#x}: cannot fstat its file: {source}")]
    Stat {
        gpa: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("region at guest address {gpa:#x}: its fd is a {kind}, not a memory file")]
    NotMemory { gpa: u64, kind: &'static str },
    #[error("region at guest address {gpa:#x}: its file is on a file system of type {fs_type:#x}, not tmpfs, hugetlbfs or ramfs; guest memory must be a memfd (QEMU's memory-backend-memfd) or a file in /dev/shm or on hugetlbfs, since accesses to a file elsewhere can stall the device")]
    NotMemoryFs { gpa: u64, fs_type: i64 },
    #[error("region at guest address {gpa:#x}: offset {offset:#x} + size {size:#x} reaches past the end of its file ({file_size:#x} bytes)")]
    PastEnd {
        gpa: u64,
        offset: u64,
        size: u64,
        file_size: u64,
    },
    #[error("region at guest address {gpa:#x} + {size:#x} overlaps the region at {other:#x} + {other_size:#x} ({what} addresses)")]
    Overlap {
        gpa: u64,
        size: u64,
        other: u64,
        other_size: u64,
        what: &'static str,
    },
    #[error("{count} memory regions: at most {MAX_MEM_SLOTS} are supported")]
    TooMany { count: usize },
    #[error("region at guest address {gpa:#x} + {size:#x}: mmap failed: {source}")]
    Map {
        gpa: u64,
        size: u64,
        #[source]
        source: vm_memory::mmap::MmapRegionError,
    },
    #[error("no region at guest address {gpa:#x} of size {size:#x} to remove")]
    NoSuchRegion { gpa: u64, size: u64 },
}

/// One region as the frontend described it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RegionDesc {
    pub gpa: u64,
    pub size: u64,
    pub user_addr: u64,
    pub mmap_offset: u64,
}

/// A mapped region with its registration in the SIGBUS guard.
#[derive(Debug)]
struct Region {
    desc: RegionDesc,
    mapping: Arc<GuestRegionMmap<()>>,
    _guard: Option<sigbus::Registration>,
}

/// One immutable view of guest memory. Replaced, never changed, when the frontend changes
/// its table; requests in flight keep the view they were parsed against alive.
#[derive(Debug)]
pub(crate) struct GuestMemory {
    mmap: GuestMemoryMmap<()>,
    regions: Vec<Arc<Region>>,
    /// The mapped regions sorted by guest address, flat: what the request parser looks up
    /// several times per request ([`GuestRam`]), without vm-memory's binary search over
    /// reference-counted regions.
    spans: Vec<Span>,
}

/// One mapped region as the parser looks it up.
#[derive(Clone, Copy, Debug)]
struct Span {
    gpa: u64,
    len: u64,
    /// Host address of `gpa` (an address, not a pointer: the view is shared by workers).
    host: usize,
}

fn spans_of(mmap: &GuestMemoryMmap<()>) -> Vec<Span> {
    // vm-memory keeps its regions sorted by guest address.
    mmap.iter()
        .map(|r| Span {
            gpa: r.start_addr().raw_value(),
            len: r.len(),
            host: r.as_ptr() as usize,
        })
        .collect()
}

// SAFETY: each span is a region this view mapped (read and write, shared) and keeps mapped
// while it lives; an answer lies inside one span: `off < span.len` and at most
// `span.len - off` bytes from there.
unsafe impl GuestRam for GuestMemory {
    fn host_span(&self, addr: u64, len: u64) -> Option<(*mut u8, u64)> {
        let spans = &self.spans[..];
        // The first region holds most guests' memory below 3 GiB (and all of a benchmark's).
        let span = match spans.first() {
            Some(s) if addr.wrapping_sub(s.gpa) < s.len => s,
            _ => {
                let i = spans.partition_point(|s| s.gpa <= addr);
                let s = spans.get(i.checked_sub(1)?)?;
                if addr - s.gpa >= s.len {
                    return None;
                }
                s
            }
        };
        let off = addr - span.gpa;
        // off < span.len, which the mapping covers: the sum stays inside it.
        Some((
            (span.host + off as usize) as *mut u8,
            (span.len - off).min(len),
        ))
    }
}

impl GuestMemory {
    /// No memory (before the first table).
    pub(crate) fn empty() -> GuestMemory {
        GuestMemory {
            mmap: GuestMemoryMmap::default(),
            regions: Vec::new(),
            spans: Vec::new(),
        }
    }

    /// A view of memory built by a test (no frontend addresses, no SIGBUS guard).
    #[cfg(test)]
    pub(crate) fn from_mmap(mmap: GuestMemoryMmap<()>) -> GuestMemory {
        GuestMemory {
            spans: spans_of(&mmap),
            mmap,
            regions: Vec::new(),
        }
    }

    /// How many regions are mapped.
    pub(crate) fn len(&self) -> usize {
        self.regions.len()
    }

    /// Whether there is no memory at all.
    pub(crate) fn is_empty(&self) -> bool {
        self.mmap.num_regions() == 0
    }

    /// The guest physical address of the frontend virtual address `va` (vring addresses
    /// arrive as frontend addresses).
    pub(crate) fn va_to_gpa(&self, va: u64) -> Option<u64> {
        self.regions.iter().find_map(|r| {
            let d = r.desc;
            (va >= d.user_addr && va - d.user_addr < d.size).then(|| d.gpa + (va - d.user_addr))
        })
    }

    /// The guest physical address of the host address `host` (a pointer the parser made
    /// from a descriptor), for the dirty log; None if no region of this view maps it.
    pub(crate) fn gpa_of(&self, host: *const u8) -> Option<u64> {
        let h = host as usize;
        self.mmap.iter().find_map(|r| {
            let base = r.as_ptr() as usize;
            let off = h.checked_sub(base)?;
            (off < r.len() as usize).then(|| r.start_addr().raw_value() + off as u64)
        })
    }

    /// A new view with `regions` replaced by the mapped `new` regions (SET_MEM_TABLE).
    pub(crate) fn replaced(
        new: Vec<(RegionDesc, File)>,
        poison: &Arc<AtomicBool>,
    ) -> Result<GuestMemory, MemError> {
        if new.len() > MAX_MEM_SLOTS {
            return Err(MemError::TooMany { count: new.len() });
        }
        let descs: Vec<RegionDesc> = new.iter().map(|(d, _)| *d).collect();
        for (i, d) in descs.iter().enumerate() {
            check_desc(d)?;
            check_overlap(d, &descs[..i])?;
        }
        let mut regions = Vec::with_capacity(new.len());
        for (d, f) in new {
            regions.push(Arc::new(map_region(d, f, poison)?));
        }
        GuestMemory::build(regions)
    }

    /// A new view with one more region (ADD_MEM_REG).
    pub(crate) fn with_region(
        &self,
        d: RegionDesc,
        file: File,
        poison: &Arc<AtomicBool>,
    ) -> Result<GuestMemory, MemError> {
        if self.regions.len() >= MAX_MEM_SLOTS {
            return Err(MemError::TooMany {
                count: self.regions.len() + 1,
            });
        }
        check_desc(&d)?;
        let descs: Vec<RegionDesc> = self.regions.iter().map(|r| r.desc).collect();
        check_overlap(&d, &descs)?;
        let mut regions = self.regions.clone();
        regions.push(Arc::new(map_region(d, file, poison)?));
        GuestMemory::build(regions)
    }

    /// A new view without the region at `gpa` of `size` bytes (REM_MEM_REG).
    pub(crate) fn without_region(&self, gpa: u64, size: u64) -> Result<GuestMemory, MemError> {
        let i = self
            .regions
            .iter()
            .position(|r| r.desc.gpa == gpa && r.desc.size == size)
            .ok_or(MemError::NoSuchRegion { gpa, size })?;
        let mut regions = self.regions.clone();
        regions.remove(i);
        GuestMemory::build(regions)
    }

    fn build(mut regions: Vec<Arc<Region>>) -> Result<GuestMemory, MemError> {
        regions.sort_by_key(|r| r.desc.gpa);
        let mmap = if regions.is_empty() {
            GuestMemoryMmap::default()
        } else {
            GuestMemoryMmap::from_arc_regions(regions.iter().map(|r| r.mapping.clone()).collect())
                .map_err(|_| {
                // check_overlap ran first; this is the same condition.
                let d = regions[0].desc;
                MemError::Overlap {
                    gpa: d.gpa,
                    size: d.size,
                    other: d.gpa,
                    other_size: d.size,
                    what: "guest physical",
                }
            })?
        };
        Ok(GuestMemory {
            spans: spans_of(&mmap),
            mmap,
            regions,
        })
    }
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(n).unwrap_or(4096).max(4096)
}

fn check_desc(d: &RegionDesc) -> Result<(), MemError> {
    let bad = MemError::BadSize {
        gpa: d.gpa,
        size: d.size,
    };
    if d.size == 0
        || d.gpa.checked_add(d.size).is_none()
        || d.user_addr.checked_add(d.size).is_none()
        || d.mmap_offset.checked_add(d.size).is_none()
        || usize::try_from(d.size).is_err()
        || i64::try_from(d.mmap_offset + d.size).is_err()
    {
        return Err(bad);
    }
    if !d.mmap_offset.is_multiple_of(page_size()) {
        return Err(MemError::Unaligned {
            gpa: d.gpa,
            offset: d.mmap_offset,
        });
    }
    Ok(())
}

fn check_overlap(d: &RegionDesc, others: &[RegionDesc]) -> Result<(), MemError> {
    let overlaps = |a: u64, b: u64, len_a: u64, len_b: u64| a < b + len_b && b < a + len_a;
    for o in others {
        for (what, a, b) in [
            ("guest physical", d.gpa, o.gpa),
            ("frontend virtual", d.user_addr, o.user_addr),
        ] {
            if overlaps(a, b, d.size, o.size) {
                return Err(MemError::Overlap {
                    gpa: d.gpa,
                    size: d.size,
                    other: o.gpa,
                    other_size: o.size,
                    what,
                });
            }
        }
    }
    Ok(())
}

/// Check the region's file and map it shared.
fn map_region(d: RegionDesc, file: File, poison: &Arc<AtomicBool>) -> Result<Region, MemError> {
    // SAFETY: fstat on a descriptor we own, into a zeroed stat buffer.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(file.as_raw_fd(), &mut st) } != 0 {
        return Err(MemError::Stat {
            gpa: d.gpa,
            source: std::io::Error::last_os_error(),
        });
    }
    let (fs_type, page) = sigbus::file_pages(file.as_raw_fd())
        .map_err(|source| MemError::Stat { gpa: d.gpa, source })?;
    match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => {
            if ![
                sigbus::TMPFS_MAGIC,
                sigbus::HUGETLBFS_MAGIC,
                sigbus::RAMFS_MAGIC,
            ]
            .contains(&fs_type)
            {
                return Err(MemError::NotMemoryFs {
                    gpa: d.gpa,
                    fs_type,
                });
            }
            let file_size = u64::try_from(st.st_size).unwrap_or(0);
            if d.mmap_offset + d.size > file_size {
                return Err(MemError::PastEnd {
                    gpa: d.gpa,
                    offset: d.mmap_offset,
                    size: d.size,
                    file_size,
                });
            }
        }
        // DAX devices and the like: no size to check, and nothing to truncate.
        libc::S_IFCHR => {}
        other => {
            let kind = match other {
                libc::S_IFIFO => "pipe",
                libc::S_IFSOCK => "socket",
                libc::S_IFDIR => "directory",
                libc::S_IFBLK => "block device",
                libc::S_IFLNK => "symbolic link",
                _ => "file of unknown type",
            };
            return Err(MemError::NotMemory { gpa: d.gpa, kind });
        }
    }
    // check_desc made sure the size fits in usize.
    let size = d.size as usize;
    let map_err = |source| MemError::Map {
        gpa: d.gpa,
        size: d.size,
        source,
    };
    let mapping = MmapRegionBuilder::new(size)
        .with_file_offset(FileOffset::new(file, d.mmap_offset))
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(libc::MAP_SHARED | libc::MAP_NORESERVE)
        .build()
        .map_err(map_err)?;
    let guard = sigbus::register(mapping.as_ptr(), mapping.size(), page, poison);
    let region = GuestRegionMmap::new(mapping, GuestAddress(d.gpa)).ok_or(MemError::BadSize {
        gpa: d.gpa,
        size: d.size,
    })?;
    Ok(Region {
        desc: d,
        mapping: Arc::new(region),
        _guard: guard,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd(len: u64) -> File {
        // SAFETY: memfd_create with a static name; the fd is owned by the File below.
        let fd = unsafe { libc::memfd_create(c"vblk-mem-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: fd was just created and is owned by nothing else.
        let f = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        f.set_len(len).unwrap();
        f
    }

    fn desc(gpa: u64, size: u64, user_addr: u64, mmap_offset: u64) -> RegionDesc {
        RegionDesc {
            gpa,
            size,
            user_addr,
            mmap_offset,
        }
    }

    #[test]
    fn regions_are_checked_before_mapping() {
        let p = Arc::new(AtomicBool::new(false));
        let ok =
            GuestMemory::replaced(vec![(desc(0, 1 << 20, 0x7000_0000, 0), memfd(1 << 20))], &p)
                .unwrap();
        assert_eq!(ok.va_to_gpa(0x7000_1000), Some(0x1000));
        assert_eq!(ok.va_to_gpa(0x7010_0000), None);
        assert!(ok.host_range(0xff000, 0x1000).is_some());
        assert!(ok.host_range(0xff000, 0x1001).is_none());

        let err =
            |v: Vec<(RegionDesc, File)>| GuestMemory::replaced(v, &p).unwrap_err().to_string();
        assert!(err(vec![(desc(0, 1 << 20, 0, 4096), memfd(1 << 20))]).contains("past the end"));
        assert!(err(vec![(desc(0, 2 << 20, 0, 0), memfd(1 << 20))]).contains("past the end"));
        assert!(err(vec![(desc(0, 4096, 0, 100), memfd(1 << 20))]).contains("page size"));
        assert!(err(vec![(desc(0, 0, 0, 0), memfd(4096))]).contains("zero"));
        assert!(err(vec![(desc(u64::MAX - 10, 4096, 0, 0), memfd(4096))]).contains("overflow"));
        let overlap = err(vec![
            (desc(0, 8192, 0, 0), memfd(8192)),
            (desc(4096, 8192, 1 << 30, 0), memfd(8192)),
        ]);
        assert!(overlap.contains("guest physical"), "{overlap}");
        let overlap = err(vec![
            (desc(0, 8192, 0, 0), memfd(8192)),
            (desc(1 << 30, 8192, 4096, 0), memfd(8192)),
        ]);
        assert!(overlap.contains("frontend virtual"), "{overlap}");
        let (r, _w) = std::io::pipe().unwrap();
        let pipe: File = std::os::fd::OwnedFd::from(r).into();
        assert!(err(vec![(desc(0, 4096, 0, 0), pipe)]).contains("pipe"));
        // A file on a disk file system (here ext4 or whatever holds the target dir): its
        // pages can stall (FUSE, NFS), so it is not taken for guest memory.
        let target = concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/tmp");
        std::fs::create_dir_all(target).unwrap();
        let disk_file = tempfile::tempfile_in(target).unwrap();
        disk_file.set_len(4096).unwrap();
        let (fs, _) = sigbus::file_pages(disk_file.as_raw_fd()).unwrap();
        assert_ne!(
            fs,
            sigbus::TMPFS_MAGIC,
            "the target dir is on tmpfs: cannot test"
        );
        let e = err(vec![(desc(0, 4096, 0, 0), disk_file)]);
        assert!(e.contains("not tmpfs, hugetlbfs or ramfs"), "{e}");

        let two = ok
            .with_region(desc(1 << 30, 4096, 0x9000_0000, 0), memfd(4096), &p)
            .unwrap();
        assert_eq!(two.len(), 2);
        assert!(two
            .with_region(desc(4096, 4096, 0xa000_0000, 0), memfd(4096), &p)
            .is_err());
        let back = two.without_region(1 << 30, 4096).unwrap();
        assert_eq!(back.len(), 1);
        assert!(back.without_region(1 << 30, 4096).is_err());
    }

    /// The flat table answers as vm-memory's `find_region` does, for every address near
    /// every region's edges and a thousand random ones, in views of one to six regions
    /// added out of order: with holes between them and below the first, and two that touch
    /// (one ends where the next starts).
    #[test]
    fn lookups_agree_with_vm_memory() {
        let p = Arc::new(AtomicBool::new(false));
        let page = 4096;
        // (gpa, pages), added in this order.
        let layout = [
            (0x10_0000, 4),
            (0, 2),
            (0x4000_0000, 1),
            (0x2_0000, 3),
            (0x3000, 1),
            (0x2_3000, 2),
        ];
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut random = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut mem = GuestMemory::empty();
        for (i, &(gpa, pages)) in layout.iter().enumerate() {
            let user = 0x7000_0000 + (i as u64) * 0x100_0000;
            mem = mem
                .with_region(desc(gpa, pages * page, user, 0), memfd(pages * page), &p)
                .unwrap();
            let mut probes = vec![u64::MAX, u64::MAX - 1];
            // Random addresses below 0x4000_2000, where the regions are, and anywhere.
            probes.extend((0..1000).map(|k| {
                let r = random();
                if k % 4 == 0 {
                    r
                } else {
                    r % 0x4000_2000
                }
            }));
            for &(g, n) in &layout[..=i] {
                for edge in [g, g + n * page] {
                    probes.extend([edge.wrapping_sub(1), edge, edge + 1, edge + 100]);
                }
            }
            for addr in probes {
                for len in [0, 1, 16, page, 3 * page] {
                    let want = <GuestMemoryMmap<()> as GuestRam>::host_span(&mem.mmap, addr, len);
                    assert_eq!(
                        mem.host_span(addr, len),
                        want,
                        "{} regions, address {addr:#x}, length {len}",
                        i + 1
                    );
                    assert_eq!(
                        mem.host_range(addr, len),
                        want.filter(|&(_, n)| n == len).map(|(h, _)| h)
                    );
                }
            }
        }
        assert!(GuestMemory::empty().host_span(0, 1).is_none());
    }
}
