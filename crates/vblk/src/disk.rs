//! `vblk disk`: the disks of a running `vblk serve`, through its control socket: list them,
//! add one, remove one, or make them what a `--config` file says (`systemctl reload`).
//!
//! Adding opens the image and binds the disk's socket here, in the client, and hands both
//! to the daemon with the request: a confined daemon opens nothing itself
//! (docs/security.md).

use std::error::Error;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Subcommand};
use device::socket_file::{SocketAccess, SocketFile};
use serde_json::{json, Value};
use storage::DiskSpec;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::disk_args::{disk_from_items, load_config, spec_of, split_items, ConfigFile};

/// How long a request may take: removing a disk waits for its requests in flight (up to
/// its drain timeout, 60 s by default) and its flush.
const SLOW_REQUEST: Duration = Duration::from_secs(600);

/// List, add, remove and resize the disks of a running `vblk serve` (its --control-socket),
/// and set their QoS limits and throttle groups.
#[derive(Debug, Subcommand)]
pub enum DiskCommand {
    /// The disks the daemon serves: name, socket, disk, size, attached or not.
    List(ListArgs),
    /// Serve one more disk.
    ///
    /// SPEC is what `vblk serve --disk` takes (socket=PATH and file=SPEC, then any disk
    /// flag as KEY=VALUE). The socket is created and the image opened here, with this
    /// command's privileges, and handed to the daemon.
    ///
    ///   vblk disk add /run/vblk/control.sock socket=/run/vblk/vm3.sock,file=/var/lib/vblk/vm3.img,num-queues=2
    #[command(verbatim_doc_comment)]
    Add(AddArgs),
    /// Stop serving a disk.
    ///
    /// Refused while a frontend is attached, unless --force (its requests in flight
    /// finish and the disk is flushed first; the guest then loses the disk as if it were
    /// unplugged without warning). The socket is removed.
    Remove(RemoveArgs),
    /// Change a disk's QoS limits or its throttle group while it runs.
    ///
    /// KEY=VALUE,... with the keys of `--disk`: throttle.iops-total=N, throttle.bps-read=N,
    /// ... or QEMU's bare names (iops-total=N); the new limits replace all the old ones, as
    /// QEMU's block_set_io_throttle does (throttle=none removes them);
    /// throttle.group=NAME or group=NAME (group=none leaves the group).
    /// Requests waiting are looked at again under the new limits at once.
    ///
    ///   vblk disk set /run/vblk/control.sock vm1 iops-total=2000,bps-total=100M
    #[command(verbatim_doc_comment)]
    Set(SetArgs),
    /// Make a disk larger (or, for a raw file and with --shrink, smaller) while it is
    /// served; its frontend is told (QEMU raises a config-change interrupt and the guest
    /// sees the new size, as with QMP block_resize).
    ///
    /// A raw file is truncated to SIZE; a qcow2 image is grown (its header, and its L1
    /// table moved when it must grow); qcow2 images are never shrunk online (`qemu-img
    /// resize --shrink` on an image nobody serves). Over a backing file longer than the
    /// image, the new space is made zero clusters first, so that it reads zeroes (a
    /// version 2 image has none and is refused, as QEMU refuses it). A block device is
    /// resized by its owner (`lvextend`), then the daemon is sent SIGHUP and reads the new
    /// size.
    ///
    ///   vblk disk resize /run/vblk/control.sock vm1 40G
    #[command(verbatim_doc_comment)]
    Resize(ResizeArgs),
    /// Set a throttle group's limits while the daemon runs (the group is made if need be).
    ///
    ///   vblk disk group /run/vblk/control.sock tenants iops-total=20000
    #[command(verbatim_doc_comment)]
    Group(GroupArgs),
    /// Make the daemon serve the disks a --config file names.
    ///
    /// Adds those it lacks, removes those the file no longer names (not while attached),
    /// applies changed QoS limits and groups, reports other settings that changed (the
    /// disk must be removed and added for them). The file's `[group.NAME]` tables are
    /// the groups' limits: a group the file does not name loses its limits, whoever set
    /// them (`--group`, `vblk disk group`). For `systemctl reload`
    /// (contrib/systemd/vblk-host.service).
    Sync(SyncArgs),
}

