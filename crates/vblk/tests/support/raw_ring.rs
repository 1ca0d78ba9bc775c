//! Guest memory and a split ring for [`super::raw_frontend`]: memfds mapped here and
//! described to the device, eventfds and pipes for notifications, and the smallest split
//! ring that puts virtio-blk writes in front of the device.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use super::raw_frontend::{req, state, u64p, vring_addr, Conn, Region};

// ---- file descriptors ----

fn check(r: libc::c_int, what: &str) -> RawFd {
    assert!(r >= 0, "{what}: {}", io::Error::last_os_error());
    r
}

/// An eventfd with `initial` in its counter; blocking unless `nonblock`.
pub fn eventfd(initial: u64, nonblock: bool) -> OwnedFd {
    let flags = libc::EFD_CLOEXEC | if nonblock { libc::EFD_NONBLOCK } else { 0 };
    // SAFETY: eventfd takes no pointers; it returns a new fd or -1.
    let fd = check(unsafe { libc::eventfd(0, flags) }, "eventfd");
    // SAFETY: `fd` was just created and nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    if initial > 0 {
        write_u64(fd.as_raw_fd(), initial).expect("eventfd write");
    }
    fd
}

/// Write a u64 to `fd` (an eventfd kick or signal).
pub fn write_u64(fd: RawFd, v: u64) -> io::Result<()> {
    let b = v.to_ne_bytes();
    // SAFETY: `b` is a valid 8-byte buffer for the duration of the call.
    let n = unsafe { libc::write(fd, b.as_ptr().cast(), b.len()) };
    if n == 8 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A pipe: (read end, write end).
pub fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: `fds` is a valid array of two c_ints for pipe2 to fill.
    check(
        unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) },
        "pipe2",
    );
    // SAFETY: both fds were just created by pipe2 and nothing else owns them.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

/// Set or clear O_NONBLOCK on `fd` (its open file description, shared with the device).
pub fn set_nonblock(fd: RawFd, on: bool) {
    // SAFETY: fcntl F_GETFL/F_SETFL on an fd we own; no pointers.
    unsafe {
        let fl = check(libc::fcntl(fd, libc::F_GETFL), "F_GETFL");
        let fl = if on {
            fl | libc::O_NONBLOCK
        } else {
            fl & !libc::O_NONBLOCK
        };
        check(libc::fcntl(fd, libc::F_SETFL, fl), "F_SETFL");
    }
}

/// Write into the pipe's write end until it is full; it is left blocking.
pub fn fill_pipe(w: RawFd) {
    set_nonblock(w, true);
    let chunk = [0x55u8; 4096];
    loop {
        // SAFETY: `chunk` is valid for its length during the call.
        let n = unsafe { libc::write(w, chunk.as_ptr().cast(), chunk.len()) };
        if n < 0 {
            break;
        }
    }
    set_nonblock(w, false);
}

// ---- guest memory ----

/// A memfd mapped here, described to the device as one region at `gpa` (the frontend
/// address the device is told is `gpa` too).
pub struct Guest {
    fd: OwnedFd,
    ptr: *mut u8,
    len: usize,
    /// Bytes still backed by the file (less than `len` after [`Guest::shrink`]).
    valid: usize,
    pub gpa: u64,
}

// SAFETY: the mapping belongs to this Guest alone (unmapped in Drop); every access goes
// through bounds-checked volatile reads and writes, which are fine from any thread.
unsafe impl Send for Guest {}

