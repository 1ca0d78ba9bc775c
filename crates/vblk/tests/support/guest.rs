//! A real Linux guest under QEMU (TCG) that talks to vhost-user-blk backends.
//!
//! The guest boots the cached kernel and base initramfs of
//! [`super::assets`]. Each boot appends a second cpio archive to the base one
//! (Linux unpacks concatenated archives) holding the per-boot shell script
//! and data files. The guest `/init` loads the modules, waits for the disks,
//! runs the script and powers off. The script reports with lines
//! `VBLK-CHECK <name> ok|fail <detail>` and `/init` ends with `VBLK-DONE`;
//! [`Boot`] holds the parsed result and the whole serial log.
//!
//! Nothing here skips: a missing tool is a test failure that names the Debian
//! package to install.

use std::fmt::Write as _;
use std::fs;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::assets::{assets, target_dir, Cpio, GUEST_ENV};
use super::assets::{find_program, require_programs};
// The host-tool helpers, where `daemon` has always found them.

/// Guest RAM in MiB unless [`Guest::memory_mib`] says otherwise; the memfd backend is
/// always the same size.
const GUEST_MEM_MIB: u32 = 512;

/// Shell helpers prepended to every per-boot script.
///
/// - `check NAME CMD...`: ok when CMD exits 0 (detail: its output, flattened)
/// - `check_fails NAME CMD...`: ok when CMD exits non-zero
/// - `check_eq NAME GOT WANT`, `check_gt NAME GOT MIN` (integers)
/// - `feature_bit DISK BIT`: negotiated virtio feature bit (0 or 1)
const SCRIPT_HELPERS: &str = r#"
vblk_flat() { tr '\r\n\t' '   ' | tr -s ' ' | tail -c 300; }
vblk_report() { echo "VBLK-CHECK $1 $2 $3"; }
check() {
    _n=$1; shift
    echo "VBLK-RUN $_n"
    _o=$("$@" 2>&1); _rc=$?
    if [ $_rc -eq 0 ]; then
        vblk_report "$_n" ok "$(printf '%s' "$_o" | vblk_flat)"
    else
        vblk_report "$_n" fail "exit $_rc: $(printf '%s' "$_o" | vblk_flat)"
    fi
    return $_rc
}
check_fails() {
    _n=$1; shift
    echo "VBLK-RUN $_n"
    _o=$("$@" 2>&1); _rc=$?
    if [ $_rc -ne 0 ]; then
        vblk_report "$_n" ok "failed as expected (exit $_rc): $(printf '%s' "$_o" | vblk_flat)"
        return 0
    fi
    vblk_report "$_n" fail "succeeded but must fail: $(printf '%s' "$_o" | vblk_flat)"
    return 1
}
check_eq() {
    if [ "$2" = "$3" ]; then vblk_report "$1" ok "$2"; return 0; fi
    vblk_report "$1" fail "got '$2', want '$3'"
    return 1
}
check_gt() {
    if [ "$2" -gt "$3" ] 2>/dev/null; then vblk_report "$1" ok "$2 > $3"; return 0; fi
    vblk_report "$1" fail "got '$2', want an integer > $3"
    return 1
}
feature_bit() { cut -c "$(($2 + 1))" "/sys/block/$1/device/features"; }
"#;

// ---------------------------------------------------------------------------
// Test data

/// Deterministic pseudo-random bytes (xorshift64*), distinct per seed.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Reads `len` bytes at `offset` of a file.
pub fn read_at(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let f = fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut buf = vec![0; len];
    f.read_exact_at(&mut buf, offset)
        .unwrap_or_else(|e| panic!("{}: read at {offset}: {e}", path.display()));
    buf
}

/// Writes `data` at `offset` of a file.
pub fn write_at(path: &Path, offset: u64, data: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    f.write_all_at(data, offset)
        .unwrap_or_else(|e| panic!("{}: write at {offset}: {e}", path.display()));
}

