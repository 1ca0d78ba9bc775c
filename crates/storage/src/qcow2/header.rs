//! The qcow2 header (cluster 0): parsed from bytes nothing vouches for, and checked the
//! way QEMU's `qcow2_do_open` checks it, before any value is used as a shift, a size or
//! an offset. Layout: QEMU's docs/interop/qcow2.txt (all fields big-endian).
//!
//! What is refused here, and why (the rows of docs/design-notes.md's hostile-image list):
//! a wrong magic or a version other than 2 and 3; a cluster size outside 512 B..2 MiB; a
//! v3 header shorter than 104 bytes, not a multiple of 8 or longer than a cluster; a
//! backing file name outside cluster 0 or longer than 1023 bytes; header extensions that
//! overrun cluster 0 or the backing name, or name a backing format or data file twice;
//! incompatible features vblk does not implement (unknown bits, an external data file,
//! zstd compression, extended L2 entries); refcounts wider than 64 bits; encryption; a
//! refcount table or L1 table that is empty when it must not be, larger than QEMU
//! allows, unaligned, or past the end of the file; an L1 table too small for the virtual
//! size; more snapshots than QEMU allows. What depends on how the image is opened (the
//! dirty and corrupt bits) is [`Header::check_writable`]'s.

use std::fmt;

/// `QFI\xfb`.
pub const MAGIC: [u8; 4] = *b"QFI\xfb";
/// The smallest cluster QEMU accepts: 2^9 bytes.
pub const MIN_CLUSTER_BITS: u32 = 9;
/// The largest cluster QEMU accepts: 2^21 bytes.
pub const MAX_CLUSTER_BITS: u32 = 21;
/// QEMU's limit on the L1 table (qcow2.h): 32 MiB of entries.
pub const MAX_L1_BYTES: u64 = 32 << 20;
/// QEMU's limit on the refcount table: 8 MiB.
pub const MAX_REFTABLE_BYTES: u64 = 8 << 20;
/// The way out for a format feature vblk does not implement: a copy without it.
const CONVERT: &str = "a copy vblk serves is `qemu-img convert -O qcow2 -o compat=1.1,extended_l2=off,compression_type=zlib IMAGE NEW.qcow2` (its data in the copy itself, no external data file)";

/// QEMU's limit on internal snapshots.
pub const MAX_SNAPSHOTS: u32 = 65536;
/// The longest backing file name QEMU writes or reads.
pub const MAX_BACKING_NAME: u32 = 1023;
/// Host offsets are 56 bits wide in L1 and L2 entries.
pub const MAX_HOST_OFFSET: u64 = (1 << 56) - 1;

const V2_HEADER_LENGTH: u32 = 72;
const V3_MIN_HEADER_LENGTH: u32 = 104;

/// Header extension types (qcow2.txt, "Header extensions").
pub mod ext {
    /// End of the extension area.
    pub const END: u32 = 0;
    /// The backing file's format name.
    pub const BACKING_FORMAT: u32 = 0xe279_2aca;
    /// Names of the feature bits.
    pub const FEATURE_NAMES: u32 = 0x6803_f857;
    /// Persistent dirty bitmaps.
    pub const BITMAPS: u32 = 0x2385_2875;
    /// The LUKS header's place (encrypted images).
    pub const CRYPTO: u32 = 0x0537_be77;
    /// The external data file's name.
    pub const DATA_FILE: u32 = 0x4441_5441;
}

/// Incompatible feature bits.
pub mod incompat {
    /// Refcounts may be out of date (lazy refcounts, not closed cleanly).
    pub const DIRTY: u64 = 1 << 0;
    /// Metadata is known to be corrupt.
    pub const CORRUPT: u64 = 1 << 1;
    /// Guest data lives in an external file.
    pub const DATA_FILE: u64 = 1 << 2;
    /// The compression type field is not zlib.
    pub const COMPRESSION: u64 = 1 << 3;
    /// L2 entries are 128 bits with subcluster bitmaps.
    pub const EXTENDED_L2: u64 = 1 << 4;
    /// Every bit QEMU knows.
    pub const KNOWN: u64 = DIRTY | CORRUPT | DATA_FILE | COMPRESSION | EXTENDED_L2;
}

