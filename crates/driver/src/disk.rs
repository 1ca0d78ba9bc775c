//! Attaching to a vhost-user-blk device: negotiation, shared memory, queues.

use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::Path as FsPath;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use log::{debug, info};
use proto::config::{BlkConfig, CONFIG_LEN};
use proto::wire::feature;
use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::error::{Error, ErrorKind};
use crate::mem::{Buffer, Pool, Region};
use crate::queue::{Queue, QueueOptions};
use crate::ring::{Layout, SplitRing};

/// Shuts a socket down if it is not stopped in time.
struct Watchdog {
    stop: mpsc::Sender<()>,
    thread: std::thread::JoinHandle<bool>,
}

impl Watchdog {
    fn start(stream: &UnixStream, limit: Duration) -> Result<Watchdog, Error> {
        let sock = stream
            .try_clone()
            .map_err(|e| Error::os(ErrorKind::Connect, "cannot watch the socket", e))?;
        let (stop, rx) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("vblk-attach".into())
            .spawn(move || match rx.recv_timeout(limit) {
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let _ = sock.shutdown(std::net::Shutdown::Both);
                    true
                }
                _ => false,
            })
            .map_err(|e| Error::os(ErrorKind::Connect, "cannot start the attach watchdog", e))?;
        Ok(Watchdog { stop, thread })
    }

    /// Stop watching; true if the deadline had passed and the socket was shut down.
    fn finish(self) -> bool {
        let _ = self.stop.send(());
        self.thread.join().unwrap_or(true)
    }
}

/// What the driver learned about the device when it attached.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DiskInfo {
    /// Socket the device was reached on.
    pub socket: String,
    /// Capacity in bytes.
    pub capacity_bytes: u64,
    /// Capacity in 512-byte sectors.
    pub capacity_sectors: u64,
    /// Logical block size in bytes.
    pub logical_block_size: u32,
    /// The device refuses writes.
    pub read_only: bool,
    /// A volatile write cache is in use (writeback); flushes are needed for durability.
    pub write_cache: bool,
    /// FLUSH is offered.
    pub flush: bool,
    /// DISCARD is offered.
    pub discard: bool,
    /// Largest discard segment, in sectors.
    pub max_discard_sectors: u32,
    /// WRITE_ZEROES is offered.
    pub write_zeroes: bool,
    /// Largest write-zeroes segment, in sectors.
    pub max_write_zeroes_sectors: u32,
    /// Write-zeroes may deallocate when asked to unmap.
    pub write_zeroes_may_unmap: bool,
    /// Most payload buffers per request.
    pub seg_max: u32,
    /// Largest payload buffer.
    pub size_max: u32,
    /// Queues the device offers.
    pub device_queues: u16,
    /// Queues this attachment set up.
    pub num_queues: u16,
    /// Entries per queue.
    pub queue_size: u16,
    /// Indirect descriptors negotiated.
    pub indirect: bool,
    /// EVENT_IDX negotiated.
    pub event_idx: bool,
    /// The GET_ID string ("" when the device answers UNSUPP).
    pub serial: String,
    /// Virtio feature bits the device offers.
    pub device_features: u64,
    /// Virtio feature bits negotiated.
    pub acked_features: u64,
    /// vhost-user protocol feature bits negotiated.
    pub protocol_features: u64,
    /// Names of the virtio-blk features the device offers.
    pub feature_names: Vec<String>,
    /// Names of the vhost-user protocol features negotiated.
    pub protocol_feature_names: Vec<String>,
    /// What a vblk device says about its disk beyond virtio (all false elsewhere).
    pub hints: DeviceHints,
}

/// vblk's hint block: what the device knows about its disk that virtio-blk has no field
/// for, and that the driver's `auto` path uses.
///
/// It lies outside the virtio configuration space: the driver reads it with a vhost-user
/// GET_CONFIG at offset [`HINT_OFFSET`] (past any virtio-blk configuration), which QEMU
/// and other frontends never ask for, so standard guests neither see it nor depend on it.
/// The block starts with the magic [`HINT_MAGIC`]; a device that ignores the offset (as
/// libvhost-user does) answers with the start of its configuration instead, which does not
/// match, and a device that refuses the read is taken as giving no hints.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct DeviceHints {
    /// The disk seeks (a rotational disk, `hdd:`), and the host does not reorder: merging
    /// and sorting in the driver pay.
    pub rotational: bool,
}

