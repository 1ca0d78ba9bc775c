//! Memory shared with the device, and the buffers handed out from it.
//!
//! The driver owns one memfd, mapped once into this process and given to the device in the
//! vhost-user memory table. Guest physical addresses are identical to this process's virtual
//! addresses inside the mapping, so a buffer's address goes into a descriptor untranslated.
//!
//! Buffers are owned values ([`Buffer`]). Lending one to the device moves it into the queue,
//! and it comes back only with its completion: safe code can never touch memory the device
//! may still write.

use std::collections::BTreeMap;
use std::io;
use std::ops::{Deref, DerefMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::error::{Error, ErrorKind};

/// Alignment (and granularity) of every buffer: a page, which suits O_DIRECT on any disk.
pub const BUFFER_ALIGN: usize = 4096;

/// One memfd mapping shared with the device.
#[derive(Debug)]
pub(crate) struct Region {
    fd: OwnedFd,
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; who may touch which part of it is governed by
// the owners of the buffers and rings carved out of it, not by the thread that made it.
unsafe impl Send for Region {}
// SAFETY: as above; the Region itself only hands out addresses.
unsafe impl Sync for Region {}

impl Region {
    /// A zero-filled shared mapping of `len` bytes (rounded up to a page).
    pub(crate) fn new(len: usize) -> Result<Region, Error> {
        let len = len.div_ceil(BUFFER_ALIGN) * BUFFER_ALIGN;
        let name = c"vblk-driver";
        // SAFETY: memfd_create takes a valid NUL-terminated name and flags; it returns a new fd.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::os(
                ErrorKind::Memory,
                "memfd_create",
                io::Error::last_os_error(),
            ));
        }
        // SAFETY: fd was just returned by memfd_create and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on our own memfd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(Error::os(
                ErrorKind::Memory,
                &format!("cannot size shared memory to {len} bytes"),
                io::Error::last_os_error(),
            ));
        }
        // SAFETY: mapping our own memfd, shared, at an address the kernel picks; the result
        // is checked against MAP_FAILED below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::os(
                ErrorKind::Memory,
                &format!("cannot map {len} bytes of shared memory"),
                io::Error::last_os_error(),
            ));
        }
        let base = NonNull::new(p.cast::<u8>())
            .ok_or_else(|| Error::new(ErrorKind::Memory, "mmap returned a null mapping".into()))?;
        Ok(Region { fd, base, len })
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    pub(crate) fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The address the device knows `base() + offset` by (identity mapping).
    pub(crate) fn gpa(&self) -> u64 {
        self.base.as_ptr() as u64
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: base/len are exactly the mapping made in new(); every Buffer and ring
        // holds an Arc that keeps the Region alive, so nothing points into it any more.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// First-fit allocator of page-aligned buffers over part of a [`Region`]. Buffers are made
/// when an application sets up, not per I/O, so a mutex here is off the hot path.
#[derive(Debug)]
pub(crate) struct Pool {
    region: Arc<Region>,
    start: usize,
    end: usize,
    /// Free extents: offset → length.
    free: Mutex<BTreeMap<usize, usize>>,
}

impl Pool {
    /// A pool over `region[start..end)`.
    pub(crate) fn new(region: Arc<Region>, start: usize, end: usize) -> Pool {
        let mut free = BTreeMap::new();
        if end > start {
            free.insert(start, end - start);
        }
        Pool {
            region,
            start,
            end,
            free: Mutex::new(free),
        }
    }

    /// Bytes the pool manages.
    pub(crate) fn capacity(&self) -> usize {
        self.end - self.start
    }

    /// A zeroed buffer of `len` bytes.
    pub(crate) fn alloc(self: &Arc<Self>, len: usize) -> Result<Buffer, Error> {
        if len == 0 {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "a buffer of 0 bytes".into(),
            ));
        }
        let size = len.div_ceil(BUFFER_ALIGN) * BUFFER_ALIGN;
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let found = free.iter().find(|(_, &l)| l >= size).map(|(&o, &l)| (o, l));
        let Some((off, ext)) = found else {
            let avail: usize = free.values().sum();
            return Err(Error::new(
                ErrorKind::Memory,
                format!(
                    "cannot allocate {len} bytes of shared buffer memory: {avail} of {} bytes free \
                     (raise the pool size)",
                    self.capacity()
                ),
            ));
        };
        free.remove(&off);
        if ext > size {
            free.insert(off + size, ext - size);
        }
        drop(free);
        // SAFETY: off + size <= end <= region.len(), inside the mapping.
        let ptr = unsafe { self.region.base().add(off) };
        // SAFETY: the extent was free, so nothing else refers to it; zero it for the new owner.
        unsafe { std::ptr::write_bytes(ptr, 0, size) };
        Ok(Buffer {
            ptr: NonNull::new(ptr).ok_or_else(|| Error::new(ErrorKind::Memory, "null".into()))?,
            len,
            size,
            pool: self.clone(),
        })
    }

    fn release(&self, ptr: *mut u8, size: usize) {
        let mut off = ptr as usize - self.region.base() as usize;
        let mut size = size;
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        // Merge with the free neighbours.
        if let Some((&prev, &plen)) = free.range(..off).next_back() {
            if prev + plen == off {
                free.remove(&prev);
                off = prev;
                size += plen;
            }
        }
        if let Some(&nlen) = free.get(&(off + size)) {
            free.remove(&(off + size));
            size += nlen;
        }
        free.insert(off, size);
    }
}