/// What is wrong with a header; each message has the numbers it is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderError {
    /// Fewer bytes than the header needs.
    Short {
        /// Bytes there are.
        have: usize,
        /// Bytes needed.
        need: usize,
    },
    /// Not `QFI\xfb`.
    Magic,
    /// A version other than 2 and 3 (1 is the older qcow format).
    Version(u32),
    /// A cluster size outside 2^9..2^21.
    ClusterBits(u32),
    /// A v3 header length that is too short, not a multiple of 8, or past cluster 0.
    HeaderLength {
        /// The header_length field.
        length: u32,
        /// The cluster size.
        cluster: u64,
    },
    /// The backing file name is not inside cluster 0, or too long.
    BackingName {
        /// Where the name is said to start.
        offset: u64,
        /// Its length.
        size: u32,
        /// The cluster size.
        cluster: u64,
    },
    /// A header extension overruns its area, or an extension that may appear once is
    /// there twice.
    Extension {
        /// The extension's type.
        kind: u32,
        /// Where its header is.
        at: u64,
        /// What is wrong.
        why: &'static str,
    },
    /// Incompatible features vblk does not implement (named where the image names them).
    Unsupported {
        /// The incompatible bits vblk does not implement.
        bits: u64,
        /// Their names.
        names: Vec<String>,
    },
    /// The compression type field and its feature bit disagree, or the type is unknown.
    Compression {
        /// The compression type field.
        kind: u8,
        /// Whether the compression feature bit is set.
        bit: bool,
    },
    /// Refcounts wider than 64 bits.
    RefcountOrder(u32),
    /// An encrypted image.
    Encrypted(u32),
    /// A table that is empty, too large, unaligned or past the end of the file.
    Table {
        /// Which table.
        what: &'static str,
        /// Its offset.
        offset: u64,
        /// Its size.
        bytes: u64,
        /// What is wrong.
        why: &'static str,
    },
    /// The L1 table cannot map the whole virtual size.
    L1TooSmall {
        /// L1 entries.
        entries: u32,
        /// The virtual size.
        size: u64,
    },
    /// More internal snapshots than QEMU allows, or their table is unaligned.
    Snapshots {
        /// The nb_snapshots field.
        count: u32,
        /// The snapshot table's offset.
        offset: u64,
    },
}

impl fmt::Display for HeaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HeaderError::Short { have, need } => {
                write!(f, "the file has {have} bytes, a qcow2 header needs {need}")
            }
            HeaderError::Magic => write!(f, "no qcow2 magic (QFI\\xfb) at offset 0"),
            HeaderError::Version(v) => {
                write!(f, "qcow2 version {v} is not supported (2 and 3 are)")
            }
            HeaderError::ClusterBits(b) => write!(
                f,
                "cluster_bits {b}: the cluster size must be 2^{MIN_CLUSTER_BITS} to 2^{MAX_CLUSTER_BITS} bytes"
            ),
            HeaderError::HeaderLength { length, cluster } => write!(
                f,
                "header_length {length}: a version 3 header is at least {V3_MIN_HEADER_LENGTH} bytes, a multiple of 8, and inside the first cluster ({cluster} bytes)"
            ),
            HeaderError::BackingName {
                offset,
                size,
                cluster,
            } => write!(
                f,
                "backing file name at {offset}, {size} bytes: it must be at most {MAX_BACKING_NAME} bytes and inside the first cluster ({cluster} bytes)"
            ),
            HeaderError::Extension { kind, at, why } => {
                write!(f, "header extension {kind:#010x} at offset {at}: {why}")
            }
            HeaderError::Unsupported { bits, names } => {
                write!(f, "incompatible features {bits:#x} are not supported")?;
                if !names.is_empty() {
                    write!(f, " ({})", names.join(", "))?;
                }
                write!(f, "; {CONVERT}")
            }
            HeaderError::Compression { kind, bit } => write!(
                f,
                "compression type {kind} with the compression feature bit {}: vblk reads zlib (type 0, bit clear) only; {CONVERT}",
                if *bit { "set" } else { "clear" }
            ),
            HeaderError::RefcountOrder(o) => write!(
                f,
                "refcount_order {o}: refcount entries are at most 64 bits (order 6)"
            ),
            HeaderError::Encrypted(m) => write!(
                f,
                "encrypted image (crypt_method {m}): vblk does not serve encrypted qcow2; an unencrypted copy is `qemu-img convert --object secret,id=s,data=PASSPHRASE --image-opts driver=qcow2,file.filename=IMAGE,encrypt.key-secret=s -O qcow2 NEW.qcow2` (or encrypt the host's storage instead)"
            ),
            HeaderError::Table {
                what,
                offset,
                bytes,
                why,
            } => write!(f, "{what} at offset {offset}, {bytes} bytes: {why}"),
            HeaderError::L1TooSmall { entries, size } => write!(
                f,
                "the L1 table's {entries} entries do not cover the virtual size of {size} bytes"
            ),
            HeaderError::Snapshots { count, offset } => write!(
                f,
                "{count} internal snapshots at offset {offset}: at most {MAX_SNAPSHOTS}, their table cluster-aligned"
            ),
        }
    }
}

