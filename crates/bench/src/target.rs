//! What a benchmark runs against: an embedded vblk device in this process, any
//! vhost-user-blk socket, or (`--baseline`) the disk straight through a storage engine.

use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use device::{DaemonConfig, DeviceConfig};
use driver::{Disk, DiskOptions, PathKind, QueueOptions, RequestOptions};
use storage::{Backend, CacheMode, DiskSpec, EngineKind, OpenOptions, POOL_THREAD_PREFIX};

use crate::lane::{DriverLane, EngineLane, Lane, PassthruLane};
use crate::stats::ThreadSample;

/// The device `vblk bench` starts in its own process: the daemon's settings (worker
/// threads, polling, CPUs) and its one disk's. Derefs to the disk's.
#[derive(Clone, Debug)]
pub struct EmbeddedDevice {
    /// The daemon's settings.
    pub daemon: DaemonConfig,
    /// The disk's.
    pub device: DeviceConfig,
}

impl std::ops::Deref for EmbeddedDevice {
    type Target = DeviceConfig;
    fn deref(&self) -> &DeviceConfig {
        &self.device
    }
}

impl std::ops::DerefMut for EmbeddedDevice {
    fn deref_mut(&mut self) -> &mut DeviceConfig {
        &mut self.device
    }
}

/// Where to run.
#[derive(Clone, Debug)]
pub enum TargetSpec {
    /// A vblk device started in this process on a private socket (its queue count is set
    /// to what the job needs).
    Embedded(Box<EmbeddedDevice>),
    /// Any vhost-user-blk device; `device_pid` lets its CPU time be read from /proc.
    Socket {
        /// The device's socket.
        path: PathBuf,
        /// The device's process, for CPU accounting.
        device_pid: Option<i32>,
        /// More devices (`--socket` given several times): the job's clones are spread over
        /// `path` and these, clone i on the (i mod n)-th, each with a queue of its own.
        also: Vec<PathBuf>,
    },
    /// No virtio: the job threads drive a storage engine on the disk directly.
    Baseline {
        /// The disk.
        disk: DiskSpec,
        /// The engine.
        engine: EngineKind,
        /// Page cache or O_DIRECT.
        cache: CacheMode,
        /// Pool size of the `threads` engine.
        engine_threads: usize,
    },
}

/// How the driver attaches (ignored by the baseline).
#[derive(Clone, Copy, Debug)]
pub struct AttachOptions {
    /// The I/O path.
    pub path: PathKind,
    /// Requests per notification on the batch path.
    pub batch: u16,
    /// Spin bound before sleeping on a completion.
    pub spin: Duration,
    /// Entries per virtqueue.
    pub queue_size: u16,
    /// The request path's tunables.
    pub request: RequestOptions,
    /// Writes are FUA.
    pub fua: bool,
}