impl Guest {
    /// `len` bytes of zeroed memory; `sealed` adds F_SEAL_SHRINK | F_SEAL_GROW, as QEMU's
    /// memory-backend-memfd does by default.
    pub fn new(len: usize, sealed: bool, gpa: u64) -> Guest {
        let name = c"vblk-hostile";
        // SAFETY: `name` is NUL-terminated; memfd_create returns a new fd or -1.
        let fd = check(
            unsafe {
                libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
            },
            "memfd_create",
        );
        // SAFETY: `fd` was just created and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate and fcntl on our own memfd; no pointers.
        unsafe {
            check(
                libc::ftruncate(fd.as_raw_fd(), len as libc::off_t),
                "ftruncate",
            );
            if sealed {
                let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
                check(
                    libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals),
                    "F_ADD_SEALS",
                );
            }
        }
        // SAFETY: a new shared mapping of our own memfd, `len` bytes long, at an address the
        // kernel picks; it aliases nothing in this process.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert!(
            ptr != libc::MAP_FAILED,
            "mmap: {}",
            io::Error::last_os_error()
        );
        Guest {
            fd,
            ptr: ptr.cast(),
            len,
            valid: len,
            gpa,
        }
    }

    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The whole memfd as one region at `gpa`.
    pub fn region(&self) -> Region {
        Region {
            gpa: self.gpa,
            size: self.len as u64,
            uaddr: self.gpa,
            offset: 0,
        }
    }

    /// Truncate the file under the device's mapping; later accesses here are refused
    /// (they would SIGBUS this process).
    pub fn shrink(&mut self, len: usize) {
        // SAFETY: ftruncate on our own memfd; our accessors check `valid` from now on.
        check(
            unsafe { libc::ftruncate(self.fd(), len as libc::off_t) },
            "ftruncate",
        );
        self.valid = self.valid.min(len);
    }

    fn at(&self, off: usize, n: usize, align: usize) -> *mut u8 {
        assert!(
            off.is_multiple_of(align) && off.checked_add(n).is_some_and(|e| e <= self.valid),
            "guest access {off:#x}+{n} outside the {:#x} valid bytes (or misaligned)",
            self.valid
        );
        // SAFETY: off + n <= valid <= len, so the result stays inside the mapping.
        unsafe { self.ptr.add(off) }
    }

    pub fn write(&self, off: usize, bytes: &[u8]) {
        let p = self.at(off, bytes.len(), 1);
        for (i, &b) in bytes.iter().enumerate() {
            // SAFETY: `at` checked [off, off + len) lies in the live mapping.
            unsafe { p.add(i).write_volatile(b) };
        }
    }

    pub fn read_u8(&self, off: usize) -> u8 {
        // SAFETY: `at` checked the byte lies in the live mapping.
        unsafe { self.at(off, 1, 1).read_volatile() }
    }

    pub fn write_u16(&self, off: usize, v: u16) {
        // SAFETY: `at` checked bounds and 2-byte alignment inside the live mapping.
        unsafe { self.at(off, 2, 2).cast::<u16>().write_volatile(v.to_le()) }
    }

    pub fn read_u16(&self, off: usize) -> u16 {
        // SAFETY: `at` checked bounds and 2-byte alignment inside the live mapping.
        u16::from_le(unsafe { self.at(off, 2, 2).cast::<u16>().read_volatile() })
    }

    pub fn write_u32(&self, off: usize, v: u32) {
        // SAFETY: `at` checked bounds and 4-byte alignment inside the live mapping.
        unsafe { self.at(off, 4, 4).cast::<u32>().write_volatile(v.to_le()) }
    }

    pub fn write_u64(&self, off: usize, v: u64) {
        // SAFETY: `at` checked bounds and 8-byte alignment inside the live mapping.
        unsafe { self.at(off, 8, 8).cast::<u64>().write_volatile(v.to_le()) }
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are the mapping made in `new`, unmapped only here.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

// ---- a minimal split ring ----

/// Entries per ring.
pub const QSZ: u16 = 16;
/// Bytes of guest memory a [`Ring`] uses from its base.
pub const RING_BYTES: usize = 0x6000;
const AVAIL: usize = 0x1000;
const USED: usize = 0x2000;
const HDRS: usize = 0x3000;
const STATUS: usize = 0x3800;
const DATA: usize = 0x4000;
/// Requests in flight at most (three descriptors each).
pub const SLOTS: u16 = QSZ / 3;
pub const DESC_NEXT: u16 = 1;
pub const DESC_WRITE: u16 = 2;

/// A split ring of [`QSZ`] entries at offset `base` of a [`Guest`], with request headers,
/// status bytes and 512-byte data buffers after it.
pub struct Ring {
    pub index: u32,
    pub base: usize,
    next_avail: u16,
    next_slot: u16,
}

impl Ring {
    pub fn new(index: u32, base: usize) -> Ring {
        Ring {
            index,
            base,
            next_avail: 0,
            next_slot: 0,
        }
    }

    /// Frontend addresses of the descriptor table, used ring and avail ring.
    pub fn addrs(&self, g: &Guest) -> (u64, u64, u64) {
        let a = g.gpa + self.base as u64;
        (a, a + USED as u64, a + AVAIL as u64)
    }

    /// Set the ring up on the device and enable it, every step acknowledged.
    pub fn start(&self, c: &mut Conn, g: &Guest, kick: RawFd, call: RawFd) -> Result<(), String> {
        let i = self.index;
        let (desc, used, avail) = self.addrs(g);
        c.ok(
            "SET_VRING_NUM",
            req::SET_VRING_NUM,
            &state(i, QSZ.into()),
            &[],
        )?;
        c.ok(
            "SET_VRING_ADDR",
            req::SET_VRING_ADDR,
            &vring_addr(i, desc, used, avail),
            &[],
        )?;
        c.ok("SET_VRING_BASE", req::SET_VRING_BASE, &state(i, 0), &[])?;
        c.ok(
            "SET_VRING_CALL",
            req::SET_VRING_CALL,
            &u64p(i.into()),
            &[call],
        )?;
        c.ok(
            "SET_VRING_KICK",
            req::SET_VRING_KICK,
            &u64p(i.into()),
            &[kick],
        )?;
        c.ok("SET_VRING_ENABLE", req::SET_VRING_ENABLE, &state(i, 1), &[])
    }

    /// Write descriptor `i`.
    pub fn desc(&self, g: &Guest, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let o = self.base + usize::from(i) * 16;
        g.write_u64(o, addr);
        g.write_u32(o + 8, len);
        g.write_u16(o + 12, flags);
        g.write_u16(o + 14, next);
    }

    /// Put `head` in the next avail slot and publish the new avail index.
    pub fn push(&mut self, g: &Guest, head: u16) {
        let slot = usize::from(self.next_avail % QSZ);
        g.write_u16(self.base + AVAIL + 4 + 2 * slot, head);
        self.next_avail = self.next_avail.wrapping_add(1);
        self.set_avail_idx(g, self.next_avail);
    }

    /// Publish `idx` as the avail index (after everything written before it).
    pub fn set_avail_idx(&self, g: &Guest, idx: u16) {
        fence(Ordering::SeqCst);
        g.write_u16(self.base + AVAIL + 2, idx);
        fence(Ordering::SeqCst);
    }

    /// Frontend address of request slot `s`'s header, status byte and data buffer.
    pub fn slot_addrs(&self, g: &Guest, s: u16) -> (u64, u64, u64) {
        let a = g.gpa + self.base as u64;
        let s = u64::from(s);
        (
            a + HDRS as u64 + s * 16,
            a + STATUS as u64 + s,
            a + DATA as u64 + s * 512,
        )
    }

    /// A 512-byte write of `fill` to `sector` in the next request slot, its data
    /// descriptor `data` (address, length; None: the slot's own 512-byte buffer), published.
    /// Returns the slot; its status byte starts as 0xff.
    pub fn write_req(&mut self, g: &Guest, sector: u64, fill: u8, data: Option<(u64, u32)>) -> u16 {
        let s = self.next_slot % SLOTS;
        self.next_slot += 1;
        let (hdr, status, buf) = self.slot_addrs(g, s);
        let off = |a: u64| (a - g.gpa) as usize;
        g.write_u32(off(hdr), 1); // VIRTIO_BLK_T_OUT
        g.write_u32(off(hdr) + 4, 0);
        g.write_u64(off(hdr) + 8, sector);
        g.write(off(buf), &[fill; 512]);
        g.write(off(status), &[0xff]);
        let d = s * 3;
        self.desc(g, d, hdr, 16, DESC_NEXT, d + 1);
        let (addr, len) = data.unwrap_or((buf, 512));
        self.desc(g, d + 1, addr, len, DESC_NEXT, d + 2);
        self.desc(g, d + 2, status, 1, DESC_WRITE, 0);
        self.push(g, d);
        s
    }

    pub fn status(&self, g: &Guest, s: u16) -> u8 {
        let (_, status, _) = self.slot_addrs(g, s);
        g.read_u8((status - g.gpa) as usize)
    }

    pub fn used_idx(&self, g: &Guest) -> u16 {
        let v = g.read_u16(self.base + USED + 2);
        fence(Ordering::SeqCst);
        v
    }

    /// Wait until the used index reaches `n` (or passes it); false on timeout.
    pub fn wait_used(&self, g: &Guest, n: u16, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while (self.used_idx(g).wrapping_sub(n) as i16) < 0 {
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }
}

/// A session spoken by hand with one ring started: the connection (protocol features
/// `want` asked), 1 MiB of guest memory at 4 GiB, queue 0's ring on it, and its kick and
/// call eventfds (the kick is written to kick the device).
pub struct StartedRing {
    pub c: Conn,
    pub g: Guest,
    pub ring: Ring,
    pub kick: OwnedFd,
    pub call: OwnedFd,
}

impl StartedRing {
    pub fn start(sock: &std::path::Path, want: u64) -> StartedRing {
        let mut c = super::raw_frontend::handshake(sock, want, true).unwrap();
        let g = Guest::new(1 << 20, true, 0x1_0000_0000);
        c.ok(
            "SET_MEM_TABLE",
            req::SET_MEM_TABLE,
            &super::raw_frontend::mem_table(1, &[g.region()]),
            &[g.fd()],
        )
        .unwrap();
        let (kick, call) = (eventfd(0, true), eventfd(0, true));
        let ring = Ring::new(0, 0);
        ring.start(&mut c, &g, kick.as_raw_fd(), call.as_raw_fd())
            .unwrap();
        StartedRing {
            c,
            g,
            ring,
            kick,
            call,
        }
    }

    /// Stop queue 0 (GET_VRING_BASE), as QEMU does before a reset or a switchover.
    pub fn stop(&mut self) {
        self.c
            .call_flags(
                req::GET_VRING_BASE,
                super::raw_frontend::VERSION,
                &state(0, 0),
                &[],
            )
            .unwrap();
    }
}
