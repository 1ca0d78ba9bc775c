//! The flags that describe one disk of `vblk serve`, and the two other ways to give
//! them: `--disk KEY=VALUE,...` (one disk per occurrence; the keys are these flags'
//! names) and the `[[disk]]` tables of a `--config` file. All three go through the same
//! parser, so a key takes exactly what its flag takes.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, CommandFactory, FromArgMatches, Parser, ValueEnum};
use device::config::{DEFAULT_NUM_QUEUES, DEFAULT_QUEUE_SIZE};
use device::{DeviceConfig, Listen, ServedDisk};
use storage::nbd::NbdOptions;
use storage::{CacheMode, DiskSpec, EngineKind, Format, ImageChecks, ImageLock};

/// One disk's flags.
#[derive(Debug, Clone, Args)]
pub struct DiskArgs {
    /// Unix socket to listen on for the frontend (created; a stale socket is replaced, a
    /// live one is refused).
    #[arg(long, value_name = "PATH", conflicts_with = "fd")]
    pub socket_path: Option<PathBuf>,

    /// Already listening Unix socket inherited from the caller (systemd socket activation:
    /// --fd 3) [default: with neither --socket-path nor --fd, the socket systemd passed,
    /// when LISTEN_PID is this process and LISTEN_FDS is 1].
    #[arg(long, value_name = "FD")]
    pub fd: Option<i32>,

    /// The disk's name, for `vblk stats --disk ID` and `vblk disk remove ID` (1-64 of
    /// A-Z a-z 0-9 . _ -) [default: the socket's file name without its extension, or
    /// `disk0`, `disk1`, ... in order].
    #[arg(long, value_name = "ID")]
    pub id: Option<String>,

    /// The disk: a raw image file or block device (PATH), a RAM disk (mem:SIZE, e.g.
    /// mem:1G), a null disk (null:SIZE: reads return zeroes, writes are dropped), a
    /// simulated 7200 rpm hard disk (hdd:SIZE: a RAM disk whose requests take the time a
    /// real disk's would, one at a time in arrival order: command overhead, seek by
    /// distance, rotational latency, media rate; hdd:SIZE:xN runs N times faster;
    /// hdd:SIZE:norot does not report that it is rotational, as most virtual disks), or an
    /// export on an NBD server (`nbd://HOST[:PORT]/EXPORT`, `nbd+unix:///EXPORT?socket=PATH`).
    /// SIZE takes K, M, G, T suffixes (powers of 1024) and must be a multiple of 512.
    #[arg(long, value_name = "SPEC")]
    pub blk_file: Option<DiskSpec>,

    /// Export the disk read-only: VIRTIO_BLK_F_RO is offered, and writes, discards and
    /// write-zeroes fail with IOERR (DISCARD and WRITE_ZEROES stay offered, as
    /// qemu-storage-daemon does; a guest kernel refuses them itself).
    #[arg(long)]
    pub read_only: bool,

    /// Image files and block devices: hold QEMU's image locks while vblk runs (OFD locks on
    /// byte 100+i for each permission held and 200+i for each one not shared; a writable
    /// export locks 100, 101 and 201, as a QEMU virtio-blk disk does). `on` refuses an
    /// image that another vblk, QEMU or qemu-storage-daemon writes, or whose reader there
    /// keeps writers out, and names the lock and its holder; read-only exports share with
    /// readers. A writable disk whose frontend has left makes the image durable and lets
    /// the write locks go until a frontend starts a ring again (then it takes them back,
    /// re-reads the image and its size, and refuses while another writer holds them): a
    /// paused VM's migration, or `qemu-img` on an idle disk, can have the image meanwhile.
    /// `off` takes and checks no locks, like QEMU's locking=off. There is no
    /// `auto`: QEMU's auto means on wherever OFD locks exist, which is every Linux vblk
    /// runs on.
    #[arg(long, value_name = "MODE", value_enum, default_value_t = LockArg::On)]
    pub image_lock: LockArg,

    /// The destination of a live migration: open the image without its write locks while
    /// the source daemon still writes it, and take them when the frontend starts the rings
    /// (QEMU starts them only after the source's switchover, where the source daemon makes
    /// its writes durable and lets go). Two active writers are still refused: the rings do
    /// not start while another writer holds the image. The source needs no flag.
    #[arg(long)]
    pub incoming: bool,

