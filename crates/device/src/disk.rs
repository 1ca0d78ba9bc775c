//! One disk the daemon serves: its socket, its frontends one at a time (back to listening
//! when one leaves), its statistics and reset fence, on a thread of its own. Its I/O runs
//! on the daemon's shared worker threads.
//!
//! A connection whose session cannot be set up (the disk refuses a new engine: an NBD
//! server briefly down) is closed and the next one is served; so is a frontend that sends
//! part of a message and then nothing for [`MESSAGE_TIMEOUT`], or does not read its
//! replies. Only the listening socket failing ends the disk's thread (and the daemon).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{error, info, warn};
use storage::{Backend, OpenOptions};

use crate::config::{DeviceConfig, Listen, ServedDisk};
use crate::daemon::{Controls, Error};
use crate::fence::Fence;
use crate::session::{Session, SessionEnd};
use crate::socket_file::SocketFile;
use crate::stats::Stats;
use crate::throttle::{Limiter, LimiterStats, Limits};
use crate::worker::{Command, Mailbox, Pool, ThrottleSetup};

/// How long the rest of a message may take once its first byte came, and how long a reply
/// may wait for the frontend to read.
pub const MESSAGE_TIMEOUT: Duration = Duration::from_secs(5);

/// What the sessions of one disk share.
pub(crate) struct DiskShared {
    /// Its name.
    pub id: String,
    /// How it is served.
    pub config: DeviceConfig,
    /// The disk.
    pub disk: Arc<Backend>,
    /// Its counters.
    pub stats: Arc<Stats>,
    /// Its reset fence.
    pub fence: Arc<Fence>,
    /// The daemon's worker threads.
    pub pool: Arc<Pool>,
    /// The pool thread its worker 0 runs on (worker w on `first_thread + w`).
    pub first_thread: usize,
    /// Where it listens, for people (a path or `fd N`).
    pub listen: String,
    /// A frontend is connected.
    pub attached: AtomicBool,
    /// How it was described (config.rs, `ServedDisk::spec`).
    pub spec: String,
    /// Its QoS limits, and the workers to tell when they change.
    pub throttle: Mutex<DiskThrottle>,
    /// Held while the image's write locks change hands: released when the frontend
    /// leaves (`release_image`) or at a switchover, taken back for `vblk disk resize` or
    /// at a ring start. A resize that came while the last frontend's release was under
    /// way found the disk still active, and then the image let go under it (EIO); one
    /// racing a ring start could leave the ring on metadata not yet read again.
    pub image_turn: Arc<Mutex<()>>,
    /// The image was let go at a migration's switchover (and not taken back since): a
    /// frontend that starts a ring here again is the way back, and waits for the other
    /// daemon's locks as a destination does.
    pub handed_over: Arc<AtomicBool>,
}

/// A disk's QoS: its own limits, its group's, and the mailboxes of the workers that serve
/// it now (told of every change).
#[derive(Default)]
pub(crate) struct DiskThrottle {
    /// Its own limits.
    pub limits: Limits,
    /// Their limiter (None: unlimited).
    pub own: Option<Arc<Limiter>>,
    /// Its group: name, the group's limiter (None: the group is unlimited), its member
    /// index there, the group's counters.
    pub group: Option<GroupMember>,
    /// Its throttling counters.
    pub stats: Arc<LimiterStats>,
    /// The workers serving it now.
    pub mailboxes: Vec<Arc<Mailbox>>,
}

/// A disk's place in a group.
#[derive(Clone)]
pub(crate) struct GroupMember {
    pub name: String,
    pub limiter: Option<Arc<Limiter>>,
    pub member: usize,
    pub stats: Arc<LimiterStats>,
}

impl DiskThrottle {
    /// What a worker serving the disk is given (None: nothing limits it).
    pub(crate) fn setup(&self) -> Option<ThrottleSetup> {
        let mut limiters = Vec::new();
        limiters.extend(self.own.clone().map(|l| (l, 0)));
        let own = limiters.len();
        if let Some(g) = &self.group {
            limiters.extend(g.limiter.clone().map(|l| (l, g.member)));
        }
        (!limiters.is_empty()).then(|| ThrottleSetup {
            limiters,
            own,
            stats: self.stats.clone(),
            group_stats: self.group.as_ref().map(|g| g.stats.clone()),
        })
    }

