//! `vblk serve`: the vhost-user-blk device daemon.

use std::error::Error;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use device::config::{DEFAULT_NUM_QUEUES, DEFAULT_POLL_US, DEFAULT_QUEUE_SIZE};
use device::{Controls, DeviceConfig, Listen};
use storage::nbd::NbdOptions;
use storage::{CacheMode, DiskSpec, EngineKind, Format, ImageChecks, ImageLock};

/// Serve a disk as a vhost-user-blk device.
///
/// Follows the vhost-user "backend program conventions" (QEMU docs/interop/vhost-user.rst):
/// `--socket-path` or `--fd`, `--print-capabilities`, `--blk-file`, `--read-only`.
///
/// Example, with QEMU:
///
///   vblk serve --socket-path /tmp/vblk.sock --blk-file disk.img --num-queues 2
///
///   qemu-system-x86_64 -m 1G -object memory-backend-memfd,id=mem,size=1G,share=on
///     -numa node,memdev=mem -chardev socket,id=vblk0,path=/tmp/vblk.sock
///     -device vhost-user-blk-pci,chardev=vblk0,num-queues=2 ...
///
/// Signals: SIGTERM or SIGINT stops the daemon cleanly: no new requests are taken, those
/// in flight finish, the disk is flushed, the socket it created is removed, and it exits 0
/// (a second signal exits at once). SIGHUP re-reads the size of the file or block device
/// and, if it grew, tells the frontend (QEMU passes it to the guest, whose /dev/vda grows).
#[derive(Debug, Args)]
#[command(verbatim_doc_comment)]
pub struct ServeArgs {
    /// Unix socket to listen on for the frontend (created; a stale socket is replaced, a
    /// live one is refused).
    #[arg(long, value_name = "PATH", conflicts_with = "fd")]
    pub socket_path: Option<PathBuf>,

    /// Already listening Unix socket inherited from the caller (systemd socket activation:
    /// --fd 3) [default: with neither --socket-path nor --fd, the socket systemd passed,
    /// when LISTEN_PID is this process and LISTEN_FDS is 1].
    #[arg(long, value_name = "FD")]
    pub fd: Option<i32>,

    /// Print the vhost-user backend capabilities as JSON and exit.
    #[arg(long)]
    pub print_capabilities: bool,

    /// Print the system calls the seccomp allow-list lets through once the daemon is set
    /// up, one per line (those checked by argument marked `(args)`), and exit: for a
    /// service manager's filter (systemd's SystemCallFilter=).
    #[arg(long)]
    pub print_syscalls: bool,

    /// What a system call outside the daemon's allow-list does once it is set up: `kill`
    /// ends the process (SECCOMP_RET_KILL_PROCESS), `trap` reports the call and the thread
    /// on stderr and exits, `log` lets it through and the kernel logs it (to build a list
    /// for a new platform), `off` installs no filter. See docs/security.md.
    #[arg(long, value_name = "MODE", default_value = "kill")]
    pub seccomp: device::sandbox::SeccompMode,

    /// Confine the filesystem with Landlock once the daemon is set up: it can then open no
    /// file (the disk, the sockets and the NBD connections are open already) and connect
    /// over TCP only to the NBD server's port. `off` for kernels whose Landlock gets in the
    /// way; without Landlock in the kernel the daemon says so and goes on.
    #[arg(long, value_name = "on|off", default_value = "on", value_parser = parse_on_off)]
    pub landlock: bool,

    /// The disk: a raw image file or block device (PATH), a RAM disk (mem:SIZE, e.g.
    /// mem:1G), a null disk (null:SIZE: reads return zeroes, writes are dropped), a
    /// simulated 7200 rpm hard disk (hdd:SIZE: a RAM disk whose requests take the time a
    /// real disk's would, one at a time in arrival order: command overhead, seek by
    /// distance, rotational latency, media rate; hdd:SIZE:xN runs N times faster), or an
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
    /// readers. `off` takes and checks no locks, like QEMU's locking=off. There is no
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