/// A buffer in memory shared with the device. Owned: while the device uses it the queue
/// holds it, and it comes back with the completion.
pub struct Buffer {
    ptr: NonNull<u8>,
    len: usize,
    size: usize,
    pool: Arc<Pool>,
}

// SAFETY: a Buffer is the only handle to its extent of the shared mapping (the pool never
// hands an extent out twice), so moving it between threads moves exclusive access.
unsafe impl Send for Buffer {}
// SAFETY: &Buffer only allows reads of the extent it exclusively owns.
unsafe impl Sync for Buffer {}

impl Buffer {
    /// Length in bytes: what an I/O on this buffer transfers.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes allocated (a multiple of the page size); the length can be set up to this.
    pub fn capacity(&self) -> usize {
        self.size
    }

    /// Set the length (how much the next I/O transfers) to `len`, at most
    /// [`capacity`](Buffer::capacity). Contents are kept.
    pub fn set_len(&mut self, len: usize) -> Result<(), Error> {
        if len == 0 || len > self.size {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "buffer length {len} must be between 1 and its capacity {}",
                    self.size
                ),
            ));
        }
        self.len = len;
        Ok(())
    }

    /// Whether the buffer is empty (never, for an allocated buffer).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address the device knows this buffer by.
    pub(crate) fn gpa(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }
}

impl Deref for Buffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: ptr..ptr+len is inside the mapping, owned by this Buffer, and not lent to
        // the device while the caller can reach the Buffer.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for Buffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("addr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        self.pool.release(self.ptr.as_ptr(), self.size);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_merge_and_exhaustion() {
        let region = Arc::new(Region::new(64 * 1024).unwrap());
        let pool = Arc::new(Pool::new(region, 0, 64 * 1024));
        let a = pool.alloc(1).unwrap();
        let b = pool.alloc(4096 * 3).unwrap();
        assert_eq!(a.gpa() % BUFFER_ALIGN as u64, 0);
        assert_eq!(b.gpa() - a.gpa(), 4096);
        let err = pool.alloc(64 * 1024).unwrap_err();
        assert!(
            err.to_string().contains("49152 of 65536 bytes free"),
            "{err}"
        );
        drop(a);
        drop(b);
        // Everything merged back into one extent.
        let all = pool.alloc(64 * 1024).unwrap();
        assert!(all.iter().all(|&x| x == 0));
        assert!(pool.alloc(0).is_err());
    }
}
