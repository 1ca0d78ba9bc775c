//! The metadata owner: one thread per image that alone reads its tables (blocking
//! `pread`, never on a worker). Workers send it what their translation table cannot
//! answer over a bounded channel: a slice to load into the table, or a read that needs it
//! (a compressed cluster, a data cluster reaching past the end of the file). It answers in
//! the asking engine's mailbox and signals the mailbox's eventfd, which sits in that
//! engine's epoll set, so a worker sleeping on its engine wakes for it.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex, PoisonError};

use miniz_oxide::inflate::core::{decompress, inflate_flags, DecompressorOxide};

use super::entry::Mapping;
use super::iov;
use super::meta::{Meta, MetaError, Source};
use super::table::{Entry, Table};
use crate::bounce::AlignedBuf;

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
}

// SAFETY: a Read job's buffers are lent to the owner under `Engine::push`'s contract: the
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
    /// A read job finished: bytes, or an errno.
    Done { sub: u32, result: Result<u64, i32> },
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

    /// Post an answer and wake the engine.
    pub(crate) fn post(&self, a: Answer) {
        self.answers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_back(a);
        self.signal();
    }

    /// Make the eventfd readable.
    pub(crate) fn signal(&self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from a live u64 to our own non-blocking eventfd.
        unsafe { libc::write(self.event.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Empty the eventfd and move every answer into `out` (whose capacity is kept).
    pub(crate) fn take(&self, out: &mut VecDeque<Answer>) {
        let mut count = 0u64;
        // SAFETY: reads 8 bytes into a live u64 from our own non-blocking eventfd.
        unsafe { libc::read(self.event.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
        let mut a = self.answers.lock().unwrap_or_else(PoisonError::into_inner);
        out.extend(a.drain(..));
    }
}

/// Reads metadata from the image file; through an aligned buffer when the file is open
/// with O_DIRECT (`align` > 1), one that is kept and grown as needed.
pub(crate) struct Reader<'a> {
    pub(crate) file: &'a File,
    pub(crate) align: u64,
    pub(crate) buf: RefCell<Option<(AlignedBuf, usize)>>,
}

impl Source for Reader<'_> {
    fn read_exact_at(&self, out: &mut [u8], offset: u64) -> io::Result<()> {
        if self.align <= 1 {
            return FileExt::read_exact_at(self.file, out, offset);
        }
        let a = self.align;
        let start = offset / a * a;
        let end = (offset + out.len() as u64).div_ceil(a) * a;
        let need = (end - start) as usize;
        let mut slot = self.buf.borrow_mut();
        if slot.as_ref().is_none_or(|(_, len)| *len < need) {
            *slot = Some((AlignedBuf::new(need, a as usize)?, need));
        }
        let Some((buf, _)) = slot.as_ref() else {
            return Err(io::Error::from_raw_os_error(libc::ENOMEM));
        };
        let mut done = 0usize;
        while done < need {
            // SAFETY: the buffer holds `need` bytes; we read into its tail.
            let n = unsafe {
                libc::pread(
                    self.file.as_raw_fd(),
                    buf.as_mut_ptr().add(done).cast(),
                    need - done,
                    (start + done as u64) as libc::off_t,
                )
            };
            match n {
                n if n > 0 => done += n as usize,
                0 => break,
                _ => {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
        let skip = (offset - start) as usize;
        if done < skip + out.len() {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        // SAFETY: `done` bytes of the buffer were filled; we copy `out.len()` of them
        // from `skip`, inside that.
        unsafe {
            std::ptr::copy_nonoverlapping(buf.as_mut_ptr().add(skip), out.as_mut_ptr(), out.len())
        };
        Ok(())
    }

    fn size(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
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
}

impl Owner {
    /// Serve jobs until every sender is gone.
    pub(crate) fn run(mut self, src: &Reader<'_>, jobs: Receiver<Job>) {
        let mut corrupt_logged = false;
        while let Ok(job) = jobs.recv() {
            match job {
                Job::Load { slice, reply } => {
                    let a = self.load(src, slice, &mut corrupt_logged);
                    reply.post(a);
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
                    if let Err(e) = &result {
                        log::error!("{}: reading guest offset {offset}: {e}", self.name);
                    }
                    reply.post(Answer::Done {
                        sub,
                        result: result.map_err(|e| e.raw_os_error().unwrap_or(libc::EIO)),
                    });
                }
            }
        }
    }

    fn load(&mut self, src: &Reader<'_>, slice: u64, logged: &mut bool) -> Answer {
        if self.table.holds(slice) {
            return Answer::Loaded { slice };
        }
        let cluster = self.meta.header().cluster_size();
        let file_size = self.meta.file_size();
        match self.meta.slice(src, slice) {
            Ok(entries) => {
                let it = entries.iter().map(|&m| Entry::of(m, cluster, file_size));
                self.table.put(slice, it);
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
        }
    }

    /// A cluster that needs the owner: compressed, or reaching past the end of the file.
    fn read(
        &mut self,
        src: &Reader<'_>,
        offset: u64,
        len: u64,
        iov: *const libc::iovec,
        iovcnt: u32,
    ) -> io::Result<u64> {
        let eio = || io::Error::from_raw_os_error(libc::EIO);
        let run = self.meta.lookup(src, offset, len).map_err(|_| eio())?;
        if run.len != len {
            return Err(eio());
        }
        let cluster = self.meta.header().cluster_size();
        let in_cluster = offset & (cluster - 1);
        let file_size = self.meta.file_size();
        // The bytes to copy out, in `self.cluster[in_cluster..][..len]`.
        match run.mapping {
            Mapping::Data { host, .. } => {
                let host = host + in_cluster;
                let have = file_size.saturating_sub(host).min(len) as usize;
                let out = &mut self.cluster[..len as usize];
                out[have..].fill(0);
                if have > 0 {
                    src.read_exact_at(&mut out[..have], host)?;
                }
                // SAFETY: the job's buffers, lent to us until we answer (Job's Send).
                unsafe { iov::copy_in(iov, iovcnt, 0, out) };
                return Ok(len);
            }
            Mapping::Compressed { host, bytes } => {
                let bytes = bytes.min(file_size.saturating_sub(host)) as usize;
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
                    return Err(eio());
                }
            }
            Mapping::Zero { .. } | Mapping::Unallocated => {
                self.cluster[in_cluster as usize..][..len as usize].fill(0);
            }
        }
        let out = &self.cluster[in_cluster as usize..][..len as usize];
        // SAFETY: as above.
        unsafe { iov::copy_in(iov, iovcnt, 0, out) };
        Ok(len)
    }
}
