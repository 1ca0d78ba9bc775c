//! The device configuration: what `vblk serve` was asked to do.

use std::os::fd::RawFd;
use std::path::PathBuf;
use std::time::Duration;

use storage::{CacheMode, DiskSpec, EngineKind};

/// Default number of virtqueues offered. QEMU's `vhost-user-blk-pci` asks for one queue
/// per vCPU unless told otherwise and refuses to start when the backend offers fewer, so
/// the default covers VMs of up to 256 vCPUs. A queue the frontend never starts costs a
/// few hundred bytes of bookkeeping: rings, slots and buffers are allocated when it starts.
pub const DEFAULT_NUM_QUEUES: u16 = 256;
/// Most virtqueues `--num-queues` may offer. vhost-user names a queue's kick, call and
/// error descriptors with an 8-bit index (SET_VRING_KICK/CALL/ERR, bits 0-7), so a queue
/// past 255 could never get its descriptors: a frontend would reach queue `i % 256`.
pub const MAX_NUM_QUEUES: u16 = 256;
/// Default for how long stopping a ring waits for its requests (`--drain-timeout-secs`).
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest `--drain-timeout-secs`.
pub const MAX_DRAIN_TIMEOUT: Duration = Duration::from_secs(3600);
/// Default for the largest virtqueue size accepted: QEMU's largest (`queue-size=1024`).
pub const DEFAULT_QUEUE_SIZE: u16 = 1024;
/// Largest virtqueue size the spec allows.
pub const MAX_QUEUE_SIZE: u16 = 32768;
/// Most data segments in one request, offered in `seg_max`, whatever queue size the
/// frontend picks. Linux puts a request of up to `seg_max + 2` descriptors in one indirect
/// table even when that is longer than the ring, so the device takes indirect tables of
/// up to `max(queue size, seg_max + 2)` entries (docs/design-notes.md, "seg_max").
pub const SEG_MAX: u32 = 254;
/// Default polling window after a worker's queues run dry, in microseconds.
pub const DEFAULT_POLL_US: u64 = 200;

/// `--coalesce-us`'s default: how long a worker may leave a paced guest's requests
/// waiting so that one wake-up serves several (0: never).
pub const DEFAULT_COALESCE_US: u64 = 0;

/// The longest `--coalesce-us` accepted: a request may wait this long for the worker.
pub const MAX_COALESCE_US: u64 = 1_000;
/// `size_max`, the segment size offered to drivers. The device serves buffers of any
/// length (a descriptor holds up to 4 GiB - 1); this is the size Linux splits segments at.
pub const SIZE_MAX: u32 = 1 << 20;
/// Largest discard / write-zeroes segment, in sectors (just under 2 GiB).
pub const MAX_DISCARD_SECTORS: u32 = 0x3f_ffff;

/// Where the device listens for its frontend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Listen {
    /// Create a Unix socket at this path.
    Path(PathBuf),
    /// Use this already listening socket (systemd socket activation).
    Fd(RawFd),
}

/// What the daemon as a whole does, whatever disks it serves.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    /// Worker threads, shared by every disk: a disk's queue `i` is served by its worker
    /// `i % min(threads, queues)`, and a disk's workers go on consecutive threads starting
    /// at a thread of its own (the disks spread over the threads).
    pub threads: usize,
    /// Polling window in microseconds (0: never spin), per worker thread.
    pub poll_us: u64,
    /// How long a worker thread may leave kicks off so that one wake-up serves several
    /// requests, µs (0: never); the worker does so only while it measures cheaper per
    /// request at the same pace (poll.rs).
    pub coalesce_us: u64,
    /// CPUs to run worker threads on: thread t on `cpus[t % len]` (empty: wherever the
    /// scheduler puts them).
    pub cpus: Vec<usize>,
    /// Serve statistics and disk management on this Unix socket (`vblk stats PATH`,
    /// `vblk disk ... PATH`).
    pub control_socket: Option<PathBuf>,
    /// Who may connect to the disks' sockets the daemon creates (the program gives each
    /// disk's `DeviceConfig::socket_access` the same), and the default for disks added
    /// later (`vblk disk add` asks with `list`).
    pub socket_access: crate::socket_file::SocketAccess,
    /// Who may connect to the control socket: its own setting, since whoever reaches it
    /// manages every disk (the frontends' group must not).
    pub control_access: crate::socket_file::SocketAccess,
    /// How the daemon confines itself once set up.
    pub sandbox: crate::sandbox::SandboxConfig,
    /// TCP ports the sandbox lets the daemon connect to besides those of the NBD disks it
    /// starts with: for NBD disks added later.
    pub nbd_ports: Vec<u16>,
    /// Parses the disks clients add through the control socket (None: none can be).
    pub disk_parser: Option<crate::control::DiskParser>,
    /// Throttle groups and their limits, covering all their member disks together
    /// (a disk joins one with `DeviceConfig::throttle_group`).
    pub throttle_groups: Vec<(String, crate::throttle::Limits)>,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        DaemonConfig {
            threads: 1,
            poll_us: DEFAULT_POLL_US,
            coalesce_us: DEFAULT_COALESCE_US,
            cpus: Vec::new(),
            control_socket: None,
            socket_access: Default::default(),
            control_access: Default::default(),
            sandbox: Default::default(),
            nbd_ports: Vec::new(),
            disk_parser: None,
            throttle_groups: Vec::new(),
        }
    }
}