impl std::error::Error for HeaderError {}

/// A header that passed every check that does not depend on how it is opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// 2 or 3.
    pub version: u32,
    /// log2 of the cluster size (9..=21).
    pub cluster_bits: u32,
    /// The virtual size in bytes, rounded down to 512 (QEMU ignores a partial sector).
    pub size: u64,
    /// The backing file name as the image writes it (bytes: any encoding), if any.
    pub backing_name: Option<Vec<u8>>,
    /// The backing file's format, from its header extension, if any.
    pub backing_format: Option<Vec<u8>>,
    /// Entries in the L1 table.
    pub l1_entries: u32,
    /// Where the L1 table is.
    pub l1_offset: u64,
    /// Where the refcount table is.
    pub reftable_offset: u64,
    /// Its size in clusters.
    pub reftable_clusters: u32,
    /// log2 of the refcount entry width in bits (0..=6; 4 for version 2).
    pub refcount_order: u32,
    /// Internal snapshots.
    pub snapshots: u32,
    /// Where their table is.
    pub snapshots_offset: u64,
    /// Incompatible feature bits (see [`incompat`]).
    pub incompatible: u64,
    /// Compatible feature bits (bit 0: lazy refcounts).
    pub compatible: u64,
    /// Autoclear feature bits.
    pub autoclear: u64,
    /// The header's length in bytes (72 for version 2).
    pub header_length: u32,
    /// Extensions vblk does not interpret, kept so that a rewritten header keeps them:
    /// (type, offset of the data in cluster 0, length).
    pub other_extensions: Vec<(u32, u64, u32)>,
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn be64(b: &[u8], at: usize) -> u64 {
    (u64::from(be32(b, at)) << 32) | u64::from(be32(b, at + 4))
}

impl Header {
    /// The cluster size in bytes.
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// L2 entries per L2 table (one cluster of 8-byte entries).
    pub fn l2_entries(&self) -> u64 {
        self.cluster_size() / 8
    }

    /// Whether the image says it was not closed cleanly (lazy refcounts).
    pub fn dirty(&self) -> bool {
        self.incompatible & incompat::DIRTY != 0
    }

    /// Whether the image is marked corrupt.
    pub fn corrupt(&self) -> bool {
        self.incompatible & incompat::CORRUPT != 0
    }

