//! The disks a daemon serves, by name: started at launch or added later through the
//! control socket, removed, listed, resized, stopped. Touched only by the daemon's
//! control paths (its main thread, the control socket's thread), never by I/O.

use std::sync::{Arc, Mutex, MutexGuard};

use log::{error, info};
use serde_json::{json, Value};

use crate::daemon::{Controls, Error};
use crate::disk::{OpenedDisk, RunningDisk};
use crate::worker::Pool;

/// The daemon's disks.
pub(crate) struct Registry {
    pool: Arc<Pool>,
    /// The daemon's controls: a disk whose socket fails stops the daemon.
    daemon: Arc<Controls>,
    inner: Mutex<Inner>,
    started: std::time::Instant,
}

struct Inner {
    disks: Vec<RunningDisk>,
    /// The pool thread the next disk's first worker goes on.
    next_thread: usize,
    /// What ended a disk on its own (its listening socket failed).
    failure: Option<Error>,
}

/// Why a disk was not removed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RemoveError {
    /// No disk of that name.
    #[error("no disk is named {0:?}")]
    Unknown(String),
    /// A frontend uses it.
    #[error("disk {0:?} is attached to a frontend; detach it first (QEMU: device_del), or remove it with --force (its requests in flight finish and are flushed, then the frontend loses the disk)")]
    Attached(String),
    /// Stopping it failed.
    #[error("disk {0:?}: {1}")]
    Stop(String, Box<Error>),
}

impl Registry {
    pub(crate) fn new(pool: Arc<Pool>, daemon: Arc<Controls>) -> Registry {
        Registry {
            pool,
            daemon,
            inner: Mutex::new(Inner {
                disks: Vec::new(),
                next_thread: 0,
                failure: None,
            }),
            started: std::time::Instant::now(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Serve `opened` (its name must be new).
    pub(crate) fn start(self: &Arc<Self>, opened: OpenedDisk) -> Result<(), Error> {
        let mut inner = self.lock();
        if inner.disks.iter().any(|d| d.shared.id == opened.id) {
            return Err(Error::Duplicate(format!(
                "a disk named {:?} is served already",
                opened.id
            )));
        }
        let first = inner.next_thread;
        inner.next_thread = (first + 1) % self.pool.len().max(1);
        let me = Arc::downgrade(self);
        let id = opened.id.clone();
        let running = RunningDisk::start(opened, self.pool.clone(), first, move |e| {
            error!("disk {id}: {e}; the daemon stops");
            if let Some(r) = me.upgrade() {
                let mut inner = r.lock();
                if inner.failure.is_none() {
                    inner.failure = Some(Error::VhostUser(format!("disk {id}: {e}")));
                }
                drop(inner);
                r.daemon.stop();
            }
        })
        .map_err(|source| Error::Listen {
            path: "disk thread".into(),
            source,
        })?;
        inner.disks.push(running);
        Ok(())
    }

    /// How many disks are served.
    pub(crate) fn len(&self) -> usize {
        self.lock().disks.len()
    }

    /// What ended a disk on its own, if anything did.
    pub(crate) fn take_failure(&self) -> Option<Error> {
        self.lock().failure.take()
    }

    /// Re-read every disk's size (SIGHUP).
    pub(crate) fn resize_all(&self) {
        for d in &self.lock().disks {
            d.controls.resize();
        }
    }

    /// Stop every disk (in parallel: each finishes its requests and flushes), wait for
    /// all. The first error, if any.
    pub(crate) fn stop_all(&self) -> Result<(), Error> {
        let mut disks = std::mem::take(&mut self.lock().disks);
        for d in &disks {
            d.controls.stop();
        }
        let mut result = Ok(());
        for d in &mut disks {
            if let Err(e) = d.stop() {
                error!("disk {}: {e}", d.shared.id);
                if result.is_ok() {
                    result = Err(e);
                }
            }
        }
        result
    }

    /// Stop serving disk `id`: refused while a frontend is attached unless `force`.
    /// Its requests in flight finish and the disk is flushed before this returns.
    pub(crate) fn remove(&self, id: &str, force: bool) -> Result<String, RemoveError> {
        let mut d = {
            let mut inner = self.lock();
            let Some(i) = inner.disks.iter().position(|d| d.shared.id == id) else {
                return Err(RemoveError::Unknown(id.into()));
            };
            if !force
                && inner.disks[i]
                    .shared
                    .attached
                    .load(std::sync::atomic::Ordering::SeqCst)
            {
                return Err(RemoveError::Attached(id.into()));
            }
            inner.disks.remove(i)
        };
        d.stop()
            .map_err(|e| RemoveError::Stop(id.into(), Box::new(e)))?;
        info!("disk {id}: removed");
        Ok(d.shared.listen.clone())
    }

    /// The disks, for `vblk disk list`.
    pub(crate) fn list(&self) -> Value {
        let disks: Vec<Value> = self
            .lock()
            .disks
            .iter()
            .map(|d| {
                let s = &d.shared;
                json!({
                    "id": s.id,
                    "socket": s.listen,
                    "disk": s.config.disk.to_string(),
                    "capacity_bytes": s.disk.size(),
                    "read_only": s.config.read_only,
                    "num_queues": s.config.num_queues,
                    "spec": s.spec,
                    "attached": s.attached.load(std::sync::atomic::Ordering::SeqCst),
                })
            })
            .collect();
        json!({ "disks": disks })
    }

    /// The statistics snapshot `vblk stats` reads: every disk (or the one named `id`),
    /// and the worker threads. With one disk its fields are also at the top level, as a
    /// one-disk daemon has always served them.
    pub(crate) fn snapshot(&self, id: Option<&str>) -> Result<Value, String> {
        let inner = self.lock();
        let chosen: Vec<&RunningDisk> = inner
            .disks
            .iter()
            .filter(|d| id.is_none_or(|id| d.shared.id == id))
            .collect();
        if let (Some(id), true) = (id, chosen.is_empty()) {
            return Err(format!("no disk is named {id:?}"));
        }
        let docs: Vec<Value> = chosen
            .iter()
            .map(|d| {
                let mut doc = d.shared.stats.snapshot(d.shared.disk.size());
                doc["id"] = json!(d.shared.id);
                doc["socket"] = json!(d.shared.listen);
                doc
            })
            .collect();
        let mut top = match docs.as_slice() {
            [one] => one.clone(),
            _ => json!({ "vblk_stats": 1 }),
        };
        top["uptime_ns"] =
            json!(u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX));
        top["workers"] = crate::stats::workers_snapshot(self.pool.stats());
        top["disks"] = Value::Array(
            docs.into_iter()
                .map(|mut d| {
                    if let Some(o) = d.as_object_mut() {
                        o.remove("workers");
                        o.remove("vblk_stats");
                    }
                    d
                })
                .collect(),
        );
        Ok(top)
    }
}