/// `vblk disk list`.
#[derive(Debug, Args)]
pub struct ListArgs {
    /// The daemon's control socket.
    pub control: PathBuf,
    /// Print the daemon's JSON.
    #[arg(long)]
    pub json: bool,
}

/// `vblk disk add`.
#[derive(Debug, Args)]
pub struct AddArgs {
    /// The daemon's control socket.
    pub control: PathBuf,
    /// The disk, as `vblk serve --disk` takes it.
    pub spec: String,
    /// The group that may connect to the disk's socket (mode 0660) [default: the
    /// daemon's --socket-group; without one, mode 0600, this user only].
    #[arg(long, value_name = "GROUP")]
    pub socket_group: Option<String>,
}

/// `vblk disk remove`.
#[derive(Debug, Args)]
pub struct RemoveArgs {
    /// The daemon's control socket.
    pub control: PathBuf,
    /// The disk's name (`vblk disk list`).
    pub id: String,
    /// Remove it even while a frontend is attached.
    #[arg(long)]
    pub force: bool,
}

/// `vblk disk set`.
#[derive(Debug, Args)]
pub struct SetArgs {
    /// The daemon's control socket.
    pub control: PathBuf,
    /// The disk's name (`vblk disk list`).
    pub id: String,
    /// throttle.KEY=VALUE,... and/or throttle.group=NAME.
    pub settings: String,
}

/// `vblk disk resize`.
#[derive(Debug, Args)]
pub struct ResizeArgs {
    /// The daemon's control socket.
    pub control: PathBuf,
    /// The disk's name (`vblk disk list`).
    pub id: String,
    /// The new size: bytes, or with K, M, G, T (powers of 1024); a multiple of 512.
    pub size: String,
    /// Allow a smaller size (raw files only): what the guest wrote past it is lost.
    #[arg(long)]
    pub shrink: bool,
}

/// `vblk disk group`.
#[derive(Debug, Args)]
pub struct GroupArgs {
    /// The daemon's control socket.
    pub control: PathBuf,
    /// The group's name.
    pub name: String,
    /// Its limits, KEY=VALUE,... (`vblk serve --throttle`'s keys; none: unlimited).
    pub limits: String,
}

/// `vblk disk sync`.
#[derive(Debug, Args)]
pub struct SyncArgs {
    /// The configuration file (`vblk serve --config`).
    #[arg(long, value_name = "FILE")]
    pub config: PathBuf,
    /// The daemon's control socket [default: the file's control-socket].
    pub control: Option<PathBuf>,
    /// The group that may connect to the sockets of disks added [default: the file's
    /// socket-group].
    #[arg(long, value_name = "GROUP")]
    pub socket_group: Option<String>,
}

/// Send `body` (and `fds`) to the daemon at `control`, return its reply; an `error` reply
/// is an error.
pub fn request(
    control: &Path,
    body: &Value,
    fds: &[RawFd],
    timeout: Duration,
) -> Result<Value, Box<dyn Error>> {
    let mut s = UnixStream::connect(control).map_err(|e| {
        format!(
            "cannot connect to {}: {e} (is `vblk serve --control-socket {}` running?)",
            control.display(),
            control.display()
        )
    })?;
    s.set_read_timeout(Some(timeout))?;
    let mut line = body.to_string();
    line.push('\n');
    // A daemon that answers before it reads (busy: every answering slot taken) may have
    // closed its side already: its answer is still there to read.
    let sent = s.send_with_fds(&[line.as_bytes()], fds);
    let mut buf = String::new();
    let read = s.read_to_string(&mut buf);
    if let (Err(e), true) = (&sent, buf.trim().is_empty()) {
        return Err(format!("cannot send to {}: {e}", control.display()).into());
    }
    read.map_err(|e| {
        if matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ) {
            format!("no answer from {} within {timeout:?}", control.display())
        } else {
            format!("no answer from {}: {e}", control.display())
        }
    })?;
    if buf.trim().is_empty() {
        return Err(format!(
            "{}: the daemon closed the connection without an answer (did it exit? its log says why)",
            control.display()
        )
        .into());
    }
    let v: Value = serde_json::from_str(&buf).map_err(|e| {
        format!(
            "{}: not a vblk control socket, or a daemon too old for `vblk disk` ({e})",
            control.display()
        )
    })?;
    if let Some(e) = v["error"].as_str() {
        return Err(e.into());
    }
    Ok(v)
}

