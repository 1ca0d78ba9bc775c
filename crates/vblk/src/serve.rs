//! `vblk serve`: the vhost-user-blk device daemon.

use std::error::Error;
use std::path::PathBuf;
use std::sync::Arc;

use clap::{Args, CommandFactory, FromArgMatches, Parser};
use device::config::{DEFAULT_COALESCE_US, DEFAULT_POLL_US};
use device::{Controls, DaemonConfig, Listen, ServedDisk};

use crate::disk_args::{
    disk_from_items, explicit_disk_flags, load_config, parse_on_off, spec_of, split_items,
    DiskArgs, Items, SINGLE_DISK_FLAGS,
};

/// Serve disks as vhost-user-blk devices.
///
/// One disk: its flags on the command line. Follows the vhost-user "backend program
/// conventions" (QEMU docs/interop/vhost-user.rst): `--socket-path` or `--fd`,
/// `--print-capabilities`, `--blk-file`, `--read-only`.
///
/// Several disks, served by one set of worker threads: `--disk KEY=VALUE,...` once per
/// disk, whose keys are the disk flags below without their dashes (`socket` and `file`
/// stand for socket-path and blk-file; a switch is `read-only` or `read-only=on`; a comma
/// inside a value is written twice); disk flags given outside `--disk` apply to every
/// `--disk` that does not set them. Or `--config FILE`: the same keys in TOML, daemon flags
/// at the top level and one `[[disk]]` table per disk (contrib/systemd/disks.toml).
/// Disks are added and removed while the daemon runs with `vblk disk add|remove` on its
/// `--control-socket`.
///
/// Examples, with QEMU:
///
///   vblk serve --socket-path /tmp/vblk.sock --blk-file disk.img --num-queues 2
///
///   vblk serve --threads 2 --control-socket /run/vblk/ctl.sock
///     --cache none --format raw
///     --disk socket=/run/vblk/vm1.sock,file=vm1.img,num-queues=4
///     --disk socket=/run/vblk/vm2.sock,file=vm2.img,read-only
///
///   qemu-system-x86_64 -m 1G -object memory-backend-memfd,id=mem,size=1G,share=on
///     -numa node,memdev=mem -chardev socket,id=vblk0,path=/tmp/vblk.sock
///     -device vhost-user-blk-pci,chardev=vblk0,num-queues=2 ...
///
/// Signals: SIGTERM or SIGINT stops the daemon cleanly: no new requests are taken, those
/// in flight finish, the disk is flushed, the socket it created is removed, and it exits 0
/// (a second signal exits at once). SIGHUP re-reads the size of every disk's file or block
/// device and, if it grew, tells the frontend (QEMU passes it to the guest, whose /dev/vda
/// grows).
#[derive(Debug, Args)]
#[command(verbatim_doc_comment)]
pub struct ServeArgs {
    /// Print the vhost-user backend capabilities as JSON and exit.
    #[arg(long)]
    pub print_capabilities: bool,

    /// Print the system calls the seccomp allow-list lets through once the daemon is set
    /// up, one per line (those checked by argument marked `(args)`), and exit: for a
    /// service manager's filter (systemd's SystemCallFilter=).
    #[arg(long)]
    pub print_syscalls: bool,

    /// One disk of several: KEY=VALUE,... with the keys of the disk flags (socket=PATH,
    /// file=SPEC, num-queues=N, cache=none, read-only, ...). Repeat for each disk.
    #[arg(long = "disk", value_name = "KEY=VALUE,...")]
    pub disks: Vec<String>,

    /// Read the daemon's flags and its disks from this TOML file (top level: threads,
    /// poll-us, coalesce-us, cpus, control-socket, control-socket-group, socket-group,
    /// seccomp, landlock, nbd-ports; one
    /// `[group.NAME]` table of limits per throttle group; one `[[disk]]` table per disk
    /// with the disk flags' names as keys, `throttle = { iops-total = 2000 }` for its
    /// limits). A flag given both here and on the command line is refused.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,

    #[command(flatten)]
    pub daemon: DaemonArgs,

    #[command(flatten)]
    pub one: DiskArgs,
}

