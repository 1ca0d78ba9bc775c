//! What the driver's integration tests share: a vblk device in this process on a socket in
//! a temp dir, its statistics, and reproducible data.
#![allow(dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use device::{DaemonConfig, DeviceConfig, Listen, ServedDisk};
use storage::DiskSpec;

/// A device serving `config` on a fresh socket; it runs until the test process exits.
pub fn start(config: DeviceConfig) -> (tempfile::TempDir, PathBuf) {
    start_with(DaemonConfig::default(), config)
}

/// [`start`], the daemon configured as `daemon` says.
pub fn start_with(daemon: DaemonConfig, config: DeviceConfig) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("vblk.sock");
    let disk = ServedDisk {
        id: "test".into(),
        listen: Listen::Path(sock.clone()),
        config,
        spec: String::new(),
    };
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let controls = std::sync::Arc::new(device::Controls::new().unwrap());
        let r = device::serve(&daemon, vec![disk], &controls, &mut || tx.send(()).unwrap());
        if let Err(e) = r {
            panic!("device failed: {e}");
        }
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("device did not start");
    (dir, sock)
}

/// A RAM disk of 64 MiB with `queues` queues.
pub fn mem_device(queues: u16) -> DeviceConfig {
    DeviceConfig {
        disk: DiskSpec::Mem(64 << 20),
        num_queues: queues,
        ..Default::default()
    }
}

/// A daemon with a control socket in `dir`, and its path.
pub fn with_stats(dir: &Path) -> (DaemonConfig, PathBuf) {
    let p = dir.join("control.sock");
    let daemon = DaemonConfig {
        control_socket: Some(p.clone()),
        ..Default::default()
    };
    (daemon, p)
}

/// Requests of `kind` ("read", "write", "flush", ...) the device completed, all queues.
pub fn device_count(control: &Path, kind: &str) -> u64 {
    let mut s = std::os::unix::net::UnixStream::connect(control).expect("control socket");
    std::io::Write::write_all(&mut s, b"{\"op\":\"stats\"}\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["queues"]
        .as_array()
        .map(|qs| {
            qs.iter()
                .map(|q| q["ops"][kind]["ios"].as_u64().unwrap_or(0))
                .sum()
        })
        .unwrap_or(0)
}

/// A deterministic pseudo-random generator (xorshift), so failures reproduce.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// `len` bytes from `seed`.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut r = Rng(seed | 1);
    (0..len).map(|_| r.next() as u8).collect()
}