/// Most worker threads.
pub const MAX_THREADS: usize = 256;

impl DaemonConfig {
    /// Check every value; the message names the flag and the number.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.threads == 0 || self.threads > MAX_THREADS {
            return Err(ConfigError::Threads(self.threads));
        }
        if self.poll_us > 1_000_000 {
            return Err(ConfigError::PollUs(self.poll_us));
        }
        if self.coalesce_us > MAX_COALESCE_US {
            return Err(ConfigError::CoalesceUs(self.coalesce_us));
        }
        let count = cpu_count();
        if let Some(&cpu) = self.cpus.iter().find(|&&c| c >= count) {
            return Err(ConfigError::Cpu { cpu, count });
        }
        if self.nbd_ports.contains(&0) {
            return Err(ConfigError::NbdPortZero);
        }
        Ok(())
    }
}

/// One disk the daemon serves: its name, where it listens, how it is served.
#[derive(Clone, Debug)]
pub struct ServedDisk {
    /// The name the control socket and the statistics know it by (`vblk disk remove ID`).
    pub id: String,
    /// Its socket.
    pub listen: Listen,
    /// How it is served.
    pub config: DeviceConfig,
    /// How it was described (`--disk` or a `[[disk]]` table as KEY=VALUE,...; empty for
    /// a one-disk command line): `vblk disk list` shows it, `vblk disk sync` compares it.
    pub spec: String,
}

impl ServedDisk {
    /// Check the name and the configuration.
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_id(&self.id)?;
        self.config.validate()
    }
}

/// Longest disk name.
pub const MAX_ID_LEN: usize = 64;

/// A disk name: 1 to 64 of `A-Z a-z 0-9 . _ -`, not starting with `-` or `.`.
pub fn check_id(id: &str) -> Result<(), ConfigError> {
    check_name("disk id", id)
}

/// Check a throttle group's name: the same characters as a disk's id, and not `none`
/// (which means "in no group" where a disk names its group).
pub fn check_group_name(name: &str) -> Result<(), ConfigError> {
    if name == "none" {
        return Err(ConfigError::GroupNone);
    }
    check_name("throttle group", name)
}

fn check_name(what: &'static str, id: &str) -> Result<(), ConfigError> {
    let ok = !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && !id.starts_with(['-', '.'])
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(ConfigError::Id {
            what,
            name: id.to_string(),
        })
    }
}

/// How one disk is served.
#[derive(Clone, Debug)]
pub struct DeviceConfig {
    /// The disk.
    pub disk: DiskSpec,
    /// Refuse writes and offer VIRTIO_BLK_F_RO.
    pub read_only: bool,
    /// Page cache or O_DIRECT.
    pub cache: CacheMode,
    /// RAM disks: allocate every page at start.
    pub prealloc: bool,
    /// The GET_ID string; None derives one from the disk.
    pub serial: Option<String>,
    /// Number of virtqueues.
    pub num_queues: u16,
    /// Largest virtqueue size accepted.
    pub queue_size: u16,
    /// Storage engine.
    pub engine: EngineKind,
    /// Threads of each `threads` engine's pool (one pool per worker).
    pub engine_threads: usize,
    /// Most requests handed to the engine per submit call (0: one submit per pass; None:
    /// [`auto_submit_batch`] for the cache mode).
    pub submit_batch: Option<u32>,
    /// Resizing: accept a disk that became smaller (I/O past its new end fails).
    pub allow_shrink: bool,
    /// Offer inflight I/O tracking (INFLIGHT_SHMFD), so that a frontend reconnecting
    /// after a crash gets exactly the requests that were in flight resubmitted.
    pub inflight: bool,
    /// Testing aid: hold every Nth operation (or its completion) back.
    pub delay: Option<storage::Delay>,
    /// How long stopping a ring (GET_VRING_BASE: reset, reboot, shutdown) waits for the
    /// ring's requests; those still out then are fenced (`fence`).
    pub drain_timeout: Duration,
    /// Who may connect to the disk's socket, when the daemon creates it.
    pub socket_access: crate::socket_file::SocketAccess,
    /// Files and block devices: image locking and the format probe.
    pub image: storage::ImageChecks,
    /// Tell vblk drivers (in the hint block, never the guest) that the disk is rotational:
    /// seeks cost and the host does not reorder, so merging and sorting in the driver
    /// pay. None: from the disk (`hdd:` is; files and block devices are not assumed to
    /// be, as a virtual machine's disks all claim to be rotational in sysfs).
    pub rotational: Option<bool>,
    /// NBD disks: reconnection limit, timeout, connections per worker.
    pub nbd: storage::nbd::NbdOptions,
    /// QoS limits (QEMU's names and semantics; none by default).
    pub throttle: crate::throttle::Limits,
    /// The throttle group it belongs to, whose limits cover all its members.
    pub throttle_group: Option<String>,
    /// qcow2 images: the backing files below the image, in order (`--backing`).
    pub backing: Vec<storage::qcow2::BackingFile>,
    /// qcow2 images: the most bytes of L2 entries the metadata owner caches
    /// (`--qcow2-cache`).
    pub qcow2_cache: usize,
}