    /// Declare the image's format; `raw` is the only one vblk serves [default: probe: an
    /// image file or block device that holds qcow2, QED, VMDK, VHDX, VDI, VHD, LUKS,
    /// Parallels, DMG, Bochs or cloop is refused, since a guest writing to one served raw
    /// destroys it]. Pass `--format raw` for disks a guest owns: a guest could write an
    /// image header into its own disk, and the next start would then refuse it.
    #[arg(long, value_name = "FORMAT", value_enum)]
    pub format: Option<FormatArg>,

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

    /// Worker threads; queue i is served by worker i % T, each queue by exactly one.
    #[arg(long, value_name = "T", default_value_t = 1)]
    pub threads: usize,

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

    /// After its queues run dry a worker keeps polling for up to this many microseconds
    /// before it re-enables notifications and sleeps; 0 never spins. The window is also
    /// bounded by the CPU a sleep costs the worker (measured), shrinks when polling finds
    /// nothing, and drops to a thirty-second of its bound while polling costs more CPU per
    /// request than sleeping (a paced or slow load): `vblk stats` shows both figures.
    #[arg(long, value_name = "US", default_value_t = DEFAULT_POLL_US)]
    pub poll_us: u64,

    /// Run worker t on CPU LIST[t % len] (e.g. 2,3 or 4-7) [default: not pinned].
    #[arg(long, value_name = "LIST")]
    pub cpus: Option<CpuList>,

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

    /// Serve live statistics on this Unix socket: per queue, requests and bytes by type,
    /// errors, requests in flight, latency histograms; per worker, polling hits and
    /// misses; ring stops, the reset fence and sessions ended by a misbehaving frontend.
    /// Read them with `vblk stats PATH` (or `--json`; `--interval 1` for rates).
    #[arg(long, value_name = "PATH")]
    pub control_socket: Option<PathBuf>,

    /// The group that may connect to the sockets vblk creates (--socket-path,
    /// --control-socket): they are made mode 0660 with this group (a name or a number)
    /// [default: mode 0600, the daemon's user only; the umask is not used]. A frontend
    /// running as another user, such as libvirt's qemu user, connects through the group.
    #[arg(long, value_name = "GROUP")]
    pub socket_group: Option<String>,

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
}

/// A CPU list such as `0,2,4-7`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuList(pub Vec<usize>);

impl std::str::FromStr for CpuList {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        device::config::parse_cpu_list(s).map(CpuList)
    }
}

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{s:?}: expected on or off")),
    }
}

fn parse_cache(s: &str) -> Result<CacheMode, String> {
    s.parse().map_err(|e: storage::Error| e.to_string())
}

fn parse_engine(s: &str) -> Result<EngineKind, String> {
    s.parse().map_err(|e: storage::Error| e.to_string())
}

/// The listening socket a service manager passed, by the sd_listen_fds(3) protocol:
/// `LISTEN_PID` (`pid`) names the process the sockets are for and `LISTEN_FDS` (`fds`)
/// how many there are, starting at fd 3. None when nothing was passed to this process
/// (`me`); an error when more than one socket was.
pub fn passed_socket(pid: Option<&str>, fds: Option<&str>, me: u32) -> Result<Option<i32>, String> {
    const SD_LISTEN_FDS_START: i32 = 3;
    let (Some(pid), Some(fds)) = (pid, fds) else {
        return Ok(None);
    };
    if pid.trim().parse::<u32>().ok() != Some(me) {
        return Ok(None);
    }
    match fds.trim().parse::<u32>() {
        Ok(0) => Ok(None),
        Ok(1) => Ok(Some(SD_LISTEN_FDS_START)),
        Ok(n) => Err(format!(
            "LISTEN_FDS={n}: vblk serve listens on one socket; give the one to use with --fd"
        )),
        Err(_) => Err(format!("LISTEN_FDS={fds:?} is not a number")),
    }
}

