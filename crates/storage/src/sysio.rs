//! Synchronous I/O on a file or block device, shared by the engines: whole
//! reads and writes (short transfers finished, EOF read as zeroes), flush,
//! discard and write-zeroes with their fallbacks, and O_DIRECT bouncing. The sync
//! engine does everything here; the io_uring engine comes here to finish what
//! the ring could not.

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::backend::{Backend, BackendKind, FallocCaps};
use crate::bounce::{gather, scatter, AlignedBuf, BouncePool, DioAlign, BOUNCE_CHUNK, IOV_MAX};
use crate::engine::{check_range, errno, iov_slice, iov_total, Dir, Op};

/// `BLKDISCARD`: discard a byte range of a block device (`_IO(0x12, 119)`).
const BLKDISCARD: libc::Ioctl = libc::_IO(0x12, 119);

/// The buffer zeroes are written from, and how many times one call repeats it.
const ZERO_BUF: usize = 256 * 1024;
const ZERO_IOVS: usize = 16;

/// Fallocate modes.
pub(crate) const PUNCH_HOLE: i32 = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
pub(crate) const ZERO_RANGE: i32 = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;

/// Whether an errno from `fallocate`/`ioctl` means "this cannot be done here"
/// (so fall back), rather than a real failure.
pub(crate) fn unsupported(code: i32) -> bool {
    matches!(
        code,
        libc::EOPNOTSUPP | libc::EINVAL | libc::ENOSYS | libc::ENOTTY
    )
}

/// The ways to make a range read as zeroes, tried in this order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ZeroStage {
    /// `FALLOC_FL_PUNCH_HOLE` (only when unmapping is allowed).
    Punch,
    /// `FALLOC_FL_ZERO_RANGE`: zeroes, blocks stay allocated.
    ZeroRange,
    /// Write zeroes.
    Write,
}

impl ZeroStage {
    /// Where to start, given what is known not to work.
    pub(crate) fn first(caps: &FallocCaps, unmap: bool) -> ZeroStage {
        if unmap && !caps.no_punch.load(Ordering::Relaxed) {
            ZeroStage::Punch
        } else {
            ZeroStage::ZeroRange.or_next(caps)
        }
    }

    fn or_next(self, caps: &FallocCaps) -> ZeroStage {
        match self {
            ZeroStage::ZeroRange if caps.no_zero_range.load(Ordering::Relaxed) => ZeroStage::Write,
            stage => stage,
        }
    }

    /// The fallocate mode of this stage; None for writing zeroes.
    pub(crate) fn mode(self) -> Option<i32> {
        match self {
            ZeroStage::Punch => Some(PUNCH_HOLE),
            ZeroStage::ZeroRange => Some(ZERO_RANGE),
            ZeroStage::Write => None,
        }
    }

    /// The stage after this one failed with `code` (an [`unsupported`] errno);
    /// remembers `EOPNOTSUPP` in `caps`.
    pub(crate) fn after(self, code: i32, caps: &FallocCaps) -> ZeroStage {
        let learnt = code == libc::EOPNOTSUPP;
        match self {
            ZeroStage::Punch => {
                if learnt {
                    caps.no_punch.store(true, Ordering::Relaxed);
                }
                ZeroStage::ZeroRange.or_next(caps)
            }
            ZeroStage::ZeroRange | ZeroStage::Write => {
                if learnt {
                    caps.no_zero_range.store(true, Ordering::Relaxed);
                }
                ZeroStage::Write
            }
        }
    }
}