    /// Tell the workers serving the disk what limits it has now.
    pub(crate) fn tell(&self) {
        for m in &self.mailboxes {
            m.send(Command::Throttle(self.setup().map(Box::new)));
        }
    }

    /// Its own limits are now `limits` (QEMU's block_set_io_throttle: they replace the
    /// old ones, the buckets start empty).
    pub(crate) fn set_limits(&mut self, limits: Limits) {
        self.own = (!limits.is_unlimited())
            .then(|| Arc::new(Limiter::new(&limits, Instant::now(), self.stats.clone())));
        self.limits = limits;
    }
}

impl DiskShared {
    /// What `disk`'s sessions will share, with new counters and fence.
    pub(crate) fn new(
        id: String,
        config: DeviceConfig,
        disk: Arc<Backend>,
        pool: Arc<Pool>,
        first_thread: usize,
        listen: String,
        spec: String,
    ) -> DiskShared {
        let stats = Arc::new(Stats::new(
            usize::from(config.num_queues),
            pool.stats().to_vec(),
            config.disk.to_string(),
            &disk,
        ));
        let fence = Arc::new(Fence::new(stats.fence.clone()));
        let mut throttle = DiskThrottle {
            stats: stats.throttle.clone(),
            ..Default::default()
        };
        throttle.set_limits(config.throttle.clone());
        DiskShared {
            id,
            config,
            disk,
            stats,
            fence,
            pool,
            first_thread,
            listen,
            attached: AtomicBool::new(false),
            spec,
            throttle: Mutex::new(throttle),
            image_turn: Arc::new(Mutex::new(())),
            handed_over: Arc::new(AtomicBool::new(false)),
        }
    }
}

/// A disk opened and listening, not served yet (everything a disk needs from the file
/// system is open: the daemon may confine itself).
pub(crate) struct OpenedDisk {
    pub id: String,
    pub config: DeviceConfig,
    pub disk: Arc<Backend>,
    pub listener: UnixListener,
    pub socket_file: Option<SocketFile>,
    pub listen: String,
    pub spec: String,
}

impl OpenedDisk {
    /// Open the disk of `served` (`file`: its image already open, from a client of the
    /// control socket) and take its socket.
    pub(crate) fn open(
        served: ServedDisk,
        file: Option<std::fs::File>,
    ) -> Result<OpenedDisk, Error> {
        OpenedDisk::open_with(served, file, Vec::new())
    }

    /// [`OpenedDisk::open`], with the qcow2 image's backing files handed over open too,
    /// in the chain's order (`vblk disk add`: the daemon is confined and opens nothing).
    pub(crate) fn open_with(
        served: ServedDisk,
        file: Option<std::fs::File>,
        backing_files: Vec<std::fs::File>,
    ) -> Result<OpenedDisk, Error> {
        if let Err(e) = served.validate() {
            close_passed(&served.listen);
            return Err(e.into());
        }
        let ServedDisk {
            id,
            listen,
            config,
            spec,
        } = served;
        let options = OpenOptions {
            read_only: config.read_only,
            cache: config.cache,
            prealloc: config.prealloc,
            image: config.image,
            engine_threads: config.engine_threads,
            nbd: config.nbd,
            backing: config.backing.clone(),
            backing_files: backing_files.into_iter().map(Arc::new).collect(),
            qcow2_cache: config.qcow2_cache,
        };
        let opened = match file {
            Some(f) => Backend::open_file(&config.disk, f, &options),
            None => Backend::open(&config.disk, &options),
        }
        .and_then(|d| {
            let d = Arc::new(d);
            // An engine that cannot work on this disk (aio without O_DIRECT, io_uring or
            // AIO refused by the kernel) is refused now, not when a frontend connects.
            drop(d.engine(config.engine, 1)?);
            Ok(d)
        });
        let disk = match opened {
            Ok(d) => d,
            Err(e) => {
                close_passed(&listen);
                return Err(e.into());
            }
        };
        info!(
            "disk {id} ({}): {} bytes, logical block {} bytes{}",
            config.disk,
            disk.size(),
            disk.logical_block_size(),
            if config.read_only { ", read-only" } else { "" }
        );
        let (listener, socket_file) = make_listener(&listen, &config)?;
        Ok(OpenedDisk {
            id,
            config,
            disk,
            listener,
            socket_file,
            listen: describe(&listen),
            spec,
        })
    }
}