/// [`passed_socket`] for this process.
fn socket_from_environment() -> Result<Option<i32>, String> {
    let var = |name| std::env::var(name).ok();
    passed_socket(
        var("LISTEN_PID").as_deref(),
        var("LISTEN_FDS").as_deref(),
        std::process::id(),
    )
}

/// The backend capabilities for `--print-capabilities` (vhost-user.rst, "block" type).
pub fn capabilities() -> serde_json::Value {
    serde_json::json!({
        "type": "block",
        "features": ["read-only", "blk-file"]
    })
}

impl TryFrom<ServeArgs> for (DeviceConfig, Listen) {
    type Error = String;

    fn try_from(a: ServeArgs) -> Result<Self, String> {
        let listen = match (a.socket_path, a.fd) {
            (Some(p), None) => Listen::Path(p),
            (None, Some(fd)) if fd >= 0 => Listen::Fd(fd),
            (None, Some(fd)) => return Err(format!("--fd {fd}: not a file descriptor")),
            (None, None) => match socket_from_environment()? {
                Some(fd) => Listen::Fd(fd),
                None => {
                    return Err("one of --socket-path PATH or --fd FD is required (or a \
                                socket passed by systemd: LISTEN_PID, LISTEN_FDS)"
                        .into())
                }
            },
            (Some(_), Some(_)) => {
                return Err("--socket-path and --fd cannot be used together".into())
            }
        };
        let disk = a
            .blk_file
            .ok_or("--blk-file SPEC is required (a PATH, mem:SIZE, null:SIZE or nbd:// URI)")?;
        let config = DeviceConfig {
            disk,
            read_only: a.read_only,
            cache: a.cache,
            prealloc: a.prealloc,
            serial: a.serial,
            num_queues: a.num_queues,
            threads: a.threads,
            queue_size: a.queue_size,
            engine: a.engine,
            engine_threads: a.engine_threads,
            poll_us: a.poll_us,
            cpus: a.cpus.map(|c| c.0).unwrap_or_default(),
            submit_batch: a.submit_batch,
            allow_shrink: a.allow_shrink,
            inflight: !a.no_inflight,
            rotational: a.rotational.then_some(true),
            delay: a.delay_every,
            drain_timeout: Duration::from_secs(a.drain_timeout_secs),
            control_socket: a.control_socket,
            socket_access: device::socket_file::SocketAccess {
                group: a.socket_group,
            },
            sandbox: device::sandbox::SandboxConfig {
                seccomp: a.seccomp,
                landlock: a.landlock,
                drop_caps: true,
            },
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
                format: a.format.map(|FormatArg::Raw| Format::Raw),
                incoming: a.incoming,
            },
        };
        config.validate().map_err(|e| e.to_string())?;
        Ok((config, listen))
    }
}

/// `vblk serve`.
pub fn run(args: ServeArgs) -> Result<(), Box<dyn Error>> {
    if args.print_capabilities {
        println!("{}", capabilities());
        return Ok(());
    }
    if args.print_syscalls {
        use device::sandbox::seccomp::{ALLOWED, CONDITIONAL};
        for (name, _) in ALLOWED {
            println!("{name}");
        }
        for (name, _) in CONDITIONAL {
            println!("{name} (args)");
        }
        return Ok(());
    }
    let (config, listen) = <(DeviceConfig, Listen)>::try_from(args)?;
    let controls = Arc::new(Controls::new()?);
    let set = block_signals()?;
    // The signal thread starts once the daemon is confined, so that it is too.
    let c = controls.clone();
    let mut started = false;
    device::serve(&config, &listen, &controls, &mut || {
        if !started {
            started = true;
            if let Err(e) = wait_for_signals(set, c.clone()) {
                log::error!("cannot start the signal thread: {e}");
            }
        }
    })?;
    log::info!("stopped");
    Ok(())
}