/// The flags of the daemon as a whole.
#[derive(Debug, Clone, Args)]
pub struct DaemonArgs {
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
    #[arg(long, value_name = "on|off", default_value = "on", value_parser = parse_on_off,
        action = clap::ArgAction::Set)]
    pub landlock: bool,

    /// Worker threads, shared by every disk: a disk's queue i is served by its worker
    /// i % min(T, queues), its workers on consecutive threads (the disks spread over them).
    /// A thread polls the queues of every disk it holds and sleeps only when all are idle.
    #[arg(long, value_name = "T", default_value_t = 1)]
    pub threads: usize,

    /// After its queues run dry a worker keeps polling for up to this many microseconds
    /// before it re-enables notifications and sleeps. 0: no window, only a grace of 4 µs
    /// while the guest answers completions within it (QD1), dropped at the first miss
    /// (one idle period in 32 of its kind tries it again). The window is also
    /// bounded by the CPU a sleep costs the worker (measured), shrinks when polling finds
    /// nothing, and drops to a thirty-second of its bound while polling costs more CPU per
    /// request than sleeping (a paced or slow load). Idle periods with requests in
    /// flight on the worker thread (at the disk, or held by --throttle) and those with
    /// none are learned apart, each with its own window, grace and probes: at QD1 a slow
    /// disk does not stop the worker from catching the guest's next request. Every
    /// 1-4 s (100 ms after a trial that could not tell) the worker tries 10 ms each of the full window, the adaptive
    /// one and the grace alone (and coalescing, with --coalesce-us), and keeps the one that costs the least CPU per request
    /// unless another makes the guest faster by at least 1.2x and by as much as it costs:
    /// `vblk stats` shows the figures and the choice.
    #[arg(long, value_name = "US", default_value_t = DEFAULT_POLL_US)]
    pub poll_us: u64,

    /// Let a paced guest's requests wait up to this many microseconds so that one wake-up
    /// of the worker serves several (0: never). With it the worker's trials (see
    /// --poll-us) try one more regime: after a busy period the worker sleeps with the
    /// guest's kicks still off for up to US µs, serves what came, and goes on so while
    /// that finds work; a sleep that finds nothing re-arms kicks. It is kept by the same
    /// rule as the others: while it costs the least CPU per request, unless another makes
    /// the guest faster by at least 1.2x and by as much as it costs (a guest waiting on
    /// each completion is several times faster with kicks). Its price is latency: up to
    /// US µs per request, and all of it for a guest that waits for completions before it
    /// sends more (fio's pacing does). At most 1000.
    #[arg(long, value_name = "US", default_value_t = DEFAULT_COALESCE_US)]
    pub coalesce_us: u64,

    /// Run worker thread t on CPU LIST[t % len] (e.g. 2,3 or 4-7) [default: not pinned].
    #[arg(long, value_name = "LIST")]
    pub cpus: Option<CpuList>,

    /// Serve live statistics and disk management on this Unix socket: per disk and queue,
    /// requests and bytes by type, errors, requests in flight, latency histograms; per
    /// worker thread, polling hits and misses; ring stops, the reset fence and sessions
    /// ended by a misbehaving frontend. Read them with `vblk stats PATH` (or `--json`;
    /// `--interval 1` for rates); add, remove and list disks with `vblk disk`.
    #[arg(long, value_name = "PATH")]
    pub control_socket: Option<PathBuf>,

    /// The group that may connect to the disks' sockets vblk creates (--socket-path, or
    /// socket= in --disk and --config; disks added later by `vblk disk add` unless it
    /// names another): they are made mode 0660 with this group (a name or a number)
    /// [default: mode 0600, the daemon's user only; the umask is not used]. A frontend
    /// running as another user, such as libvirt's qemu user, connects through the group.
    /// Not the control socket: whoever reaches it manages every disk
    /// (--control-socket-group).
    #[arg(long, value_name = "GROUP")]
    pub socket_group: Option<String>,

    /// The group that may connect to --control-socket (mode 0660 with it) [default: mode
    /// 0600, the daemon's user only]. Whoever connects can add, remove, resize and
    /// re-limit every disk: give it to the host's management (e.g. a `vblk-admin` group),
    /// never to the frontends' group.
    #[arg(long, value_name = "GROUP")]
    pub control_socket_group: Option<String>,

    /// NBD disks added later over TCP (`vblk disk add`): the ports the sandbox lets the
    /// daemon connect to, besides those of the NBD disks it starts with (e.g. 10809).
    #[arg(long, value_name = "PORT,...", value_delimiter = ',')]
    pub nbd_ports: Vec<u16>,

    /// A throttle group and its limits, NAME:KEY=VALUE,... with --throttle's keys (e.g.
    /// tenants:iops-total=20000,bps-total=200M): the limits cover all the disks that name
    /// the group (--throttle-group, throttle.group= in --disk) together, shared fairly
    /// among those that want more. Repeat for each group; change one while running with
    /// `vblk disk group`.
    #[arg(long = "group", value_name = "NAME:KEY=VALUE,...", value_parser = parse_group)]
    pub groups: Vec<(String, device::throttle::Limits)>,
}