    /// Declare the image's format: `raw` or `qcow2` [default: probe: an image file or
    /// block device that holds qcow2,
    /// QED, VMDK, VHDX, VDI, VHD, LUKS, Parallels, DMG, Bochs or cloop is refused, since a
    /// guest writing to one served raw destroys it]. Pass `--format raw` for disks a guest
    /// owns: a guest could write an image header into its own disk, and the next start
    /// would then refuse it. vblk never probes a format into use.
    #[arg(long, value_name = "FORMAT", value_enum)]
    pub format: Option<FormatArg>,

    /// qcow2 images: the backing file below the image, opened read-only; repeat it for
    /// each image further down the chain, in order (`--backing base.qcow2 --backing
    /// base.raw`). `PATH,format=raw|qcow2` names its format where the image's header does
    /// not record it. vblk never opens a file an image names on its own: an image whose
    /// header names a backing file is refused until one is given here, and one given here
    /// must be the file the header names if that exists.
    #[arg(long, value_name = "PATH[,format=F]")]
    pub backing: Vec<storage::qcow2::BackingFile>,

    /// qcow2 images: the most memory for the image's L2 table entries (its cluster
    /// mappings), as QEMU's l2-cache-size: 8 MiB holds all of a 64 GiB image with 64 KiB
    /// clusters (1 MiB of entries per 8 GiB). A lookup that misses is a read of the image
    /// on its metadata thread, and every first write to a cluster looks up its mapping
    /// there: make it cover the part of the disk the guest writes to. Taken as used
    /// (4 KiB-4 GiB, e.g. 32M) [default: 8M].
    #[arg(long, value_name = "SIZE", default_value = "8M", value_parser = parse_qcow2_cache)]
    pub qcow2_cache: u64,

    /// RAM disks: allocate and map all of it at start (no first-touch page faults during
    /// I/O; not enough memory is an error at start, not later).
    #[arg(long)]
    pub prealloc: bool,

    /// Host cache: `none` opens with O_DIRECT (bounce buffers only for unaligned guest
    /// buffers); `writeback` uses the page cache. Either way FLUSH is an fdatasync.
    #[arg(long, value_name = "MODE", default_value = "writeback", value_parser = parse_cache)]
    pub cache: CacheMode,

    /// The GET_ID serial string (at most 20 bytes) [default: derived from the disk:
    /// the image's file name, "vblk-mem" or "vblk-null"].
    #[arg(long, value_name = "STRING")]
    pub serial: Option<String>,

    /// Number of virtqueues offered (1-256: vhost-user passes a queue's descriptors with an
    /// 8-bit index). QEMU's vhost-user-blk-pci asks for one per vCPU by default and refuses
    /// to start with fewer; the default covers VMs of up to 256 vCPUs. Queues the frontend
    /// never starts cost nothing but a few hundred bytes.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_NUM_QUEUES)]
    pub num_queues: u16,

    /// Largest virtqueue size accepted (a power of two up to 32768; QEMU allows up to 1024).
    /// Slots and buffers are sized to the size the frontend picks, when it starts a queue.
    /// seg_max (254 segments per request) does not depend on it.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_QUEUE_SIZE)]
    pub queue_size: u16,

