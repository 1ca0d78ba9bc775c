//! One frontend connection: the vhost-user control plane of the device.
//!
//! `messages` decodes each request (`wire` frames them) and calls its method in `requests`.
//! Each is checked at the top, before any state changes, and refused with a message that
//! says what was expected and what came: a queue index past the queues offered, a size that
//! is zero, not a power of two or above the maximum, ring addresses outside guest memory,
//! features that were not offered, memory regions that overlap or reach past their file,
//! more regions than GET_MAX_MEM_SLOTS said. A refusal ends the connection (the daemon then
//! serves the next frontend), because a frontend that sent one cannot be trusted to agree
//! with the device about any state.
//!
//! Rings: a ring starts when it has a size, addresses, memory and a kick fd
//! (SET_VRING_KICK), and is handed to its worker; it stops on GET_VRING_BASE, which waits
//! (up to the drain timeout) for its requests to finish and answers the next available
//! index. The kick, call and error descriptors are checked to be eventfds, pipes or
//! sockets and are used in ways that never block (`vring_fd`), whatever the frontend does
//! to their flags.
//!
//! Every wait on a worker has a deadline: a worker that does not answer in time, or whose
//! thread panicked, ends the session (and the daemon serves the next frontend).

mod messages;
mod requests;

use std::fs::File;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{debug, error, info, warn};
use proto::wire::feature;
use proto::RingInfo;
use storage::Backend;

use crate::blk::Blk;
use crate::dirty_log::DirtyLog;
use crate::disk::DiskShared;
use crate::fence::Fence;
use crate::inflight::InflightRegion;
use crate::memory::GuestMemory;
use crate::ring::{DeviceRing, RingAddrs};
use crate::stats::{LifecycleStats, QueueStats};
use crate::vring_fd::VringFd;
use crate::wire::{protocol, BackendChannel, VHOST_F_LOG_ALL};
use crate::worker::{
    indirect_acked, Command, Lost, Mailbox, QueueStart, Worker, WorkerHandle, WorkerSetup,
};

pub(crate) use messages::SessionEnd;

/// Most requests one worker's engine holds at once; chains beyond wait in their rings.
const MAX_ENGINE_DEPTH: usize = 4096;
/// How long a worker may take to answer a command that waits for nothing (a new memory
/// view) — and beyond the drain timeout, one that does (a ring stop).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a request was refused (NACKed when REPLY_ACK was negotiated; ends the connection).
#[derive(Debug)]
pub(crate) struct Refusal(pub String);

/// The result of a request's handler.
type Answer<T> = Result<T, Refusal>;

fn refuse(msg: String) -> Refusal {
    Refusal(msg)
}

/// What the frontend has told us about one vring.
#[derive(Debug, Default)]
struct Vring {
    size: Option<u16>,
    addrs: Option<RingAddrs>,
    base: u16,
    /// Fds held until the ring starts (then they belong to the worker).
    kick: Option<VringFd>,
    call: Option<VringFd>,
    err: Option<VringFd>,
    enabled: bool,
    started: bool,
    /// Where used-ring writes are logged (SET_VRING_ADDR with VHOST_VRING_F_LOG).
    log_used: Option<u64>,
}

/// The device's side of one frontend connection.
/// How often a ring start that waits for another writer's locks tries them again.
const LOCK_RETRY: Duration = Duration::from_millis(20);

