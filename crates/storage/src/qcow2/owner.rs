//! The metadata owner: one thread per image that alone reads and writes its tables
//! (blocking I/O, never on a worker). Workers send it what their translation table cannot
//! answer over a bounded channel: a slice to load into the table, a read that needs it (a
//! compressed cluster, a data cluster reaching past the end of the file), and every write
//! that is not to a cluster the table says may be written in place (allocation and
//! copy-on-write, write.rs), discards, write-zeroes and flushes. It answers in the asking
//! engine's mailbox and signals the mailbox's eventfd, which sits in that engine's epoll
//! set, so a worker sleeping on its engine wakes for it.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use miniz_oxide::inflate::core::{decompress, inflate_flags, DecompressorOxide};

use super::entry::Mapping;
use super::fileio::FileIo;
use super::image::Counters;
use super::iov;
use super::meta::{Meta, MetaError, Source};
use super::table::{Entry, Table};
use super::write::{Until, Writer};

/// What a worker asks of the owner.
pub(crate) enum Job {
    /// Put slice `slice` into the table.
    Load { slice: u64, reply: Arc<Mailbox> },
    /// Read guest bytes `[offset, offset + len)` (inside one cluster) into the buffers.
    Read {
        sub: u32,
        offset: u64,
        len: u64,
        iov: *const libc::iovec,
        iovcnt: u32,
        reply: Arc<Mailbox>,
    },
    /// Write the buffers to guest bytes `[offset, offset + len)` (inside one cluster).
    Write {
        sub: u32,
        offset: u64,
        len: u64,
        iov: *const libc::iovec,
        iovcnt: u32,
        durable: bool,
        reply: Arc<Mailbox>,
    },
    /// Discard (`discard`) or write zeroes to `[offset, offset + len)`; `unmap` allows
    /// deallocating.
    Zero {
        sub: u32,
        offset: u64,
        len: u64,
        unmap: bool,
        discard: bool,
        durable: bool,
        reply: Arc<Mailbox>,
    },
    /// Make every completed write durable, mappings included.
    Flush { sub: u32, reply: Arc<Mailbox> },
    /// Take the image over (`active`), or let go of it (qcow2/handoff.rs).
    Handoff { active: bool, reply: Arc<Mailbox> },
    /// Grow the image to `size` bytes (qcow2/resize.rs).
    Resize { size: u64, reply: Arc<Mailbox> },
}

// SAFETY: a Read or Write job's buffers are lent to the owner under `Engine::push`'s contract: the
// engine that sent it keeps them valid and untouched until the answer comes back, and
// waits for every answer before it is dropped.
unsafe impl Send for Job {}

/// The owner's answer.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Answer {
    /// The slice is in the table (or its metadata was found corrupt and marked so).
    Loaded { slice: u64 },
    /// Reading the slice failed (an I/O error): requests waiting for it fail.
    Failed { slice: u64, errno: i32 },
    /// A job finished: bytes, or an errno.
    Done { sub: u32, result: Result<u64, i32> },
    /// A write job's cluster is at `host`, its own (new, or given in an earlier batch;
    /// a new one's other bytes read as zeroes): the engine writes the data there itself,
    /// while the owner writes the mapping. The job ends with [`Answer::Mapped`].
    Place { sub: u32, host: u64 },
    /// A placed write's mapping is in the file (`ok`), or could not be written: the
    /// write fails with EIO.
    Mapped { sub: u32, ok: bool },
}

/// One engine's inbox: the owner's answers and an eventfd it signals.
pub(crate) struct Mailbox {
    answers: Mutex<VecDeque<Answer>>,
    event: OwnedFd,
}

impl Mailbox {
    pub(crate) fn new(capacity: usize) -> io::Result<Mailbox> {
        // SAFETY: eventfd creates a new descriptor, owned right below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Mailbox {
            answers: Mutex::new(VecDeque::with_capacity(capacity)),
            // SAFETY: eventfd just returned it and nothing else owns it.
            event: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.event.as_raw_fd()
    }

    /// Post an answer without waking the engine (the poster signals once for several).
    pub(crate) fn post_quietly(&self, a: Answer) {
        self.answers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_back(a);
    }