    /// Storage engine for file and block-device disks, one per worker:
    ///   io_uring  batched submission on one ring per worker; completions on an eventfd.
    ///   aio       Linux AIO (io_submit, up to 32 requests per call), as QEMU's aio=native;
    ///             needs --cache none (on the page cache Linux AIO does each request inside
    ///             io_submit). Discard and write-zeroes run on a helper thread.
    ///   threads   a pool of --engine-threads threads per worker doing preadv/pwritev, as
    ///             QEMU's aio=threads.
    ///   sync      preadv/pwritev on the worker itself: one request at a time.
    /// RAM and null disks are served in memory whatever the engine.
    #[arg(long, value_name = "ENGINE", default_value = "io_uring", value_parser = parse_engine,
          verbatim_doc_comment)]
    pub engine: EngineKind,

    /// Threads in each worker's pool with --engine threads (1-64), started as the load
    /// needs them. They bound the requests a worker has at the disk at once; each may hold
    /// one 1 MiB O_DIRECT bounce buffer.
    #[arg(long, value_name = "N", default_value_t = storage::DEFAULT_ENGINE_THREADS)]
    pub engine_threads: usize,

    /// NBD disks: when the connection to the server breaks, hold the requests in flight
    /// and reconnect for up to this many seconds (1-3600), replaying them on the new
    /// connection; then fail them (and later ones, while the server stays away) with
    /// IOERR. Counted from the first break that catches requests: a server that accepts
    /// and breaks again does not restart it.
    #[arg(long, value_name = "SECS", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub nbd_reconnect_secs: u64,

    /// NBD disks: the deadline of every wait on the server (1-3600). A request not
    /// answered this many seconds after it was sent, a request the server will not read
    /// for as long, or no byte from the server for as long while replies are awaited,
    /// breaks the connection; its requests are replayed as --nbd-reconnect-secs says, then
    /// fail with IOERR. A single request that legitimately takes longer (a 32 MiB write to
    /// a very slow server, or over a slow link) is therefore retried and then fails: raise
    /// this for such servers. Also the limit of one connection attempt (name lookup,
    /// connect, handshake), and of waiting for requests in flight when a worker stops.
    #[arg(long, value_name = "SECS", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub nbd_timeout_secs: u64,

    /// NBD disks: connections per worker when the server offers multi-conn (1-64; a server
    /// without it gets one, and then only one writable worker).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub nbd_conns: u32,

    /// Most requests handed to the engine per submit call; 0 submits once per pass
    /// [default: 4 with --cache none (O_DIRECT reads are dispatched to the disk inside the
    /// submit call, so big batches delay their tail), 0 with the page cache].
    #[arg(long, value_name = "N")]
    pub submit_batch: Option<u32>,

    /// On SIGHUP (re-read the disk's size), accept a file or block device that became
    /// smaller [default: refused with a log line, the old size stays in force]. I/O past
    /// the new end then fails with IOERR.
    #[arg(long)]
    pub allow_shrink: bool,

    /// Do not offer inflight I/O tracking (INFLIGHT_SHMFD). With it (the default) QEMU
    /// keeps a region in which the daemon records the requests it has taken and not
    /// answered, so that after a crash the restarted daemon resubmits exactly those. Without
    /// it QEMU resumes at the used index, which is exact only if requests complete in
    /// order; for comparison and for frontends that mishandle the region.
    #[arg(long)]
    pub no_inflight: bool,
    /// Tell vblk drivers the disk is rotational (seeks cost, the host does not reorder), so
    /// that their `auto` path merges and sorts. Only vblk's driver reads this hint (outside
    /// the virtio configuration space); guests never see it. (hdd: disks say so already.)
    #[arg(long)]
    pub rotational: bool,

    /// How long stopping a ring waits for its requests (the frontend stops rings to reset,
    /// reboot, pause or shut down the VM; QEMU waits for the answer). Requests still at the
    /// disk then are fenced: no request taken after the stop reaches the disk or the
    /// guest's memory before they end, and `vblk stats` counts the wait.
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    pub drain_timeout_secs: u64,

    /// Testing aid: hold every Nth request MS milliseconds (N:MS, e.g. 4:50): its
    /// completion by default, so that completions come out of order and some requests stay
    /// in flight for long; with N:MS:hold the request itself, before it reaches the disk;
    /// with N:MS:hold-writes every Nth write (reads go through at once). For testing guests,
    /// frontends and crash recovery; never for production.
    #[arg(long, value_name = "N:MS[:hold|:hold-writes]")]
    pub delay_every: Option<storage::Delay>,

    /// QoS limits, with QEMU's names and semantics (libvirt's `<iotune>`): iops-total,
    /// iops-read, iops-write (requests per second; K, M, G suffixes are 1000s),
    /// bps-total, bps-read, bps-write (bytes per second; K, M, G, T suffixes are powers
    /// of 1024, as in sizes; either case), each with -max (a burst rate)
    /// and -max-length (seconds the burst may last at that rate), and iops-size (a
    /// request larger than this counts as size/iops-size requests). Without -max a
    /// tenth of a second of the rate may go at once. Writes, discards and write-zeroes
    /// count as writes; flushes are not limited. E.g. iops-total=2000,bps-total=100M.
    /// In --disk: throttle.iops-total=2000,throttle.bps-total=100M. Changed while
    /// running with `vblk disk set` [default: none].
    #[arg(long, value_name = "KEY=VALUE,...", value_parser = parse_limits)]
    pub throttle: Option<device::throttle::Limits>,

    /// The throttle group this disk belongs to: the group's limits (--group) cover all
    /// its disks together, and disks that all want more than their share get equal
    /// shares. In --disk: throttle.group=NAME (or group=NAME); `none` there keeps one
    /// disk out of the group given outside --disk.
    #[arg(long, value_name = "NAME")]
    pub throttle_group: Option<String>,
}

