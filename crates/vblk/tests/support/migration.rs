//! A guest that lives in several QEMU processes one after another: each is started from
//! the same [`Guest`] definition (its disk's socket changed to the other backend), the
//! next with `-incoming unix:PATH`, and the running one is migrated to it over QMP
//! (`migrate`, then `query-migrate` until `completed`) and told to `quit`.
//!
//! Every wait is bounded; every QEMU process is killed with its group when its [`Vm`] is
//! dropped.

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::guest::{Guest, QemuGuard};

/// A QMP connection.
pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Qmp {
    /// Connect to `path` (retrying until `within`), read the greeting, negotiate.
    pub fn connect(path: &Path, within: Duration) -> Result<Qmp, String> {
        let deadline = Instant::now() + within;
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    return Err(format!("QMP {}: {e}", path.display()))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .map_err(|e| e.to_string())?;
        let writer = stream.try_clone().map_err(|e| e.to_string())?;
        let mut q = Qmp {
            reader: BufReader::new(stream),
            writer,
        };
        q.line()?;
        q.cmd("qmp_capabilities", json!({}))?;
        Ok(q)
    }

    fn line(&mut self) -> Result<Value, String> {
        let mut l = String::new();
        self.reader
            .read_line(&mut l)
            .map_err(|e| format!("QMP read: {e}"))?;
        if l.is_empty() {
            return Err("QMP: QEMU closed the connection".into());
        }
        serde_json::from_str(&l).map_err(|e| format!("QMP: {e}: {l}"))
    }

    /// Run `execute` with `arguments`; its `return` value, or its error.
    pub fn cmd(&mut self, execute: &str, arguments: Value) -> Result<Value, String> {
        let m = json!({"execute": execute, "arguments": arguments});
        writeln!(self.writer, "{m}").map_err(|e| format!("QMP write: {e}"))?;
        loop {
            let v = self.line()?;
            if v.get("event").is_some() {
                continue;
            }
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            return Err(format!("QMP {execute}: {v}"));
        }
    }
}

/// One QEMU process of the guest.
pub struct Vm {
    pub name: String,
    guard: QemuGuard,
    pub qmp: Qmp,
    pub serial: PathBuf,
    pub stderr: PathBuf,
    pub command_line: String,
}

impl Vm {
    /// Start `guest` as process `name` (files in `dir`), waiting for a migration on
    /// `incoming` if given.
    pub fn start(
        guest: &Guest,
        initrd: &Path,
        dir: &Path,
        name: &str,
        incoming: Option<&Path>,
    ) -> Vm {
        let serial = dir.join(format!("{name}.serial"));
        let stderr = dir.join(format!("{name}.stderr"));
        let qmp = dir.join(format!("{name}.qmp"));
        let mut extra = vec![
            "-qmp".to_string(),
            format!("unix:{},server=on,wait=off", qmp.display()),
        ];
        if let Some(p) = incoming {
            // -S: the destination stays paused after the migration until `resume`, so its
            // memory can be compared with the source's first.
            extra.push("-S".into());
            extra.push("-incoming".into());
            extra.push(format!("unix:{}", p.display()));
        }
        let console = format!("file:{}", serial.display());
        // Every VM of a migration (source and destinations) has the same RAM, sized so
        // that QEMU 7.2's TCG dirty tracking carries every page (Guest::migratable).
        let guest = guest.clone().migratable();
        let mut cmd = guest.qemu_command(initrd, guest.timeout_secs(), &console, &extra);
        let err = fs::File::create(&stderr).expect("stderr log");
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(err)
            .process_group(0);
        let command_line = format!("{cmd:?}");
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {command_line}: {e}"));
        let guard = QemuGuard(Some(child));
        let qmp = Qmp::connect(&qmp, Duration::from_secs(30)).unwrap_or_else(|e| {
            panic!(
                "{name}: {e}\n{command_line}\n{}",
                fs::read_to_string(&stderr).unwrap_or_default()
            )
        });
        Vm {
            name: name.into(),
            guard,
            qmp,
            serial,
            stderr,
            command_line,
        }
    }

    /// The console so far.
    pub fn console(&self) -> String {
        String::from_utf8_lossy(&fs::read(&self.serial).unwrap_or_default()).replace('\r', "")
    }

