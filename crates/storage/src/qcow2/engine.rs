//! A worker's engine on a qcow2 image: it translates each guest read through the shared
//! table into runs, and carries them on engines of the image file and of its backing
//! file (the same kind the worker asked for), filling zero runs itself. A request whose
//! clusters the table does not hold waits, parked, while the metadata owner loads them;
//! compressed clusters and clusters reaching past the end of the file are read by the
//! owner. Nothing here blocks: the engine's completion fd is an epoll set holding both
//! engines' fds and the owner's answers.
//!
//! Slots for requests and for their pieces are reused; the pieces' iovec arrays keep
//! their capacity, so a steady workload allocates nothing.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::Arc;

use super::image::Image;
use super::iov;
use super::owner::{Answer, Job, Mailbox};
use super::table::Entry;
use crate::engine::{Completion, Engine, Full, Op};

/// No slice.
const NONE: u64 = u64::MAX;

/// Where a piece goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Target {
    Image,
    Backing,
    Owner,
}

/// What a run of a request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Data,
    Backing,
    Zero,
    Slow,
    Corrupt,
}

#[derive(Clone, Copy)]
struct Run {
    kind: Kind,
    /// Offset in the request.
    start: u64,
    len: u64,
    /// Image file offset (Data), guest offset (Backing, Slow).
    at: u64,
}

struct Parent {
    token: u64,
    /// Writes route to owned clusters in place, everything else to the owner.
    write: Option<bool>,
    offset: u64,
    len: u64,
    iov: *const libc::iovec,
    iovcnt: u32,
    pending: u32,
    /// Bytes from `offset` translated and sent (or zeroed) already: a request spanning
    /// more slices than the table holds at once goes out in parts, each routed when its
    /// slice is in (two of its slices may share a slot).
    routed: u64,
    errno: i32,
    /// The slice it waits for while parked, and the one it asked the owner for
    /// ([`NONE`] when its question was answered or not asked).
    waiting: u64,
    asked: u64,
}

/// What a piece does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Does {
    Read,
    Write {
        durable: bool,
    },
    Zero {
        unmap: bool,
        discard: bool,
        durable: bool,
    },
    Flush,
}

struct Sub {
    parent: u32,
    target: Target,
    does: Does,
    at: u64,
    len: u64,
    iov: Vec<libc::iovec>,
    /// A write the owner placed: it ends once both its data and its cluster's mapping
    /// are written ([`Answer::Mapped`]: whether the mapping was), in either order.
    placed: bool,
    mapped: Option<bool>,
    /// Its data write's result, while the mapping's is awaited.
    data: Option<Result<u64, i32>>,
}

/// The engine. Field order matters: the wrapped engines are dropped (waiting for what
/// they carry) before the iovec arrays they read, and the job sender before the image.
pub(crate) struct Qcow2Engine {
    inner: Box<dyn Engine>,
    backing: Option<Box<dyn Engine>>,
    /// Before `image`: the owner returns (and an image dropped with the last engine
    /// joins it) only once every sender is gone.
    jobs: SyncSender<Job>,
    image: Arc<Image>,
    mailbox: Arc<Mailbox>,
    epoll: OwnedFd,
    depth: usize,
    parents: Vec<Parent>,
    free_parents: Vec<u32>,
    subs: Vec<Sub>,
    free_subs: Vec<u32>,
    parked: VecDeque<u32>,
    blocked: VecDeque<u32>,
    ready: VecDeque<Completion>,
    answers: VecDeque<Answer>,
    reaped: Vec<(u64, io::Result<u64>)>,
    runs: Vec<Run>,
    /// Jobs sent to the owner and not answered.
    at_owner: usize,
    /// Slices asked of the owner and not answered: one Load per slice in flight.
    loading: Vec<u64>,
    /// The mailbox's eventfd was signalled for completions finished in `push`.
    signalled: bool,
    /// Pieces were pushed to the wrapped engines since their last submit.
    unsubmitted: bool,
    in_flight: usize,
}