    /// Parse and check cluster 0 of an image of `file_size` bytes. `head` holds the
    /// file's first bytes: at least the header, and all of cluster 0 for the extensions
    /// and the backing name (fewer when the file is shorter).
    pub fn parse(head: &[u8], file_size: u64) -> Result<Header, HeaderError> {
        let short = |need: usize| HeaderError::Short {
            have: head.len(),
            need,
        };
        if head.len() < V2_HEADER_LENGTH as usize {
            return Err(if head.len() >= 4 && head[..4] != MAGIC {
                HeaderError::Magic
            } else {
                short(V2_HEADER_LENGTH as usize)
            });
        }
        if head[..4] != MAGIC {
            return Err(HeaderError::Magic);
        }
        let version = be32(head, 4);
        if version != 2 && version != 3 {
            return Err(HeaderError::Version(version));
        }
        let cluster_bits = be32(head, 20);
        if !(MIN_CLUSTER_BITS..=MAX_CLUSTER_BITS).contains(&cluster_bits) {
            return Err(HeaderError::ClusterBits(cluster_bits));
        }
        let cluster = 1u64 << cluster_bits;
        let mut h = Header {
            version,
            cluster_bits,
            size: be64(head, 24) & !511,
            backing_name: None,
            backing_format: None,
            l1_entries: be32(head, 36),
            l1_offset: be64(head, 40),
            reftable_offset: be64(head, 48),
            reftable_clusters: be32(head, 56),
            refcount_order: 4,
            snapshots: be32(head, 60),
            snapshots_offset: be64(head, 64),
            incompatible: 0,
            compatible: 0,
            autoclear: 0,
            header_length: V2_HEADER_LENGTH,
            other_extensions: Vec::new(),
        };
        let crypt = be32(head, 32);
        let mut compression = 0u8;
        if version == 3 {
            if head.len() < V3_MIN_HEADER_LENGTH as usize {
                return Err(short(V3_MIN_HEADER_LENGTH as usize));
            }
            h.incompatible = be64(head, 72);
            h.compatible = be64(head, 80);
            h.autoclear = be64(head, 88);
            h.refcount_order = be32(head, 96);
            h.header_length = be32(head, 100);
            if h.header_length < V3_MIN_HEADER_LENGTH
                || !h.header_length.is_multiple_of(8)
                || u64::from(h.header_length) > cluster
            {
                return Err(HeaderError::HeaderLength {
                    length: h.header_length,
                    cluster,
                });
            }
            if h.header_length > V3_MIN_HEADER_LENGTH {
                compression = *head.get(104).ok_or_else(|| short(105))?;
            }
        }
        // Cluster 0 as far as the file has it: extensions and the backing name live there.
        let c0 = &head[..head.len().min(cluster as usize)];
        let backing_offset = be64(head, 8);
        let backing_size = be32(head, 16);
        let ext_end = if backing_offset != 0 {
            backing_offset.min(cluster)
        } else {
            cluster
        };
        h.parse_extensions(c0, ext_end)?;
        if backing_offset != 0 {
            let end = backing_offset.checked_add(u64::from(backing_size));
            if backing_size > MAX_BACKING_NAME || end.is_none_or(|e| e > cluster) {
                return Err(HeaderError::BackingName {
                    offset: backing_offset,
                    size: backing_size,
                    cluster,
                });
            }
            let (a, e) = (backing_offset as usize, end.unwrap_or(0) as usize);
            let name = c0.get(a..e).ok_or_else(|| short(e))?;
            h.backing_name = Some(name.to_vec());
        }
        h.check_features(compression)?;
        if h.refcount_order > 6 {
            return Err(HeaderError::RefcountOrder(h.refcount_order));
        }
        if crypt != 0 {
            return Err(HeaderError::Encrypted(crypt));
        }
        h.check_tables(file_size)?;
        Ok(h)
    }

    /// Walk the header extensions between the header and `end` (the backing name, or the
    /// end of cluster 0).
    fn parse_extensions(&mut self, c0: &[u8], end: u64) -> Result<(), HeaderError> {
        let mut at = u64::from(self.header_length);
        let (mut seen_format, mut seen_data_file) = (false, false);
        loop {
            if at + 8 > end {
                // No room for another extension header: the area simply ends (QEMU reads
                // up to the end of the area and stops).
                return Ok(());
            }
            let a = at as usize;
            let Some(bytes) = c0.get(a..a + 8) else {
                return Err(HeaderError::Short {
                    have: c0.len(),
                    need: a + 8,
                });
            };
            let (kind, len) = (be32(bytes, 0), be32(bytes, 4));
            if kind == ext::END {
                return Ok(());
            }
            let data = at + 8;
            let padded = (u64::from(len) + 7) & !7;
            if data + padded > end {
                return Err(HeaderError::Extension {
                    kind,
                    at,
                    why: "it runs past the end of the extension area",
                });
            }
            let Some(body) = c0.get(data as usize..(data + u64::from(len)) as usize) else {
                return Err(HeaderError::Short {
                    have: c0.len(),
                    need: (data + u64::from(len)) as usize,
                });
            };
            match kind {
                ext::BACKING_FORMAT => {
                    if seen_format {
                        return Err(HeaderError::Extension {
                            kind,
                            at,
                            why: "a second backing format",
                        });
                    }
                    seen_format = true;
                    self.backing_format = Some(body.to_vec());
                }
                ext::DATA_FILE => {
                    if seen_data_file {
                        return Err(HeaderError::Extension {
                            kind,
                            at,
                            why: "a second external data file name",
                        });
                    }
                    seen_data_file = true;
                    self.other_extensions.push((kind, data, len));
                }
                _ => self.other_extensions.push((kind, data, len)),
            }
            at = data + padded;
        }
    }