    /// Wait until the console shows `text`; false after `within`.
    pub fn wait_console(&mut self, text: &str, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if self.console().contains(text) {
                return true;
            }
            if self.exited() {
                return self.console().contains(text);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }

    fn exited(&mut self) -> bool {
        self.guard
            .0
            .as_mut()
            .is_none_or(|c| c.try_wait().ok().flatten().is_some())
    }

    /// Migrate to `dest` (started with `-incoming mig`), waiting up to `within` for
    /// `completed`. The final `query-migrate` answer.
    pub fn migrate_to(&mut self, dest: &Vm, mig: &Path, within: Duration) -> Result<Value, String> {
        let uri = format!("unix:{}", mig.display());
        // The destination listens once its QMP socket answers; give its -incoming socket a
        // moment to exist too.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !mig.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        self.qmp.cmd("migrate", json!({ "uri": uri }))?;
        let deadline = Instant::now() + within;
        loop {
            let r = self.qmp.cmd("query-migrate", json!({}))?;
            match r.get("status").and_then(Value::as_str) {
                Some("completed") => return Ok(r),
                Some("failed") | Some("cancelled") => {
                    return Err(format!(
                        "migration {} -> {}: {r}\n{}",
                        self.name,
                        dest.name,
                        fs::read_to_string(&self.stderr).unwrap_or_default()
                    ))
                }
                _ => {}
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "migration {} -> {} not completed within {within:?}: {r}",
                    self.name, dest.name
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Where the guest's virtqueues are (QMP `x-query-virtio-queue-status`, for every
    /// virtio device and queue QEMU has), for a report.
    pub fn queues(&mut self) -> String {
        let devices = match self.qmp.cmd("x-query-virtio", json!({})) {
            Ok(Value::Array(d)) => d,
            other => return format!("x-query-virtio: {other:?}"),
        };
        let mut out = Vec::new();
        for d in devices {
            let path = d["path"].as_str().unwrap_or_default().to_owned();
            for queue in 0..16 {
                match self.qmp.cmd(
                    "x-query-virtio-queue-status",
                    json!({"path": path, "queue": queue}),
                ) {
                    Ok(q) => out.push(format!(
                        "{path} queue {queue}: desc {:#x} avail {:#x} used {:#x} (last avail {}, used {})",
                        q["vring-desc"].as_u64().unwrap_or(0),
                        q["vring-avail"].as_u64().unwrap_or(0),
                        q["vring-used"].as_u64().unwrap_or(0),
                        q["last-avail-idx"],
                        q["used-idx"]
                    )),
                    Err(_) => break,
                }
            }
        }
        out.join("; ")
    }

    /// Let a migration's destination run (`cont`).
    pub fn resume(&mut self) -> Result<(), String> {
        self.qmp.cmd("cont", json!({})).map(|_| ())
    }

    /// The QEMU process (the child of the `timeout` that runs it).
    fn qemu_pid(&self) -> Result<u32, String> {
        let child = self.guard.0.as_ref().ok_or("the QEMU process has ended")?;
        let id = child.id();
        let children = fs::read_to_string(format!("/proc/{id}/task/{id}/children"))
            .map_err(|e| format!("{}: children of {id}: {e}", self.name))?;
        children
            .split_whitespace()
            .next()
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| format!("{}: timeout {id} has no QEMU child", self.name))
    }

    /// The guest's RAM: QEMU's memfd (`memory-backend-memfd,id=mem`), read through /proc.
    pub fn ram(&self) -> Result<Vec<u8>, String> {
        let pid = self.qemu_pid()?;
        let dir = format!("/proc/{pid}/fd");
        for e in fs::read_dir(&dir).map_err(|e| format!("{dir}: {e}"))? {
            let path = e.map_err(|e| e.to_string())?.path();
            let Ok(link) = fs::read_link(&path) else {
                continue;
            };
            if link
                .to_string_lossy()
                .starts_with("/memfd:memory-backend-memfd ")
            {
                return fs::read(&path).map_err(|e| format!("{}: {e}", path.display()));
            }
        }
        Err(format!(
            "{}: QEMU {pid} has no memory-backend-memfd",
            self.name
        ))
    }

    /// `quit`, then wait for the process to end (killed after `within`).
    pub fn quit(mut self, within: Duration) -> Option<ExitStatus> {
        let _ = self.qmp.cmd("quit", json!({}));
        self.wait(within)
    }

    /// Wait for the process to end; killed (with its group) after `within`.
    pub fn wait(&mut self, within: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + within;
        let child = self.guard.0.as_mut()?;
        loop {
            if let Ok(Some(st)) = child.try_wait() {
                self.guard.0 = None;
                return Some(st);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
