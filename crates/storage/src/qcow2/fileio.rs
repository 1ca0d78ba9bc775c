//! The owner's blocking I/O on the image file: metadata and the data it moves itself
//! (compressed clusters, copy-on-write). Under O_DIRECT (`align` > 1) every transfer goes
//! through one aligned buffer, kept and grown as needed; a write that does not cover
//! whole aligned blocks reads them first (the bytes around it are kept).

use std::cell::{Cell, RefCell};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use super::meta::Source;
use crate::bounce::AlignedBuf;

pub(crate) struct FileIo<'a> {
    pub(crate) file: &'a File,
    /// O_DIRECT's alignment of file offsets and lengths (1 without O_DIRECT): the
    /// window a transfer covers.
    pub(crate) align: u64,
    /// O_DIRECT's alignment of buffers.
    mem: u64,
    buf: RefCell<Option<(AlignedBuf, usize)>>,
    /// The file's size, as far as this handle's writes and `grow_to` made it.
    end: Cell<u64>,
    /// An `fdatasync` through this handle failed (whoever asked for it: the writer, the
    /// refcounts' own ordering syncs, a hand-over).
    sync_failed: Cell<bool>,
}

impl<'a> FileIo<'a> {
    pub(crate) fn new(file: &'a File, mem: u64, align: u64) -> FileIo<'a> {
        FileIo {
            file,
            align,
            mem: mem.max(1),
            buf: RefCell::new(None),
            end: Cell::new(file.metadata().map_or(0, |m| m.len())),
            sync_failed: Cell::new(false),
        }
    }

    /// Make the file at least `len` bytes long (the new part a hole). Never shrinks it.
    pub(crate) fn grow_to(&self, len: u64) -> io::Result<()> {
        if len > self.end.get() {
            self.file.set_len(len)?;
            self.end.set(len);
        }
        Ok(())
    }

    /// Runs `f` on an aligned buffer of at least `need` bytes.
    fn with_buf<T>(&self, need: usize, f: impl FnOnce(*mut u8) -> io::Result<T>) -> io::Result<T> {
        let mut slot = self.buf.borrow_mut();
        if slot.as_ref().is_none_or(|(_, len)| *len < need) {
            *slot = Some((
                AlignedBuf::new(need, self.mem.max(self.align) as usize)?,
                need,
            ));
        }
        match slot.as_ref() {
            Some((buf, _)) => f(buf.as_mut_ptr()),
            None => Err(io::Error::from_raw_os_error(libc::ENOMEM)),
        }
    }

    /// `pread` into `len` bytes at `p` from `at` until done or the end of the file;
    /// returns the bytes read.
    fn pread_full(&self, p: *mut u8, len: usize, at: u64) -> io::Result<usize> {
        let mut done = 0usize;
        while done < len {
            // SAFETY: the caller's buffer holds `len` bytes; we read into its tail.
            let n = unsafe {
                libc::pread(
                    self.file.as_raw_fd(),
                    p.add(done).cast(),
                    len - done,
                    (at + done as u64) as libc::off_t,
                )
            };
            match n {
                // Under O_DIRECT a short read is the end of the file: a second read from
                // the unaligned point it stopped at could fail with EINVAL.
                n if n > 0 && self.align > 1 && (n as usize) < len - done => {
                    done += n as usize;
                    break;
                }
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
        Ok(done)
    }

    /// Read up to `out.len()` bytes at `offset`; what lies past the end of the file reads
    /// as zeroes.
    pub(crate) fn read_or_zero(&self, out: &mut [u8], offset: u64) -> io::Result<()> {
        if self.align <= 1 {
            let n = self.pread_full(out.as_mut_ptr(), out.len(), offset)?;
            out[n..].fill(0);
            return Ok(());
        }
        let (start, need) = self.window(offset, out.len());
        self.with_buf(need, |b| {
            let n = self.pread_full(b, need, start)?;
            // SAFETY: the buffer holds `need` bytes, `n` of them read.
            unsafe { std::ptr::write_bytes(b.add(n), 0, need - n) };
            let skip = (offset - start) as usize;
            // SAFETY: [skip, skip + out.len()) lies inside the `need` bytes.
            unsafe { std::ptr::copy_nonoverlapping(b.add(skip), out.as_mut_ptr(), out.len()) };
            Ok(())
        })
    }

    /// The aligned window around `[offset, offset + len)`: its start and length.
    fn window(&self, offset: u64, len: usize) -> (u64, usize) {
        let a = self.align.max(1);
        let start = offset / a * a;
        let end = (offset + len as u64).div_ceil(a) * a;
        (start, (end - start) as usize)
    }

    /// Write all of `data` at `offset`. The file's recorded size grows only once the
    /// write succeeded: a write that failed (a full file system) must not make
    /// [`FileIo::grow_to`] skip the growth it was asked for.
    pub(crate) fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.write_unrecorded(data, offset)?;
        self.end.set(self.end.get().max(offset + data.len() as u64));
        Ok(())
    }

    fn write_unrecorded(&self, data: &[u8], offset: u64) -> io::Result<()> {
        if self.align <= 1 {
            return self.file.write_all_at(data, offset);
        }
        let (start, need) = self.window(offset, data.len());
        self.with_buf(need, |b| {
            let skip = (offset - start) as usize;
            if skip != 0 || need != data.len() {
                // Keep the bytes around the write: read the window first.
                let n = self.pread_full(b, need, start)?;
                // SAFETY: the buffer holds `need` bytes, `n` of them read.
                unsafe { std::ptr::write_bytes(b.add(n), 0, need - n) };
            }
            // SAFETY: [skip, skip + data.len()) lies inside the `need` bytes.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), b.add(skip), data.len()) };
            let mut done = 0usize;
            while done < need {
                // SAFETY: the aligned buffer holds `need` bytes; we write from its tail.
                let n = unsafe {
                    libc::pwrite(
                        self.file.as_raw_fd(),
                        b.add(done).cast(),
                        need - done,
                        (start + done as u64) as libc::off_t,
                    )
                };
                match n {
                    n if n > 0 => done += n as usize,
                    0 => return Err(io::ErrorKind::WriteZero.into()),
                    _ => {
                        let e = io::Error::last_os_error();
                        if e.kind() != io::ErrorKind::Interrupted {
                            return Err(e);
                        }
                    }
                }
            }
            Ok(())
        })
    }

    /// Make everything written durable.
    pub(crate) fn sync(&self) -> io::Result<()> {
        let r = self.file.sync_data();
        if r.is_err() {
            self.sync_failed.set(true);
        }
        r
    }

    /// Whether an `fdatasync` through this handle ever failed: the kernel may have
    /// dropped the writes it was about, and a later one would not say so.
    pub(crate) fn sync_failed(&self) -> bool {
        self.sync_failed.get()
    }
}

impl Source for FileIo<'_> {
    fn read_exact_at(&self, out: &mut [u8], offset: u64) -> io::Result<()> {
        if self.align <= 1 {
            return FileExt::read_exact_at(self.file, out, offset);
        }
        let (start, need) = self.window(offset, out.len());
        self.with_buf(need, |b| {
            let n = self.pread_full(b, need, start)?;
            let skip = (offset - start) as usize;
            if n < skip + out.len() {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            // SAFETY: `n` bytes of the buffer were filled; we copy `out.len()` of them
            // from `skip`, inside that.
            unsafe { std::ptr::copy_nonoverlapping(b.add(skip), out.as_mut_ptr(), out.len()) };
            Ok(())
        })
    }

    fn size(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }
}