impl OpenedDisk {
    /// The socket at `path` is this disk's (a client bound it and passed it): shown by
    /// that path, and removed with the disk if it is still that socket.
    pub(crate) fn adopt_socket(&mut self, path: &std::path::Path) {
        match SocketFile::adopt(path) {
            Ok(f) => {
                self.listen = path.display().to_string();
                self.socket_file = Some(f);
            }
            Err(e) => warn!("disk {}: {e}; it is not removed with the disk", self.id),
        }
    }
}

/// A passed socket (`Listen::Fd`) that will not be used: closed, so that its frontend
/// does not wait on it.
fn close_passed(listen: &Listen) {
    if let Listen::Fd(fd) = listen {
        // SAFETY: the daemon owns the descriptor it was passed and nothing else uses it:
        // the disk it was for is refused.
        drop(unsafe { std::os::fd::OwnedFd::from_raw_fd(*fd) });
    }
}

/// A disk being served: its thread and what it shares.
pub(crate) struct RunningDisk {
    pub shared: Arc<DiskShared>,
    pub controls: Arc<Controls>,
    pub thread: Option<JoinHandle<Result<(), Error>>>,
}

impl RunningDisk {
    /// Serve `opened` on a thread of its own, its I/O on `pool`'s threads from
    /// `first_thread` on. `ended` is called on that thread when it ends on its own (its
    /// listening socket failed).
    pub(crate) fn start(
        opened: OpenedDisk,
        pool: Arc<Pool>,
        first_thread: usize,
        ended: impl FnOnce(&Error) + Send + 'static,
    ) -> io::Result<RunningDisk> {
        let OpenedDisk {
            id,
            config,
            disk,
            listener,
            socket_file,
            listen,
            spec,
        } = opened;
        let shared = Arc::new(DiskShared::new(
            id,
            config,
            disk,
            pool,
            first_thread,
            listen,
            spec,
        ));
        let controls = Arc::new(Controls::new()?);
        shared.fence.set_waker(controls.clone());
        let (s, c) = (shared.clone(), controls.clone());
        let thread = std::thread::Builder::new()
            .name(format!("vblk-disk-{}", shared.id))
            .spawn(move || {
                let r = crate::log_context::with_disk(&s.id, || accept_loop(&s, &listener, &c));
                if let Err(e) = s.disk.flush() {
                    error!("disk {}: flushing at exit failed: {e}", s.id);
                }
                drop(socket_file);
                if let Err(e) = &r {
                    if !c.stopping() {
                        ended(e);
                    }
                }
                r
            })?;
        info!(
            "disk {}: listening on {} ({} queues of up to {} entries, engine {})",
            shared.id,
            shared.listen,
            shared.config.num_queues,
            shared.config.queue_size,
            shared.config.engine
        );
        Ok(RunningDisk {
            shared,
            controls,
            thread: Some(thread),
        })
    }

    /// Stop serving: the session's requests in flight finish, the disk is flushed, its
    /// socket removed. Waits for it.
    pub(crate) fn stop(&mut self) -> Result<(), Error> {
        self.controls.stop();
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(Error::VhostUser(format!(
                "disk {}: its thread panicked",
                self.shared.id
            ))),
            None => Ok(()),
        }
    }
}

/// Re-read the disk's size (SIGHUP, or after `vblk disk resize` changed it); tell the
/// frontend if it is not the capacity it was told.
fn resize(shared: &DiskShared, session: Option<&mut Session>) {
    let id = &shared.id;
    match shared.disk.refresh_size(shared.config.allow_shrink) {
        Ok((old, new)) if old == new => info!("disk {id}: the disk is {new} bytes"),
        Ok((old, new)) => info!("disk {id}: resize: the disk is now {new} bytes (was {old})"),
        // A RAM, null, simulated or NBD disk has nothing to read again: SIGHUP (every
        // `systemctl reload`) is no error for it.
        Err(storage::Error::Resize { .. }) => {
            info!("disk {id}: its size is fixed: {} bytes", shared.disk.size())
        }
        Err(e) => error!("disk {id}: resize refused: {e}"),
    }
    let sectors = shared.disk.size() >> proto::wire::SECTOR_SHIFT;
    if let Some(s) = session.filter(|s| s.capacity() != sectors) {
        s.capacity_changed(sectors);
    }
}

/// What woke the disk's thread up.
enum Wake {
    Socket,
    Controls,
}