pub(crate) struct Session {
    // Dropped (joined) first: workers hold requests that point into guest memory.
    workers: Vec<WorkerHandle>,
    blk: Arc<Blk>,
    /// The disk, for handing the image over at a migration's switchover.
    disk: Arc<Backend>,
    threads: usize,
    owner: bool,
    features_set: bool,
    acked_protocol: u64,
    /// The backend channel (SET_BACKEND_REQ_FD), for config-change messages.
    backend: Option<BackendChannel>,
    /// The inflight region (GET_INFLIGHT_FD / SET_INFLIGHT_FD).
    inflight: Option<Arc<InflightRegion>>,
    /// The dirty log's bitmap (SET_LOG_BASE); in use while VHOST_F_LOG_ALL is acked.
    log: Option<Arc<DirtyLog>>,
    /// The log the workers have (VHOST_F_LOG_ALL acked and a bitmap mapped), if any.
    given: Option<Arc<DirtyLog>>,
    /// SET_LOG_FD's descriptor, kept for the frontend (vhost-user does not use it).
    log_fd: Option<File>,
    /// The vhost-user protocol features offered.
    protocol_offered: u64,
    mem: Arc<GuestMemory>,
    poison: Arc<AtomicBool>,
    vrings: Vec<Vring>,
    stats: Vec<Arc<QueueStats>>,
    lifecycle: Arc<LifecycleStats>,
    /// How long a ring stop may wait for its requests.
    drain_timeout: Duration,
    /// The disk's reset fence: the image is handed over only once it holds nothing.
    fence: Arc<Fence>,
    /// A switchover came while requests were still at the disk: the hand-over waits for
    /// them ([`Session::hand_over_if_waiting`]).
    hand_over_waits: bool,
    /// A migration's destination (`--incoming`): its ring starts wait for the source's
    /// locks.
    incoming: bool,
    /// The disk's: the image was handed over at a switchover (DiskShared::handed_over).
    handed_over: Arc<AtomicBool>,
    /// The disk's: held while the image's write locks change hands (DiskShared).
    image_turn: Arc<std::sync::Mutex<()>>,
    /// `--allow-shrink`: a smaller image taken over is served smaller.
    allow_shrink: bool,
    /// (completed, rejected, failed) per queue when the session began.
    base: Vec<(u64, u64, u64)>,
}

impl Session {
    /// A session serving `disk` as `config` says on the connection `conn` (a clone of the
    /// stream the messages arrive on, used to end it from a worker).
    pub(crate) fn new(shared: &DiskShared, conn: UnixStream) -> Result<Session, storage::Error> {
        let (config, disk, stats, fence) =
            (&shared.config, &shared.disk, &shared.stats, &shared.fence);
        let pool = &shared.pool;
        let blk = Arc::new(Blk::new(config, disk));
        if let Some(wb) = disk.remembered_writeback() {
            // The guest chose it (here or on the source of a migration): keep to it.
            blk.writeback.store(wb, Ordering::Relaxed);
        }
        let num_queues = usize::from(config.num_queues);
        // Queue i is served by worker i % workers; worker w runs on pool thread
        // (first + w) % threads, so that the disks of a daemon spread over its threads.
        // A writable NBD export without multi-conn takes one writer: all the disk's queues
        // on one worker (`--threads` serves the daemon's other disks).
        let threads = if disk.one_writer_only() {
            1
        } else {
            pool.len().clamp(1, num_queues)
        };
        let poison = Arc::new(AtomicBool::new(false));
        let conn = Arc::new(conn);
        // Held while the workers start: a change of limits meanwhile waits, then reaches
        // every one of them.
        let mut throttle = shared.throttle.lock().unwrap_or_else(|p| p.into_inner());
        let limits = throttle.setup();
        let mut workers = Vec::with_capacity(threads);
        for t in 0..threads {
            let owned = (0..num_queues).filter(|q| q % threads == t).count();
            let depth = (owned * usize::from(config.queue_size)).clamp(1, MAX_ENGINE_DEPTH);
            let mut engine = disk.engine(config.engine, depth as u32)?;
            if let Some(delay) = config.delay {
                engine = storage::delayed(engine, delay).map_err(|source| {
                    storage::Error::EngineSetup {
                        engine: "delay",
                        depth: depth as u32,
                        source,
                    }
                })?;
            }
            let conn = conn.clone();
            let setup = WorkerSetup {
                id: t,
                disk: Arc::from(shared.id.as_str()),
                blk: blk.clone(),
                engine,
                depth,
                submit_batch: config.effective_submit_batch(),
                drain_timeout: config.drain_timeout,
                fence: fence.clone(),
                poison: poison.clone(),
                kill: Box::new(move || {
                    let _ = conn.shutdown(std::net::Shutdown::Both);
                }),
                lifecycle: stats.lifecycle.clone(),
                throttle: limits.clone(),
            };
            // Ending waits for the engine's requests: as long as a drain may take.
            let join = config.drain_timeout + ANSWER_TIMEOUT;
            let setup_err = |source| storage::Error::EngineSetup {
                engine: "worker",
                depth: depth as u32,
                source,
            };
            let worker = Worker::new(setup, Arc::new(Mailbox::new().map_err(setup_err)?))
                .map_err(setup_err)?;
            workers.push(
                pool.attach(shared.first_thread + t, worker, join)
                    .map_err(setup_err)?,
            );
        }
        throttle.mailboxes = workers.iter().map(|w| w.mailbox()).collect();
        drop(throttle);
        Ok(Session {
            blk,
            disk: disk.clone(),
            threads,
            owner: false,
            features_set: false,
            acked_protocol: 0,
            backend: None,
            inflight: None,
            log: None,
            given: None,
            log_fd: None,
            protocol_offered: offered_protocol(config.inflight),
            mem: Arc::new(GuestMemory::empty()),
            poison,
            vrings: (0..num_queues).map(|_| Vring::default()).collect(),
            workers,
            base: stats.queues.iter().map(|q| counts(q)).collect(),
            stats: stats.queues.clone(),
            lifecycle: stats.lifecycle.clone(),
            drain_timeout: config.drain_timeout,
            fence: fence.clone(),
            hand_over_waits: false,
            incoming: config.image.incoming,
            handed_over: shared.handed_over.clone(),
            image_turn: shared.image_turn.clone(),
            allow_shrink: config.allow_shrink,
        })
    }

