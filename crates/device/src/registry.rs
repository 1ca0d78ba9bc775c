//! The disks a daemon serves, by name: started at launch or added later through the
//! control socket, removed, listed, resized, stopped. Touched only by the daemon's
//! control paths (its main thread, the control socket's thread), never by I/O.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use log::{error, info};
use serde_json::{json, Value};

use crate::daemon::{Controls, Error};
use crate::disk::{DiskShared, GroupMember, OpenedDisk, RunningDisk};
use crate::throttle::{Limiter, LimiterStats, Limits, MAX_MEMBERS};
use crate::worker::Pool;

/// The daemon's disks.
pub(crate) struct Registry {
    pool: Arc<Pool>,
    /// The daemon's controls: a disk whose socket fails stops the daemon.
    daemon: Arc<Controls>,
    inner: Mutex<Inner>,
    started: std::time::Instant,
    /// Who may connect to the daemon's sockets: the default for disks added later.
    socket_access: crate::socket_file::SocketAccess,
    /// The TCP ports the sandbox lets the daemon connect to (None: it is not confined).
    tcp_ports: Option<Vec<u16>>,
}

struct Inner {
    disks: Vec<RunningDisk>,
    /// The pool thread the next disk's first worker goes on.
    next_thread: usize,
    /// What ended a disk on its own (its listening socket failed).
    failure: Option<Error>,
    /// Throttle groups by name.
    groups: BTreeMap<String, Group>,
}

/// A throttle group: limits that cover all its member disks together.
#[derive(Default)]
struct Group {
    limits: Limits,
    /// None: unlimited.
    limiter: Option<Arc<Limiter>>,
    /// Its counters, kept across changes of its limits.
    stats: Arc<LimiterStats>,
    /// Member disks by member index (None: a free index).
    members: Vec<Option<String>>,
}

impl Group {
    fn member_count(&self) -> usize {
        self.members.iter().filter(|m| m.is_some()).count()
    }
}

/// The throttle state of a disk (locked).
fn throttle_of(d: &DiskShared) -> MutexGuard<'_, crate::disk::DiskThrottle> {
    d.throttle.lock().unwrap_or_else(|p| p.into_inner())
}

/// Why a disk was not removed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RemoveError {
    /// No disk of that name.
    #[error("no disk is named {0:?}")]
    Unknown(String),
    /// A frontend uses it.
    #[error("disk {0:?} is attached to a frontend; detach it first (QEMU: device_del, then chardev-remove, which closes the connection), or remove it with --force (its requests in flight finish and are flushed, then the frontend loses the disk)")]
    Attached(String),
    /// Stopping it failed.
    #[error("disk {0:?}: {1}")]
    Stop(String, Box<Error>),
}

impl Registry {
    pub(crate) fn new(
        pool: Arc<Pool>,
        daemon: Arc<Controls>,
        socket_access: crate::socket_file::SocketAccess,
        tcp_ports: Option<Vec<u16>>,
    ) -> Registry {
        Registry {
            pool,
            daemon,
            inner: Mutex::new(Inner {
                disks: Vec::new(),
                next_thread: 0,
                failure: None,
                groups: BTreeMap::new(),
            }),
            started: std::time::Instant::now(),
            socket_access,
            tcp_ports,
        }
    }