impl Default for DeviceConfig {
    fn default() -> Self {
        DeviceConfig {
            disk: DiskSpec::Null(1 << 30),
            read_only: false,
            cache: CacheMode::default(),
            prealloc: false,
            serial: None,
            num_queues: DEFAULT_NUM_QUEUES,
            queue_size: DEFAULT_QUEUE_SIZE,
            engine: EngineKind::default(),
            engine_threads: storage::DEFAULT_ENGINE_THREADS,
            submit_batch: None,
            image: Default::default(),
            allow_shrink: false,
            inflight: true,
            rotational: None,
            delay: None,
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
            socket_access: Default::default(),
            nbd: Default::default(),
            throttle: Default::default(),
            throttle_group: None,
            backing: Vec::new(),
            qcow2_cache: storage::qcow2::DEFAULT_CACHE_BYTES,
        }
    }
}

/// A configuration value that cannot work.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// Queue count out of range.
    #[error("--num-queues {0}: must be between 1 and 256 (vhost-user's SET_VRING_KICK, CALL and ERR carry an 8-bit queue index)")]
    NumQueues(u16),
    /// Drain timeout out of range.
    #[error("--drain-timeout-secs {0}: must be between 1 and 3600")]
    DrainTimeout(u64),
    /// Queue size not a power of two in range.
    #[error("--queue-size {0}: must be a power of two between 4 and 32768")]
    QueueSize(u16),
    /// Thread count out of range.
    #[error("--threads {0}: must be between 1 and 256")]
    Threads(usize),
    /// A throttle group named `none`, which means "in no group" where a disk names one.
    #[error(
        "throttle group \"none\": that name means \"in no group\" (group=none); choose another"
    )]
    GroupNone,
    /// A disk name that cannot be one.
    #[error("{what} {name:?}: must be 1 to 64 of A-Z a-z 0-9 . _ - (not starting with - or .)")]
    Id {
        /// What the name names: a disk id, a throttle group.
        what: &'static str,
        /// The name.
        name: String,
    },
    /// Serial too long.
    #[error("--serial {serial:?} is {len} bytes; GET_ID holds at most 20")]
    Serial {
        /// The serial.
        serial: String,
        /// Its length in bytes.
        len: usize,
    },
    /// A CPU that does not exist.
    #[error("--cpus: CPU {cpu} does not exist (this machine has {count})")]
    Cpu {
        /// The CPU asked for.
        cpu: usize,
        /// CPUs on the machine.
        count: usize,
    },
    /// TCP port 0 among the NBD ports (no server listens there).
    #[error("--nbd-ports: port 0 is no port an NBD server listens on")]
    NbdPortZero,
    /// Poll window absurdly large.
    #[error("--poll-us {0}: must be at most 1000000 (one second)")]
    PollUs(u64),
    /// Coalescing delay too long.
    #[error(
        "--coalesce-us {0}: must be at most {MAX_COALESCE_US} (a request waits up to this long)"
    )]
    CoalesceUs(u64),
    /// Thread pool size out of range.
    #[error("--engine-threads {0}: must be between 1 and {max}", max = storage::MAX_ENGINE_THREADS)]
    EngineThreads(usize),
}

impl DeviceConfig {
    /// Check every value; the message names the flag and the number.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.num_queues == 0 || self.num_queues > MAX_NUM_QUEUES {
            return Err(ConfigError::NumQueues(self.num_queues));
        }
        if !self.queue_size.is_power_of_two()
            || self.queue_size < 4
            || self.queue_size > MAX_QUEUE_SIZE
        {
            return Err(ConfigError::QueueSize(self.queue_size));
        }
        if let Some(s) = &self.serial {
            if s.len() > proto::wire::ID_BYTES {
                return Err(ConfigError::Serial {
                    serial: s.clone(),
                    len: s.len(),
                });
            }
        }
        if self.drain_timeout < Duration::from_secs(1) || self.drain_timeout > MAX_DRAIN_TIMEOUT {
            return Err(ConfigError::DrainTimeout(self.drain_timeout.as_secs()));
        }
        if self.engine_threads == 0 || self.engine_threads > storage::MAX_ENGINE_THREADS {
            return Err(ConfigError::EngineThreads(self.engine_threads));
        }
        Ok(())
    }
}