struct Embedded {
    stop: Arc<device::Controls>,
    thread: Option<JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl Drop for Embedded {
    fn drop(&mut self) {
        self.stop.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// An open target.
pub struct Target {
    spec: TargetSpec,
    socket: Option<PathBuf>,
    backend: Option<Arc<Backend>>,
    _embedded: Option<Embedded>,
}

/// Size and alignment of the target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Bytes.
    pub capacity: u64,
    /// Logical block size: every offset and length is a multiple of it.
    pub block: u64,
}

impl Target {
    /// Open `spec`; an embedded device gets `queues` virtqueues. A job that does not
    /// write opens the embedded device's or the baseline's disk read-only (as fio opens
    /// a read job's file): a file the user may only read can be read.
    pub fn open(spec: &TargetSpec, queues: u16, writes: bool) -> Result<Target, String> {
        match spec {
            TargetSpec::Embedded(cfg) => {
                let mut cfg = EmbeddedDevice::clone(cfg);
                cfg.device.read_only |= !writes;
                cfg.device.num_queues = queues.max(1);
                cfg.daemon.threads = cfg.daemon.threads.clamp(1, usize::from(queues.max(1)));
                let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
                let socket = dir.path().join("embedded.sock");
                let stop = Arc::new(
                    device::Controls::new()
                        .map_err(|e| format!("cannot start the embedded device: {e}"))?,
                );
                let (tx, rx) = mpsc::channel();
                let disk = device::ServedDisk {
                    id: "embedded".into(),
                    listen: device::Listen::Path(socket.clone()),
                    config: cfg.device.clone(),
                    spec: String::new(),
                };
                let stop2 = stop.clone();
                let thread = std::thread::Builder::new()
                    .name("vblk-embedded".into())
                    .spawn(move || {
                        let txe = tx.clone();
                        if let Err(e) = device::serve(&cfg.daemon, vec![disk], &stop2, &mut || {
                            let _ = tx.send(Ok(()));
                        }) {
                            let _ = txe.send(Err(e.to_string()));
                        }
                    })
                    .map_err(|e| format!("cannot start the embedded device: {e}"))?;
                match rx.recv_timeout(Duration::from_secs(30)) {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return Err(format!("embedded device: {e}")),
                    Err(_) => return Err("embedded device did not start".into()),
                }
                Ok(Target {
                    spec: spec.clone(),
                    socket: Some(socket.clone()),
                    backend: None,
                    _embedded: Some(Embedded {
                        stop,
                        thread: Some(thread),
                        _dir: dir,
                    }),
                })
            }
            TargetSpec::Socket { path, .. } => Ok(Target {
                spec: spec.clone(),
                socket: Some(path.clone()),
                backend: None,
                _embedded: None,
            }),
            TargetSpec::Baseline {
                disk,
                cache,
                engine_threads,
                ..
            } => {
                let b = Backend::open(
                    disk,
                    &OpenOptions {
                        read_only: !writes,
                        cache: *cache,
                        prealloc: true,
                        engine_threads: *engine_threads,
                        ..Default::default()
                    },
                )
                .map_err(|e| e.to_string())?;
                Ok(Target {
                    spec: spec.clone(),
                    socket: None,
                    backend: Some(Arc::new(b)),
                    _embedded: None,
                })
            }
        }
    }

    /// One line naming the target.
    pub fn describe(&self) -> String {
        match &self.spec {
            TargetSpec::Embedded(c) => format!(
                "embedded vblk device: {}, engine {}{}, {} worker(s), poll {} µs{}",
                c.disk,
                engine_label(c.engine, c.engine_threads),
                if matches!(c.disk, storage::DiskSpec::File(_)) {
                    format!(" (cache {})", c.cache)
                } else {
                    String::new()
                },
                c.daemon.threads,
                c.daemon.poll_us,
                if c.daemon.coalesce_us > 0 {
                    format!(", coalescing up to {} µs", c.daemon.coalesce_us)
                } else {
                    String::new()
                }
            ),
            TargetSpec::Socket { path, also, .. } if also.is_empty() => {
                format!("vhost-user-blk device at {}", path.display())
            }
            TargetSpec::Socket { path, also, .. } => format!(
                "{} vhost-user-blk devices at {}, {}",
                also.len() + 1,
                path.display(),
                also.iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            TargetSpec::Baseline {
                disk,
                engine,
                cache,
                engine_threads,
            } => {
                let engine = engine_label(*engine, *engine_threads);
                format!("baseline: {disk} through {engine} (cache {cache}), no virtio")
            }
        }
    }

    /// Whether this is the no-virtio baseline.
    pub fn is_baseline(&self) -> bool {
        matches!(self.spec, TargetSpec::Baseline { .. })
    }

    /// Whether the device side's CPU can be measured.
    pub fn has_device_side(&self) -> bool {
        match &self.spec {
            TargetSpec::Embedded(_) => true,
            TargetSpec::Socket { device_pid, .. } => device_pid.is_some(),
            TargetSpec::Baseline { .. } => false,
        }
    }

    /// A CPU sample of the device side: its worker threads, their engines' pool threads
    /// and their io_uring workers when embedded; the whole process when external with a
    /// known pid.
    pub fn device_sample(&self) -> Option<ThreadSample> {
        let me = std::process::id() as i32;
        match &self.spec {
            TargetSpec::Embedded(_) => {
                ThreadSample::take(me, &["vblk-worker", POOL_THREAD_PREFIX, "iou-"]).ok()
            }
            TargetSpec::Socket { device_pid, .. } => {
                device_pid.and_then(|p| ThreadSample::process(p).ok())
            }
            TargetSpec::Baseline { .. } => None,
        }
    }

    /// A CPU sample of helpers working for the job threads (the baseline's io_uring workers
    /// and engine pool threads), counted on the driver side.
    pub fn helper_sample(&self) -> ThreadSample {
        match &self.spec {
            TargetSpec::Baseline { .. } => {
                ThreadSample::take(std::process::id() as i32, &[POOL_THREAD_PREFIX, "iou-"])
                    .unwrap_or_default()
            }
            _ => ThreadSample::default(),
        }
    }

    /// `n` lanes of `depth` slots with buffers of `max_block` bytes, and the geometry.
    pub fn lanes(
        &self,
        n: usize,
        depth: usize,
        max_block: usize,
        attach: AttachOptions,
    ) -> Result<(Vec<Box<dyn Lane>>, Geometry), String> {
        if let (Some(b), TargetSpec::Baseline { engine, .. }) = (&self.backend, &self.spec) {
            let lanes = (0..n)
                .map(|_| {
                    EngineLane::new(b.clone(), *engine, depth, max_block, attach.fua)
                        .map(|l| Box::new(l) as Box<dyn Lane>)
                })
                .collect::<Result<Vec<_>, _>>()?;
            let geo = Geometry {
                capacity: b.size(),
                block: u64::from(b.logical_block_size()),
            };
            return Ok((lanes, geo));
        }
        let socket = self.socket.as_ref().ok_or("target has no socket")?;
        let mut sockets = vec![socket.as_path()];
        if let TargetSpec::Socket { also, .. } = &self.spec {
            sockets.extend(also.iter().map(PathBuf::as_path));
        }
        if sockets.len() > 1 {
            return self.lanes_across(&sockets, n, depth, max_block, attach);
        }
        attach_lanes(socket, n, depth, max_block, attach)
    }

    /// `n` lanes spread over several devices, lane i on `sockets[i % len]`; the geometry
    /// is the smallest device's, at the largest block size.
    fn lanes_across(
        &self,
        sockets: &[&Path],
        n: usize,
        depth: usize,
        max_block: usize,
        attach: AttachOptions,
    ) -> Result<(Vec<Box<dyn Lane>>, Geometry), String> {
        let mut per: Vec<std::collections::VecDeque<Box<dyn Lane>>> = Vec::new();
        let mut geo: Option<Geometry> = None;
        for (k, s) in sockets.iter().enumerate() {
            // Lanes k, k + len, k + 2 len, ... are this device's.
            let count = (n + sockets.len() - 1 - k) / sockets.len();
            if count == 0 {
                return Err(format!(
                    "{} sockets but {n} clone(s): every device needs a clone (numjobs={})",
                    sockets.len(),
                    sockets.len()
                ));
            }
            let (lanes, g) = attach_lanes(s, count, depth, max_block, attach)?;
            geo = Some(geo.map_or(g, |o| Geometry {
                capacity: o.capacity.min(g.capacity),
                block: o.block.max(g.block),
            }));
            per.push(lanes.into());
        }
        let lanes = (0..n)
            .map(|i| {
                per[i % sockets.len()]
                    .pop_front()
                    .expect("a lane per clone")
            })
            .collect();
        Ok((lanes, geo.expect("at least one socket")))
    }
}

/// Attach to the device at `socket` with `n` queues and make a lane of each.
fn attach_lanes(
    socket: &Path,
    n: usize,
    depth: usize,
    max_block: usize,
    attach: AttachOptions,
) -> Result<(Vec<Box<dyn Lane>>, Geometry), String> {
    let pool = n * depth * max_block.next_multiple_of(4096) + (8 << 20);
    let opts = DiskOptions {
        num_queues: Some(n as u16),
        queue_size: attach.queue_size,
        pool_size: pool,
        queue: QueueOptions {
            path: attach.path,
            batch: attach.batch,
            spin: attach.spin,
            request: attach.request,
            ..Default::default()
        },
        ..Default::default()
    };
    let disk = Disk::attach(socket, &opts).map_err(|e| format!("{}: {e}", socket.display()))?;
    let info = disk.info().clone();
    let lanes = disk
        .take_queues()
        .into_iter()
        .map(|q| -> Result<Box<dyn Lane>, String> {
            if attach.path == PathKind::Passthru {
                Ok(Box::new(PassthruLane::new(q, depth, max_block)?))
            } else {
                Ok(Box::new(DriverLane::new(q, depth, max_block, attach.fua)?))
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((
        lanes,
        Geometry {
            capacity: info.capacity_bytes,
            block: u64::from(info.logical_block_size),
        },
    ))
}

/// An engine's name, with its pool size for `threads`: `threads (16 per worker)`.
fn engine_label(engine: EngineKind, threads: usize) -> String {
    match engine {
        EngineKind::Threads => format!("threads ({threads} per worker)"),
        e => e.to_string(),
    }
}