    /// Refuse a disk the sandbox would not let the daemon reach: an NBD server over TCP
    /// on a port it was not started with. (Connecting anyway makes a system call the
    /// seccomp filter kills the daemon for, with every disk, or one Landlock refuses.)
    pub(crate) fn check_reachable(&self, disk: &storage::DiskSpec) -> Result<(), String> {
        let storage::DiskSpec::Nbd(nbd) = disk else {
            return Ok(());
        };
        let (Some(port), Some(allowed)) = (nbd.tcp_port(), &self.tcp_ports) else {
            return Ok(());
        };
        if allowed.contains(&port) {
            return Ok(());
        }
        let ports: Vec<String> = allowed.iter().map(u16::to_string).collect();
        Err(format!(
            "{disk}: this daemon's sandbox lets it connect over TCP only to the ports it knew at its start ({}); restart it with --nbd-ports {port} (or nbd-ports = [{port}] in its config file) to add NBD disks on port {port}",
            if ports.is_empty() {
                "none".to_string()
            } else {
                ports.join(", ")
            }
        ))
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Serve `opened` (its name must be new).
    pub(crate) fn start(self: &Arc<Self>, opened: OpenedDisk) -> Result<(), Error> {
        let mut inner = self.lock();
        // A disk added while the daemon stops would be left running (stop_all has taken
        // the disks already, or is about to, under this lock).
        if self.daemon.stopping() {
            return Err(Error::VhostUser(format!(
                "disk {:?} not started: the daemon is stopping",
                opened.id
            )));
        }
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
        if let Some(g) = running.shared.config.throttle_group.clone() {
            if let Err(e) = join_group(&mut inner.groups, &running.shared, &g) {
                drop(inner);
                let mut running = running;
                let _ = running.stop();
                return Err(Error::VhostUser(e));
            }
        }
        inner.disks.push(running);
        Ok(())
    }

    /// Set group `name`'s limits (QEMU's semantics: they replace the old ones; the
    /// buckets start empty); the group is made if it does not exist.
    pub(crate) fn set_group(&self, name: &str, limits: Limits) -> Result<(), String> {
        crate::config::check_group_name(name).map_err(|e| e.to_string())?;
        limits.validate()?;
        let mut inner = self.lock();
        let inner = &mut *inner;
        let g = inner.groups.entry(name.to_string()).or_default();
        g.limiter = (!limits.is_unlimited()).then(|| {
            let l = Arc::new(Limiter::new(&limits, Instant::now(), g.stats.clone()));
            l.set_members(g.members.len());
            l
        });
        g.limits = limits;
        for d in &inner.disks {
            let mut t = throttle_of(&d.shared);
            if let Some(m) = t.group.as_mut().filter(|m| m.name == name) {
                m.limiter = g.limiter.clone();
                t.tell();
            }
        }
        info!("throttle group {name}: {}", g.limits);
        Ok(())
    }

    /// Set disk `id`'s own limits (`limits`, replacing the old ones) and its group
    /// (`group`: Some(None) leaves it, Some(Some(name)) moves it there).
    pub(crate) fn set_disk(
        &self,
        id: &str,
        limits: Option<Limits>,
        group: Option<Option<String>>,
    ) -> Result<(), String> {
        if let Some(l) = &limits {
            l.validate()?;
        }
        let mut inner = self.lock();
        let inner = &mut *inner;
        let d = inner
            .disks
            .iter()
            .find(|d| d.shared.id == id)
            .ok_or_else(|| format!("no disk is named {id:?}"))?;
        if let Some(group) = group {
            leave_group(&mut inner.groups, &d.shared);
            if let Some(g) = group {
                join_group(&mut inner.groups, &d.shared, &g)?;
            }
        }
        let mut t = throttle_of(&d.shared);
        if let Some(l) = limits {
            t.set_limits(l);
        }
        t.tell();
        info!(
            "disk {id}: limits {}{}",
            t.limits,
            t.group
                .as_ref()
                .map(|g| format!(", throttle group {}", g.name))
                .unwrap_or_default()
        );
        Ok(())
    }

    /// The throttle groups, for `vblk stats`: all, or those disk `id` is in.
    fn groups_snapshot(&self, id: Option<&str>) -> Value {
        let inner = self.lock();
        let groups: Vec<Value> = inner
            .groups
            .iter()
            .filter(|(_, g)| id.is_none_or(|id| g.members.iter().flatten().any(|m| m == id)))
            .map(|(name, g)| {
                json!({
                    "name": name,
                    "limits": g.limits.to_json(),
                    "members": g.members.iter().flatten().collect::<Vec<_>>(),
                    "delayed": g.stats.delayed.load(std::sync::atomic::Ordering::Relaxed),
                    "wait_ns": g.stats.wait_ns.load(std::sync::atomic::Ordering::Relaxed),
                    "forfeited_ns": g
                        .members
                        .iter()
                        .enumerate()
                        .filter_map(|(i, m)| {
                            let ns = g.stats.forfeited_ns[i]
                                .load(std::sync::atomic::Ordering::Relaxed);
                            m.as_ref().map(|m| (m.clone(), json!(ns)))
                        })
                        .collect::<serde_json::Map<String, Value>>(),
                })
            })
            .collect();
        Value::Array(groups)
    }

    /// A disk that serves the file of (device, inode) `id` writable, or any disk on it
    /// when `writable`: two writers, or a writer and a reader, cannot share an image
    /// (two readers can).
    pub(crate) fn serving_file(&self, id: (u64, u64), writable: bool) -> Option<String> {
        // Looked at outside the lock: an fstat may be slow on a network file system.
        let disks: Vec<(String, Arc<storage::Backend>)> = self
            .lock()
            .disks
            .iter()
            .map(|d| (d.shared.id.clone(), d.shared.disk.clone()))
            .collect();
        disks
            .into_iter()
            .find(|(_, b)| (writable || !b.read_only()) && b.file_id() == Some(id))
            .map(|(name, _)| name)
    }

    /// Whether a disk named `id` is served.
    pub(crate) fn contains(&self, id: &str) -> bool {
        self.lock().disks.iter().any(|d| d.shared.id == id)
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

    /// Make disk `id` `size` bytes (`vblk disk resize`: a raw file truncated, a qcow2
    /// image grown; smaller only with `shrink`, and never a qcow2), then tell its
    /// frontend. The old and new sizes.
    pub(crate) fn resize_disk(
        &self,
        id: &str,
        size: u64,
        shrink: bool,
    ) -> Result<(u64, u64), String> {
        let (shared, controls) = {
            let inner = self.lock();
            let d = inner
                .disks
                .iter()
                .find(|d| d.shared.id == id)
                .ok_or_else(|| format!("no disk is named {id:?}"))?;
            (Arc::clone(&d.shared), Arc::clone(&d.controls))
        };
        // Not under the registry's lock: growing a qcow2 writes and syncs its metadata.
        // A disk that let its image go when its frontend left (disk.rs, `release_image`)
        // takes it back to resize it, and keeps it (its next frontend would take it
        // anyway); a migration's destination before it starts does not. The turn keeps a
        // release under way from letting the image go between the two.
        let _turn = shared.image_turn.lock().unwrap_or_else(|p| p.into_inner());
        if !shared.config.image.incoming && shared.disk.holding() == storage::Holding::Inactive {
            shared
                .disk
                .activate()
                .map_err(|e| format!("disk {id}: {e}"))?;
        }
        let (old, new) = shared
            .disk
            .resize(size, shrink)
            .map_err(|e| format!("disk {id}: {e}"))?;
        info!("disk {id}: resized from {old} to {new} bytes");
        controls.resize();
        Ok((old, new))
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
            let d = inner.disks.remove(i);
            leave_group(&mut inner.groups, &d.shared);
            d
        };
        d.stop()
            .map_err(|e| RemoveError::Stop(id.into(), Box::new(e)))?;
        info!("disk {id}: removed");
        Ok(d.shared.listen.clone())
    }

    /// The disks, for `vblk disk list`, and the throttle groups.
    pub(crate) fn list(&self) -> Value {
        let inner = self.lock();
        let groups: Vec<Value> = inner
            .groups
            .iter()
            .map(|(name, g)| {
                json!({
                    "name": name,
                    "throttle": g.limits.to_string(),
                    "members": g.members.iter().flatten().collect::<Vec<_>>(),
                })
            })
            .collect();
        let disks: Vec<Value> = inner
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
                    "throttle": throttle_of(s).limits.to_string(),
                    "throttle_group": throttle_of(s).group.as_ref().map(|g| g.name.clone()),
                    "attached": s.attached.load(std::sync::atomic::Ordering::SeqCst),
                })
            })
            .collect();
        json!({ "disks": disks, "groups": groups, "socket_group": self.socket_access.group })
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
                let t = throttle_of(&d.shared);
                doc["throttle"] = json!({
                    "limits": t.limits.to_json(),
                    "group": t.group.as_ref().map(|g| g.name.clone()),
                    "delayed": t.stats.delayed.load(std::sync::atomic::Ordering::Relaxed),
                    "wait_ns": t.stats.wait_ns.load(std::sync::atomic::Ordering::Relaxed),
                });
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
        drop(inner);
        top["throttle_groups"] = self.groups_snapshot(id);
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