fn parse_group(s: &str) -> Result<(String, device::throttle::Limits), String> {
    let (name, limits) = s.split_once(':').ok_or_else(|| {
        format!("{s:?}: expected NAME:KEY=VALUE,... (e.g. tenants:iops-total=20000)")
    })?;
    device::config::check_group_name(name).map_err(|e| format!("--group: {e}"))?;
    Ok((name.to_string(), device::throttle::Limits::parse(limits)?))
}

/// `DaemonArgs` alone, to apply a `--config` file's top-level keys.
#[derive(Debug, Parser)]
#[command(name = "--config", no_binary_name = true)]
struct DaemonCli {
    #[command(flatten)]
    daemon: DaemonArgs,
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

impl DaemonArgs {
    fn into_config(self) -> DaemonConfig {
        DaemonConfig {
            threads: self.threads,
            poll_us: self.poll_us,
            coalesce_us: self.coalesce_us,
            cpus: self.cpus.map(|c| c.0).unwrap_or_default(),
            control_socket: self.control_socket,
            socket_access: device::socket_file::SocketAccess {
                group: self.socket_group,
            },
            control_access: device::socket_file::SocketAccess {
                group: self.control_socket_group,
            },
            sandbox: device::sandbox::SandboxConfig {
                seccomp: self.seccomp,
                landlock: self.landlock,
                drop_caps: true,
            },
            nbd_ports: self.nbd_ports,
            disk_parser: None,
            throttle_groups: self.groups,
        }
    }
}

/// The daemon and its disks, from `vblk serve`'s arguments and their matches (which
/// flags the command line gave).
pub fn plan(
    args: ServeArgs,
    matches: &clap::ArgMatches,
) -> Result<(DaemonConfig, Vec<ServedDisk>), String> {
    let given = |id: &str| matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine);
    let many = !args.disks.is_empty() || args.config.is_some();
    if many {
        if let Some(flag) = SINGLE_DISK_FLAGS.iter().find(|f| given(f)) {
            return Err(format!(
                "--{} names the one disk of a one-disk daemon; with --disk or --config give it inside each disk",
                flag.replace('_', "-")
            ));
        }
    }
    let mut daemon_args = args.daemon;
    // (where it came from, its items, its spec)
    let mut items: Vec<(String, Items, String)> = args
        .disks
        .iter()
        .map(|d| (format!("--disk {d}"), split_items(d), d.clone()))
        .collect();
    if let Some(path) = &args.config {
        let file = load_config(path)?;
        let mut argv = Vec::new();
        for (key, value) in &file.daemon {
            let id = match key.as_str() {
                "group" => "groups".to_string(),
                k => k.replace('-', "_"),
            };
            if given(&id) {
                return Err(format!(
                    "{key} is given both in {} and on the command line: give it once",
                    path.display()
                ));
            }
            argv.push(match value {
                Some(v) => format!("--{key}={v}"),
                None => format!("--{key}"),
            });
        }
        // The file's daemon keys, then the command line's (none of them twice).
        let from_file = DaemonCli::command()
            .try_get_matches_from(argv)
            .map_err(|e| {
                // clap's message without its "For more information, try '--help'": the
                // file is not the command line.
                let text = e.to_string();
                let first = text.split("\n\n").next().unwrap_or(&text).trim();
                format!("{}: {first}", path.display())
            })?;
        let file_daemon = DaemonCli::from_arg_matches(&from_file)
            .map_err(|e| e.to_string())?
            .daemon;
        // The file's values on their own first, so that a bad one names the file (the
        // command line's, not given there, are at their defaults, which pass).
        file_daemon
            .clone()
            .into_config()
            .validate()
            .map_err(|e| format!("{}: {e}", path.display()))?;
        daemon_args = merge_daemon(daemon_args, file_daemon, &file.daemon);
        for (i, d) in file.disks.into_iter().enumerate() {
            let spec = spec_of(&d);
            items.push((format!("{} [[disk]] {}", path.display(), i + 1), d, spec));
        }
        if items.is_empty() {
            return Err(format!("{}: no [[disk]] table", path.display()));
        }
    }
    let daemon = daemon_args.into_config();
    daemon.validate().map_err(|e| e.to_string())?;
    if !many {
        let mut served = args
            .one
            .into_served(socket_from_environment()?.map(Listen::Fd), "disk0".into())?;
        served.config.socket_access = daemon.socket_access.clone();
        return Ok((daemon, vec![served]));
    }
    let inherited = explicit_disk_flags(matches);
    let mut disks = Vec::with_capacity(items.len());
    for (i, (what, items, spec)) in items.into_iter().enumerate() {
        let mut served = disk_from_items(&items, &inherited, &what)?
            .into_served(None, format!("disk{i}"))
            .map_err(|e| format!("{what}: {e}"))?;
        served.spec = spec;
        served.config.socket_access = daemon.socket_access.clone();
        disks.push(served);
    }
    Ok((daemon, disks))
}

