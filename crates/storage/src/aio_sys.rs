//! The Linux AIO system interface the aio engine uses: an AIO context
//! (`io_setup`/`io_destroy`), `io_submit`, `io_getevents`, and a look at the completion ring
//! the kernel maps into the process, to tell without a syscall whether events wait.
//!
//! vmm-sys-util's `aio` module provides the iocb and event layouts and the constants used
//! here. Its `IoContext` is not used: it hides the context id, which is also the ring's
//! address, and its `submit` takes `&[&mut IoControlBlock]`, unique borrows of iocbs that
//! live in the engine's slot table.

use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

use vmm_sys_util::aio::{IoControlBlock, IoEvent};

// The bindings name `aio_rw_flags` `aio_reserved1`: its place on little-endian machines.
const _: () = assert!(
    cfg!(target_endian = "little"),
    "the iocb layout of vmm-sys-util's bindings is little-endian"
);

/// `AIO_RING_MAGIC` (fs/aio.c).
const AIO_RING_MAGIC: u32 = 0xa10a_10a1;

/// The header of the completion ring the kernel maps at the context's address
/// (`struct aio_ring`, fs/aio.c); the events follow it.
#[repr(C)]
struct RingHeader {
    id: u32,
    nr: u32,
    head: u32,
    tail: u32,
    magic: u32,
    compat_features: u32,
    incompat_features: u32,
    header_length: u32,
}

/// A Linux AIO context (`aio_context_t`); destroyed on drop, which waits for every
/// operation still in the kernel.
pub(crate) struct Context {
    id: libc::c_ulong,
    /// The completion ring's header, when its layout is the known one.
    ring: Option<NonNull<RingHeader>>,
}

// SAFETY: the context id and the ring mapping belong to the process, not to a thread; the
// ring is only read, through atomics.
unsafe impl Send for Context {}

impl Context {
    /// `io_setup` for up to `nr_events` operations at once.
    pub(crate) fn setup(nr_events: u32) -> io::Result<Context> {
        let mut id: libc::c_ulong = 0;
        // SAFETY: io_setup writes the new context id to the live local it is given.
        let rc = unsafe { libc::syscall(libc::SYS_io_setup, nr_events, &mut id) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut ctx = Context { id, ring: None };
        ctx.ring = ctx.known_ring();
        Ok(ctx)
    }

    /// `io_submit`: how many of `iocbs` the kernel took (from the first).
    ///
    /// # Safety
    /// Every pointer names a filled iocb whose buffers and iovecs satisfy the push
    /// contract until its event has been read.
    pub(crate) unsafe fn submit(&self, iocbs: &[*mut IoControlBlock]) -> io::Result<usize> {
        // SAFETY: `iocbs` is a live array of iocb pointers of the given length; the
        // caller vouches for what they point to.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_io_submit,
                self.id,
                iocbs.len() as libc::c_long,
                iocbs.as_ptr(),
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(rc as usize)
    }

    /// `io_getevents`: at least `min_nr` events into `events` (all that are there, up to
    /// its length, when `timeout` is zero).
    pub(crate) fn getevents(
        &self,
        min_nr: usize,
        events: &mut [IoEvent],
        timeout: Option<&libc::timespec>,
    ) -> io::Result<usize> {
        let ts = timeout.map_or(std::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: `events` is a live, writable array of the given length; `ts` is null or
        // points to a live timespec.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_io_getevents,
                self.id,
                min_nr as libc::c_long,
                events.len() as libc::c_long,
                events.as_mut_ptr(),
                ts,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(rc as usize)
    }

    /// The completion ring's header, if it has the layout this code knows.
    fn known_ring(&self) -> Option<NonNull<RingHeader>> {
        let ring = NonNull::new(self.id as *mut RingHeader)?;
        // SAFETY: the kernel maps the ring, readable, at the context's address from
        // io_setup until io_destroy (self's drop); the header fields read here are plain
        // u32s the kernel does not change after setup.
        let known = unsafe {
            let h = ring.as_ptr();
            std::ptr::addr_of!((*h).magic).read_volatile() == AIO_RING_MAGIC
                && std::ptr::addr_of!((*h).incompat_features).read_volatile() == 0
                && std::ptr::addr_of!((*h).header_length).read_volatile()
                    == std::mem::size_of::<RingHeader>() as u32
        };
        known.then_some(ring)
    }

    /// Whether the ring's layout is known, so that [`Context::ring_has_events`] answers.
    pub(crate) fn has_ring(&self) -> bool {
        self.ring.is_some()
    }

    /// Whether events wait in the ring (head != tail), without a syscall; None when the
    /// ring's layout is unknown.
    pub(crate) fn ring_has_events(&self) -> Option<bool> {
        let h = self.ring?.as_ptr();
        // SAFETY: the ring stays mapped while the context lives; head and tail are aligned
        // u32s the kernel updates atomically (the tail after the event, with a barrier).
        unsafe {
            let tail = AtomicU32::from_ptr(std::ptr::addr_of_mut!((*h).tail));
            let head = AtomicU32::from_ptr(std::ptr::addr_of_mut!((*h).head));
            Some(tail.load(Ordering::Acquire) != head.load(Ordering::Relaxed))
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: destroys the context this value owns; io_destroy waits for its
        // operations and unmaps its ring, which nothing reads afterwards.
        if unsafe { libc::syscall(libc::SYS_io_destroy, self.id) } < 0 {
            log::error!("aio engine: io_destroy: {}", io::Error::last_os_error());
        }
    }
}