    /// The capacity the frontend was told, in sectors.
    pub(crate) fn capacity(&self) -> u64 {
        self.blk.capacity.load(Ordering::Relaxed)
    }

    /// The disk now has `sectors` sectors: publish the new capacity and tell the frontend
    /// through the backend channel (VHOST_USER_BACKEND_CONFIG_CHANGE_MSG), which QEMU
    /// turns into a virtio config-change interrupt.
    pub(crate) fn capacity_changed(&mut self, sectors: u64) {
        self.blk.capacity.store(sectors, Ordering::Relaxed);
        let config = self.acked_protocol & protocol::CONFIG != 0;
        match (&mut self.backend, config) {
            (Some(ch), true) => match ch.config_changed() {
                Ok(()) => info!("told the frontend the capacity is now {sectors} sectors"),
                Err(e) => warn!("cannot tell the frontend about the new capacity: {e}"),
            },
            _ => warn!(
                "the frontend set up no backend channel (BACKEND_REQ and CONFIG): it sees the new capacity of {sectors} sectors only when it reads the configuration again"
            ),
        }
    }

    /// Stop every running ring, letting its requests finish (a clean shutdown).
    pub(crate) fn shutdown(&mut self) {
        for i in 0..self.vrings.len() {
            if self.vrings[i].started {
                match self.stop(i) {
                    Ok(next) => info!("queue {i}: stopped for shutdown at available index {next}"),
                    Err(Refusal(why)) => error!("queue {i}: not stopped cleanly: {why}"),
                }
            }
        }
    }

    /// A worker thread that ended on its own (it panicked): the session cannot go on.
    pub(crate) fn lost_worker(&self) -> Option<usize> {
        self.workers.iter().position(|w| w.ended())
    }

    /// Whether the SIGBUS guard caught the frontend truncating guest memory.
    pub(crate) fn poisoned(&self) -> bool {
        self.poison.load(Ordering::SeqCst)
    }