/// `base` (the command line's daemon flags) with the keys a `--config` file set taken
/// from `file`.
fn merge_daemon(
    mut base: DaemonArgs,
    file: DaemonArgs,
    keys: &[(String, Option<String>)],
) -> DaemonArgs {
    for (key, _) in keys {
        match key.as_str() {
            "threads" => base.threads = file.threads,
            "poll-us" => base.poll_us = file.poll_us,
            "coalesce-us" => base.coalesce_us = file.coalesce_us,
            "cpus" => base.cpus = file.cpus.clone(),
            "control-socket" => base.control_socket = file.control_socket.clone(),
            "socket-group" => base.socket_group = file.socket_group.clone(),
            "control-socket-group" => base.control_socket_group = file.control_socket_group.clone(),
            "seccomp" => base.seccomp = file.seccomp,
            "landlock" => base.landlock = file.landlock,
            "nbd-ports" => base.nbd_ports = file.nbd_ports.clone(),
            "group" => base.groups = file.groups.clone(),
            _ => {}
        }
    }
    base
}

/// How `vblk disk add` requests are parsed: as `--disk` values, after `inherited` (the
/// disk flags a daemon of several disks was given outside `--disk`: every disk's
/// defaults, those added later too; a one-disk daemon's flags are its disk's own).
pub fn disk_parser(inherited: Vec<std::ffi::OsString>) -> device::DiskParser {
    let shown = inherited
        .iter()
        .map(|f| f.to_string_lossy().into_owned())
        .collect();
    device::DiskParser(
        Arc::new(move |spec: &str| {
            let what = format!("disk {spec}");
            disk_from_items(&split_items(spec), &inherited, &what)?
                .into_served(Some(Listen::Fd(-1)), "disk".into())
                .map_err(|e| format!("{what}: {e}"))
        }),
        shown,
    )
}