/// Where vblk's hint block lies in vhost-user's configuration address space.
pub const HINT_OFFSET: u32 = proto::config::HINT_OFFSET;
/// The first 8 bytes of the hint block.
pub const HINT_MAGIC: [u8; 8] = proto::config::HINT_MAGIC;

impl DeviceHints {
    /// Decode a hint block (None: not vblk's).
    pub fn from_bytes(b: &[u8]) -> Option<DeviceHints> {
        let h = proto::config::Hints::from_bytes(b)?;
        Some(DeviceHints {
            rotational: h.rotational,
        })
    }
}

/// How to attach.
#[derive(Clone, Debug)]
pub struct DiskOptions {
    /// Queues to set up (None: one per CPU of this machine, at most as many as the device
    /// offers — what Linux's virtio_blk does).
    pub num_queues: Option<u16>,
    /// Entries per queue (a power of two).
    pub queue_size: u16,
    /// Bytes of shared memory for I/O buffers.
    pub pool_size: usize,
    /// Negotiate indirect descriptors when offered.
    pub indirect: bool,
    /// Negotiate EVENT_IDX when offered.
    pub event_idx: bool,
    /// vhost-user protocol features the driver may negotiate (a subset of MQ, REPLY_ACK,
    /// CONFIG and CONFIGURE_MEM_SLOTS; CONFIG is required).
    pub protocol_features: VhostUserProtocolFeatures,
    /// Queue tuning: path, batch size, spin bound.
    pub queue: QueueOptions,
    /// How long the handshake may take before attaching fails (a device that never
    /// answers must not hang the caller).
    pub attach_timeout: Duration,
    /// Set the device's cache mode when it lets the driver (CONFIG_WCE): `Some(true)`
    /// writeback, `Some(false)` writethrough (Linux's `cache_type`); None leaves it as
    /// the device has it.
    pub write_cache: Option<bool>,
}

impl Default for DiskOptions {
    fn default() -> Self {
        DiskOptions {
            num_queues: None,
            queue_size: 256,
            pool_size: 64 << 20,
            indirect: true,
            event_idx: true,
            protocol_features: supported_protocol_features(),
            queue: QueueOptions::default(),
            attach_timeout: Duration::from_secs(30),
            write_cache: None,
        }
    }
}

/// The protocol features the driver knows how to use.
pub fn supported_protocol_features() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
        | VhostUserProtocolFeatures::BACKEND_REQ
}

/// What a queue checks requests against (copied from [`DiskInfo`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub logical_block_size: u32,
    pub read_only: bool,
    pub flush: bool,
    pub discard: bool,
    pub max_discard_sectors: u32,
    pub write_zeroes: bool,
    pub max_write_zeroes_sectors: u32,
    pub write_zeroes_may_unmap: bool,
    pub seg_max: u32,
    pub size_max: u32,
    /// A volatile write cache: FUA needs a flush after the write.
    pub write_cache: bool,
}

impl From<&DiskInfo> for Limits {
    fn from(i: &DiskInfo) -> Limits {
        Limits {
            logical_block_size: i.logical_block_size,
            read_only: i.read_only,
            flush: i.flush,
            discard: i.discard,
            max_discard_sectors: i.max_discard_sectors,
            write_zeroes: i.write_zeroes,
            max_write_zeroes_sectors: i.max_write_zeroes_sectors,
            write_zeroes_may_unmap: i.write_zeroes_may_unmap,
            seg_max: i.seg_max,
            size_max: i.size_max,
            write_cache: i.write_cache,
        }
    }
}

/// State shared by a disk's queues.
pub(crate) struct Shared {
    pub pool: Arc<Pool>,
    pub sock_fd: i32,
    pub dead: AtomicBool,
    /// The capacity in bytes; follows the device's configuration changes.
    pub capacity: AtomicU64,
    /// Keeps the control connection open while any queue lives (and reads the
    /// configuration again when it changes).
    pub frontend: Mutex<Frontend>,
    /// `auto`'s rounds, run by all the disk's queues together.
    pub auto: crate::path::auto::AutoDisk,
    _region: Arc<Region>,
}