/// Retries a syscall on EINTR; maps -1 to the errno.
fn retry(mut f: impl FnMut() -> isize) -> io::Result<usize> {
    loop {
        let rc = f();
        if rc >= 0 {
            return Ok(rc.unsigned_abs());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `fdatasync(fd)`.
pub(crate) fn fdatasync(fd: RawFd) -> io::Result<()> {
    // SAFETY: plain syscall on a descriptor the backend keeps open.
    retry(|| unsafe { libc::fdatasync(fd) } as isize).map(drop)
}

/// `fallocate(fd, mode, offset, len)`.
pub(crate) fn fallocate(fd: RawFd, mode: i32, offset: u64, len: u64) -> io::Result<()> {
    let off = i64::try_from(offset).map_err(|_| errno(libc::EINVAL))?;
    let len = i64::try_from(len).map_err(|_| errno(libc::EINVAL))?;
    // SAFETY: plain syscall on a descriptor the backend keeps open.
    retry(|| unsafe { libc::fallocate64(fd, mode, off, len) } as isize).map(drop)
}

/// `ioctl(BLKDISCARD)` on a block device.
fn blkdiscard(fd: RawFd, offset: u64, len: u64) -> io::Result<()> {
    let range: [u64; 2] = [offset, len];
    // SAFETY: BLKDISCARD reads two u64s through the pointer, which points to a
    // live local array.
    retry(|| unsafe { libc::ioctl(fd, BLKDISCARD, range.as_ptr()) } as isize).map(drop)
}

/// Reads or writes `iov` (total `total` bytes) at `offset`, starting after the
/// first `done` bytes, until all are done. A short transfer is continued; a read
/// that meets end of file fills the rest with zeroes (as QEMU does); a write that
/// makes no progress is `EIO`. `durable` writes use `RWF_DSYNC`, or `fdatasync`
/// after the write on kernels without it.
///
/// # Safety
/// The iovecs point to buffers that are valid for `iov_len` bytes, writable for a
/// read, and not accessed by anyone else during the call; `total` is their sum.
pub(crate) unsafe fn rw_from(
    fd: RawFd,
    dir: Dir,
    offset: u64,
    iov: &[libc::iovec],
    total: u64,
    mut done: u64,
    durable: bool,
) -> io::Result<u64> {
    let mut flags = if durable && dir == Dir::Write {
        libc::RWF_DSYNC
    } else {
        0
    };
    let mut sync_after = false;
    // Position: iovec `idx`, `skip` bytes into it.
    let (mut idx, mut skip) = (0usize, done);
    while idx < iov.len() && skip >= iov[idx].iov_len as u64 && skip > 0 {
        skip -= iov[idx].iov_len as u64;
        idx += 1;
    }
    while done < total {
        let Some(cur) = iov.get(idx) else {
            return Err(errno(libc::EINVAL));
        };
        let pos = offset
            .checked_add(done)
            .and_then(|p| i64::try_from(p).ok())
            .ok_or_else(|| errno(libc::EINVAL))?;
        // `skip` < cur.iov_len here, so it fits in usize.
        let skip_n = skip as usize;
        let partial = libc::iovec {
            // SAFETY: skip < iov_len, so the pointer stays inside the buffer.
            iov_base: unsafe { cur.iov_base.cast::<u8>().add(skip_n) }.cast(),
            iov_len: cur.iov_len - skip_n,
        };
        let (ptr, cnt) = if skip > 0 {
            (&partial as *const libc::iovec, 1)
        } else {
            (cur as *const libc::iovec, (iov.len() - idx).min(IOV_MAX))
        };
        let cnt = cnt as libc::c_int;
        let rc = match dir {
            // SAFETY: `ptr` names `cnt` iovecs of valid buffers (the contract, or
            // `partial` that lives on this stack frame), writable for a read.
            Dir::Read => retry(|| unsafe { libc::preadv2(fd, ptr, cnt, pos, 0) }),
            // SAFETY: as above, readable for a write.
            Dir::Write => retry(|| unsafe { libc::pwritev2(fd, ptr, cnt, pos, flags) }),
        };
        let mut n = match rc {
            Err(e) if flags != 0 && e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                flags = 0;
                sync_after = true;
                continue;
            }
            Err(e) => return Err(e),
            Ok(0) if dir == Dir::Read => {
                // SAFETY: the remaining buffers are writable (a read) per the contract.
                unsafe { zero_fill(iov, idx, skip_n) };
                break;
            }
            Ok(0) => return Err(errno(libc::EIO)),
            Ok(n) => n as u64,
        };
        done += n;
        // Advance the position by n bytes.
        while n > 0 {
            let Some(v) = iov.get(idx) else { break };
            let left = v.iov_len as u64 - skip;
            if n >= left {
                n -= left;
                idx += 1;
                skip = 0;
            } else {
                skip += n;
                n = 0;
            }
        }
    }
    if sync_after {
        fdatasync(fd)?;
    }
    Ok(total)
}

/// Zeroes the buffers of `iov` from iovec `idx`, `skip` bytes in, to the end.
///
/// # Safety
/// Those buffers are valid and writable.
unsafe fn zero_fill(iov: &[libc::iovec], idx: usize, skip: usize) {
    for (i, v) in iov.iter().enumerate().skip(idx) {
        let from = if i == idx { skip } else { 0 };
        if from < v.iov_len {
            // SAFETY: writable for iov_len bytes per the contract; from < iov_len.
            unsafe {
                std::ptr::write_bytes(v.iov_base.cast::<u8>().add(from), 0, v.iov_len - from)
            };
        }
    }
}

/// Synchronous I/O on one backend's file descriptor, with the per-engine state it
/// needs: the bounce pool and the zero buffer.
pub(crate) struct SyncIo {
    pub backend: Arc<Backend>,
    pub fd: RawFd,
    pub dio: Option<DioAlign>,
    pub bounce: BouncePool,
    zero: Option<AlignedBuf>,
}

impl SyncIo {
    pub(crate) fn new(backend: Arc<Backend>) -> Self {
        let dio = backend.dio();
        let bounce = BouncePool::new(dio.unwrap_or(DioAlign {
            mem: 512,
            offset: 512,
        }));
        SyncIo {
            fd: backend.fd(),
            dio,
            backend,
            bounce,
            zero: None,
        }
    }

    /// Does `op` to the end.
    ///
    /// # Safety
    /// The [`Engine::push`](crate::Engine::push) contract holds for `op` for the
    /// duration of the call.
    pub(crate) unsafe fn run(&mut self, op: &Op) -> io::Result<u64> {
        match *op {
            Op::Read {
                offset,
                iov,
                iovcnt,
            } => {
                // SAFETY: forwarded contract.
                unsafe { self.rw(Dir::Read, offset, iov, iovcnt, false) }
            }
            Op::Write {
                offset,
                iov,
                iovcnt,
                durable,
            } => {
                // SAFETY: forwarded contract.
                unsafe { self.rw(Dir::Write, offset, iov, iovcnt, durable) }
            }
            Op::Flush => fdatasync(self.fd).map(|()| 0),
            Op::Discard {
                offset,
                len,
                durable,
            } => {
                check_range(offset, len, self.backend.size())?;
                match fallocate(self.fd, PUNCH_HOLE, offset, len) {
                    Ok(()) => Ok(0),
                    Err(e) => self.discard_failed(e, offset, len),
                }?;
                self.sync_if(durable)
            }
            Op::WriteZeroes {
                offset,
                len,
                unmap,
                durable,
            } => {
                check_range(offset, len, self.backend.size())?;
                let stage = ZeroStage::first(&self.backend.caps, unmap);
                self.write_zeroes_from(stage, offset, len)?;
                self.sync_if(durable)
            }
        }
    }

    /// A whole read or write, through a bounce buffer when O_DIRECT needs one.
    ///
    /// # Safety
    /// As for [`SyncIo::run`].
    unsafe fn rw(
        &mut self,
        dir: Dir,
        offset: u64,
        iov: *const libc::iovec,
        iovcnt: u32,
        durable: bool,
    ) -> io::Result<u64> {
        // SAFETY: the push contract keeps the iovec array valid.
        let iov = unsafe { iov_slice(iov, iovcnt) }?;
        let total = iov_total(iov)?;
        check_range(offset, total, self.backend.size())?;
        match self.dio {
            Some(dio) if !dio.fits(iov) => {
                let total_n = usize::try_from(total).map_err(|_| errno(libc::EINVAL))?;
                // One operation at a time here, so the pool always has a buffer.
                let buf = self.bounce.take().ok_or_else(|| errno(libc::ENOMEM))?;
                let mut pos = 0usize;
                let result = loop {
                    if pos == total_n {
                        break Ok(total);
                    }
                    let n = (total_n - pos).min(BOUNCE_CHUNK);
                    if dir == Dir::Write {
                        // SAFETY: the caller's buffers are readable for `total` bytes,
                        // pos + n <= total; the bounce holds BOUNCE_CHUNK >= n bytes.
                        unsafe { gather(iov, pos, n, buf.as_mut_ptr()) };
                    }
                    let one = [libc::iovec {
                        iov_base: buf.as_mut_ptr().cast(),
                        iov_len: n,
                    }];
                    // SAFETY: `one` names the bounce buffer, owned here for the call.
                    let piece = unsafe {
                        rw_from(
                            self.fd,
                            dir,
                            offset + pos as u64,
                            &one,
                            n as u64,
                            0,
                            durable,
                        )
                    };
                    if let Err(e) = piece {
                        break Err(e);
                    }
                    if dir == Dir::Read {
                        // SAFETY: the bounce holds `n` bytes just read; the caller's
                        // buffers are writable and distinct from it.
                        unsafe { scatter(buf.as_mut_ptr(), n, iov, pos) };
                    }
                    pos += n;
                };
                self.bounce.give(buf);
                result
            }
            // SAFETY: forwarded contract.
            _ => unsafe { rw_from(self.fd, dir, offset, iov, total, 0, durable) },
        }
    }

    /// The rest of a discard whose hole punch failed with `e`: block devices try
    /// `BLKDISCARD`; "not supported" is success (discard is a hint).
    /// A durable discard or write-zeroes is made durable before it completes.
    fn sync_if(&self, durable: bool) -> io::Result<u64> {
        if durable {
            fdatasync(self.fd)?;
        }
        Ok(0)
    }

    pub(crate) fn discard_failed(&self, e: io::Error, offset: u64, len: u64) -> io::Result<u64> {
        let code = e.raw_os_error().unwrap_or(libc::EIO);
        if !unsupported(code) {
            return Err(e);
        }
        if self.backend.kind() == BackendKind::BlockDevice {
            match blkdiscard(self.fd, offset, len) {
                Err(e) if !unsupported(e.raw_os_error().unwrap_or(libc::EIO)) => return Err(e),
                _ => {}
            }
        }
        Ok(0)
    }

    /// Makes `offset .. offset + len` read as zeroes, trying `stage` and the ones
    /// after it.
    pub(crate) fn write_zeroes_from(
        &mut self,
        mut stage: ZeroStage,
        offset: u64,
        len: u64,
    ) -> io::Result<u64> {
        while let Some(mode) = stage.mode() {
            match fallocate(self.fd, mode, offset, len) {
                Ok(()) => return Ok(0),
                Err(e) => match e.raw_os_error() {
                    Some(code) if unsupported(code) => {
                        stage = stage.after(code, &self.backend.caps)
                    }
                    _ => return Err(e),
                },
            }
        }
        self.write_zero_bytes(offset, len).map(|()| 0)
    }

    /// Writes zeroes over the range, from a shared aligned zero buffer.
    fn write_zero_bytes(&mut self, offset: u64, len: u64) -> io::Result<()> {
        if self.zero.is_none() {
            self.zero = Some(AlignedBuf::new(ZERO_BUF, 4096)?);
        }
        let Some(zero) = self.zero.as_ref() else {
            return Err(errno(libc::ENOMEM));
        };
        let mut iovs = [libc::iovec {
            iov_base: zero.as_mut_ptr().cast(),
            iov_len: ZERO_BUF,
        }; ZERO_IOVS];
        let mut done = 0u64;
        while done < len {
            let mut chunk = 0u64;
            let mut cnt = 0;
            while cnt < ZERO_IOVS && done + chunk < len {
                let n = (len - done - chunk).min(ZERO_BUF as u64);
                iovs[cnt].iov_len = n as usize;
                chunk += n;
                cnt += 1;
            }
            // SAFETY: every iovec names the zero buffer (ZERO_BUF bytes, owned by
            // self and never written after allocation) with iov_len <= ZERO_BUF.
            unsafe {
                rw_from(
                    self.fd,
                    Dir::Write,
                    offset + done,
                    &iovs[..cnt],
                    chunk,
                    0,
                    false,
                )
            }?;
            done += chunk;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;
    use crate::{CacheMode, DiskSpec, EngineKind, OpenOptions};

    fn scratch() -> tempfile::TempDir {
        let target = concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/tmp");
        std::fs::create_dir_all(target).unwrap();
        tempfile::Builder::new()
            .prefix("vblk-sysio-")
            .tempdir_in(target)
            .unwrap()
    }

    #[test]
    fn zero_stages() {
        let caps = FallocCaps::default();
        assert_eq!(ZeroStage::first(&caps, true), ZeroStage::Punch);
        assert_eq!(ZeroStage::first(&caps, false), ZeroStage::ZeroRange);
        assert_eq!(
            ZeroStage::Punch.after(libc::EINVAL, &caps),
            ZeroStage::ZeroRange
        );
        assert_eq!(
            ZeroStage::first(&caps, true),
            ZeroStage::Punch,
            "EINVAL is not learnt"
        );
        assert_eq!(
            ZeroStage::Punch.after(libc::EOPNOTSUPP, &caps),
            ZeroStage::ZeroRange
        );
        assert_eq!(
            ZeroStage::first(&caps, true),
            ZeroStage::ZeroRange,
            "EOPNOTSUPP is"
        );
        assert_eq!(
            ZeroStage::ZeroRange.after(libc::EOPNOTSUPP, &caps),
            ZeroStage::Write
        );
        assert_eq!(ZeroStage::first(&caps, true), ZeroStage::Write);
        assert_eq!(ZeroStage::first(&caps, false), ZeroStage::Write);
        assert_eq!(ZeroStage::Write.mode(), None);
    }

    /// With both fallocate modes marked unsupported, write-zeroes writes zeroes
    /// (the io_uring engine defers it to submit) and keeps the blocks allocated.
    #[test]
    fn write_zeroes_falls_back_to_writing() {
        let dir = scratch();
        let path = dir.path().join("disk.img");
        let size = 2 << 20;
        std::fs::write(&path, vec![0x33u8; size]).unwrap();
        for kind in [EngineKind::IoUring, EngineKind::Sync] {
            for cache in [CacheMode::Writeback, CacheMode::None] {
                let opts = OpenOptions {
                    read_only: false,
                    cache,
                    prealloc: false,
                    ..Default::default()
                };
                let b = Arc::new(Backend::open(&DiskSpec::File(path.clone()), &opts).unwrap());
                b.caps.no_punch.store(true, Ordering::Relaxed);
                b.caps.no_zero_range.store(true, Ordering::Relaxed);
                let blocks = std::fs::metadata(&path).unwrap().blocks();
                let mut e = b.engine(kind, 4).unwrap();
                // 1 MiB + 4 KiB: more than one call of the zero buffer.
                let (off, len) = (8192u64, (1u64 << 20) + 4096);
                // SAFETY: WriteZeroes lends no buffer.
                unsafe {
                    e.push(
                        1,
                        Op::WriteZeroes {
                            offset: off,
                            len,
                            unmap: true,
                            durable: false,
                        },
                    )
                }
                .unwrap();
                e.submit().unwrap();
                let mut got = None;
                while got.is_none() {
                    e.reap(&mut |c| got = Some(c.result));
                    if got.is_none() {
                        e.wait().unwrap();
                    }
                }
                assert_eq!(got.unwrap().unwrap(), 0);
                // SAFETY: Flush lends no buffer.
                unsafe { e.push(2, Op::Flush) }.unwrap();
                e.wait().unwrap();
                e.reap(&mut |c| assert!(c.result.is_ok()));
                let file = std::fs::read(&path).unwrap();
                let (a, z) = (off as usize, (off + len) as usize);
                assert!(file[..a].iter().all(|&x| x == 0x33), "{kind} {cache:?}");
                assert!(file[a..z].iter().all(|&x| x == 0), "{kind} {cache:?}");
                assert!(file[z..].iter().all(|&x| x == 0x33), "{kind} {cache:?}");
                assert!(
                    std::fs::metadata(&path).unwrap().blocks() >= blocks,
                    "still allocated"
                );
                std::fs::write(&path, vec![0x33u8; size]).unwrap();
            }
        }
    }

    /// A durable write whose RWF_DSYNC path runs, and a read continued after a
    /// partial first transfer (`done` > 0, inside an iovec).
    #[test]
    fn rw_from_continues() {
        let dir = scratch();
        let path = dir.path().join("disk.img");
        let data: Vec<u8> = (0..8192u32).map(|i| (i % 253) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
        let mut a = vec![0u8; 1000];
        let mut b = vec![0u8; 3096];
        let iov = [
            libc::iovec {
                iov_base: a.as_mut_ptr().cast(),
                iov_len: a.len(),
            },
            libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            },
        ];
        // Pretend 700 bytes already arrived: only the rest is read.
        // SAFETY: the iovecs name live vectors of their lengths.
        let n = unsafe { rw_from(fd, Dir::Read, 0, &iov, 4096, 700, false) };
        assert_eq!(n.unwrap(), 4096);
        assert!(a[..700].iter().all(|&x| x == 0));
        assert!(a[700..] == data[700..1000]);
        assert!(b[..] == data[1000..4096]);
        // SAFETY: as above; a write reads the same buffers.
        let n = unsafe { rw_from(fd, Dir::Write, 4096, &iov, 4096, 0, true) };
        assert_eq!(n.unwrap(), 4096);
        let file = std::fs::read(&path).unwrap();
        assert!(file[4096..4096 + 700].iter().all(|&x| x == 0));
        assert!(file[4096 + 1000..] == data[1000..4096]);
    }
}