/// Run `vblk disk ...`.
pub fn run(cmd: DiskCommand) -> Result<(), Box<dyn Error>> {
    match cmd {
        DiskCommand::List(a) => list(&a),
        DiskCommand::Add(a) => {
            let id = add(&a.control, &a.spec, a.socket_group.as_deref())?;
            outln!("disk {id} added");
            Ok(())
        }
        DiskCommand::Remove(a) => {
            remove(&a.control, &a.id, a.force)?;
            outln!("disk {} removed", a.id);
            Ok(())
        }
        DiskCommand::Set(a) => {
            set(&a.control, &a.id, &split_items(&a.settings))?;
            outln!("disk {}: set", a.id);
            Ok(())
        }
        DiskCommand::Resize(a) => {
            let size = storage::parse_size(&a.size)
                .map_err(|e| format!("{}: not a size ({e})", a.size))?;
            let reply = request(
                &a.control,
                &json!({"op": "resize", "id": a.id, "size": size, "shrink": a.shrink}),
                &[],
                SLOW_REQUEST,
            )?;
            let old = reply["old"].as_u64().unwrap_or(0);
            let new = reply["size"].as_u64().unwrap_or(size);
            outln!(
                "disk {}: {} bytes ({}), was {} bytes ({})",
                a.id,
                new,
                size_text(new),
                old,
                size_text(old)
            );
            Ok(())
        }
        DiskCommand::Group(a) => {
            // The keys as `vblk disk set` takes them: throttle.KEY or QEMU's bare names.
            let items = split_items(&a.limits);
            crate::disk_args::check_unique(&items, &|_| false)
                .map_err(|e| format!("throttle group {}: {e}", a.name))?;
            let limits: Vec<String> = items
                .iter()
                .map(|(k, v)| {
                    let k = k.strip_prefix("throttle.").unwrap_or(k);
                    format!("{k}={}", v.as_deref().unwrap_or(""))
                })
                .collect();
            let limits = match items.as_slice() {
                [(k, None)] if k == "none" => "none".to_string(),
                _ => limits.join(","),
            };
            let canonical = device::throttle::Limits::parse(&limits)
                .map_err(|e| format!("throttle group {}: {e}", a.name))?;
            request(
                &a.control,
                &json!({"op": "group", "name": a.name, "limits": limits}),
                &[],
                Duration::from_secs(5),
            )?;
            outln!("throttle group {}: {canonical}", a.name);
            Ok(())
        }
        DiskCommand::Sync(a) => sync(&a),
    }
}