// SAFETY: the raw iovec pointers name buffers lent under `Engine::push`'s contract; the
// engine is used by one thread at a time (`&mut self`).
unsafe impl Send for Qcow2Engine {}

impl Qcow2Engine {
    pub(crate) fn new(
        image: Arc<Image>,
        inner: Box<dyn Engine>,
        backing: Option<Box<dyn Engine>>,
        depth: u32,
    ) -> io::Result<Qcow2Engine> {
        let depth = depth as usize;
        let mailbox = Arc::new(Mailbox::new(depth)?);
        // SAFETY: creates a new descriptor, owned right below.
        let e = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if e < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: epoll_create1 just returned it and nothing else owns it.
        let epoll = unsafe { OwnedFd::from_raw_fd(e) };
        let fds = [
            Some(mailbox.fd()),
            inner.notify_fd(),
            backing.as_ref().and_then(|b| b.notify_fd()),
        ];
        for fd in fds.into_iter().flatten() {
            let mut ev = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: fd as u64,
            };
            // SAFETY: adds a live descriptor to our own epoll set; `ev` is a live struct.
            if unsafe { libc::epoll_ctl(epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) } != 0
            {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(Qcow2Engine {
            inner,
            backing,
            jobs: image.jobs(),
            image,
            mailbox,
            epoll,
            depth,
            parents: Vec::with_capacity(depth),
            free_parents: Vec::with_capacity(depth),
            subs: Vec::with_capacity(depth),
            free_subs: Vec::with_capacity(depth),
            parked: VecDeque::with_capacity(depth),
            blocked: VecDeque::with_capacity(depth),
            ready: VecDeque::with_capacity(depth),
            answers: VecDeque::with_capacity(depth),
            reaped: Vec::with_capacity(depth),
            runs: Vec::with_capacity(16),
            at_owner: 0,
            loading: Vec::with_capacity(16),
            signalled: false,
            unsubmitted: false,
            in_flight: 0,
        })
    }

    fn finish(&mut self, token: u64, result: io::Result<u64>) {
        self.ready.push_back(Completion { token, result });
    }

    /// A read (`write` None) or a write: checked, translated, sent or parked.
    fn start(
        &mut self,
        token: u64,
        write: Option<bool>,
        offset: u64,
        iov: *const libc::iovec,
        iovcnt: u32,
    ) {
        let mut len = 0u64;
        for i in 0..iovcnt as usize {
            // SAFETY: `iov` points to `iovcnt` iovecs (push's contract).
            len += unsafe { (*iov.add(i)).iov_len } as u64;
        }
        if !self.in_bounds(offset, len) {
            self.finish(token, Err(io::Error::from_raw_os_error(libc::EINVAL)));
            return;
        }
        let p = self.new_parent(Parent {
            token,
            write,
            offset,
            len,
            iov,
            iovcnt,
            pending: 0,
            routed: 0,
            errno: 0,
            waiting: NONE,
            asked: NONE,
        });
        if !self.route(p) {
            self.park(p);
        }
    }

    fn in_bounds(&self, offset: u64, len: u64) -> bool {
        offset.is_multiple_of(512)
            && len.is_multiple_of(512)
            && offset
                .checked_add(len)
                .is_some_and(|e| e <= self.image.size())
    }

    /// A request the owner does whole (flush, discard, write-zeroes): one piece.
    fn send_whole(&mut self, token: u64, does: Does, offset: u64, len: u64) {
        let p = self.new_parent(Parent {
            token,
            write: None,
            offset,
            len: 0,
            iov: std::ptr::null(),
            iovcnt: 0,
            pending: 1,
            routed: 0,
            errno: 0,
            waiting: NONE,
            asked: NONE,
        });
        let s = self.new_sub(p, Target::Owner, does, offset, len);
        if !self.push_sub(s) {
            self.blocked.push_back(s);
        }
    }

    fn new_parent(&mut self, p: Parent) -> u32 {
        match self.free_parents.pop() {
            Some(i) => {
                self.parents[i as usize] = p;
                i
            }
            None => {
                self.parents.push(p);
                (self.parents.len() - 1) as u32
            }
        }
    }

    /// Parent `p` is done: hand its completion out.
    fn end_parent(&mut self, p: u32) {
        let (token, errno, len) = {
            let pr = &self.parents[p as usize];
            (pr.token, pr.errno, pr.len)
        };
        self.free_parents.push(p);
        self.finish(
            token,
            if errno == 0 {
                Ok(len)
            } else {
                Err(io::Error::from_raw_os_error(errno))
            },
        );
    }

    /// Parent `p` fails with `errno`: nothing more of it is sent, and it ends once its
    /// pieces out are back.
    fn fail_parent(&mut self, p: u32, errno: i32) {
        let pr = &mut self.parents[p as usize];
        pr.errno = errno;
        pr.routed = pr.len;
        if pr.pending == 0 {
            self.end_parent(p);
        }
    }

    /// Translate what is left of parent `p` and send its pieces; false when a slice is
    /// missing (the parent is then to be parked, with what came before it sent).
    fn route(&mut self, p: u32) -> bool {
        let img = &self.image;
        let (bits, table) = (img.cluster_bits, &img.table);
        let cluster = 1u64 << bits;
        let (offset, len, routed) = {
            let pr = &self.parents[p as usize];
            (pr.offset, pr.len, pr.routed)
        };
        self.runs.clear();
        let mut off = offset + routed;
        let mut missing = None;
        while off < offset + len {
            let c = off >> bits;
            let in_c = off & (cluster - 1);
            let n = (cluster - in_c).min(offset + len - off);
            let Some(e) = table.get(c) else {
                missing = Some(c / table.per_slice());
                break;
            };
            let write = self.parents[p as usize].write;
            let (kind, at) = match (e, write) {
                (Entry::Corrupt, _) => (Kind::Corrupt, 0),
                (Entry::Owned(host), _) | (Entry::Fresh(host), None | Some(false)) => {
                    (Kind::Data, host + in_c)
                }
                // Not to be written in place: the owner writes it.
                (_, Some(_)) => (Kind::Slow, off),
                (Entry::Unallocated, None) if img.backing.is_some() => (Kind::Backing, off),
                (Entry::Unallocated | Entry::Zero, None) => (Kind::Zero, 0),
                (Entry::Data(host), None) => (Kind::Data, host + in_c),
                (Entry::Slow, None) => (Kind::Slow, off),
            };
            let start = off - offset;
            match self.runs.last_mut() {
                Some(r)
                    if r.kind == kind
                        && kind != Kind::Slow
                        && (kind == Kind::Zero || kind == Kind::Corrupt || r.at + r.len == at) =>
                {
                    r.len += n
                }
                _ => self.runs.push(Run {
                    kind,
                    start,
                    len: n,
                    at,
                }),
            }
            off += n;
        }
        if self.runs.iter().any(|r| r.kind == Kind::Corrupt) {
            self.fail_parent(p, libc::EIO);
            return true;
        }
        if let Some(slice) = missing {
            self.parents[p as usize].waiting = slice;
            if self.runs.is_empty() {
                return false;
            }
        }
        let backing_size = self.image.backing_size;
        let does = match self.parents[p as usize].write {
            Some(durable) => Does::Write { durable },
            None => Does::Read,
        };
        // Counted before any piece goes out: a piece can finish while we send the next.
        let pending: u32 = self
            .runs
            .iter()
            .map(|r| match r.kind {
                Kind::Data | Kind::Slow => 1,
                Kind::Backing => u32::from(backing_size > r.at),
                Kind::Zero | Kind::Corrupt => 0,
            })
            .sum();
        self.parents[p as usize].pending += pending + 1;
        for i in 0..self.runs.len() {
            let r = self.runs[i];
            match r.kind {
                Kind::Zero => self.zero(p, r.start, r.len),
                Kind::Data => self.send(p, Target::Image, does, r.start, r.len, r.at),
                Kind::Backing => {
                    // What lies past the end of a smaller backing file reads as zeroes.
                    let inside = backing_size.saturating_sub(r.at).min(r.len);
                    if inside > 0 {
                        self.send(p, Target::Backing, does, r.start, inside, r.at);
                    }
                    if inside < r.len {
                        self.zero(p, r.start + inside, r.len - inside);
                    }
                }
                Kind::Slow => self.send(p, Target::Owner, does, r.start, r.len, r.at),
                Kind::Corrupt => {}
            }
        }
        // The count's extra one, taken back now that every piece is out.
        let pr = &mut self.parents[p as usize];
        pr.routed = off - offset;
        pr.pending -= 1;
        if missing.is_some() {
            return false;
        }
        if pr.pending == 0 {
            self.end_parent(p);
        }
        true
    }

    fn zero(&mut self, p: u32, start: u64, len: u64) {
        let pr = &self.parents[p as usize];
        // SAFETY: the request's buffers, lent to us for writing until it completes.
        unsafe { iov::zero(pr.iov, pr.iovcnt, start, len) };
    }

    /// A piece slot for parent `p`, with no buffers yet.
    fn new_sub(&mut self, p: u32, target: Target, does: Does, at: u64, len: u64) -> u32 {
        let s = match self.free_subs.pop() {
            Some(i) => i,
            None => {
                self.subs.push(Sub {
                    parent: 0,
                    target,
                    does,
                    at: 0,
                    len: 0,
                    iov: Vec::new(),
                    placed: false,
                    mapped: None,
                    data: None,
                });
                (self.subs.len() - 1) as u32
            }
        };
        let sub = &mut self.subs[s as usize];
        sub.parent = p;
        sub.target = target;
        sub.does = does;
        sub.at = at;
        sub.len = len;
        sub.iov.clear();
        sub.placed = false;
        sub.mapped = None;
        sub.data = None;
        s
    }

    /// Make a piece of parent `p` (bytes `[start, start + len)` of it, at `at` on its
    /// target) and send it.
    fn send(&mut self, p: u32, target: Target, does: Does, start: u64, len: u64, at: u64) {
        let s = self.new_sub(p, target, does, at, len);
        let (piov, pcnt) = {
            let pr = &self.parents[p as usize];
            (pr.iov, pr.iovcnt)
        };
        // SAFETY: the request's iovecs, valid until it completes.
        unsafe { iov::slice_into(piov, pcnt, start, len, &mut self.subs[s as usize].iov) };
        if !self.push_sub(s) {
            self.blocked.push_back(s);
        }
    }

    /// Hand piece `s` to its target; false when the target is full.
    fn push_sub(&mut self, s: u32) -> bool {
        let sub = &self.subs[s as usize];
        let (iov, iovcnt) = (sub.iov.as_ptr(), sub.iov.len() as u32);
        let op = match sub.does {
            Does::Write { durable } => Op::Write {
                offset: sub.at,
                iov,
                iovcnt,
                durable,
            },
            _ => Op::Read {
                offset: sub.at,
                iov,
                iovcnt,
            },
        };
        match sub.target {
            Target::Image => {
                self.unsubmitted = true;
                // SAFETY: the piece's iovecs live in `self.subs[s]` (never touched until
                // its completion) and name the request's buffers, lent to us until it
                // completes; the wrapped engines are dropped before `subs`.
                unsafe { self.inner.push(u64::from(s), op).is_ok() }
            }
            Target::Backing => match self.backing.as_mut() {
                Some(b) => {
                    self.unsubmitted = true;
                    // SAFETY: as above.
                    unsafe { b.push(u64::from(s), op).is_ok() }
                }
                None => false,
            },
            Target::Owner => {
                let reply = Arc::clone(&self.mailbox);
                let (offset, len) = (sub.at, sub.len);
                let job = match sub.does {
                    Does::Read => Job::Read {
                        sub: s,
                        offset,
                        len,
                        iov,
                        iovcnt,
                        reply,
                    },
                    Does::Write { durable } => Job::Write {
                        sub: s,
                        offset,
                        len,
                        iov,
                        iovcnt,
                        durable,
                        reply,
                    },
                    Does::Zero {
                        unmap,
                        discard,
                        durable,
                    } => Job::Zero {
                        sub: s,
                        offset,
                        len,
                        unmap,
                        discard,
                        durable,
                        reply,
                    },
                    Does::Flush => Job::Flush { sub: s, reply },
                };
                match self.jobs.try_send(job) {
                    Ok(()) => {
                        self.at_owner += 1;
                        true
                    }
                    Err(TrySendError::Full(_)) => false,
                    Err(TrySendError::Disconnected(_)) => {
                        self.sub_done(s, Err(io::Error::from_raw_os_error(libc::EIO)));
                        true
                    }
                }
            }
        }
    }

    fn sub_done(&mut self, s: u32, mut result: io::Result<u64>) {
        let sub = &mut self.subs[s as usize];
        if sub.placed {
            match sub.mapped {
                None => {
                    // The data is written; the mapping not yet.
                    sub.data = Some(result.map_err(|e| e.raw_os_error().unwrap_or(libc::EIO)));
                    return;
                }
                Some(false) => result = Err(io::Error::from_raw_os_error(libc::EIO)),
                Some(true) => {}
            }
            sub.placed = false;
        }
        let (p, len) = (sub.parent, sub.len);
        self.free_subs.push(s);
        let pr = &mut self.parents[p as usize];
        match result {
            Ok(n) if n == len => {}
            Ok(_) => pr.errno = libc::EIO,
            Err(e) => pr.errno = e.raw_os_error().unwrap_or(libc::EIO),
        }
        pr.pending -= 1;
        if pr.pending == 0 && pr.routed == pr.len {
            self.end_parent(p);
        }
    }

    /// Ask the owner for parent `p`'s missing slice, unless a question about it is out
    /// already (its answer re-routes every parked request). False when the owner is gone.
    fn ask(&mut self, p: u32) -> bool {
        let slice = self.parents[p as usize].waiting;
        if self.loading.contains(&slice) {
            self.parents[p as usize].asked = slice;
            return true;
        }
        let job = Job::Load {
            slice,
            reply: Arc::clone(&self.mailbox),
        };
        match self.jobs.try_send(job) {
            Ok(()) => {
                self.parents[p as usize].asked = slice;
                self.loading.push(slice);
                self.at_owner += 1;
                true
            }
            // Asked again at the next submit or reap (backlog() counts it).
            Err(TrySendError::Full(_)) => true,
            Err(TrySendError::Disconnected(_)) => false,
        }
    }

    /// Park parent `p` until its slice comes in, or end it with EIO if the owner is gone.
    fn park(&mut self, p: u32) {
        if self.ask(p) {
            self.parked.push_back(p);
        } else {
            self.fail_parent(p, libc::EIO);
        }
    }

    /// Route the parked requests again (a slice came in, or one could not be asked for),
    /// asking for what is still missing.
    fn unpark(&mut self, loaded: Option<u64>) {
        if let Some(slice) = loaded {
            self.loading.retain(|&s| s != slice);
            for &p in &self.parked {
                let pr = &mut self.parents[p as usize];
                if pr.asked == slice {
                    pr.asked = NONE;
                }
            }
        }
        for _ in 0..self.parked.len() {
            let Some(p) = self.parked.pop_front() else {
                break;
            };
            if !self.route(p) {
                self.park(p);
            }
        }
    }

    /// Take the owner's answers and the wrapped engines' completions; retry what waits.
    fn collect(&mut self) {
        // Only when an answer or a signal can be there: a translation hit costs no system
        // call.
        if self.at_owner > 0 || self.signalled {
            self.signalled = false;
            self.mailbox.take(&mut self.answers);
            while let Some(a) = self.answers.pop_front() {
                if !matches!(a, Answer::Place { .. }) {
                    // A placed write's job is answered twice: the second ends it.
                    self.at_owner = self.at_owner.saturating_sub(1);
                }
                match a {
                    Answer::Loaded { slice } => self.unpark(Some(slice)),
                    Answer::Failed { slice, errno } => {
                        self.loading.retain(|&s| s != slice);
                        for _ in 0..self.parked.len() {
                            let Some(p) = self.parked.pop_front() else {
                                break;
                            };
                            let pr = &mut self.parents[p as usize];
                            if pr.waiting == slice {
                                self.fail_parent(p, errno);
                            } else {
                                if pr.asked == slice {
                                    pr.asked = NONE;
                                }
                                self.parked.push_back(p);
                            }
                        }
                    }
                    Answer::Place { sub, host } => {
                        // Placed by the owner: the data goes to the file from here, while
                        // the owner writes the mapping.
                        let s = &mut self.subs[sub as usize];
                        s.target = Target::Image;
                        s.at = host;
                        s.placed = true;
                        if !self.push_sub(sub) {
                            self.blocked.push_back(sub);
                        }
                    }
                    Answer::Mapped { sub, ok } => {
                        let s = &mut self.subs[sub as usize];
                        s.mapped = Some(ok);
                        if let Some(r) = s.data.take() {
                            self.sub_done(sub, r.map_err(io::Error::from_raw_os_error));
                        }
                    }
                    Answer::Done { sub, result } => {
                        self.sub_done(sub, result.map_err(io::Error::from_raw_os_error))
                    }
                }
            }
            if self.at_owner == 0 {
                // Every answer is in. One posted between our read of the eventfd and our
                // taking of the answers left its count behind: cleared, so that the epoll
                // set does not stay readable with nothing to do (the worker would spin).
                self.mailbox.drain();
            }
        }
        let mut reaped = std::mem::take(&mut self.reaped);
        self.inner.reap(&mut |c| reaped.push((c.token, c.result)));
        if let Some(b) = self.backing.as_mut() {
            b.reap(&mut |c| reaped.push((c.token, c.result)));
        }
        for (token, result) in reaped.drain(..) {
            self.sub_done(token as u32, result);
        }
        self.reaped = reaped;
        for _ in 0..self.blocked.len() {
            let Some(s) = self.blocked.pop_front() else {
                break;
            };
            if !self.push_sub(s) {
                self.blocked.push_front(s);
                break;
            }
        }
        if self.parked.iter().any(|&p| {
            let pr = &self.parents[p as usize];
            pr.asked != pr.waiting
        }) {
            self.unpark(None);
        }
        if self.unsubmitted {
            // Pieces routed here (a slice came in, an engine had room again) go out now:
            // the worker may sleep next, and only their completions would wake it.
            if let Err(e) = self.submit_wrapped() {
                log::warn!("qcow2: submitting to the image's engines: {e}");
            }
        }
    }

    fn submit_wrapped(&mut self) -> io::Result<()> {
        self.unsubmitted = false;
        let a = self.inner.submit();
        let b = self.backing.as_mut().map_or(Ok(()), |b| b.submit());
        if a.is_err() || b.is_err() {
            self.unsubmitted = true;
        }
        // An engine without a completion fd (sync) finished its work in submit: nothing
        // will wake the worker for it, so the mailbox does.
        let silent = |e: &dyn Engine| e.notify_fd().is_none() && e.in_flight() > 0;
        if silent(self.inner.as_ref()) || self.backing.as_deref().is_some_and(silent) {
            self.mailbox.signal();
            self.signalled = true;
        }
        a.and(b)
    }
}

impl Engine for Qcow2Engine {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    unsafe fn push(&mut self, token: u64, op: Op) -> Result<(), Full> {
        if self.in_flight >= self.depth {
            return Err(Full);
        }
        self.in_flight += 1;
        match op {
            Op::Read {
                offset,
                iov,
                iovcnt,
            } => self.start(token, None, offset, iov, iovcnt),
            Op::Write { .. } if !self.image.writable => {
                self.finish(token, Err(io::Error::from_raw_os_error(libc::EBADF)))
            }
            Op::Write {
                offset,
                iov,
                iovcnt,
                durable,
            } => self.start(token, Some(durable), offset, iov, iovcnt),
            Op::Flush if !self.image.writable => self.finish(token, Ok(0)),
            Op::Discard { .. } | Op::WriteZeroes { .. } if !self.image.writable => {
                self.finish(token, Err(io::Error::from_raw_os_error(libc::EBADF)))
            }
            Op::Flush => self.send_whole(token, Does::Flush, 0, 0),
            Op::Discard {
                offset,
                len,
                durable,
            } => {
                let does = Does::Zero {
                    unmap: true,
                    discard: true,
                    durable,
                };
                if self.in_bounds(offset, len) {
                    self.send_whole(token, does, offset, len)
                } else {
                    self.finish(token, Err(io::Error::from_raw_os_error(libc::EINVAL)))
                }
            }
            Op::WriteZeroes {
                offset,
                len,
                unmap,
                durable,
            } => {
                let does = Does::Zero {
                    unmap,
                    discard: false,
                    durable,
                };
                if self.in_bounds(offset, len) {
                    self.send_whole(token, does, offset, len)
                } else {
                    self.finish(token, Err(io::Error::from_raw_os_error(libc::EINVAL)))
                }
            }
        }
        Ok(())
    }