/// An attached vhost-user-blk device. Hands out one [`Queue`] per thread.
pub struct Disk {
    info: DiskInfo,
    shared: Arc<Shared>,
    queues: Mutex<Vec<Option<Queue>>>,
}

impl std::fmt::Debug for Disk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Disk").field("info", &self.info).finish()
    }
}

fn connect_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Connect, format!("{what}: {e}"))
}

/// The virtio-blk features the driver can use.
fn wanted_features(opts: &DiskOptions) -> u64 {
    let mut f = [
        feature::VERSION_1,
        feature::SEG_MAX,
        feature::SIZE_MAX,
        feature::BLK_SIZE,
        feature::TOPOLOGY,
        feature::FLUSH,
        feature::CONFIG_WCE,
        feature::MQ,
        feature::DISCARD,
        feature::WRITE_ZEROES,
        feature::RO,
    ]
    .iter()
    .fold(0u64, |m, &b| m | feature::bit(b));
    if opts.indirect {
        f |= feature::bit(feature::RING_INDIRECT_DESC);
    }
    if opts.event_idx {
        f |= feature::bit(feature::RING_EVENT_IDX);
    }
    f | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
}

/// Bytes of configuration space to read: the fields that the offered features define, and
/// no more. A libvhost-user device (qemu-storage-daemon 7.2) refuses a read longer than its
/// own `struct virtio_blk_config` with an empty reply, on which the vhost crate's
/// `get_config` blocks forever waiting for the payload; QEMU's frontend sizes its read the
/// same way (`virtio_get_config_size`).
fn config_len(device_features: u64) -> usize {
    // Through num_queues (36); discard fields end at 48, write-zeroes fields (with the
    // padding after write_zeroes_may_unmap) at 60. Secure erase (to 72) is not used.
    let len = if device_features & feature::bit(feature::WRITE_ZEROES) != 0 {
        60
    } else if device_features & feature::bit(feature::DISCARD) != 0 {
        48
    } else {
        36
    };
    len.min(CONFIG_LEN)
}

/// Names of the virtio-blk feature bits set in `f`.
pub fn feature_names(f: u64) -> Vec<String> {
    const NAMES: [(u32, &str); 16] = [
        (feature::SIZE_MAX, "SIZE_MAX"),
        (feature::SEG_MAX, "SEG_MAX"),
        (feature::GEOMETRY, "GEOMETRY"),
        (feature::RO, "RO"),
        (feature::BLK_SIZE, "BLK_SIZE"),
        (feature::FLUSH, "FLUSH"),
        (feature::TOPOLOGY, "TOPOLOGY"),
        (feature::CONFIG_WCE, "CONFIG_WCE"),
        (feature::MQ, "MQ"),
        (feature::DISCARD, "DISCARD"),
        (feature::WRITE_ZEROES, "WRITE_ZEROES"),
        (15, "LIFETIME"),
        (16, "SECURE_ERASE"),
        (feature::RING_INDIRECT_DESC, "RING_INDIRECT_DESC"),
        (feature::RING_EVENT_IDX, "RING_EVENT_IDX"),
        (feature::VERSION_1, "VERSION_1"),
    ];
    NAMES
        .iter()
        .filter(|(b, _)| f & feature::bit(*b) != 0)
        .map(|(_, n)| n.to_string())
        .collect()
}

fn protocol_names(p: VhostUserProtocolFeatures) -> Vec<String> {
    [
        (VhostUserProtocolFeatures::MQ, "MQ"),
        (VhostUserProtocolFeatures::REPLY_ACK, "REPLY_ACK"),
        (VhostUserProtocolFeatures::BACKEND_REQ, "BACKEND_REQ"),
        (VhostUserProtocolFeatures::CONFIG, "CONFIG"),
        (
            VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS,
            "CONFIGURE_MEM_SLOTS",
        ),
    ]
    .iter()
    .filter(|(f, _)| p.contains(*f))
    .map(|(_, n)| n.to_string())
    .collect()
}