    /// Make the eventfd readable.
    pub(crate) fn signal(&self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from a live u64 to our own non-blocking eventfd.
        unsafe { libc::write(self.event.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Empty the eventfd and move every answer into `out` (whose capacity is kept).
    pub(crate) fn take(&self, out: &mut VecDeque<Answer>) {
        self.drain();
        let mut a = self.answers.lock().unwrap_or_else(PoisonError::into_inner);
        out.extend(a.drain(..));
    }

    /// Empty the eventfd.
    pub(crate) fn drain(&self) {
        let mut count = 0u64;
        // SAFETY: reads 8 bytes into a live u64 from our own non-blocking eventfd.
        unsafe { libc::read(self.event.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
    }
}

/// The owner thread's state.
pub(crate) struct Owner {
    pub(crate) meta: Meta,
    pub(crate) table: Arc<Table>,
    pub(crate) name: String,
    /// Compressed input and one decompressed cluster.
    pub(crate) input: Vec<u8>,
    pub(crate) cluster: Vec<u8>,
    pub(crate) inflater: Box<DecompressorOxide>,
    /// Writing state, for a writable image.
    pub(crate) writer: Option<Writer>,
    /// A slice's entries on their way into the table (kept for its capacity).
    pub(crate) entries: Vec<Entry>,
    /// A slice's mappings, as the metadata gives them (kept for its capacity).
    pub(crate) mappings: Vec<Result<Mapping, MetaError>>,
    /// What the owner did, for `vblk stats`.
    pub(crate) counters: Arc<Counters>,
    /// The batch's answers, posted once its mappings are in the file (placed writes:
    /// before, and their `Mapped` after).
    pub(crate) outbox: Vec<(Arc<Mailbox>, Answer, bool)>,
    /// The mailboxes an answer was posted to, each signalled once.
    pub(crate) posted: Vec<Arc<Mailbox>>,
    /// Testing aid: where the owner stops before it writes changed mappings.
    pub(crate) hold: Arc<super::hold::Hold>,
    /// Another daemon may write the image (a migration's other end): no write, discard
    /// or write-zeroes is done until the image is taken over (qcow2/handoff.rs).
    pub(crate) inactive: bool,
    /// Failed requests logged in this second, those left unlogged, and when the second
    /// began: a full file system fails every allocating write, one per cluster.
    pub(crate) failures: (u32, u64, Option<Instant>),
}

/// The most failed requests logged per second; the others are counted in the next line.
const FAILURES_LOGGED_PER_SECOND: u32 = 8;

/// The most jobs taken at one wake-up of the owner.
const BATCH_JOBS: usize = 64;

/// How long mappings of acknowledged writes (in the file already) wait, at most, before
/// the owner makes them durable on its own (a guest FLUSH does it at once).
const WRITEBACK_AFTER: Duration = Duration::from_secs(1);

/// How often the owner looks for the end of a sync in flight when no job comes.
const IO_POLL: Duration = Duration::from_millis(2);

impl Owner {
    /// Serve jobs until every sender is gone.
    pub(crate) fn run(mut self, src: &FileIo<'_>, jobs: Receiver<Job>) {
        let mut corrupt_logged = false;
        loop {
            // With a sync in flight, the owner looks for its end every few milliseconds.
            let timeout = match self.writer.as_ref() {
                Some(w) if w.io_out() => Some(IO_POLL),
                Some(w) if w.pending() => Some(WRITEBACK_AFTER / 4),
                _ => None,
            };
            let job = match timeout {
                Some(t) => match jobs.recv_timeout(t) {
                    Ok(j) => Some(j),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => break,
                },
                None => match jobs.recv() {
                    Ok(j) => Some(j),
                    Err(_) => break,
                },
            };
            if let Err(e) = self.poll_io(src, Until::Now) {
                log::error!("{}: syncing the image: {e}", self.name);
            }
            if self.writer.as_ref().is_some_and(|w| w.due(WRITEBACK_AFTER)) {
                if let Err(e) = self.writeback_soon(src) {
                    log::error!("{}: writing mappings back: {e}", self.name);
                }
                self.check_sync(src);
            }
            let Some(job) = job else { continue };
            // A batch: this job and those waiting behind it, answered together once the
            // mappings they changed are in the file (one write per run of changed
            // slices, one sync for all their copy-on-writes).
            self.job(src, job, &mut corrupt_logged);
            for _ in 1..BATCH_JOBS {
                match jobs.try_recv() {
                    Ok(job) => self.job(src, job, &mut corrupt_logged),
                    Err(_) => break,
                }
            }
            self.settle(src);
            self.counters
                .l2_reads
                .store(self.meta.loads, Ordering::Relaxed);
        }
        // Every engine is gone: the unused counted clusters are given back, and
        // everything is made durable.
        let closed = self.release_reserved(src).and_then(|()| {
            if self.writer.as_ref().is_some_and(|w| w.pending()) {
                self.writeback(src)
            } else if self.writer.is_some() {
                src.sync()
            } else {
                Ok(())
            }
        });
        if let Err(e) = closed {
            log::error!("{}: closing the image: {e}", self.name);
        }
        if self.failures.1 > 0 {
            log::error!(
                "{}: {} more failed requests were not logged",
                self.name,
                self.failures.1
            );
        }
    }

    fn job(&mut self, src: &FileIo<'_>, job: Job, corrupt_logged: &mut bool) {
        self.serve(src, job, corrupt_logged);
        self.check_sync(src);
    }

    fn serve(&mut self, src: &FileIo<'_>, job: Job, corrupt_logged: &mut bool) {
        if self.inactive {
            if let Job::Write {
                sub, offset, reply, ..
            }
            | Job::Zero {
                sub, offset, reply, ..
            } = job
            {
                let result = Err(io::Error::other(
                    "the image is handed over to another daemon (a live migration)",
                ));
                self.answer(&reply, sub, "writing", offset, result, false);
                return;
            }
        }
        match job {
            Job::Load { slice, reply } => {
                let a = self.load(src, slice, corrupt_logged);
                self.outbox.push((reply, a, false));
            }
            Job::Read {
                sub,
                offset,
                len,
                iov,
                iovcnt,
                reply,
            } => {
                let result = self.read(src, offset, len, iov, iovcnt);
                self.answer(&reply, sub, "reading", offset, result, false);
            }
            Job::Write {
                sub,
                offset,
                len,
                iov,
                iovcnt,
                durable,
                reply,
            } => match self.write_job(src, offset, len, iov, iovcnt, durable) {
                Ok(Some(host)) => self.outbox.push((reply, Answer::Place { sub, host }, true)),
                result => {
                    let result = result.map(|_| len);
                    self.answer(&reply, sub, "writing", offset, result, true)
                }
            },
            Job::Zero {
                sub,
                offset,
                len,
                unmap,
                discard,
                durable,
                reply,
            } => {
                let result = self.zero_job(src, offset, len, unmap, discard, durable);
                self.answer(&reply, sub, "zeroing", offset, result, true);
            }
            Job::Flush { sub, reply } => {
                let result = self.flush_job(src).map(|()| 0);
                self.answer(&reply, sub, "flushing", 0, result, false);
            }
            Job::Handoff { .. } | Job::Resize { .. } => {
                let (result, reply) = match job {
                    Job::Handoff {
                        active: true,
                        reply,
                    } => (self.activate(src), reply),
                    Job::Handoff { reply, .. } => (self.deactivate(src).map(|()| 0), reply),
                    Job::Resize { size, reply } => (self.grow(src, size).map(|()| size), reply),
                    _ => return,
                };
                if let Err(e) = &result {
                    log::error!("{}: {e}", self.name);
                }
                let result = result.map_err(|e| e.raw_os_error().unwrap_or(libc::EIO));
                self.outbox
                    .push((reply, Answer::Done { sub: 0, result }, false));
            }
        }
    }

    /// Answer a job at the end of the batch; `mapped`: its success depends on the
    /// batch's mappings reaching the file.
    fn answer(
        &mut self,
        reply: &Arc<Mailbox>,
        sub: u32,
        what: &str,
        offset: u64,
        result: io::Result<u64>,
        mapped: bool,
    ) {
        if let Err(e) = &result {
            let (logged, unlogged, since) = &mut self.failures;
            if since.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
                (*logged, *since) = (0, Some(Instant::now()));
            }
            if *logged < FAILURES_LOGGED_PER_SECOND {
                *logged += 1;
                let more = std::mem::take(unlogged);
                let more = if more > 0 {
                    format!(" ({more} more failed requests not logged before it)")
                } else {
                    String::new()
                };
                log::error!("{}: {what} guest offset {offset}: {e}{more}", self.name);
            } else {
                *unlogged += 1;
            }
        }
        let a = Answer::Done {
            sub,
            result: result.map_err(|e| e.raw_os_error().unwrap_or(libc::EIO)),
        };
        self.outbox.push((Arc::clone(reply), a, mapped));
    }

    /// End of a batch: the placed writes go out (their data is written while their
    /// mappings are: each was a new cluster that read as zeroes, or one with its mapping
    /// in the file already, so either may reach the disk first), the changed mappings go
    /// into the file, then every other answer, and the placed writes learn that their
    /// mappings are in. If the mappings could not be written, the jobs that changed them
    /// fail.
    fn settle(&mut self, src: &FileIo<'_>) {
        let mut outbox = std::mem::take(&mut self.outbox);
        for (reply, a, _) in &outbox {
            if let Answer::Place { .. } = a {
                self.post_quietly(reply, *a);
            }
        }
        self.signal_posted();
        let ok = self.flush_mappings(src).is_ok();
        for (reply, a, mapped) in outbox.drain(..) {
            let a = match a {
                Answer::Place { sub, .. } => Answer::Mapped { sub, ok },
                Answer::Done { sub, result: Ok(_) } if mapped && !ok => Answer::Done {
                    sub,
                    result: Err(libc::EIO),
                },
                a => a,
            };
            self.post_quietly(&reply, a);
        }
        self.outbox = outbox;
        self.signal_posted();
    }

    /// Post `a` to `reply`, which is signalled at the next [`Owner::signal_posted`].
    fn post_quietly(&mut self, reply: &Arc<Mailbox>, a: Answer) {
        reply.post_quietly(a);
        if !self.posted.iter().any(|m| Arc::ptr_eq(m, reply)) {
            self.posted.push(Arc::clone(reply));
        }
    }

    /// Wake each engine answers were posted to, once.
    fn signal_posted(&mut self) {
        for m in self.posted.drain(..) {
            m.signal();
        }
    }

    fn load(&mut self, src: &FileIo<'_>, slice: u64, logged: &mut bool) -> Answer {
        if self.table.holds(slice) {
            return Answer::Loaded { slice };
        }
        let cluster = self.meta.header().cluster_size();
        let file_size = self.meta.file_size();
        let first = slice * self.table.per_slice();
        let bits = self.meta.header().cluster_bits;
        let mut mappings = std::mem::take(&mut self.mappings);
        let r = self.meta.slice(src, slice, &mut mappings);
        let entries = &mappings;
        let answer = match r {
            Ok(()) => {
                // Mappings written but not yet in the file come from the writer, and a
                // cluster is written in place only if the writer agrees it may be.
                let mut out = std::mem::take(&mut self.entries);
                out.clear();
                for m in entries {
                    out.push(match m {
                        Ok(m) => Entry::of(*m, cluster, file_size),
                        // The image is corrupt here: this cluster's reads and writes fail
                        // with EIO from now on; the slice's other clusters are served.
                        Err(e) => {
                            if !*logged {
                                log::error!(
                                    "{}: the image is corrupt ({e}); the guest cluster it maps fails with EIO (`qemu-img check` tells more)",
                                    self.name
                                );
                                *logged = true;
                            }
                            Entry::Corrupt
                        }
                    });
                }
                if self.inactive {
                    // Read in place, written by no one (qcow2/handoff.rs).
                    for e in out.iter_mut() {
                        if let Entry::Owned(h) = *e {
                            *e = Entry::Data(h);
                        }
                    }
                } else if let Some(w) = self.writer.as_mut() {
                    for (i, e) in out.iter_mut().enumerate() {
                        let gc = first + i as u64;
                        if let Some(m) = w.pending_mapping(gc) {
                            *e = w.entry(gc, m, cluster, file_size);
                        }
                        if let Entry::Owned(h) = *e {
                            if !w.in_place(src, h, bits, file_size).unwrap_or(false) {
                                *e = Entry::Data(h);
                            }
                        }
                    }
                }
                self.table.put(slice, out.iter().copied());
                self.entries = out;
                Answer::Loaded { slice }
            }
            Err(MetaError::Io(e)) => {
                log::error!("{}: reading L2 slice {slice}: {e}", self.name);
                Answer::Failed {
                    slice,
                    errno: e.raw_os_error().unwrap_or(libc::EIO),
                }
            }
            Err(e) => {
                // The image is corrupt here: this slice's reads fail with EIO from now on.
                if !*logged {
                    log::error!(
                        "{}: the image is corrupt ({e}); reads of the guest clusters it maps fail with EIO (`qemu-img check` tells more)",
                        self.name
                    );
                    *logged = true;
                }
                let n = self.table.per_slice() as usize;
                self.table
                    .put(slice, std::iter::repeat_n(Entry::Corrupt, n));
                Answer::Loaded { slice }
            }
        };
        self.mappings = mappings;
        answer
    }

    /// A cluster that needs the owner: compressed, or reaching past the end of the file.
    fn read(
        &mut self,
        src: &FileIo<'_>,
        offset: u64,
        len: u64,
        iov: *const libc::iovec,
        iovcnt: u32,
    ) -> io::Result<u64> {
        let cluster = self.meta.header().cluster_size();
        let in_cluster = offset & (cluster - 1);
        if in_cluster + len > cluster {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        let m = self.current(src, offset / cluster)?;
        match m {
            Mapping::Data { host, .. } => {
                let out = &mut self.cluster[..len as usize];
                src.read_or_zero(out, host + in_cluster)?;
                // SAFETY: the job's buffers, lent to us until we answer (Job's Send).
                unsafe { iov::copy_in(iov, iovcnt, 0, out) };
                return Ok(len);
            }
            Mapping::Compressed { host, bytes } => self.inflate(src, host, bytes)?,
            Mapping::Zero { .. } | Mapping::Unallocated => {
                self.cluster[in_cluster as usize..][..len as usize].fill(0);
            }
        }
        let out = &self.cluster[in_cluster as usize..][..len as usize];
        // SAFETY: as above.
        unsafe { iov::copy_in(iov, iovcnt, 0, out) };
        Ok(len)
    }

    /// Guest cluster `gc`'s mapping now: the writer's, where it changed it and the file
    /// does not say so yet, else the metadata's.
    pub(crate) fn current(&mut self, src: &FileIo<'_>, gc: u64) -> io::Result<Mapping> {
        if let Some(m) = self.writer.as_ref().and_then(|w| w.pending_mapping(gc)) {
            return Ok(m);
        }
        let cluster = self.meta.header().cluster_size();
        match self.meta.lookup(src, gc * cluster, cluster) {
            Ok(run) => Ok(run.mapping),
            Err(MetaError::Io(e)) => Err(e),
            Err(e) => {
                log::error!("{}: guest cluster {gc}: {e}", self.name);
                Err(io::Error::from_raw_os_error(libc::EIO))
            }
        }
    }

    /// Decompress the cluster at `host` (at most `bytes` bytes of input) into
    /// `self.cluster`.
    pub(crate) fn inflate(&mut self, src: &FileIo<'_>, host: u64, bytes: u64) -> io::Result<()> {
        let cluster = self.meta.header().cluster_size();
        let bytes = bytes.min(self.meta.file_size().saturating_sub(host)) as usize;
        if self.input.len() < bytes {
            self.input.resize(bytes, 0);
        }
        src.read_exact_at(&mut self.input[..bytes], host)?;
        self.inflater.init();
        let (_, _, written) = decompress(
            &mut self.inflater,
            &self.input[..bytes],
            &mut self.cluster,
            0,
            inflate_flags::TINFL_FLAG_USING_NON_WRAPPING_OUTPUT_BUF,
        );
        if written != cluster as usize {
            log::error!(
                "{}: a compressed cluster at {host:#x} inflates to {written} bytes, not {cluster}",
                self.name
            );
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        Ok(())
    }
}