    fn submit(&mut self) -> io::Result<()> {
        self.submit_wrapped()?;
        if !self.ready.is_empty() && !self.signalled {
            // Completions finished here: make the completion fd say so.
            self.mailbox.signal();
            self.signalled = true;
        }
        Ok(())
    }

    fn reap(&mut self, f: &mut dyn FnMut(Completion)) -> usize {
        self.collect();
        let n = self.ready.len();
        for c in self.ready.drain(..) {
            f(c);
        }
        self.in_flight -= n;
        n
    }

    fn wait(&mut self) -> io::Result<()> {
        loop {
            self.collect();
            if !self.ready.is_empty() || self.in_flight == 0 {
                return Ok(());
            }
            self.submit()?;
            let mut pfd = libc::pollfd {
                fd: self.epoll.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one live pollfd. A bounded wait: work refused by a full engine or
            // channel is retried even if nothing signals.
            unsafe { libc::poll(&mut pfd, 1, 100) };
        }
    }

    fn notify_fd(&self) -> Option<RawFd> {
        Some(self.epoll.as_raw_fd())
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn backlog(&self) -> usize {
        self.blocked.len()
            + self
                .parked
                .iter()
                .filter(|&&p| {
                    let pr = &self.parents[p as usize];
                    pr.asked != pr.waiting
                })
                .count()
            + self.inner.backlog()
            + self.backing.as_ref().map_or(0, |b| b.backlog())
    }
}

impl Drop for Qcow2Engine {
    fn drop(&mut self) {
        // The owner may still be reading into buffers of ours: wait for its answers.
        while self.at_owner > 0 && self.image.owner_alive() {
            let mut pfd = libc::pollfd {
                fd: self.mailbox.fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one live pollfd.
            unsafe { libc::poll(&mut pfd, 1, 1000) };
            self.mailbox.take(&mut self.answers);
            let ends = self
                .answers
                .iter()
                .filter(|a| !matches!(a, Answer::Place { .. }))
                .count();
            self.at_owner = self.at_owner.saturating_sub(ends);
            self.answers.clear();
        }
    }
}