impl Disk {
    /// Attach to the vhost-user-blk device listening on `socket`.
    pub fn attach(socket: impl AsRef<FsPath>, opts: &DiskOptions) -> Result<Disk, Error> {
        let socket = socket.as_ref();
        let name = socket.display().to_string();
        if !opts.queue_size.is_power_of_two() || opts.queue_size < 4 {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "queue size {} must be a power of two of at least 4",
                    opts.queue_size
                ),
            ));
        }
        let stream = UnixStream::connect(socket).map_err(|e| {
            // connect(2) says "Connection refused" for a path that is no socket at all.
            let what = match std::fs::metadata(socket) {
                Ok(m) if !m.file_type().is_socket() => format!(
                    "cannot connect to {name}: it is not a socket (a {})",
                    if m.is_dir() { "directory" } else { "file" }
                ),
                _ => format!("cannot connect to {name}"),
            };
            Error::os(ErrorKind::Connect, &what, e)
        })?;
        // The vhost crate waits for replies without a deadline; a watchdog shuts the
        // socket down if the handshake outlives `attach_timeout`, which turns a silent
        // device into an error instead of a hang.
        let watchdog = Watchdog::start(&stream, opts.attach_timeout)?;
        let attached = Self::handshake(stream, name.clone(), opts);
        if watchdog.finish() {
            return Err(Error::new(
                ErrorKind::Connect,
                format!(
                    "{name}: the device did not complete the handshake within {:?} (a vhost-user device serves one frontend at a time: is another one attached?)",
                    opts.attach_timeout
                ),
            ));
        }
        attached
    }

    fn handshake(stream: UnixStream, name: String, opts: &DiskOptions) -> Result<Disk, Error> {
        let sock_fd = stream.as_raw_fd();
        let mut fe = Frontend::from_stream(stream, 64);
        fe.set_owner().map_err(|e| connect_err("SET_OWNER", e))?;
        let device_features = fe
            .get_features()
            .map_err(|e| connect_err("GET_FEATURES", e))?;
        if device_features & feature::bit(feature::VERSION_1) == 0 {
            return Err(connect_err(
                "features",
                format!("device offers {device_features:#x} without VERSION_1"),
            ));
        }
        let mut proto = VhostUserProtocolFeatures::empty();
        if device_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0 {
            let offered = fe
                .get_protocol_features()
                .map_err(|e| connect_err("GET_PROTOCOL_FEATURES", e))?;
            proto = offered & opts.protocol_features;
            fe.set_protocol_features(proto)
                .map_err(|e| connect_err("SET_PROTOCOL_FEATURES", e))?;
        }
        if !proto.contains(VhostUserProtocolFeatures::CONFIG) {
            return Err(connect_err(
                "negotiation",
                "the device does not offer the CONFIG protocol feature, so its capacity cannot be read",
            ));
        }
        let cfg_len = config_len(device_features);
        let (_, cfg_bytes) = fe
            .get_config(
                0,
                cfg_len as u32,
                VhostUserConfigFlags::WRITABLE,
                &[0u8; CONFIG_LEN][..cfg_len],
            )
            .map_err(|e| connect_err("GET_CONFIG", e))?;
        let cfg = BlkConfig::from_bytes(&cfg_bytes);
        let hints = fe
            .get_config(
                HINT_OFFSET,
                proto::config::HINT_LEN as u32,
                VhostUserConfigFlags::WRITABLE,
                &[0u8; proto::config::HINT_LEN],
            )
            .ok()
            .and_then(|(_, b)| DeviceHints::from_bytes(&b))
            .unwrap_or_default();
        let acked = device_features & wanted_features(opts);
        let has = |b| acked & feature::bit(b) != 0;
        let mut device_queues = if has(feature::MQ) {
            cfg.num_queues.max(1)
        } else {
            1
        };
        if proto.contains(VhostUserProtocolFeatures::MQ) {
            let n = fe
                .get_queue_num()
                .map_err(|e| connect_err("GET_QUEUE_NUM", e))?;
            device_queues = device_queues.min(n.min(u64::from(u16::MAX)) as u16).max(1);
        }
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let num_queues = opts
            .num_queues
            .unwrap_or_else(|| device_queues.min(u16::try_from(cpus).unwrap_or(u16::MAX)));
        if num_queues == 0 || num_queues > device_queues {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!("{num_queues} queues asked for; the device offers {device_queues}"),
            ));
        }
        fe.set_features(acked)
            .map_err(|e| connect_err("SET_FEATURES", e))?;
        let channel = if proto.contains(VhostUserProtocolFeatures::BACKEND_REQ) {
            let reply_ack = proto.contains(VhostUserProtocolFeatures::REPLY_ACK);
            Some(crate::watch::Channel::open(&mut fe, reply_ack)?)
        } else {
            None
        };
        debug!(
            "{name}: device features {device_features:#x}, acked {acked:#x}, protocol {proto:?}"
        );

        let seg_max = if has(feature::SEG_MAX) && cfg.seg_max > 0 {
            cfg.seg_max
        } else {
            u32::from(opts.queue_size) - 2
        };
        let size_max = if has(feature::SIZE_MAX) && cfg.size_max >= 512 {
            cfg.size_max
        } else {
            1 << 20
        };
        let indirect = has(feature::RING_INDIRECT_DESC);
        let event_idx = has(feature::RING_EVENT_IDX);
        let max_indirect = if indirect {
            (seg_max + 3).min(u32::from(opts.queue_size)) as u16
        } else {
            0
        };
        let layout = Layout::new(opts.queue_size, max_indirect);
        let rings_len = layout.len * usize::from(num_queues);
        let region = Arc::new(Region::new(rings_len + opts.pool_size)?);
        let pool = Arc::new(Pool::new(region.clone(), rings_len, region.len()));
        let mem = VhostUserMemoryRegionInfo {
            guest_phys_addr: region.gpa(),
            memory_size: region.len() as u64,
            userspace_addr: region.gpa(),
            mmap_offset: 0,
            mmap_handle: region.fd(),
        };
        if proto.contains(VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS) {
            fe.add_mem_region(&mem)
                .map_err(|e| connect_err("ADD_MEM_REG", e))?;
        } else {
            fe.set_mem_table(&[mem])
                .map_err(|e| connect_err("SET_MEM_TABLE", e))?;
        }

        let mut writeback = cfg.writeback != 0;
        if let Some(wc) = opts.write_cache {
            if has(feature::CONFIG_WCE) {
                fe.set_config(
                    proto::config::WRITEBACK_OFFSET as u32,
                    VhostUserConfigFlags::WRITABLE,
                    &[u8::from(wc)],
                )
                .map_err(|e| connect_err("SET_CONFIG (writeback)", e))?;
                writeback = wc;
            } else if has(feature::FLUSH) != wc {
                info!(
                    "{name}: the device does not let the driver choose its cache mode (no \
                     CONFIG_WCE); it stays {}",
                    if has(feature::FLUSH) {
                        "writeback"
                    } else {
                        "writethrough"
                    }
                );
            }
        }
        let blk = if has(feature::BLK_SIZE) && cfg.blk_size >= 512 && cfg.blk_size.is_power_of_two()
        {
            cfg.blk_size
        } else {
            512
        };
        let mut info = DiskInfo {
            socket: name.clone(),
            capacity_bytes: cfg.capacity.saturating_mul(512),
            capacity_sectors: cfg.capacity,
            logical_block_size: blk,
            read_only: has(feature::RO),
            write_cache: has(feature::FLUSH) && (!has(feature::CONFIG_WCE) || writeback),
            flush: has(feature::FLUSH),
            discard: has(feature::DISCARD),
            max_discard_sectors: if has(feature::DISCARD) {
                cfg.max_discard_sectors.max(1)
            } else {
                0
            },
            write_zeroes: has(feature::WRITE_ZEROES),
            max_write_zeroes_sectors: if has(feature::WRITE_ZEROES) {
                cfg.max_write_zeroes_sectors.max(1)
            } else {
                0
            },
            write_zeroes_may_unmap: has(feature::WRITE_ZEROES) && cfg.write_zeroes_may_unmap != 0,
            seg_max,
            size_max,
            device_queues,
            num_queues,
            queue_size: opts.queue_size,
            indirect,
            event_idx,
            serial: String::new(),
            device_features,
            acked_features: acked,
            protocol_features: proto.bits(),
            feature_names: feature_names(device_features),
            protocol_feature_names: protocol_names(proto),
            hints,
        };

        let mut rings = Vec::with_capacity(usize::from(num_queues));
        for q in 0..num_queues {
            let off = layout.len * usize::from(q);
            // SAFETY: [off, off + layout.len) lies in the rings part of the region (before
            // the pool), is zero (fresh memfd), belongs to this queue alone, and the region
            // outlives the ring through Shared.
            let ring =
                unsafe { SplitRing::new(region.base().add(off), layout, indirect, event_idx) };
            let kick = EventFd::new(EFD_NONBLOCK)
                .map_err(|e| Error::os(ErrorKind::Connect, "eventfd", e))?;
            let call = EventFd::new(EFD_NONBLOCK)
                .map_err(|e| Error::os(ErrorKind::Connect, "eventfd", e))?;
            let (desc, avail, used) = ring.addresses();
            let i = usize::from(q);
            let step = |what: &str, r: vhost::Result<()>| {
                r.map_err(|e| connect_err(&format!("queue {q}: {what}"), e))
            };
            step("SET_VRING_NUM", fe.set_vring_num(i, opts.queue_size))?;
            step(
                "SET_VRING_ADDR",
                fe.set_vring_addr(
                    i,
                    &VringConfigData {
                        queue_max_size: opts.queue_size,
                        queue_size: opts.queue_size,
                        flags: 0,
                        desc_table_addr: desc,
                        used_ring_addr: used,
                        avail_ring_addr: avail,
                        log_addr: None,
                    },
                ),
            )?;
            step("SET_VRING_BASE", fe.set_vring_base(i, 0))?;
            step("SET_VRING_CALL", fe.set_vring_call(i, &call))?;
            step("SET_VRING_KICK", fe.set_vring_kick(i, &kick))?;
            if acked & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0 {
                step("SET_VRING_ENABLE", fe.set_vring_enable(i, true))?;
            }
            rings.push((ring, kick, call));
        }

        let limits = Limits::from(&info);
        let shared = Arc::new(Shared {
            pool,
            sock_fd,
            dead: AtomicBool::new(false),
            capacity: AtomicU64::new(info.capacity_bytes),
            frontend: Mutex::new(fe),
            auto: crate::path::auto::AutoDisk::new(),
            _region: region,
        });
        if let Some(ch) = channel {
            ch.spawn(Arc::downgrade(&shared), cfg_len);
        }
        let mut queues: Vec<Option<Queue>> = rings
            .into_iter()
            .enumerate()
            .map(|(q, (ring, kick, call))| {
                Some(Queue::new(
                    shared.clone(),
                    limits,
                    q as u16,
                    ring,
                    kick,
                    call,
                    opts.queue,
                    hints.rotational,
                ))
            })
            .collect();
        // Learn the serial with queue 0 (an UNSUPP answer leaves it empty).
        info.serial = match queues[0].as_mut().map(|q| q.get_id()) {
            Some(Ok(s)) => s,
            Some(Err(e)) if e.kind() == ErrorKind::Unsupported => String::new(),
            Some(Err(e)) => return Err(e),
            None => String::new(),
        };
        info!("attached to {name}");
        Ok(Disk {
            info,
            shared,
            queues: Mutex::new(queues),
        })
    }

    /// What the device offers and what was negotiated (as at attach time).
    pub fn info(&self) -> &DiskInfo {
        &self.info
    }

    /// The capacity now: it follows the device's configuration changes (a disk grown
    /// under a running `vblk serve`, announced on the backend channel).
    pub fn capacity_bytes(&self) -> u64 {
        self.shared.capacity.load(Ordering::SeqCst)
    }

    /// Take queue `index` (each queue can be taken once; it is then owned by its thread).
    pub fn take_queue(&self, index: u16) -> Option<Queue> {
        let mut qs = self.queues.lock().unwrap_or_else(|p| p.into_inner());
        qs.get_mut(usize::from(index)).and_then(Option::take)
    }

    /// Take every queue not yet taken.
    pub fn take_queues(&self) -> Vec<Queue> {
        let mut qs = self.queues.lock().unwrap_or_else(|p| p.into_inner());
        qs.iter_mut().filter_map(Option::take).collect()
    }

    /// Allocate a buffer in memory shared with the device.
    pub fn alloc(&self, len: usize) -> Result<Buffer, Error> {
        self.shared.pool.alloc(len)
    }
}