/// A new qcow2 image `name` in `dir` of `size` (e.g. "4G") with clusters of `cluster`
/// bytes, whose 4 KiB at each guest offset of `markers` are written (zeroes) beforehand:
/// the host tells a guest something by writing into the file there, where `qemu-img
/// map` found them. Its path and the markers' offsets in the file.
pub fn qcow2_with_markers(
    dir: &Path,
    name: &str,
    size: &str,
    cluster: u64,
    markers: &[u64],
) -> (PathBuf, Vec<u64>) {
    let qemu = |args: &[&str]| {
        let out = std::process::Command::new(args[0])
            .args(&args[1..])
            .current_dir(dir)
            .output()
            .unwrap_or_else(|e| panic!("{} (qemu-utils): {e}", args[0]));
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let opts = format!("cluster_size={cluster}");
    qemu(&["qemu-img", "create", "-f", "qcow2", "-o", &opts, name, size]);
    let writes: Vec<String> = markers
        .iter()
        .map(|m| format!("write -P 0 {m} 4k"))
        .collect();
    let mut args = vec!["qemu-io", "-f", "qcow2"];
    for w in &writes {
        args.extend(["-c", w.as_str()]);
    }
    args.push(name);
    qemu(&args);
    let map: serde_json::Value =
        serde_json::from_str(&qemu(&["qemu-img", "map", "--output=json", name])).unwrap();
    let host = |guest: u64| {
        map.as_array()
            .unwrap()
            .iter()
            .find(|e| e["start"].as_u64() == Some(guest) && e["data"] == true)
            .and_then(|e| e["offset"].as_u64())
            .unwrap_or_else(|| panic!("qemu-img map: no data at {guest}: {map}"))
    };
    (dir.join(name), markers.iter().map(|&m| host(m)).collect())
}

/// Where two buffers first differ, for messages.
pub fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .or(if a.len() == b.len() {
            None
        } else {
            Some(a.len().min(b.len()))
        })
}

// ---------------------------------------------------------------------------
// Temporary directories