/// Wait until `fd` is readable or the controls fire.
fn wait(fd: RawFd, controls: &Controls) -> io::Result<Wake> {
    let mut fds = [
        libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: controls.wake_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: two live pollfd structures.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if fds[1].revents != 0 {
            controls.clear_wake();
            return Ok(Wake::Controls);
        }
        return Ok(Wake::Socket);
    }
}

fn accept_loop(
    shared: &DiskShared,
    listener: &UnixListener,
    controls: &Controls,
) -> Result<(), Error> {
    let listen_err = |source| Error::Listen {
        path: shared.listen.clone(),
        source,
    };
    // A release of the image the fence put off when the last frontend left (true: it
    // completes a migration's switchover), retried when the fence pokes this thread.
    let mut pending: Option<bool> = None;
    // Said once until a connection is taken again (the one waiting fires poll at once).
    let mut accept_failing = false;
    while !controls.stopping() {
        match wait(listener.as_raw_fd(), controls).map_err(listen_err)? {
            Wake::Controls => {
                if controls.take_resize() {
                    resize(shared, None);
                }
                if let Some(switchover) = pending {
                    pending = release_image(shared, controls, switchover);
                }
                continue;
            }
            Wake::Socket => {}
        }
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if accept_may_recover(&e) => {
                // Out of descriptors or memory: the connection waits in the backlog and
                // is taken once they are back; the disk goes on (it stopped the daemon).
                if !accept_failing {
                    warn!(
                        "disk {}: cannot take a frontend's connection yet: {e}; trying again every {ACCEPT_RETRY:?}",
                        shared.id
                    );
                    accept_failing = true;
                }
                std::thread::sleep(ACCEPT_RETRY);
                continue;
            }
            Err(e) => return Err(listen_err(e)),
        };
        accept_failing = false;
        shared.attached.store(true, Ordering::SeqCst);
        pending = serve_one(shared, stream, controls);
        shared.attached.store(false, Ordering::SeqCst);
    }
    info!("disk {}: stopping", shared.id);
    Ok(())
}

/// How long the disk's thread waits after an accept that failed for want of resources.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// Whether `accept` failed for this connection or for a while (descriptors, memory), not
/// for the listening socket itself.
fn accept_may_recover(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(
            libc::EMFILE
                | libc::ENFILE
                | libc::ENOBUFS
                | libc::ENOMEM
                | libc::ECONNABORTED
                | libc::EPROTO
                | libc::EAGAIN
        )
    )
}

fn describe(listen: &Listen) -> String {
    match listen {
        Listen::Path(p) => p.display().to_string(),
        Listen::Fd(fd) => format!("fd {fd}"),
    }
}

/// Serve one frontend until it disconnects, breaks the protocol, or the disk stops.
/// Whatever goes wrong with this connection ends only this connection. Returns the
/// release of the image the fence put off, if any (`release_image`).
fn serve_one(shared: &DiskShared, mut stream: UnixStream, controls: &Controls) -> Option<bool> {
    let id = &shared.id;
    let stats = &shared.stats;
    let prepared = stream
        .set_read_timeout(Some(MESSAGE_TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(MESSAGE_TIMEOUT)))
        .and_then(|()| stream.try_clone());
    let conn = match prepared {
        Ok(c) => c,
        Err(e) => {
            error!("disk {id}: frontend connection refused: cannot set it up: {e}");
            return None;
        }
    };
    let mut session = match Session::new(shared, conn) {
        Ok(s) => s,
        Err(e) => {
            stats
                .lifecycle
                .failed_setups
                .fetch_add(1, Ordering::Relaxed);
            error!("disk {id}: frontend connection closed: its session cannot be set up: {e}; waiting for the next");
            return None;
        }
    };
    info!("disk {id}: frontend connected");
    loop {
        match wait(stream.as_raw_fd(), controls) {
            Ok(Wake::Socket) => {}
            Ok(Wake::Controls) => {
                if controls.stopping() {
                    session.shutdown();
                    break;
                }
                if controls.take_resize() {
                    resize(shared, Some(&mut session));
                }
                // A switchover that waited for requests still at the disk goes on once
                // they have ended.
                session.hand_over_if_waiting();
                continue;
            }
            Err(e) => {
                warn!("disk {id}: frontend session ended: poll failed: {e}");
                break;
            }
        }
        match session.handle(&mut stream) {
            Ok(()) => {}
            Err(SessionEnd::Disconnected) => {
                info!("disk {id}: frontend disconnected");
                break;
            }
            Err(e) => {
                stats
                    .lifecycle
                    .broken_sessions
                    .fetch_add(1, Ordering::Relaxed);
                warn!("disk {id}: frontend session ended: {e}");
                break;
            }
        }
        if session.poisoned() {
            stats
                .lifecycle
                .broken_sessions
                .fetch_add(1, Ordering::Relaxed);
            error!("disk {id}: the frontend truncated guest memory under the device; connection closed");
            break;
        }
        if let Some(w) = session.lost_worker() {
            stats.lifecycle.lost_workers.fetch_add(1, Ordering::Relaxed);
            error!("disk {id}: worker {w} ended (it panicked); connection closed");
            break;
        }
    }
    let counters = session.counters();
    // A switchover that waited for requests still at the disk completes with the release.
    let switchover = session.hand_over_waits();
    drop(session);
    // The frontend learns now that the session is over, even if a worker that did not
    // end within the drain timeout still holds a clone of the connection (to end it).
    let _ = stream.shutdown(std::net::Shutdown::Both);
    shared
        .throttle
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .mailboxes
        .clear();
    for (q, done, bad, failed) in counters {
        info!("disk {id}: queue {q}: {done} requests completed, {bad} rejected, {failed} failed");
    }
    release_image(shared, controls, switchover)
}