/// `--image-lock`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LockArg {
    /// Take QEMU-compatible image locks and honour other users' locks.
    On,
    /// No image locks.
    Off,
}

/// `--format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FormatArg {
    /// The bytes are the disk; no probe.
    Raw,
    /// A qcow2 image, with its backing chain from `--backing`.
    Qcow2,
}

pub(crate) fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{s:?}: expected on or off")),
    }
}

fn parse_limits(s: &str) -> Result<device::throttle::Limits, String> {
    device::throttle::Limits::parse(s)
}

fn parse_cache(s: &str) -> Result<CacheMode, String> {
    s.parse().map_err(|e: storage::Error| e.to_string())
}

fn parse_engine(s: &str) -> Result<EngineKind, String> {
    s.parse().map_err(|e: storage::Error| e.to_string())
}

/// `--qcow2-cache`: a size from 4 KiB to 4 GiB.
fn parse_qcow2_cache(s: &str) -> Result<u64, String> {
    let n = storage::parse_size(s).map_err(|e| e.to_string())?;
    if !(4096..=4 << 30).contains(&n) {
        return Err(format!(
            "{n} bytes: the qcow2 metadata cache takes 4K to 4G (it holds 4 KiB slices of L2 entries)"
        ));
    }
    Ok(n)
}

/// The flags outside `DiskArgs` that `--disk` keys and `[[disk]]` tables may not name:
/// they apply to the whole daemon.
pub const DAEMON_KEYS: &[&str] = &[
    "threads",
    "poll-us",
    "coalesce-us",
    "cpus",
    "control-socket",
    "control-socket-group",
    "socket-group",
    "seccomp",
    "landlock",
    "nbd-ports",
    "group",
    "config",
    "disk",
];

/// `DiskArgs` alone, to parse a `--disk` value or a `[[disk]]` table with the flags' own
/// parser. A later value of a flag overrides an earlier one (flags given outside `--disk`
/// come first, as defaults).
#[derive(Debug, Parser)]
#[command(name = "--disk", no_binary_name = true, args_override_self = true)]
struct DiskCli {
    #[command(flatten)]
    disk: DiskArgs,
}

/// The key a `--disk` item names: `socket` and `file` stand for `socket-path` and
/// `blk-file`, as in QEMU's and Cloud Hypervisor's `--disk`.
fn long_name(key: &str) -> &str {
    match key {
        "socket" => "socket-path",
        "file" => "blk-file",
        k => k,
    }
}

/// A disk's items: `(KEY, VALUE)`, VALUE absent for a bare switch.
pub type Items = Vec<(String, Option<String>)>;

/// Split a `--disk` value into its items: `KEY=VALUE` or `KEY`, separated by commas; a
/// comma inside a value is written twice (`,,`), as in QEMU's option syntax.
pub fn split_items(spec: &str) -> Items {
    let mut items = Vec::new();
    let mut cur = String::new();
    let mut chars = spec.chars().peekable();
    while let Some(c) = chars.next() {
        if c == ',' {
            if chars.peek() == Some(&',') {
                chars.next();
                cur.push(',');
                continue;
            }
            items.push(std::mem::take(&mut cur));
        } else {
            cur.push(c);
        }
    }
    items.push(cur);
    items
        .into_iter()
        .filter(|i| !i.is_empty())
        .map(|i| match i.split_once('=') {
            Some((k, v)) => (k.trim().to_string(), Some(v.to_string())),
            None => (i.trim().to_string(), None),
        })
        .collect()
}