    /// Per-queue counters of this session: (queue, completed, rejected, failed), for
    /// queues that saw requests.
    pub(crate) fn counters(&self) -> Vec<(usize, u64, u64, u64)> {
        self.stats
            .iter()
            .zip(&self.base)
            .enumerate()
            .map(|(i, (s, b))| {
                let (c, r, f) = counts(s);
                (i, c - b.0, r - b.1, f - b.2)
            })
            .filter(|&(_, c, r, f)| c + r + f > 0)
            .collect()
    }

    fn worker(&self, queue: usize) -> &WorkerHandle {
        &self.workers[queue % self.threads]
    }

    fn vring(&mut self, index: u32, what: &str) -> Answer<&mut Vring> {
        let n = self.vrings.len();
        self.vrings.get_mut(index as usize).ok_or_else(|| {
            refuse(format!(
                "{what}: queue {index} does not exist (the device has {n} queues)"
            ))
        })
    }

    fn protocol_acked(&self) -> bool {
        self.features_set && self.blk.acked(feature::VHOST_USER_PROTOCOL_FEATURES)
    }

    /// Take the image's write locks if this daemon does not hold them (a migration
    /// destination, or a source whose migration failed after its switchover): the rings
    /// may then write. Refused while another writer holds them.
    fn take_image(&mut self, index: usize) -> Answer<()> {
        // Another writer's locks are waited for, up to the drain timeout: a migration's
        // source keeps them until the requests its storage still holds have ended, and
        // this side must not write before they have (QEMU's own source drains before it
        // lets go, and its destination waits for that too).
        // Only where the other writer is a migration's other end: another QEMU or
        // daemon that holds the image is refused at once.
        let since = Instant::now();
        let activate = || {
            let _turn = self.image_turn.lock().unwrap_or_else(|p| p.into_inner());
            self.disk.activate()
        };
        let mut activated = activate();
        let mut said = false;
        let migrating = self.incoming || self.handed_over.load(Ordering::Acquire);
        while migrating
            && matches!(activated, Err(storage::Error::Locked { .. }))
            && since.elapsed() < self.drain_timeout
        {
            if !said {
                info!(
                    "queue {index}: another writer holds the image; waiting up to {:?} for it to let go (a migration's source finishing requests its storage held)",
                    self.drain_timeout
                );
                said = true;
            }
            std::thread::sleep(LOCK_RETRY);
            activated = activate();
        }
        if said && activated.is_ok() {
            info!(
                "queue {index}: the other writer let the image go after {:?}",
                since.elapsed()
            );
        }
        match activated {
            Ok(false) => Ok(()),
            Ok(true) => {
                // Another program may have resized the image while nobody here held it
                // (`qemu-img resize` while no frontend was attached): the frontend read
                // the old capacity with the configuration and learns the new one now. A
                // smaller one is what SIGHUP refuses without --allow-shrink: the image
                // goes back, and the ring does not start.
                let sectors = self.disk.size() >> proto::wire::SECTOR_SHIFT;
                if sectors < self.capacity() && !self.allow_shrink {
                    let turn = self.image_turn.clone();
                    let _turn = turn.lock().unwrap_or_else(|p| p.into_inner());
                    let _ = self.disk.deactivate();
                    return Err(refuse(format!(
                        "queue {index} cannot start: the image shrank from {} to {} bytes while another program held it, and what the guest had past its new end is gone (--allow-shrink serves it smaller)",
                        self.capacity() << proto::wire::SECTOR_SHIFT,
                        sectors << proto::wire::SECTOR_SHIFT
                    )));
                }
                self.handed_over.store(false, Ordering::Release);
                if let Some(wb) = self.disk.remembered_writeback() {
                    self.blk.writeback.store(wb, Ordering::Relaxed);
                }
                if sectors != self.capacity() {
                    self.capacity_changed(sectors);
                }
                info!(
                    "took the image over (its write locks): queue {index} starts; the guest's cache is {}",
                    if self.blk.writeback.load(Ordering::Relaxed) {
                        "writeback"
                    } else {
                        "writethrough"
                    }
                );
                Ok(())
            }
            Err(e) => Err(refuse(format!(
                "queue {index} cannot start: the image cannot be taken over: {e}"
            ))),
        }
    }