fn list(a: &ListArgs) -> Result<(), Box<dyn Error>> {
    let v = request(
        &a.control,
        &json!({"op": "list"}),
        &[],
        Duration::from_secs(5),
    )?;
    if a.json {
        outln!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let empty = Vec::new();
    let disks = v["disks"].as_array().unwrap_or(&empty);
    outln!(
        "{:<16} {:<9} {:>10}  {:<32} disk",
        "id",
        "attached",
        "size",
        "socket"
    );
    for d in disks {
        outln!(
            "{:<16} {:<9} {:>10}  {:<32} {}{}",
            d["id"].as_str().unwrap_or("?"),
            if d["attached"].as_bool() == Some(true) {
                "yes"
            } else {
                "no"
            },
            size_text(d["capacity_bytes"].as_u64().unwrap_or(0)),
            d["socket"].as_str().unwrap_or("?"),
            d["disk"].as_str().unwrap_or("?"),
            if d["read_only"].as_bool() == Some(true) {
                " (read-only)"
            } else {
                ""
            }
        );
    }
    Ok(())
}

/// Add the disk `spec` to the daemon at `control`; its name.
pub fn add(control: &Path, spec: &str, group: Option<&str>) -> Result<String, Box<dyn Error>> {
    let what = format!("disk {spec}");
    let args = disk_from_items(&split_items(spec), &[], &what)?;
    if args.fd.is_some() {
        return Err(
            format!("{what}: fd= cannot be handed to another process; give socket=PATH").into(),
        );
    }
    let socket = args
        .socket_path
        .clone()
        .ok_or_else(|| format!("{what}: socket=PATH is required"))?;
    let read_only = args.read_only;
    let image: Option<File> = match &args.blk_file {
        Some(DiskSpec::File(path)) => Some(
            std::fs::OpenOptions::new()
                .read(true)
                .write(!read_only)
                .open(path)
                .map_err(|e| format!("{what}: cannot open {}: {e}", path.display()))?,
        ),
        Some(_) => None,
        None => return Err(format!("{what}: file=SPEC is required").into()),
    };
    // Checked here as the daemon will check it, before anything is created.
    args.clone()
        .into_served(None, "disk".into())
        .map_err(|e| format!("{what}: {e}"))?;
    // Without --socket-group, the disk's socket is the daemon's other sockets' kind.
    let group = match group {
        Some(g) => Some(g.to_string()),
        None => request(control, &json!({"op": "list"}), &[], Duration::from_secs(5))?
            ["socket_group"]
            .as_str()
            .map(str::to_string),
    };
    let access = SocketAccess { group };
    // A qcow2 image's backing chain is opened here too, read-only, in order: the daemon
    // opens nothing.
    if args.backing.len() > 32 {
        return Err(format!(
            "{what}: a chain of {} backing files; 32 at most",
            args.backing.len()
        )
        .into());
    }
    let backing: Vec<File> = args
        .backing
        .iter()
        .map(|b| {
            File::open(&b.path).map_err(|e| {
                format!(
                    "{what}: cannot open the backing file {}: {e}",
                    b.path.display()
                )
            })
        })
        .collect::<Result<_, _>>()?;
    let (listener, file) = SocketFile::bind(&socket, &access)?;
    let mut fds = vec![listener.as_raw_fd()];
    fds.extend(image.as_ref().map(|f| f.as_raw_fd()));
    fds.extend(backing.iter().map(|f| f.as_raw_fd()));
    let body = json!({"op": "add", "disk": spec, "socket": socket});
    // On an error the socket file is dropped here, and removed.
    let reply = request(control, &body, &fds, SLOW_REQUEST)?;
    // The daemon serves the socket now, and removes it with the disk.
    file.release();
    Ok(reply["id"].as_str().unwrap_or("?").to_string())
}

/// A size in the largest binary unit that keeps a whole number before the point:
/// `16.0 MiB`, `1.5 GiB`, `512 B`.
pub(crate) fn size_text(bytes: u64) -> String {
    let units = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64;
    let mut unit = None;
    for u in units {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = Some(u);
    }
    match unit {
        Some(u) => format!("{value:.1} {u}"),
        None => format!("{bytes} B"),
    }
}

/// Whether `key` is one of QEMU's limit names (`iops-total`, `bps-read-max`, ...), which
/// `vblk disk set` takes without `throttle.` as `vblk disk group` does (the daemon checks
/// the name).
pub(crate) fn is_limit_name(key: &str) -> bool {
    key.starts_with("iops-") || key.starts_with("bps-")
}

/// Whether an item is a QoS setting (`throttle...`, `group`).
fn is_throttle_item(key: &str) -> bool {
    key == "throttle" || key == "group" || key.starts_with("throttle.")
}

/// Set disk `id`'s QoS from `items` (throttle.KEY=VALUE, throttle=none, throttle.group or
/// group): the limits named replace all the old ones.
pub fn set(
    control: &Path,
    id: &str,
    items: &[(String, Option<String>)],
) -> Result<(), Box<dyn Error>> {
    if items.is_empty() {
        return Err(format!(
            "disk {id}: nothing to set: give throttle.KEY=VALUE,..., throttle=none or group=NAME (group=none to leave it)"
        )
        .into());
    }
    crate::disk_args::check_unique(items, &|_| false).map_err(|e| format!("disk {id}: {e}"))?;
    let mut body = json!({"op": "set", "id": id});
    let mut limits = Vec::new();
    let mut cleared = false;
    for (k, v) in items {
        let v = v.as_deref().unwrap_or("");
        match k.as_str() {
            "throttle" if v == "none" => cleared = true,
            "group" | "throttle.group" if v.is_empty() => {
                return Err(format!("disk {id}: {k} needs a name ({k}=NAME, or {k}=none)").into())
            }
            "group" | "throttle.group" => body["group"] = json!(if v == "none" { "" } else { v }),
            k => match k.strip_prefix("throttle.").or_else(|| is_limit_name(k).then_some(k)) {
                Some(key) => limits.push(format!("{key}={v}")),
                None => {
                    return Err(format!(
                        "{k}: only throttle.KEY=VALUE, throttle=none and throttle.group=NAME change while a disk runs (remove and add it for the rest)"
                    )
                    .into())
                }
            },
        }
    }
    if cleared || !limits.is_empty() {
        let l = if limits.is_empty() {
            "none".to_string()
        } else {
            limits.join(",")
        };
        device::throttle::Limits::parse(&l).map_err(|e| format!("disk {id}: {e}"))?;
        body["throttle"] = json!(l);
    }
    request(control, &body, &[], Duration::from_secs(5))?;
    Ok(())
}

/// Remove disk `id` from the daemon at `control`.
pub fn remove(control: &Path, id: &str, force: bool) -> Result<(), Box<dyn Error>> {
    let reply = request(
        control,
        &json!({"op": "remove", "id": id, "force": force}),
        &[],
        SLOW_REQUEST,
    )?;
    // A disk added live may have its socket where the daemon's sandbox cannot remove
    // files (`vblk disk add` made it, not the daemon): the daemon has closed it; remove
    // it here if nobody listens on it.
    if let Some(path) = reply["socket"].as_str() {
        if let Err(e) = device::socket_file::remove_if_stale(Path::new(path)) {
            eprintln!("vblk disk remove: disk {id} removed, but its socket stays: {e}");
        }
    }
    Ok(())
}

fn sync(a: &SyncArgs) -> Result<(), Box<dyn Error>> {
    let file = load_config(&a.config)?;
    let daemon_key = |k: &str| {
        file.daemon
            .iter()
            .find(|(key, _)| key == k)
            .and_then(|(_, v)| v.clone())
    };
    let control = a
        .control
        .clone()
        .or_else(|| daemon_key("control-socket").map(PathBuf::from))
        .ok_or_else(|| {
            format!(
                "{}: no control-socket, and none given: which daemon?",
                a.config.display()
            )
        })?;
    let group = a
        .socket_group
        .clone()
        .or_else(|| daemon_key("socket-group"));
    let now = request(
        &control,
        &json!({"op": "list"}),
        &[],
        Duration::from_secs(5),
    )?;
    let empty = Vec::new();
    let all = now["disks"].as_array().unwrap_or(&empty);
    let served: Vec<(String, String)> = all
        .iter()
        .map(|d| {
            (
                d["id"].as_str().unwrap_or("").to_string(),
                d["spec"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    // What QoS each disk has now: its limits (canonical) and its group.
    let qos_now = |id: &str| {
        all.iter().find(|d| d["id"] == id).map(|d| {
            (
                d["throttle"].as_str().unwrap_or("none").to_string(),
                d["throttle_group"].as_str().map(str::to_string),
            )
        })
    };
    // The disk flags the daemon's command line gave outside --disk: every disk's
    // defaults, so the file's disks are compared as the daemon serves them (a file disk
    // without limits under `--throttle iops-total=1000` has that limit, not none).
    let defaults: Vec<std::ffi::OsString> = now["disk_defaults"]
        .as_array()
        .map(|v| {
            v.iter()
                .filter_map(|f| f.as_str())
                .map(Into::into)
                .collect()
        })
        .unwrap_or_default();
    let mut wanted: Vec<(String, String)> = Vec::new();
    // Per disk: its limits (canonical) and its group, as the daemon would serve it.
    let mut wanted_qos: Vec<(String, Option<String>)> = Vec::new();
    let mut sockets = Vec::new();
    for (i, items) in file.disks.iter().enumerate() {
        let what = format!("{} [[disk]] {}", a.config.display(), i + 1);
        let served = disk_from_items(items, &defaults, &what)?
            .into_served(None, format!("disk{i}"))
            .map_err(|e| format!("{what}: {e}"))?;
        if let Some(g) = served.config.throttle_group.as_deref() {
            let in_file = file.daemon.iter().any(|(k, v)| {
                k == "group"
                    && v.as_deref().and_then(|v| v.split_once(':')).map(|(n, _)| n) == Some(g)
            });
            let limited_now = now["groups"].as_array().is_some_and(|gs| {
                gs.iter()
                    .any(|x| x["name"] == g && x["throttle"].as_str() != Some("none"))
            });
            if !in_file && !limited_now {
                outln!(
                    "warning: {what}: throttle group {g:?} has no limits (no [group.{g}] table): it limits nothing"
                );
            }
        }
        wanted_qos.push((
            served.config.throttle.to_string(),
            served.config.throttle_group.clone(),
        ));
        // Refused as `vblk serve --config` refuses it, before anything changes.
        if wanted.iter().any(|(id, _)| *id == served.id) {
            return Err(format!("{what}: two disks are named {:?}", served.id).into());
        }
        if sockets.contains(&served.listen) {
            return Err(format!("{what}: another disk has the same socket").into());
        }
        sockets.push(served.listen);
        wanted.push((served.id, spec_of(items)));
    }
    let mut failed = Vec::new();
    sync_groups(&control, &file, &now, &mut failed);
    for (id, spec) in &served {
        if !wanted.iter().any(|(w, _)| w == id) {
            match remove(&control, id, false) {
                Ok(()) => outln!("disk {id} removed"),
                Err(e) => failed.push(format!("disk {id} not removed: {e}")),
            }
        } else if let Some((_, want)) = wanted.iter().find(|(w, _)| w == id) {
            // QoS changes apply to a running disk; anything else needs it re-added.
            let (want_items, have_items) = (split_items(want), split_items(spec));
            let rest = |v: &[(String, Option<String>)]| {
                v.iter()
                    .filter(|(k, _)| !is_throttle_item(k))
                    .cloned()
                    .collect::<Vec<_>>()
            };
            let changes = changed_items(&rest(&have_items), &rest(&want_items));
            if !changes.is_empty() {
                // Reported; its QoS changes still apply (they were skipped with them).
                failed.push(format!(
                    "disk {id}: its settings in {} changed ({changes}); remove and add it to apply them",
                    a.config.display(),
                ));
            }
            let at = wanted.iter().position(|(w, _)| w == id).unwrap_or(0);
            let (want_limits, want_group) = wanted_qos[at].clone();
            if qos_now(id) == Some((want_limits.clone(), want_group.clone())) {
                continue;
            }
            let mut qos: Vec<(String, Option<String>)> = if want_limits == "none" {
                vec![("throttle".into(), Some("none".into()))]
            } else {
                want_limits
                    .split(',')
                    .filter_map(|kv| kv.split_once('='))
                    .map(|(k, v)| (format!("throttle.{k}"), Some(v.to_string())))
                    .collect()
            };
            qos.push((
                "group".into(),
                Some(want_group.unwrap_or_else(|| "none".into())),
            ));
            match set(&control, id, &qos) {
                Ok(()) => outln!("disk {id}: QoS set"),
                Err(e) => failed.push(format!("disk {id}: QoS not set: {e}")),
            }
        }
    }
    for (id, spec) in &wanted {
        if served.iter().any(|(s, _)| s == id) {
            continue;
        }
        match add(&control, spec, group.as_deref()) {
            Ok(id) => outln!("disk {id} added"),
            Err(e) => failed.push(format!("disk {id} not added: {e}")),
        }
    }
    if failed.is_empty() {
        return Ok(());
    }
    Err(failed.join("\n").into())
}

/// What differs between the items served (`have`) and those wanted: `KEY: A served, B in
/// the file` for each key (`-` where one side has none).
fn changed_items(have: &[(String, Option<String>)], want: &[(String, Option<String>)]) -> String {
    let value = |items: &[(String, Option<String>)], k: &str| {
        items
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone().unwrap_or_else(|| "on".into()))
            .unwrap_or_else(|| "-".into())
    };
    let mut keys: Vec<&str> = have.iter().chain(want).map(|(k, _)| k.as_str()).collect();
    keys.sort_unstable();
    keys.dedup();
    keys.into_iter()
        .filter(|k| value(have, k) != value(want, k))
        .map(|k| {
            format!(
                "{k}: {} served, {} in the file",
                value(have, k),
                value(want, k)
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Give the daemon's throttle groups the limits the file's `[group.NAME]` tables give
/// them; a group the file no longer names loses its limits (a disk may still name it).
/// `now` is the daemon's `list` reply. What fails goes to `failed`.
fn sync_groups(control: &Path, file: &ConfigFile, now: &Value, failed: &mut Vec<String>) {
    let empty = Vec::new();
    let have = now["groups"].as_array().unwrap_or(&empty);
    let limits_now = |name: &str| {
        have.iter()
            .find(|g| g["name"] == name)
            .and_then(|g| g["throttle"].as_str())
            .unwrap_or("none")
            .to_string()
    };
    let mut want: Vec<(String, String)> = Vec::new();
    for (key, value) in &file.daemon {
        let Some((name, limits)) = value
            .as_deref()
            .filter(|_| key == "group")
            .and_then(|v| v.split_once(':'))
        else {
            continue;
        };
        want.push((name.to_string(), limits.to_string()));
    }
    for g in have {
        let name = g["name"].as_str().unwrap_or("");
        if !want.iter().any(|(n, _)| n == name) && limits_now(name) != "none" {
            want.push((name.to_string(), String::new()));
        }
    }
    for (name, limits) in want {
        let canonical = match device::throttle::Limits::parse(&limits) {
            Ok(l) => l.to_string(),
            Err(e) => {
                failed.push(format!("throttle group {name}: {e}"));
                continue;
            }
        };
        if limits_now(&name) == canonical {
            continue;
        }
        let body = json!({"op": "group", "name": name, "limits": limits});
        match request(control, &body, &[], Duration::from_secs(5)) {
            Ok(_) => outln!("throttle group {name}: {canonical}"),
            Err(e) => failed.push(format!("throttle group {name}: not set: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::size_text;

    #[test]
    fn sizes_read_in_their_unit() {
        assert_eq!(size_text(512), "512 B");
        assert_eq!(size_text(16 << 20), "16.0 MiB");
        assert_eq!(size_text(3 << 29), "1.5 GiB");
        assert_eq!(size_text(8 << 40), "8.0 TiB");
    }
}