/// SIGTERM and SIGINT stop the daemon cleanly (a second one exits at once, status 130);
/// SIGHUP makes it re-read the disk's size. The signals are blocked in every thread and
/// taken by one thread with `sigwait`, so no signal handler runs inside the daemon.
/// Block SIGTERM, SIGINT and SIGHUP in this (the main) thread before any other thread
/// starts, so that all inherit the mask and one thread takes them with `sigwait`.
fn block_signals() -> std::io::Result<libc::sigset_t> {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a live sigset_t; the signal numbers are valid. pthread_sigmask on
    // the calling (main) thread before any other thread starts, so all inherit the mask.
    unsafe {
        libc::sigemptyset(&mut set);
        for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            libc::sigaddset(&mut set, sig);
        }
        let r = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        if r != 0 {
            return Err(std::io::Error::from_raw_os_error(r));
        }
    }
    Ok(set)
}

/// Start the thread that takes the blocked signals.
fn wait_for_signals(set: libc::sigset_t, controls: Arc<Controls>) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("vblk-signals".into())
        .spawn(move || {
            let mut stopping = false;
            loop {
                let mut sig: libc::c_int = 0;
                // SAFETY: `set` holds blocked signals; `sig` is a live out-parameter.
                if unsafe { libc::sigwait(&set, &mut sig) } != 0 {
                    continue;
                }
                match sig {
                    libc::SIGHUP => {
                        log::info!("SIGHUP: re-reading the disk's size");
                        controls.resize();
                    }
                    _ if stopping => {
                        log::warn!("second stop signal: exiting now");
                        std::process::exit(130);
                    }
                    _ => {
                        log::info!(
                            "signal {sig}: stopping (requests in flight finish, the disk is flushed)"
                        );
                        stopping = true;
                        controls.stop();
                    }
                }
            }
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;
    use crate::cli::{Cli, Command};

    fn serve(args: &[&str]) -> Result<(DeviceConfig, Listen), String> {
        let cli =
            Cli::try_parse_from(["vblk", "serve"].iter().chain(args)).map_err(|e| e.to_string())?;
        match cli.command {
            Command::Serve(a) => <(DeviceConfig, Listen)>::try_from(*a),
            _ => Err("not serve".into()),
        }
    }

    #[test]
    fn a_socket_passed_by_systemd_is_fd_3() {
        assert_eq!(passed_socket(Some("42"), Some("1"), 42), Ok(Some(3)));
        assert_eq!(
            passed_socket(Some("41"), Some("1"), 42),
            Ok(None),
            "not ours"
        );
        assert_eq!(passed_socket(None, Some("1"), 42), Ok(None));
        assert_eq!(passed_socket(Some("42"), None, 42), Ok(None));
        assert_eq!(passed_socket(Some("42"), Some("0"), 42), Ok(None));
        let e = passed_socket(Some("42"), Some("2"), 42).unwrap_err();
        assert!(e.contains("LISTEN_FDS=2") && e.contains("--fd"), "{e}");
        assert!(passed_socket(Some("42"), Some("x"), 42).is_err());
    }

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn serve_flags_reach_the_config() {
        let (c, l) = serve(&[
            "--socket-path",
            "/run/x.sock",
            "--blk-file",
            "mem:1G",
            "--num-queues",
            "4",
            "--threads",
            "2",
            "--cpus",
            "0,1",
            "--engine",
            "sync",
            "--cache",
            "none",
            "--poll-us",
            "0",
            "--read-only",
            "--serial",
            "abc",
            "--queue-size",
            "128",
            "--prealloc",
            "--submit-batch",
            "2",
            "--image-lock",
            "off",
            "--format",
            "raw",
        ])
        .unwrap();
        assert_eq!(l, Listen::Path("/run/x.sock".into()));
        assert_eq!(c.disk, DiskSpec::Mem(1 << 30));
        assert_eq!((c.num_queues, c.threads, c.queue_size), (4, 2, 128));
        assert_eq!(c.cpus, vec![0, 1]);
        assert_eq!(c.engine, EngineKind::Sync);
        assert_eq!(c.cache, CacheMode::None);
        assert_eq!(c.poll_us, 0);
        assert!(c.read_only && c.prealloc);
        assert_eq!(c.serial.as_deref(), Some("abc"));
        assert_eq!(c.effective_submit_batch(), 2);
        assert_eq!(
            c.image,
            ImageChecks {
                lock: ImageLock::Off,
                format: Some(Format::Raw),
                incoming: false,
            }
        );
        for (name, kind) in [("aio", EngineKind::Aio), ("threads", EngineKind::Threads)] {
            let (c, _) = serve(&[
                "--socket-path",
                "/x",
                "--blk-file",
                "null:1G",
                "--engine",
                name,
                "--engine-threads",
                "8",
            ])
            .unwrap();
            assert_eq!((c.engine, c.engine_threads), (kind, 8));
        }
        let (auto, _) = serve(&[
            "--socket-path",
            "/x",
            "--blk-file",
            "null:1G",
            "--cache",
            "none",
        ])
        .unwrap();
        assert_eq!(auto.engine_threads, storage::DEFAULT_ENGINE_THREADS);
        assert_eq!(
            auto.effective_submit_batch(),
            4,
            "O_DIRECT: batches of 4 by default"
        );
        let (auto, _) = serve(&["--socket-path", "/x", "--blk-file", "null:1G"]).unwrap();
        assert_eq!(
            auto.effective_submit_batch(),
            0,
            "page cache: one submit per pass"
        );
        assert_eq!(
            auto.image,
            ImageChecks {
                lock: ImageLock::On,
                format: None,
                incoming: false,
            },
            "locks on and the format probed by default"
        );
    }

    #[test]
    fn bad_serve_flags_are_clear_errors() {
        let e = serve(&["--blk-file", "null:1G"]).unwrap_err();
        assert!(
            e.contains("--socket-path PATH or --fd FD is required"),
            "{e}"
        );
        let e = serve(&["--socket-path", "/x", "--blk-file", "mem:1000"]).unwrap_err();
        assert!(e.contains("size 1000 is not a multiple of 512"), "{e}");
        let e = serve(&[
            "--socket-path",
            "/x",
            "--blk-file",
            "null:1G",
            "--num-queues",
            "2",
            "--threads",
            "3",
        ])
        .unwrap_err();
        assert!(e.contains("--threads 3"), "{e}");
        let e = serve(&["--socket-path", "/x", "--fd", "3", "--blk-file", "null:1G"]).unwrap_err();
        assert!(e.contains("cannot be used with"), "{e}");
        let e = serve(&[
            "--socket-path",
            "/x",
            "--blk-file",
            "null:1G",
            "--cpus",
            "3-1",
        ])
        .unwrap_err();
        assert!(e.contains("bad CPU list"), "{e}");
        let e = serve(&[
            "--socket-path",
            "/x",
            "--blk-file",
            "null:1G",
            "--engine",
            "spdk",
        ])
        .unwrap_err();
        assert!(
            e.contains("unknown engine \"spdk\" (expected io_uring, aio, threads or sync)"),
            "{e}"
        );
        let e = serve(&[
            "--socket-path",
            "/x",
            "--blk-file",
            "null:1G",
            "--engine-threads",
            "0",
        ])
        .unwrap_err();
        assert!(
            e.contains("--engine-threads 0: must be between 1 and 64"),
            "{e}"
        );
        let e = serve(&[
            "--socket-path",
            "/x",
            "--blk-file",
            "d",
            "--format",
            "qcow2",
        ])
        .unwrap_err();
        assert!(e.contains("qcow2") && e.contains("raw"), "{e}");
        let e = serve(&[
            "--socket-path",
            "/x",
            "--blk-file",
            "d",
            "--image-lock",
            "auto",
        ])
        .unwrap_err();
        assert!(e.contains("auto") && e.contains("on, off"), "{e}");
    }
}