    /// After a ring stop: if dirty logging is on (a live migration) and no ring runs any
    /// more, this is the switchover: make every write durable and let go of the image, so
    /// that the destination can take it. A restart (a failed or cancelled migration) takes
    /// it back.
    fn maybe_hand_over(&mut self) {
        if self.given.is_none() || self.vrings.iter().any(|v| v.started) {
            self.hand_over_waits = false;
            return;
        }
        let old = self.fence.old();
        if old > 0 {
            // A drain ran out of time: those requests may still reach the disk. The
            // destination must not write before them (its newer writes would be
            // overwritten by them): the locks stay until they end, and the destination
            // waits for them (`take_image`).
            if !self.hand_over_waits {
                warn!(
                    "every ring stopped with dirty logging on (a migration's switchover), but {old} requests are still at the disk: the image's write locks are kept until they end (the destination waits for them)"
                );
            }
            self.hand_over_waits = true;
            return;
        }
        self.hand_over_waits = false;
        let turn = self.image_turn.clone();
        let _turn = turn.lock().unwrap_or_else(|p| p.into_inner());
        match self.disk.deactivate() {
            Ok(true) => {
                self.handed_over.store(true, Ordering::Release);
                info!(
                "every ring stopped with dirty logging on (a migration's switchover): writes made durable, the image's write locks released for the destination"
            )
            }
            Ok(false) => {}
            Err(e) => error!(
                "cannot hand the image over at the switchover: {e}; the destination will find it locked"
            ),
        }
    }

    /// Whether a switchover's hand-over waits for requests still at the disk.
    pub(crate) fn hand_over_waits(&self) -> bool {
        self.hand_over_waits
    }

    /// The hand-over [`Session::maybe_hand_over`] put off for requests still at the disk,
    /// if they have ended.
    pub(crate) fn hand_over_if_waiting(&mut self) {
        if self.hand_over_waits {
            self.maybe_hand_over();
        }
    }

    /// Start ring `index` if everything it needs has arrived.
    fn try_start(&mut self, index: usize) -> Answer<()> {
        let protocol = self.protocol_acked();
        let event_idx = self.blk.acked(feature::RING_EVENT_IDX);
        let indirect = indirect_acked(&self.blk);
        let v = &mut self.vrings[index];
        if v.started || v.kick.is_none() {
            return Ok(());
        }
        let (Some(size), Some(addrs)) = (v.size, v.addrs) else {
            return Err(refuse(format!(
                "queue {index}: kick fd before its size and addresses (SET_VRING_NUM, SET_VRING_ADDR)"
            )));
        };
        if self.mem.is_empty() {
            return Err(refuse(format!(
                "queue {index}: kick fd before any memory table"
            )));
        }
        let mut ring = DeviceRing::new(&self.mem, size, addrs, event_idx, v.base)
            .map_err(|e| refuse(format!("queue {index} of size {size}: {e}")))?;
        self.take_image(index)?;
        let v = &mut self.vrings[index];
        let (inflight, resubmit) = match &self.inflight {
            None => (None, Vec::new()),
            Some(region) => {
                let Some(mut iq) = region.queue(index, size) else {
                    let (_, n, qs) = region.shape();
                    return Err(refuse(format!(
                        "queue {index} of size {size}: the inflight region holds {n} queues of {qs}"
                    )));
                };
                let (resubmit, next) = iq.prepare(ring.next_used());
                if !resubmit.is_empty() || next != v.base {
                    info!(
                        "queue {index}: resuming at available index {next} (base was {}), resubmitting {} requests in flight: {resubmit:?}",
                        v.base,
                        resubmit.len()
                    );
                }
                ring.set_next_avail(next);
                (Some(iq), resubmit)
            }
        };
        let info = RingInfo {
            desc_table: vm_memory::GuestAddress(ring.desc_table()),
            size,
            indirect,
            max_indirect: RingInfo::max_indirect_for(size, self.blk.base_limits.seg_max),
        };
        let Some(kick) = v.kick.take() else {
            return Ok(());
        };
        let start = QueueStart {
            index,
            ring,
            info,
            kick,
            call: v.call.take(),
            err: v.err.take(),
            // Without VHOST_USER_F_PROTOCOL_FEATURES a ring starts enabled.
            enabled: v.enabled || !protocol,
            stats: self.stats[index].clone(),
            inflight,
            resubmit,
            log_used: v.log_used,
        };
        v.started = true;
        debug!("queue {index}: started (size {size}, base {})", v.base);
        self.worker(index).send(Command::Start(Box::new(start)));
        Ok(())
    }