/// With no frontend, the daemon writes nothing: make the image durable and let its write
/// locks go until a frontend starts a ring again (which takes them back, or is refused if
/// another writer took them meanwhile). A migration of a paused VM never turns dirty
/// logging on, so the switchover is never seen; the destination can take the image once
/// the source's QEMU has gone (as QEMU inactivates its images at the end of every
/// migration). Kept while requests of the session may still reach the disk (the reset
/// fence holds some, or a worker of it still exists, whose engine may hold some that no
/// fence counts yet) until they have ended, and when the daemon stops (it closes the
/// image anyway). `switchover`: the session's switchover put its hand-over off for such
/// requests; this completes it (the disk is then one that handed its image over).
/// Returns `Some(switchover)` when the fence put the release off: the caller calls again
/// when the fence pokes the disk's thread.
fn release_image(shared: &DiskShared, controls: &Controls, switchover: bool) -> Option<bool> {
    if controls.stopping() {
        return None;
    }
    if !shared.fence.clear() {
        return Some(switchover);
    }
    let _turn = shared.image_turn.lock().unwrap_or_else(|p| p.into_inner());
    match shared.disk.deactivate() {
        Ok(true) if switchover => {
            shared.handed_over.store(true, Ordering::Release);
            info!(
                "disk {}: the requests still at the disk at the switchover have ended: writes made durable, the image's write locks released for the destination",
                shared.id
            )
        }
        Ok(true) => info!(
            "disk {}: no frontend: writes made durable, the image's write locks released until a frontend starts a ring",
            shared.id
        ),
        Ok(false) => {}
        Err(e) => error!(
            "disk {}: no frontend, and the image cannot be made durable and let go: {e}; it stays locked",
            shared.id
        ),
    }
    None
}

fn make_listener(
    listen: &Listen,
    config: &DeviceConfig,
) -> Result<(UnixListener, Option<SocketFile>), Error> {
    match listen {
        Listen::Path(path) => {
            let (l, file) = SocketFile::bind(path, &config.socket_access)?;
            Ok((l, Some(file)))
        }
        Listen::Fd(fd) => {
            // SAFETY: fstat on an fd number only reads metadata; a bad fd gives EBADF.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: `st` is a valid, writable stat buffer.
            if unsafe { libc::fstat(*fd, &mut st) } != 0 {
                return Err(Error::Listen {
                    path: format!("fd {fd}"),
                    source: io::Error::last_os_error(),
                });
            }
            if st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
                return Err(Error::Listen {
                    path: format!("fd {fd}"),
                    source: io::Error::new(io::ErrorKind::InvalidInput, "not a socket"),
                });
            }
            // SAFETY: the caller handed us this listening socket (--fd, or a client of
            // the control socket); from here on the daemon owns it and nothing else
            // closes it.
            Ok((unsafe { UnixListener::from_raw_fd(*fd) }, None))
        }
    }
}