/// A directory removed (with its contents) on drop.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    /// A fresh directory under `base` (short paths matter: Unix socket paths
    /// are limited to 107 bytes).
    pub fn new_in(base: &Path, label: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .subsec_nanos();
        let path = base.join(format!(
            "vblk-{label}-{}-{}-{nanos:x}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        fs::create_dir_all(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        TempDir(path)
    }

    /// A fresh directory under the system temp dir.
    pub fn new(label: &str) -> TempDir {
        TempDir::new_in(&std::env::temp_dir(), label)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn join(&self, p: impl AsRef<Path>) -> PathBuf {
        self.0.join(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

// ---------------------------------------------------------------------------
// Booting

/// One vhost-user-blk-pci device of the guest.
#[derive(Debug, Clone)]
pub struct Disk {
    pub socket: PathBuf,
    /// QEMU's `num-queues`; `None`: QEMU's default (one per vCPU).
    pub num_queues: Option<u16>,
    /// QEMU's `queue-size` (entries per virtqueue); `None`: QEMU's default (128).
    pub queue_size: Option<u16>,
    /// `reconnect=1` on the chardev: QEMU reattaches a restarted backend.
    pub reconnect: bool,
}

/// A guest boot: devices, script, data files and limits.
#[derive(Debug, Clone)]
pub struct Guest {
    name: String,
    disks: Vec<Disk>,
    script: String,
    files: Vec<(String, Vec<u8>)>,
    timeout: Duration,
    smp: u32,
    cpu: String,
    memory_mib: u32,
    /// RAM 8 KiB over `memory_mib`, for a guest that QEMU 7.2 migrates ([`Guest::migratable`]).
    migratable: bool,
    cmdline: Vec<String>,
    layers: Vec<PathBuf>,
    logs: Vec<(String, PathBuf)>,
    watched: Vec<(String, u32)>,
    /// A guest reset reboots (QEMU without `-no-reboot`).
    reboot: bool,
    /// More QEMU arguments (devices to plug into later, ...).
    qemu_args: Vec<String>,
}

/// Has process `pid` exited (gone, or a zombie not yet reaped)?
fn process_ended(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next());
            matches!(state, Some('Z' | 'X') | None)
        }
        Err(_) => true,
    }
}

/// A QEMU process (the `timeout` wrapper leads its process group); killed
/// with its group on drop unless it was waited for.
pub struct QemuGuard(pub Option<Child>);

/// Sends `signal` (a name: TERM, KILL) to process group `pgid`, through the
/// shell's `kill` (std has no kill(2) and this crate no libc dependency).
/// `kill -SIG -PGID` is understood by dash, bash and busybox sh alike.
pub fn signal_group(pgid: u32, signal: &str) {
    let _ = Command::new("sh")
        .arg("-c")
        .arg(format!("kill -{signal} -{pgid} 2>/dev/null"))
        .stdin(Stdio::null())
        .status();
}

impl Drop for QemuGuard {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            // `timeout` put itself and QEMU into a process group led by itself.
            signal_group(child.id(), "KILL");
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Guest {
    /// A guest named `name` (used in messages); 2 vCPUs (the number of
    /// virtio-blk hardware queues is capped by the number of CPUs), no disks.
    pub fn new(name: &str) -> Guest {
        Guest {
            name: name.into(),
            disks: Vec::new(),
            script: String::new(),
            files: Vec::new(),
            timeout: Duration::from_secs(240),
            smp: 2,
            cpu: "max".into(),
            memory_mib: GUEST_MEM_MIB,
            migratable: false,
            cmdline: Vec::new(),
            layers: Vec::new(),
            logs: Vec::new(),
            watched: Vec::new(),
            reboot: false,
            qemu_args: Vec::new(),
        }
    }

    /// One more QEMU argument (e.g. `-device pcie-root-port,...` to hot-plug a disk into).
    pub fn qemu_arg(mut self, arg: &str) -> Guest {
        self.qemu_args.push(arg.into());
        self
    }

    /// Adds a vhost-user-blk-pci device; the first is `/dev/vda`, then `vdb`...
    pub fn disk(mut self, socket: impl AsRef<Path>, num_queues: u16) -> Guest {
        self.disks.push(Disk {
            socket: socket.as_ref().to_path_buf(),
            num_queues: Some(num_queues),
            queue_size: None,
            reconnect: false,
        });
        self
    }

    /// Adds a vhost-user-blk-pci device with none of its properties set: what a user
    /// gets from `-device vhost-user-blk-pci,chardev=...` (one queue per vCPU, 128
    /// entries).
    pub fn disk_qemu_defaults(mut self, socket: impl AsRef<Path>) -> Guest {
        self.disks.push(Disk {
            socket: socket.as_ref().to_path_buf(),
            num_queues: None,
            queue_size: None,
            reconnect: false,
        });
        self
    }

    /// Adds a vhost-user-blk-pci device whose chardev reconnects (`reconnect=1`), so that
    /// QEMU reattaches a backend restarted after a crash.
    pub fn disk_reconnecting(mut self, socket: impl AsRef<Path>, num_queues: u16) -> Guest {
        self.disks.push(Disk {
            socket: socket.as_ref().to_path_buf(),
            num_queues: Some(num_queues),
            queue_size: None,
            reconnect: true,
        });
        self
    }

    /// Adds a vhost-user-blk-pci device with QEMU's `queue-size=queue_size`.
    pub fn disk_with_queue_size(
        mut self,
        socket: impl AsRef<Path>,
        num_queues: u16,
        queue_size: u16,
    ) -> Guest {
        self.disks.push(Disk {
            socket: socket.as_ref().to_path_buf(),
            num_queues: Some(num_queues),
            queue_size: Some(queue_size),
            reconnect: false,
        });
        self
    }

    /// QEMU's `-cpu` model (default `max`).
    pub fn cpu(mut self, model: &str) -> Guest {
        self.cpu = model.into();
        self
    }

    /// Guest RAM in MiB (default 512).
    pub fn memory_mib(mut self, mib: u32) -> Guest {
        self.memory_mib = mib;
        self
    }

    /// Size the RAM so that QEMU 7.2 under TCG migrates every page the vCPUs write:
    /// 8 KiB more than [`Guest::memory_mib`].
    ///
    /// QEMU before 9.0 (commit 03bfc2188f, "physmem: Fix migration dirty bitmap
    /// coherency with TCG memory access") clears the migration dirty bits of a RAM block
    /// whose size is a multiple of 64 pages (256 KiB) word by word without resetting the
    /// vCPUs' TLB entries. A vCPU that has written a page once keeps writing it through
    /// its TLB without marking it dirty again, so the migration never sends those writes:
    /// kernel pages, page-table pages and the guest's own virtqueue indices arrive stale
    /// (in this harness: thousands of pages per migration under a guest's memory
    /// writes, an oops or a ring "ahead by 65528" on the destination). A size that is
    /// not a multiple of 64 pages takes QEMU's page-by-page path, which resets the TLB
    /// entries. KVM tracks dirty pages in the host kernel and is not affected.
    pub fn migratable(mut self) -> Guest {
        self.migratable = true;
        self
    }

    /// More kernel command-line arguments.
    pub fn kernel_arg(mut self, arg: &str) -> Guest {
        self.cmdline.push(arg.into());
        self
    }

    /// A cached cpio archive (e.g. from [`super::layer`]) unpacked over the base
    /// initramfs, before the per-boot files.
    pub fn layer(mut self, archive: impl AsRef<Path>) -> Guest {
        self.layers.push(archive.as_ref().to_path_buf());
        self
    }

    /// The guest-side shell script (busybox sh), with [`SCRIPT_HELPERS`] and
    /// [`GUEST_ENV`] available.
    pub fn script(mut self, script: impl Into<String>) -> Guest {
        self.script = script.into();
        self
    }

    /// A file placed in the guest's root file system before it starts.
    pub fn file(mut self, guest_path: &str, data: impl Into<Vec<u8>>) -> Guest {
        self.files
            .push((guest_path.trim_start_matches('/').to_string(), data.into()));
        self
    }

    /// Overall limit for the QEMU run (`$VBLK_GUEST_TIMEOUT_SECS` overrides it,
    /// for slow machines).
    pub fn timeout(mut self, timeout: Duration) -> Guest {
        self.timeout = timeout;
        self
    }

    pub fn smp(mut self, cpus: u32) -> Guest {
        self.smp = cpus;
        self
    }

    /// A host log (e.g. a daemon's) to include in failure reports.
    pub fn attach_log(mut self, label: &str, path: impl AsRef<Path>) -> Guest {
        self.logs.push((label.into(), path.as_ref().to_path_buf()));
        self
    }

    /// A reset (`echo b > /proc/sysrq-trigger`, a triple fault) reboots the guest, which
    /// runs its script again; by default QEMU exits instead (`-no-reboot`).
    pub fn allow_reboot(mut self) -> Guest {
        self.reboot = true;
        self
    }

    /// Stops the boot early (instead of waiting for the timeout) if process
    /// `pid` (e.g. a backend daemon) exits while the guest runs.
    pub fn watch(mut self, label: &str, pid: u32) -> Guest {
        self.watched.push((label.into(), pid));
        self
    }

    /// The initramfs of this guest (the base archive, the layers, the per-boot files) in
    /// a fresh work directory, after checking that its disks' sockets exist.
    pub fn prepare(&self) -> (TempDir, PathBuf) {
        require_programs(&[
            ("qemu-system-x86_64", "qemu-system-x86"),
            ("timeout", "coreutils"),
        ]);
        let assets = assets();
        let work = TempDir::new_in(&target_dir().join("tmp"), &format!("boot-{}", self.name));

        // Base archive + per-boot archive.
        let mut extra = Cpio::default();
        let letters: Vec<String> = (0..self.disks.len())
            .map(|i| format!("vd{}", (b'a' + i as u8) as char))
            .collect();
        extra.file("vblk/disks", 0o644, letters.join(" ").as_bytes());
        let script = format!(
            "{SCRIPT_HELPERS}\nexport {GUEST_ENV}\n# ---- test script ----\n{}\n",
            self.script
        );
        extra.file("vblk/test.sh", 0o755, script.as_bytes());
        for (path, data) in &self.files {
            extra.file(path, 0o644, data);
        }
        let mut initrd = Vec::new();
        for archive in std::iter::once(&assets.initramfs).chain(&self.layers) {
            let data = fs::read(archive).unwrap_or_else(|e| panic!("{}: {e}", archive.display()));
            initrd.extend_from_slice(&data);
        }
        initrd.extend_from_slice(&extra.finish());
        let initrd_path = work.join("initramfs.cpio");
        fs::write(&initrd_path, &initrd)
            .unwrap_or_else(|e| panic!("{}: {e}", initrd_path.display()));
        self.check_sockets();
        (work, initrd_path)
    }

    fn check_sockets(&self) {
        for disk in &self.disks {
            let ok = fs::metadata(&disk.socket)
                .map(|m| m.file_type().is_socket())
                .unwrap_or(false);
            assert!(
                ok,
                "[{}] vhost-user socket {} does not exist",
                self.name,
                disk.socket.display()
            );
        }
    }

    /// This guest's disks, with disk `i`'s socket replaced (a migration's other end).
    pub fn with_socket(&self, i: usize, socket: impl AsRef<Path>) -> Guest {
        let mut g = self.clone();
        g.disks[i].socket = socket.as_ref().to_path_buf();
        g
    }

    /// The QEMU command line of this guest (under `timeout` for `secs`), its console on
    /// `serial` (QEMU's `-serial` argument), with `extra` arguments.
    pub fn qemu_command(
        &self,
        initrd_path: &Path,
        secs: u64,
        serial: &str,
        extra: &[String],
    ) -> Command {
        let assets = assets();
        let mut cmd = Command::new(find_program("timeout").expect("checked"));
        cmd.args(["--kill-after=10", &format!("{secs}")]);
        cmd.arg(find_program("qemu-system-x86_64").expect("checked"));
        cmd.args(["-nodefaults", "-no-user-config", "-display", "none"]);
        if !self.reboot {
            cmd.arg("-no-reboot");
        }
        cmd.args([
            "-machine",
            "q35",
            "-accel",
            "tcg",
            "-cpu",
            &self.cpu,
            "-smp",
            &self.smp.to_string(),
        ]);
        // QEMU rounds RAM to 8 KiB; the NUMA node's memdev must be exactly that size.
        let mem = if self.migratable {
            format!("{}K", u64::from(self.memory_mib) * 1024 + 8)
        } else {
            format!("{}M", self.memory_mib)
        };
        cmd.args(["-m", &mem]);
        cmd.args([
            "-object",
            &format!("memory-backend-memfd,id=mem,size={mem},share=on"),
        ]);
        cmd.args(["-numa", "node,memdev=mem"]);
        cmd.arg("-kernel").arg(&assets.vmlinux);
        cmd.arg("-initrd").arg(initrd_path);
        let mut append =
            "console=ttyS0 rdinit=/init panic=-1 oops=panic mitigations=off".to_string();
        for arg in &self.cmdline {
            append.push(' ');
            append.push_str(arg);
        }
        cmd.arg("-append").arg(append);
        cmd.args(["-serial", serial]);
        for (i, disk) in self.disks.iter().enumerate() {
            cmd.arg("-chardev").arg(format!(
                "socket,id=vhu{i},path={}{}",
                disk.socket.display(),
                if disk.reconnect { ",reconnect=1" } else { "" }
            ));
            let mut device = format!("vhost-user-blk-pci,chardev=vhu{i}");
            if let Some(n) = disk.num_queues {
                write!(device, ",num-queues={n}").expect("string");
            }
            if let Some(q) = disk.queue_size {
                write!(device, ",queue-size={q}").expect("string");
            }
            cmd.arg("-device").arg(device);
        }
        cmd.args(&self.qemu_args);
        cmd.args(extra);
        cmd
    }

    /// The limit of a QEMU run, in seconds (`$VBLK_GUEST_TIMEOUT_SECS` overrides it).
    pub fn timeout_secs(&self) -> u64 {
        match std::env::var("VBLK_GUEST_TIMEOUT_SECS") {
            Ok(v) => v
                .parse::<u64>()
                .unwrap_or_else(|_| panic!("VBLK_GUEST_TIMEOUT_SECS={v}: not a number")),
            Err(_) => self.timeout.as_secs(),
        }
        .max(1)
    }

    /// Boots the guest, runs the script and returns the parsed results. Does
    /// not assert: see [`Boot::assert_ok`].
    pub fn boot(&self) -> Boot {
        let (work, initrd_path) = self.prepare();
        let serial_path = work.join("serial.log");
        let stderr_path = work.join("qemu.stderr");
        let mut cmd = self.qemu_command(&initrd_path, self.timeout_secs(), "stdio", &[]);
        let serial = fs::File::create(&serial_path).expect("serial log");
        let stderr = fs::File::create(&stderr_path).expect("stderr log");
        cmd.stdin(Stdio::null())
            .stdout(serial)
            .stderr(stderr)
            .process_group(0);
        let command_line = format!("{cmd:?}");

        let start = Instant::now();
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {command_line}: {e}"));
        let mut guard = QemuGuard(Some(child));
        let mut aborted = None;
        let status = loop {
            let qemu = guard.0.as_mut().expect("set until waited for");
            if let Some(status) = qemu.try_wait().expect("wait for QEMU") {
                break status;
            }
            if aborted.is_none() {
                if let Some((label, pid)) = self.watched.iter().find(|(_, pid)| process_ended(*pid))
                {
                    aborted = Some(format!(
                        "{label} (pid {pid}) exited while the guest was running"
                    ));
                    // Give QEMU a moment to log the disconnect, then stop it
                    // (TERM to the group of `timeout`, which holds QEMU).
                    std::thread::sleep(Duration::from_millis(500));
                    signal_group(qemu.id(), "TERM");
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        guard.0 = None;
        let elapsed = start.elapsed();

        let serial =
            String::from_utf8_lossy(&fs::read(&serial_path).unwrap_or_default()).replace('\r', "");
        let stderr =
            String::from_utf8_lossy(&fs::read(&stderr_path).unwrap_or_default()).into_owned();
        let mut boot = Boot::parse(self, command_line, status, elapsed, serial, stderr);
        boot.aborted = aborted;
        boot
    }
}

/// One `VBLK-CHECK` line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub name: String,
    pub ok: bool,
    pub detail: String,
}

/// The outcome of a boot.
#[derive(Debug, Clone)]
pub struct Boot {
    pub name: String,
    pub command_line: String,
    pub status: ExitStatus,
    pub elapsed: Duration,
    pub timed_out: bool,
    /// Why the boot was stopped early (a watched process exited).
    pub aborted: Option<String>,
    pub done: bool,
    pub checks: Vec<Check>,
    /// The guest serial console.
    pub serial: String,
    pub qemu_stderr: String,
    logs: Vec<(String, PathBuf)>,
}

impl Boot {
    /// The outcome of a run whose console is `serial` (several QEMU processes' consoles
    /// joined, for a migrated guest).
    pub fn parse(
        guest: &Guest,
        command_line: String,
        status: ExitStatus,
        elapsed: Duration,
        serial: String,
        qemu_stderr: String,
    ) -> Boot {
        let mut checks = Vec::new();
        let mut done = false;
        for line in serial.lines() {
            if let Some(pos) = line.find("VBLK-CHECK ") {
                let mut parts = line[pos + "VBLK-CHECK ".len()..].splitn(3, ' ');
                let name = parts.next().unwrap_or_default().to_string();
                let ok = match parts.next() {
                    Some("ok") => true,
                    Some(_) | None => false,
                };
                let detail = parts.next().unwrap_or_default().trim().to_string();
                checks.push(Check { name, ok, detail });
            } else if line.trim_end().ends_with("VBLK-DONE") {
                done = true;
            }
        }
        Boot {
            name: guest.name.clone(),
            command_line,
            timed_out: status.code() == Some(124) || status.code() == Some(137),
            aborted: None,
            status,
            elapsed,
            done,
            checks,
            serial,
            qemu_stderr,
            logs: guest.logs.clone(),
        }
    }

    /// The first check called `name`.
    pub fn check(&self, name: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.name == name)
    }

    pub fn failed(&self) -> Vec<&Check> {
        self.checks.iter().filter(|c| !c.ok).collect()
    }

    /// Everything needed to debug a failure: summary, checks, serial log,
    /// QEMU's stderr and the attached host logs.
    pub fn report(&self) -> String {
        let mut r = String::new();
        let _ = writeln!(
            r,
            "guest boot `{}`: QEMU {} after {:.1?}{}; VBLK-DONE {}",
            self.name,
            self.status,
            self.elapsed,
            if self.timed_out { " (TIMED OUT)" } else { "" },
            if self.done { "seen" } else { "NOT seen" }
        );
        if let Some(why) = &self.aborted {
            let _ = writeln!(r, "ABORTED: {why}");
        }
        let _ = writeln!(r, "command: {}", self.command_line);
        let _ = writeln!(r, "---- checks ----");
        for c in &self.checks {
            let _ = writeln!(
                r,
                "{:<4} {:<24} {}",
                if c.ok { "ok" } else { "FAIL" },
                c.name,
                c.detail
            );
        }
        let _ = writeln!(r, "---- serial log ----\n{}", self.serial);
        if !self.qemu_stderr.trim().is_empty() {
            let _ = writeln!(r, "---- QEMU stderr ----\n{}", self.qemu_stderr);
        }
        for (label, path) in &self.logs {
            let text = fs::read(path).map(|b| String::from_utf8_lossy(&b).into_owned());
            let text = text.unwrap_or_else(|e| format!("<cannot read {}: {e}>", path.display()));
            let tail: Vec<&str> = text.lines().rev().take(200).collect();
            let _ = writeln!(
                r,
                "---- {label} ({}, last {} lines) ----",
                path.display(),
                tail.len()
            );
            for l in tail.iter().rev() {
                let _ = writeln!(r, "{l}");
            }
        }
        r
    }

    /// Asserts that the guest finished its script, QEMU exited cleanly,
    /// every check passed and every name in `expected` was checked.
    pub fn assert_ok(&self, expected: &[&str]) {
        let mut problems = Vec::new();
        if let Some(why) = &self.aborted {
            problems.push(format!("boot aborted: {why}"));
        } else if self.timed_out {
            problems.push(format!("QEMU timed out after {:.1?}", self.elapsed));
        } else if !self.status.success() {
            problems.push(format!("QEMU exited with {}", self.status));
        }
        if !self.done {
            problems.push("the guest did not print VBLK-DONE".to_string());
        }
        for c in self.failed() {
            problems.push(format!("check `{}` failed: {}", c.name, c.detail));
        }
        for name in expected {
            if self.check(name).is_none() {
                problems.push(format!("check `{name}` did not run"));
            }
        }
        assert!(
            problems.is_empty(),
            "{}\n\n{}",
            problems.join("\n"),
            self.report()
        );
    }
}