/// The submit batch for a cache mode, by measurement (BENCHMARKS.md, "Engines, and the
/// io_uring submission batch").
/// With O_DIRECT an io_uring submission dispatches each read to the disk inside
/// `io_uring_enter`, so a large batch makes its last reads wait for the whole batch: 4 per
/// call. Through the page cache reads complete inside the call, and extra calls only cost:
/// one submit per pass.
pub fn auto_submit_batch(cache: CacheMode) -> u32 {
    match cache {
        CacheMode::None => 4,
        CacheMode::Writeback => 0,
    }
}

impl DeviceConfig {
    /// The submit batch in force (0: one submit per pass).
    pub fn effective_submit_batch(&self) -> u32 {
        self.submit_batch
            .unwrap_or_else(|| auto_submit_batch(self.cache))
    }
}

/// CPUs the machine has.
pub fn cpu_count() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Parse a CPU list: `0,2,4-7`.
pub fn parse_cpu_list(s: &str) -> Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        let bad = || format!("bad CPU list {s:?} (expected e.g. 0,2,4-7)");
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) =
                    (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
                if a > b {
                    return Err(bad());
                }
                out.extend(a..=b);
            }
            None => out.push(part.parse().map_err(|_| bad())?),
        }
    }
    if out.is_empty() {
        return Err(format!("empty CPU list {s:?}"));
    }
    Ok(out)
}

/// Pin the calling thread to `cpu`.
pub fn pin_current_thread(cpu: usize) -> std::io::Result<()> {
    // SAFETY: cpu_set_t is plain data; zeroed is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
    }
    // SAFETY: CPU_SET writes one bit inside `set`; cpu is below CPU_SETSIZE (checked).
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: pid 0 is the calling thread; set is a valid cpu_set_t of the size passed.
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validate_names_the_flag_and_number() {
        let ok = DeviceConfig {
            num_queues: 4,
            ..Default::default()
        };
        assert_eq!(ok.validate(), Ok(()));
        assert_eq!(DeviceConfig::default().validate(), Ok(()));
        // A queue past 255 could never get its kick, call and error descriptors (their
        // messages carry an 8-bit index): refused, not offered.
        let bad = DeviceConfig {
            num_queues: 257,
            ..Default::default()
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("8-bit queue index"));
        let max = DeviceConfig {
            num_queues: 256,
            ..Default::default()
        };
        assert_eq!(max.validate(), Ok(()));
        for secs in [0, 3601] {
            let bad = DeviceConfig {
                drain_timeout: std::time::Duration::from_secs(secs),
                ..Default::default()
            };
            assert!(bad.validate().is_err(), "drain timeout {secs} s");
        }
        for threads in [0, 257] {
            let bad = DaemonConfig {
                threads,
                ..Default::default()
            };
            assert_eq!(
                bad.validate().unwrap_err().to_string(),
                format!("--threads {threads}: must be between 1 and 256")
            );
        }
        assert_eq!(DaemonConfig::default().validate(), Ok(()));
        let bad = DeviceConfig {
            queue_size: 100,
            ..Default::default()
        };
        assert!(bad.validate().unwrap_err().to_string().contains("100"));
        let bad = DeviceConfig {
            serial: Some("x".repeat(21)),
            ..Default::default()
        };
        assert!(bad.validate().is_err());
        let bad = DaemonConfig {
            cpus: vec![4096],
            ..Default::default()
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("CPU 4096 does not exist"));
        for n in [0, 65] {
            let bad = DeviceConfig {
                engine_threads: n,
                ..Default::default()
            };
            assert_eq!(
                bad.validate().unwrap_err().to_string(),
                format!("--engine-threads {n}: must be between 1 and 64")
            );
        }
    }

    #[test]
    fn disk_ids() {
        for ok in ["vm1", "a", "VM-1.disk_2", &"x".repeat(64)] {
            assert_eq!(check_id(ok), Ok(()), "{ok}");
        }
        for bad in ["", "-x", ".x", "a/b", "a b", "é", &"x".repeat(65)] {
            assert!(check_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0,2,4-6"), Ok(vec![0, 2, 4, 5, 6]));
        assert!(parse_cpu_list("3-1").is_err());
        assert!(parse_cpu_list("x").is_err());
        assert!(parse_cpu_list("").is_err());
    }
}