/// Put `disk` in group `name` (made, unlimited, if it does not exist).
fn join_group(
    groups: &mut BTreeMap<String, Group>,
    disk: &DiskShared,
    name: &str,
) -> Result<(), String> {
    crate::config::check_group_name(name).map_err(|e| e.to_string())?;
    let g = groups.entry(name.to_string()).or_default();
    let member = match g.members.iter().position(Option::is_none) {
        Some(free) => free,
        None if g.members.len() < MAX_MEMBERS => {
            g.members.push(None);
            g.members.len() - 1
        }
        None => {
            return Err(format!(
                "throttle group {name} has {MAX_MEMBERS} disks already"
            ))
        }
    };
    g.members[member] = Some(disk.id.clone());
    // What an earlier holder of the index gave up is not the new member's.
    g.stats.forfeited_ns[member].store(0, std::sync::atomic::Ordering::Relaxed);
    if let Some(l) = &g.limiter {
        l.set_members(g.members.len());
    }
    let mut t = throttle_of(disk);
    t.group = Some(GroupMember {
        name: name.to_string(),
        limiter: g.limiter.clone(),
        member,
        stats: g.stats.clone(),
    });
    t.tell();
    info!(
        "disk {}: in throttle group {name} ({} disks)",
        disk.id,
        g.member_count()
    );
    Ok(())
}

/// Take `disk` out of its group, if it is in one.
fn leave_group(groups: &mut BTreeMap<String, Group>, disk: &DiskShared) {
    let mut t = throttle_of(disk);
    let Some(m) = t.group.take() else { return };
    if let Some(g) = groups.get_mut(&m.name) {
        if let Some(slot) = g.members.get_mut(m.member) {
            *slot = None;
        }
        // A group without limits exists only through its disks (a disk naming a group no
        // one set made it): it goes with the last of them. One with limits stays, as it
        // was set.
        if g.member_count() == 0 && g.limits.is_unlimited() {
            groups.remove(&m.name);
        }
    }
    t.tell();
}