/// `vblk serve`.
pub fn run(args: ServeArgs, matches: &clap::ArgMatches) -> Result<(), Box<dyn Error>> {
    if args.print_capabilities {
        outln!("{}", capabilities());
        return Ok(());
    }
    if args.print_syscalls {
        use device::sandbox::seccomp::{ALLOWED, CONDITIONAL};
        for (name, _) in ALLOWED {
            outln!("{name}");
        }
        for (name, _) in CONDITIONAL {
            outln!("{name} (args)");
        }
        return Ok(());
    }
    let many = !args.disks.is_empty() || args.config.is_some();
    let inherited = if many {
        explicit_disk_flags(matches)
    } else {
        Vec::new()
    };
    let (mut daemon, disks) = plan(args, matches)?;
    daemon.disk_parser = Some(disk_parser(inherited));
    let controls = Arc::new(Controls::new()?);
    let set = block_signals()?;
    // The signal thread starts once the daemon is confined, so that it is too.
    let c = controls.clone();
    let mut started = false;
    device::serve(&daemon, disks, &controls, &mut || {
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
    use clap::CommandFactory;
    use device::DeviceConfig;
    use storage::{CacheMode, DiskSpec, EngineKind, Format, ImageChecks, ImageLock};

    use super::*;
    use crate::cli::{Cli, Command};

    fn plan_of(args: &[&str]) -> Result<(DaemonConfig, Vec<ServedDisk>), String> {
        let matches = Cli::command()
            .try_get_matches_from(["vblk", "serve"].iter().chain(args))
            .map_err(|e| e.to_string())?;
        let cli = Cli::from_arg_matches(&matches).map_err(|e| e.to_string())?;
        let sub = matches.subcommand_matches("serve").unwrap();
        match cli.command {
            Command::Serve(a) => plan(*a, sub),
            _ => Err("not serve".into()),
        }
    }

    fn serve(args: &[&str]) -> Result<(DeviceConfig, Listen), String> {
        let (_, mut disks) = plan_of(args)?;
        assert_eq!(disks.len(), 1);
        let d = disks.remove(0);
        Ok((d.config, d.listen))
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
        assert_eq!((c.num_queues, c.queue_size), (4, 128));
        assert_eq!(c.engine, EngineKind::Sync);
        assert_eq!(c.cache, CacheMode::None);
        assert_eq!(c.qcow2_cache, 8 << 20);
        let (big, _) = serve(&[
            "--socket-path",
            "/x",
            "--blk-file",
            "null:1G",
            "--qcow2-cache",
            "32M",
        ])
        .unwrap();
        assert_eq!(big.qcow2_cache, 32 << 20);
        let (d, disks) = plan_of(&[
            "--socket-path",
            "/run/x.sock",
            "--blk-file",
            "mem:1G",
            "--threads",
            "2",
            "--cpus",
            "0,1",
            "--poll-us",
            "0",
            "--coalesce-us",
            "1000",
        ])
        .unwrap();
        assert_eq!((d.threads, d.poll_us, d.coalesce_us), (2, 0, 1000));
        assert_eq!(d.cpus, vec![0, 1]);
        assert_eq!(disks[0].id, "x", "named after its socket");
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
            "--threads",
            "0",
        ])
        .unwrap_err();
        assert!(e.contains("--threads 0: must be between 1 and 256"), "{e}");
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
        for (size, want) in [("1K", "takes 4K to 4G"), ("8X", "size")] {
            let e = serve(&[
                "--socket-path",
                "/x",
                "--blk-file",
                "null:1G",
                "--qcow2-cache",
                size,
            ])
            .unwrap_err();
            assert!(e.contains(want), "{size}: {e}");
        }
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
        let e = serve(&["--socket-path", "/x", "--blk-file", "d", "--format", "vmdk"]).unwrap_err();
        assert!(
            e.contains("vmdk") && e.contains("raw") && e.contains("qcow2"),
            "{e}"
        );
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

    #[test]
    fn several_disks_on_the_command_line() {
        let (d, disks) = plan_of(&[
            "--threads",
            "2",
            "--cache",
            "none",
            "--disk",
            "socket=/run/vm1.sock,file=null:1G,num-queues=4",
            "--disk",
            "id=second,socket=/run/b.sock,file=mem:64M,read-only,cache=writeback,serial=a,,b",
        ])
        .unwrap();
        assert_eq!(d.threads, 2);
        assert_eq!(disks.len(), 2);
        assert_eq!(disks[0].id, "vm1");
        assert_eq!(disks[0].listen, Listen::Path("/run/vm1.sock".into()));
        assert_eq!(disks[0].config.num_queues, 4);
        assert_eq!(
            disks[0].config.cache,
            CacheMode::None,
            "a disk flag outside --disk applies to every --disk"
        );
        assert_eq!(
            disks[0].spec,
            "socket=/run/vm1.sock,file=null:1G,num-queues=4"
        );
        assert_eq!(disks[1].id, "second");
        assert!(disks[1].config.read_only);
        assert_eq!(
            disks[1].config.cache,
            CacheMode::Writeback,
            "a key inside --disk wins"
        );
        assert_eq!(
            disks[1].config.serial.as_deref(),
            Some("a,b"),
            "a doubled comma"
        );
        assert_eq!(disks[1].config.disk, DiskSpec::Mem(64 << 20));
    }

    #[test]
    fn bad_disks_are_clear_errors() {
        let e = plan_of(&["--disk", "socket=/a.sock,file=null:1G,threads=2"]).unwrap_err();
        assert!(e.contains("threads applies to the whole daemon"), "{e}");
        let e = plan_of(&["--disk", "socket=/a.sock,file=null:1G,colour=red"]).unwrap_err();
        assert!(
            e.contains("unknown key \"colour\"") && e.contains("num-queues"),
            "{e}"
        );
        let e = plan_of(&["--disk", "socket=/a.sock,file=null:1G,num-queues=x"]).unwrap_err();
        assert!(
            e.contains("--disk socket=/a.sock") && e.contains("num-queues"),
            "{e}"
        );
        let e = plan_of(&["--disk", "file=null:1G"]).unwrap_err();
        assert!(e.contains("needs its socket"), "{e}");
        let e = plan_of(&[
            "--blk-file",
            "null:1G",
            "--disk",
            "socket=/a.sock,file=null:1G",
        ])
        .unwrap_err();
        assert!(e.contains("--blk-file names the one disk"), "{e}");
        let e = plan_of(&["--disk", "socket=/a.sock,file=null:1G,read-only=maybe"]).unwrap_err();
        assert!(e.contains("read-only=maybe: expected on or off"), "{e}");
        let e = plan_of(&["--disk", "socket=/a.sock,file=null:1G,id=a/b"]).unwrap_err();
        assert!(e.contains("disk id \"a/b\""), "{e}");
        let e = plan_of(&["--disk", "socket=/a.sock,file=null:1G,socket=/b.sock"]).unwrap_err();
        assert!(e.contains("socket is given twice"), "{e}");
        let e = plan_of(&[
            "--disk",
            "socket=/a.sock,file=null:1G,group=g,throttle.group=h",
        ])
        .unwrap_err();
        assert!(
            e.contains("group and throttle.group are the same setting"),
            "{e}"
        );
        let e =
            plan_of(&["--disk", "socket=/a.sock,file=null:1G,socket-path=/b.sock"]).unwrap_err();
        assert!(
            e.contains("socket and socket-path are the same setting"),
            "{e}"
        );
        let e = plan_of(&[
            "--group",
            "none:iops-total=100",
            "--disk",
            "socket=/a.sock,file=null:1G",
        ])
        .unwrap_err();
        assert!(e.contains("that name means \"in no group\""), "{e}");
        // A list may come again: the backing chain, in order.
        let (_, disks) = plan_of(&[
            "--disk",
            "socket=/a.sock,file=/a.qcow2,format=qcow2,backing=/b.qcow2,backing=/c.raw",
        ])
        .unwrap();
        assert_eq!(disks[0].config.backing.len(), 2);
    }

    #[test]
    fn landlock_takes_on_and_off() {
        for (args, want) in [
            (&["--landlock", "off"][..], false),
            (&["--landlock=off"][..], false),
            (&["--landlock", "on"][..], true),
            (&[][..], true),
        ] {
            let mut argv = args.to_vec();
            argv.extend(["--blk-file", "null:1G", "--socket-path", "/a.sock"]);
            let (d, _) = plan_of(&argv).unwrap();
            assert_eq!(d.sandbox.landlock, want, "{args:?}");
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disks.toml");
        std::fs::write(
            &path,
            "landlock = \"off\"\n[[disk]]\nsocket = \"/a.sock\"\nfile = \"null:1G\"\n",
        )
        .unwrap();
        let (d, _) = plan_of(&["--config", path.to_str().unwrap()]).unwrap();
        assert!(!d.sandbox.landlock, "landlock = \"off\" in a config file");
    }

    /// A bad value among a config file's daemon keys names the file, and says nothing of
    /// `--help` (it named no file for threads = 0, and accepted port 0).
    #[test]
    fn a_config_files_bad_daemon_values_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disks.toml");
        for (line, says) in [
            ("threads = 0", "--threads 0: must be between 1 and 256"),
            (
                "nbd-ports = [0]",
                "port 0 is no port an NBD server listens on",
            ),
            ("threads = \"many\"", "invalid value 'many'"),
        ] {
            std::fs::write(
                &path,
                format!("{line}\n[[disk]]\nsocket = \"/a.sock\"\nfile = \"null:1G\"\n"),
            )
            .unwrap();
            let e = plan_of(&["--config", path.to_str().unwrap()]).unwrap_err();
            assert!(
                e.starts_with(&format!("{}: ", path.display())),
                "{line}: {e}"
            );
            assert!(e.contains(says), "{line}: {e}");
            assert!(!e.contains("--help"), "{line}: {e}");
        }
    }

    #[test]
    fn sockets_take_the_socket_group_and_none_leaves_the_group() {
        let (d, disks) = plan_of(&[
            "--socket-group",
            "kvm",
            "--throttle-group",
            "tenants",
            "--disk",
            "socket=/a.sock,file=null:1G",
            "--disk",
            "socket=/b.sock,file=null:1G,group=none",
        ])
        .unwrap();
        assert_eq!(d.socket_access.group.as_deref(), Some("kvm"));
        for disk in &disks {
            assert_eq!(disk.config.socket_access, d.socket_access, "{}", disk.id);
        }
        assert_eq!(disks[0].config.throttle_group.as_deref(), Some("tenants"));
        assert_eq!(
            disks[1].config.throttle_group, None,
            "group=none: in no group"
        );
        let (d, disks) = plan_of(&[
            "--socket-group",
            "kvm",
            "--blk-file",
            "null:1G",
            "--socket-path",
            "/c.sock",
        ])
        .unwrap();
        assert_eq!(disks[0].config.socket_access, d.socket_access, "one disk");
        // The control socket has its own group: the disks' does not reach it.
        assert_eq!(d.control_access.group, None);
        let (d, _) = plan_of(&[
            "--socket-group",
            "kvm",
            "--control-socket-group",
            "vblk-admin",
            "--blk-file",
            "null:1G",
            "--socket-path",
            "/c.sock",
        ])
        .unwrap();
        assert_eq!(d.control_access.group.as_deref(), Some("vblk-admin"));
        assert_eq!(d.socket_access.group.as_deref(), Some("kvm"));
    }

    #[test]
    fn a_config_file_holds_the_daemon_and_its_disks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disks.toml");
        std::fs::write(
            &path,
            r#"
threads = 2
poll-us = 50
coalesce-us = 30
control-socket = "/run/vblk/control.sock"

[[disk]]
socket = "/run/vblk/vm1.sock"
file = "null:1G"
num-queues = 2
read-only = true

[[disk]]
id = "vm2"
socket = "/run/vblk/other.sock"
file = "mem:64M"
cache = "none"
"#,
        )
        .unwrap();
        let p = path.to_str().unwrap();
        let (d, disks) = plan_of(&["--config", p]).unwrap();
        assert_eq!((d.threads, d.poll_us, d.coalesce_us), (2, 50, 30));
        assert_eq!(d.control_socket, Some("/run/vblk/control.sock".into()));
        assert_eq!(disks.len(), 2);
        assert_eq!(disks[0].id, "vm1");
        assert!(disks[0].config.read_only);
        assert_eq!(disks[0].config.num_queues, 2);
        assert_eq!(disks[1].id, "vm2");
        assert_eq!(disks[1].config.cache, CacheMode::None);
        let e = plan_of(&["--config", p, "--threads", "4"]).unwrap_err();
        assert!(e.contains("threads is given both"), "{e}");
        let (d, _) = plan_of(&["--config", p, "--seccomp", "log"]).unwrap();
        assert_eq!(
            d.threads, 2,
            "the file's keys and the command line's together"
        );
        std::fs::write(&path, "threads = 2\nnum-queues = 4\n").unwrap();
        let e = plan_of(&["--config", p]).unwrap_err();
        assert!(
            e.contains("unknown key \"num-queues\" at the top level"),
            "{e}"
        );
        std::fs::write(&path, "threads = 2\n").unwrap();
        let e = plan_of(&["--config", p]).unwrap_err();
        assert!(e.contains("no [[disk]] table"), "{e}");
        std::fs::write(
            &path,
            "[[disk]]\nsocket = \"/a\"\nfile = \"null:1G\"\nthreads = 1\n",
        )
        .unwrap();
        let e = plan_of(&["--config", p]).unwrap_err();
        assert!(
            e.contains("[[disk]] 1: threads applies to the whole daemon"),
            "{e}"
        );
        std::fs::write(&path, "threads = [").unwrap();
        let e = plan_of(&["--config", p]).unwrap_err();
        assert!(e.contains("disks.toml"), "{e}");
    }
}