/// Refuse a key given twice (`group` and `throttle.group` are one key, as are
/// `throttle.KEY` and a bare limit name where both are taken), as the command line
/// refuses a flag given twice: the last one would silently win. Keys that `repeatable`
/// says are lists (`backing`) may come again.
pub fn check_unique(
    items: &[(String, Option<String>)],
    repeatable: &dyn Fn(&str) -> bool,
) -> Result<(), String> {
    let canonical = |k: &str| match k {
        "group" => "throttle.group".to_string(),
        k if crate::disk::is_limit_name(k) => format!("throttle.{k}"),
        k => long_name(k).to_string(),
    };
    for (i, (k, _)) in items.iter().enumerate() {
        if k.is_empty() {
            return Err("a setting without a key: each is KEY=VALUE".into());
        }
        if repeatable(k) {
            continue;
        }
        if let Some((first, _)) = items[..i]
            .iter()
            .find(|(e, _)| canonical(e) == canonical(k))
        {
            return Err(if first == k {
                format!("{k} is given twice")
            } else {
                format!("{first} and {k} are the same setting: give it once")
            });
        }
    }
    Ok(())
}

/// Items as a `--disk` value (commas in values doubled): how a disk from a `[[disk]]`
/// table is described to the daemon and compared by `vblk disk sync`.
pub fn spec_of(items: &[(String, Option<String>)]) -> String {
    items
        .iter()
        .map(|(k, v)| match v {
            Some(v) => format!("{k}={}", v.replace(',', ",,")),
            None => k.clone(),
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Parse one disk from `items` (`--disk` or a `[[disk]]` table), after `inherited` (the
/// per-disk flags given on the command line outside `--disk`, as typed). `what` names
/// the source in errors (`--disk socket=...`, `disks.toml [[disk]] 2`).
pub fn disk_from_items(
    items: &[(String, Option<String>)],
    inherited: &[std::ffi::OsString],
    what: &str,
) -> Result<DiskArgs, String> {
    let cmd = DiskCli::command();
    let repeatable = |key: &str| {
        cmd.get_arguments().any(|a| {
            a.get_long() == Some(long_name(key))
                && matches!(a.get_action(), clap::ArgAction::Append)
        })
    };
    check_unique(items, &repeatable).map_err(|e| format!("{what}: {e}"))?;
    let mut argv: Vec<std::ffi::OsString> = inherited.to_vec();
    // throttle.KEY=VALUE items make one --throttle; throttle.group (or group) names the
    // group.
    let mut limits = Vec::new();
    for (key, value) in items {
        if key == "group" || key == "throttle.group" {
            let v = value
                .as_deref()
                .ok_or_else(|| format!("{what}: {key} needs a value ({key}=NAME)"))?;
            argv.push(format!("--throttle-group={v}").into());
            continue;
        }
        if let Some(k) = key.strip_prefix("throttle.") {
            let v = value
                .as_deref()
                .ok_or_else(|| format!("{what}: {key} needs a value ({key}=N)"))?;
            limits.push(format!("{k}={v}"));
            continue;
        }
        let long = long_name(key);
        let Some(arg) = cmd.get_arguments().find(|a| a.get_long() == Some(long)) else {
            if DAEMON_KEYS.contains(&long) {
                return Err(format!(
                    "{what}: {key} applies to the whole daemon: give it once, as --{key}, not for a disk"
                ));
            }
            let keys: Vec<&str> = cmd.get_arguments().filter_map(|a| a.get_long()).collect();
            return Err(format!(
                "{what}: unknown key {key:?} (a disk takes socket, file and the disk flags of `vblk serve --help`: {})",
                keys.join(", ")
            ));
        };
        if !arg.get_action().takes_values() {
            match value.as_deref().map(str::to_ascii_lowercase).as_deref() {
                None | Some("on" | "true" | "yes" | "1") => argv.push(format!("--{long}").into()),
                Some("off" | "false" | "no" | "0") => {}
                Some(_) => {
                    return Err(format!(
                        "{what}: {key}={}: expected on or off (or true/false, yes/no, 1/0)",
                        value.as_deref().unwrap_or("")
                    ))
                }
            }
            continue;
        }
        let Some(value) = value else {
            return Err(format!("{what}: {key} needs a value ({key}=...)"));
        };
        argv.push(format!("--{long}={value}").into());
    }
    if !limits.is_empty() {
        argv.push(format!("--throttle={}", limits.join(",")).into());
    }
    let matches = DiskCli::command()
        .try_get_matches_from(argv)
        .map_err(|e| format!("{what}: {}", first_line(&e.to_string())))?;
    DiskCli::from_arg_matches(&matches)
        .map(|c| c.disk)
        .map_err(|e| format!("{what}: {}", first_line(&e.to_string())))
}

fn first_line(s: &str) -> &str {
    s.trim_start_matches("error: ").lines().next().unwrap_or(s)
}

/// The per-disk flags the command line gave explicitly (outside `--disk`), as typed: the
/// defaults of every `--disk`. `matches` are `vblk serve`'s.
pub fn explicit_disk_flags(matches: &clap::ArgMatches) -> Vec<std::ffi::OsString> {
    let mut out = Vec::new();
    for arg in DiskCli::command().get_arguments() {
        let id = arg.get_id().as_str();
        if matches.value_source(id) != Some(clap::parser::ValueSource::CommandLine) {
            continue;
        }
        let Some(long) = arg.get_long() else { continue };
        if !arg.get_action().takes_values() {
            out.push(format!("--{long}").into());
            continue;
        }
        for v in matches.get_raw(id).into_iter().flatten() {
            let mut s = std::ffi::OsString::from(format!("--{long}="));
            s.push(v);
            out.push(s);
        }
    }
    out
}

/// The per-disk flags that name the single disk of a one-disk command line: with
/// `--disk` or `--config` they are refused.
pub const SINGLE_DISK_FLAGS: &[&str] = &["blk_file", "socket_path", "fd", "id"];

impl DiskArgs {
    /// The disk these flags describe. `listen` is where it listens when neither
    /// `--socket-path` nor `--fd` is given (None: an error), `default_id` its name when
    /// `--id` is not given and its socket has no file name.
    pub fn into_served(
        self,
        listen: Option<Listen>,
        default_id: String,
    ) -> Result<ServedDisk, String> {
        let a = self;
        let listen = match (a.socket_path, a.fd) {
            (Some(p), None) => Listen::Path(p),
            (None, Some(fd)) if fd >= 0 => Listen::Fd(fd),
            (None, Some(fd)) => return Err(format!("--fd {fd}: not a file descriptor")),
            (None, None) => listen.ok_or(
                "a disk needs its socket: one of --socket-path PATH or --fd FD is required (socket=PATH in --disk; for a one-disk daemon, or a socket passed by systemd: LISTEN_PID, LISTEN_FDS)",
            )?,
            (Some(_), Some(_)) => {
                return Err("--socket-path and --fd cannot be used together".into())
            }
        };
        let disk = a.blk_file.ok_or(
            "--blk-file SPEC is required (file=SPEC in --disk: a PATH, mem:SIZE, null:SIZE or nbd:// URI)",
        )?;
        let id = a.id.unwrap_or_else(|| match &listen {
            Listen::Path(p) => p
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .filter(|s| device::config::check_id(s).is_ok())
                .unwrap_or(default_id),
            Listen::Fd(_) => default_id,
        });
        let config = DeviceConfig {
            disk,
            read_only: a.read_only,
            cache: a.cache,
            prealloc: a.prealloc,
            serial: a.serial,
            num_queues: a.num_queues,
            queue_size: a.queue_size,
            engine: a.engine,
            engine_threads: a.engine_threads,
            submit_batch: a.submit_batch,
            allow_shrink: a.allow_shrink,
            inflight: !a.no_inflight,
            rotational: a.rotational.then_some(true),
            delay: a.delay_every,
            drain_timeout: Duration::from_secs(a.drain_timeout_secs),
            socket_access: Default::default(),
            nbd: NbdOptions {
                reconnect: Duration::from_secs(a.nbd_reconnect_secs),
                timeout: Duration::from_secs(a.nbd_timeout_secs.max(1)),
                conns: a.nbd_conns.clamp(1, 64),
            },
            image: ImageChecks {
                lock: match a.image_lock {
                    LockArg::On => ImageLock::On,
                    LockArg::Off => ImageLock::Off,
                },
                format: a.format.map(|f| match f {
                    FormatArg::Raw => Format::Raw,
                    FormatArg::Qcow2 => Format::Qcow2,
                }),
                incoming: a.incoming,
            },
            throttle: a.throttle.unwrap_or_default(),
            // `none` (as `vblk disk set` takes it): in no group.
            throttle_group: a.throttle_group.filter(|g| g != "none"),
            backing: a.backing,
            qcow2_cache: a.qcow2_cache as usize,
        };
        let served = ServedDisk {
            id,
            listen,
            config,
            spec: String::new(),
        };
        served.validate().map_err(|e| e.to_string())?;
        Ok(served)
    }
}

/// A `--config` file: the daemon's flags and its disks, in TOML with the flags' names as
/// keys (see `vblk serve --help`, contrib/systemd/disks.toml).
#[derive(Debug, Default)]
pub struct ConfigFile {
    /// Top-level keys: daemon flags, as `--KEY=VALUE` (or `--KEY` for a switch).
    pub daemon: Vec<(String, Option<String>)>,
    /// Each `[[disk]]` table's items.
    pub disks: Vec<Vec<(String, Option<String>)>>,
}

/// Read a `--config` file.
pub fn load_config(path: &std::path::Path) -> Result<ConfigFile, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the configuration {}: {e}", path.display()))?;
    parse_config(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Parse a `--config` file's text.
pub fn parse_config(text: &str) -> Result<ConfigFile, String> {
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| e.to_string())?;
    let mut out = ConfigFile::default();
    for (key, value) in &table {
        if key == "disk" {
            let toml::Value::Array(disks) = value else {
                return Err("`disk` must be tables: [[disk]]".into());
            };
            for (i, d) in disks.iter().enumerate() {
                let toml::Value::Table(t) = d else {
                    return Err(format!("[[disk]] {}: not a table", i + 1));
                };
                let mut items = Vec::new();
                flatten("", t, &mut items).map_err(|e| format!("[[disk]] {}: {e}", i + 1))?;
                out.disks.push(items);
            }
            continue;
        }
        if key == "group" {
            let toml::Value::Table(groups) = value else {
                return Err("`group` must be tables: [group.NAME] with its limits".into());
            };
            for (name, limits) in groups {
                let toml::Value::Table(t) = limits else {
                    return Err(format!("[group.{name}]: not a table of limits"));
                };
                let mut items = Vec::new();
                flatten("", t, &mut items).map_err(|e| format!("[group.{name}]: {e}"))?;
                let list: Vec<String> = items
                    .iter()
                    .map(|(k, v)| format!("{k}={}", v.as_deref().unwrap_or("")))
                    .collect();
                out.daemon
                    .push(("group".into(), Some(format!("{name}:{}", list.join(",")))));
            }
            continue;
        }
        if !DAEMON_KEYS.contains(&key.as_str()) || key == "config" {
            return Err(format!(
                "unknown key {key:?} at the top level (the daemon's keys are {}; a disk's go in a [[disk]] table)",
                DAEMON_KEYS[..DAEMON_KEYS.len() - 2].join(", ")
            ));
        }
        out.daemon.push((key.clone(), scalar(key, value)?));
    }
    Ok(out)
}

/// A table's entries as items, nested tables as dotted keys (`throttle.iops-total`).
fn flatten(
    prefix: &str,
    t: &toml::Table,
    out: &mut Vec<(String, Option<String>)>,
) -> Result<(), String> {
    for (k, v) in t {
        let key = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match v {
            toml::Value::Table(inner) => flatten(&key, inner, out)?,
            _ => out.push((key.clone(), scalar(&key, v)?)),
        }
    }
    Ok(())
}

/// A value as a flag's value: strings as they are, numbers and booleans in their usual
/// form, arrays as comma lists (`cpus = [0, 1]`). `false` is a switch left off.
fn scalar(key: &str, v: &toml::Value) -> Result<Option<String>, String> {
    Ok(Some(match v {
        toml::Value::String(s) => s.clone(),
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Float(f) => f.to_string(),
        toml::Value::Boolean(b) => (if *b { "on" } else { "off" }).to_string(),
        toml::Value::Array(a) => a
            .iter()
            .map(|x| match x {
                toml::Value::String(s) => Ok(s.clone()),
                toml::Value::Integer(i) => Ok(i.to_string()),
                _ => Err(format!("{key}: a list of strings or numbers")),
            })
            .collect::<Result<Vec<_>, _>>()?
            .join(","),
        _ => return Err(format!("{key}: a string, a number, a boolean or a list")),
    }))
}