    /// Stop ring `index` if it runs; the next available index. The worker answers once
    /// the ring's requests are done, or at the drain timeout.
    fn stop(&mut self, index: usize) -> Answer<u16> {
        let v = &mut self.vrings[index];
        if !v.started {
            return Ok(v.base);
        }
        v.started = false;
        let deadline = self.drain_timeout + ANSWER_TIMEOUT;
        let next = self.workers[index % self.threads]
            .ask(deadline, |reply| Command::Stop {
                queue: index,
                reply,
            })
            .map_err(|e| self.lost(e))?;
        self.vrings[index].base = next;
        Ok(next)
    }

    /// Give the workers the dirty log if logging is on and a bitmap is mapped, or take it
    /// away; waits until every worker uses the new state.
    fn update_logging(&mut self) -> Answer<()> {
        let on = self.blk.acked.load(Ordering::Relaxed) & VHOST_F_LOG_ALL != 0;
        let log = if on { self.log.clone() } else { None };
        if on && log.is_none() {
            warn!(
                "VHOST_F_LOG_ALL acked before SET_LOG_BASE: nothing can be logged until it comes"
            );
        }
        let same = match (&log, &self.given) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        if same {
            return Ok(());
        }
        if let Some(old) = &self.given {
            let (pages, outside) = old.counts();
            info!("dirty log: {pages} page marks, {outside} past the end of the bitmap");
        }
        self.given = log.clone();
        self.lifecycle
            .log_active
            .store(u64::from(log.is_some()), Ordering::Relaxed);
        for w in &self.workers {
            let log = log.clone();
            w.ask(ANSWER_TIMEOUT, |reply| Command::Log { log, reply })
                .map_err(|e| self.lost(e))?;
        }
        info!("dirty logging {}", if log.is_some() { "on" } else { "off" });
        Ok(())
    }

    fn lost(&self, e: Lost) -> Refusal {
        self.lifecycle.lost_workers.fetch_add(1, Ordering::Relaxed);
        refuse(format!("{e}; the session cannot go on"))
    }

    /// Give every worker the current memory view and wait until they use it.
    fn publish_memory(&mut self, mem: GuestMemory) -> Answer<()> {
        self.mem = Arc::new(mem);
        for w in &self.workers {
            let mem = self.mem.clone();
            w.ask(ANSWER_TIMEOUT, |reply| Command::Memory { mem, reply })
                .map_err(|e| self.lost(e))?;
        }
        Ok(())
    }
}

fn counts(q: &QueueStats) -> (u64, u64, u64) {
    (
        q.completed.load(Ordering::Relaxed),
        q.rejected.load(Ordering::Relaxed),
        q.failed.load(Ordering::Relaxed),
    )
}

/// The vhost-user protocol features the device offers.
fn offered_protocol(inflight: bool) -> u64 {
    let all = protocol::MQ
        | protocol::LOG_SHMFD
        | protocol::REPLY_ACK
        | protocol::CONFIG
        | protocol::CONFIGURE_MEM_SLOTS
        | protocol::BACKEND_REQ;
    if inflight {
        all | protocol::INFLIGHT_SHMFD
    } else {
        all
    }
}