    fn check_features(&self, compression: u8) -> Result<(), HeaderError> {
        let bit = self.incompatible & incompat::COMPRESSION != 0;
        if (compression != 0) != bit || compression > 1 {
            return Err(HeaderError::Compression {
                kind: compression,
                bit,
            });
        }
        let unsupported = self.incompatible & !(incompat::DIRTY | incompat::CORRUPT);
        if unsupported != 0 {
            let known = [
                (incompat::DATA_FILE, "external data file"),
                (incompat::COMPRESSION, "zstd compression"),
                (incompat::EXTENDED_L2, "extended L2 entries"),
            ];
            let mut names: Vec<String> = known
                .iter()
                .filter(|(b, _)| unsupported & b != 0)
                .map(|(_, n)| (*n).to_string())
                .collect();
            let unknown = unsupported & !incompat::KNOWN;
            if unknown != 0 {
                names.push(format!("unknown bits {unknown:#x}"));
            }
            return Err(HeaderError::Unsupported {
                bits: unsupported,
                names,
            });
        }
        Ok(())
    }

    fn check_tables(&self, file_size: u64) -> Result<(), HeaderError> {
        let cluster = self.cluster_size();
        let table = |what: &'static str, offset: u64, bytes: u64, max: u64| {
            let err = |why| HeaderError::Table {
                what,
                offset,
                bytes,
                why,
            };
            if bytes > max {
                return Err(err("larger than QEMU allows"));
            }
            if !offset.is_multiple_of(cluster) {
                return Err(err("not cluster-aligned"));
            }
            match offset.checked_add(bytes) {
                Some(end) if end <= file_size && end <= MAX_HOST_OFFSET => Ok(()),
                _ => Err(err("past the end of the file")),
            }
        };
        if self.reftable_clusters == 0 {
            return Err(HeaderError::Table {
                what: "refcount table",
                offset: self.reftable_offset,
                bytes: 0,
                why: "empty: every image has one",
            });
        }
        table(
            "refcount table",
            self.reftable_offset,
            u64::from(self.reftable_clusters) * cluster,
            MAX_REFTABLE_BYTES,
        )?;
        if self.reftable_offset == 0 {
            return Err(HeaderError::Table {
                what: "refcount table",
                offset: 0,
                bytes: u64::from(self.reftable_clusters) * cluster,
                why: "it would overlap the header",
            });
        }
        let l1_bytes = u64::from(self.l1_entries) * 8;
        table("L1 table", self.l1_offset, l1_bytes, MAX_L1_BYTES)?;
        if self.l1_entries > 0 && self.l1_offset == 0 {
            return Err(HeaderError::Table {
                what: "L1 table",
                offset: 0,
                bytes: l1_bytes,
                why: "it would overlap the header",
            });
        }
        // One L1 entry maps an L2 table's worth of clusters.
        let per_l1 = self.l2_entries() * cluster;
        let need = self.size.div_ceil(per_l1);
        if need > u64::from(self.l1_entries) {
            return Err(HeaderError::L1TooSmall {
                entries: self.l1_entries,
                size: self.size,
            });
        }
        if self.snapshots > MAX_SNAPSHOTS
            || (self.snapshots > 0
                && (!self.snapshots_offset.is_multiple_of(cluster)
                    || self.snapshots_offset == 0
                    || self.snapshots_offset >= file_size))
        {
            return Err(HeaderError::Snapshots {
                count: self.snapshots,
                offset: self.snapshots_offset,
            });
        }
        Ok(())
    }

    /// Whether the image may be opened for writing: not when it is marked corrupt, nor
    /// when it is dirty (its refcounts need `qemu-img check -r all` first: vblk does not
    /// repair), nor with internal snapshots (their clusters' COPIED flags would have to
    /// be trusted on a shared refcount).
    pub fn check_writable(&self) -> Result<(), String> {
        if self.corrupt() {
            return Err("the image is marked corrupt; it can be served read-only, or repaired with `qemu-img check -r all` first".into());
        }
        if self.dirty() {
            return Err("the image was not closed cleanly (lazy refcounts); run `qemu-img check -r all` on it first".into());
        }
        if self.snapshots > 0 {
            return Err(format!(
                "the image has {} internal snapshots; vblk writes only to images without them (delete them with `qemu-img snapshot -d`, or serve it read-only)",
                self.snapshots
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
