//! The guest side of the vhost-user target: guest memory in memfds, the standard layout
//! of rings and buffers in it, and a driver that puts mostly valid requests on a ring so
//! that a started queue has work (its worker then parses them and runs them against the
//! RAM disk through iovecs into this memory).

use std::fs::File;
use std::os::fd::FromRawFd;
use std::os::unix::fs::FileExt;

use proto::wire::req_type;

use crate::input::Input;

/// Size of the standard memory regions.
pub const MEM: u64 = 0x1_0000;
/// Region A: guest address 0, frontend address UA, offset 0 of memfd A.
pub const UA: u64 = 0x7f00_0000_0000;
/// Region B: guest address GPA_B, frontend address UB, memfd B.
pub const GPA_B: u64 = 0x10_0000;
/// Frontend address of region B.
pub const UB: u64 = 0x7f00_1000_0000;
/// Queues the harness drives (the device offers two).
pub const QUEUES: usize = 2;

/// Guest addresses of queue `q`'s descriptor table, available ring and used ring in
/// region A (each part 4 KiB apart: room for 256 entries).
pub fn ring_gpa(q: usize) -> (u64, u64, u64) {
    let base = 0x4000 * q as u64;
    (base, base + 0x1000, base + 0x2000)
}

/// Start of queue `q`'s buffer area in region A (16 KiB each).
fn buf_area(q: usize) -> u64 {
    0x8000 + 0x4000 * q as u64
}

/// A memfd of `len` bytes.
pub fn memfd(len: u64) -> File {
    // SAFETY: memfd_create with a static, NUL-terminated name; no pointers kept.
    let fd = unsafe { libc::memfd_create(c"vblk-fuzz".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: fd was just created and nothing else owns it.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(len).expect("memfd set_len");
    f
}

/// An eventfd.
pub fn eventfd() -> File {
    // SAFETY: eventfd takes no pointers.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    assert!(fd >= 0, "eventfd: {}", std::io::Error::last_os_error());
    // SAFETY: fd was just created and nothing else owns it.
    unsafe { File::from_raw_fd(fd) }
}

/// What the harness, as the driver, has put on one queue.
#[derive(Clone, Copy, Debug)]
pub struct Driver {
    /// The queue size the frontend last asked for.
    pub size: u16,
    /// The available index the driver has published.
    pub avail: u16,
    next_desc: u16,
    next_buf: u64,
    /// The buffer area wrapped during the current fill.
    wrapped: bool,
}

impl Default for Driver {
    fn default() -> Self {
        Driver {
            size: 16,
            avail: 0,
            next_desc: 0,
            next_buf: 0,
            wrapped: false,
        }
    }
}

/// A request the driver put on a ring.
#[derive(Clone, Copy, Debug)]
pub struct Sent {
    /// Its head.
    pub head: u16,
    /// Guest address of its status byte (0xff until the device answers).
    pub status: u64,
    /// Some(used length) when the device must complete it with status OK: a read, a
    /// write or a GET_ID inside the disk (no feature needed).
    pub ok_len: Option<u32>,
}

/// The requests of one fill and the writes that put them on the ring.
#[derive(Debug)]
pub struct Fill {
    /// Queue.
    pub q: usize,
    /// The queue size the driver assumed.
    pub size: u16,
    /// What to write into guest memory.
    pub writes: Writes,
    /// The available index after it.
    pub avail: u16,
    /// The requests.
    pub sent: Vec<Sent>,
    /// Nothing was broken on purpose and no buffer or descriptor was reused within the
    /// fill: each request's status can be checked once the device has used it.
    pub checkable: bool,
}

/// Writes to guest memory (memfd A, offset = guest address), collected when the
/// message stream is built and made when the harness reaches them.
pub type Writes = Vec<(u64, Vec<u8>)>;

fn desc(addr: u64, len: u32, flags: u16, next: u16) -> Vec<u8> {
    let mut d = Vec::with_capacity(16);
    d.extend_from_slice(&addr.to_le_bytes());
    d.extend_from_slice(&len.to_le_bytes());
    d.extend_from_slice(&flags.to_le_bytes());
    d.extend_from_slice(&next.to_le_bytes());
    d
}

impl Driver {
    fn buf(&mut self, q: usize, len: u64) -> u64 {
        if self.next_buf + len > 0x4000 {
            self.next_buf = 0;
            self.wrapped = true;
        }
        let at = buf_area(q) + self.next_buf;
        self.next_buf += (len + 15) & !15;
        at
    }

    /// Put 1 to 8 requests on queue `q` (rarely broken ones) and publish them. Buffers
    /// start again at the beginning of the queue's area.
    pub fn fill(&mut self, q: usize, inp: &mut Input) -> Fill {
        let size = self.size.max(1);
        let (table, avail, _) = ring_gpa(q);
        let mut w = Writes::new();
        let mut sent = Vec::new();
        let mut checkable = true;
        let mut descs = 0u32;
        self.next_buf = 0;
        self.wrapped = false;
        for _ in 0..1 + inp.below(8) {
            let type_ = match inp.below(8) {
                0 | 6 => req_type::IN,
                1 => req_type::OUT,
                2 => req_type::FLUSH,
                3 => req_type::GET_ID,
                4 => req_type::DISCARD,
                5 => req_type::WRITE_ZEROES,
                _ => inp.u32(),
            };
            // The RAM disk has 2048 sectors.
            let odd_sector = inp.rare();
            let sector = if odd_sector {
                inp.u64()
            } else {
                inp.below(2040)
            };
            let data_len = 512 * (1 + inp.below(8));
            let hdr = self.buf(q, 16);
            let mut h = Vec::with_capacity(16);
            h.extend_from_slice(&type_.to_le_bytes());
            h.extend_from_slice(&0u32.to_le_bytes());
            h.extend_from_slice(&sector.to_le_bytes());
            w.push((hdr, h));
            // (address, length, device-writable) in chain order.
            let mut bufs = vec![(hdr, 16u32, false)];
            match type_ {
                req_type::IN | req_type::OUT => {
                    let at = self.buf(q, data_len);
                    bufs.push((at, data_len as u32, type_ == req_type::IN));
                }
                req_type::GET_ID => bufs.push((self.buf(q, 20), 20, true)),
                req_type::DISCARD | req_type::WRITE_ZEROES => {
                    let at = self.buf(q, 16);
                    let mut s = Vec::with_capacity(16);
                    s.extend_from_slice(&sector.to_le_bytes());
                    s.extend_from_slice(&(inp.below(16) as u32).to_le_bytes());
                    s.extend_from_slice(&u32::from(inp.u8() & 1).to_le_bytes());
                    w.push((at, s));
                    bufs.push((at, 16, false));
                }
                _ => {}
            }
            let status = self.buf(q, 1);
            bufs.push((status, 1, true));
            w.push((status, vec![0xff]));
            let ok_len = match type_ {
                _ if odd_sector => None,
                req_type::IN => Some(data_len as u32 + 1),
                req_type::OUT => Some(1),
                req_type::GET_ID => Some(21),
                _ => None,
            };

            let head = self.next_desc % size;
            sent.push(Sent {
                head,
                status,
                ok_len,
            });
            if inp.u8() & 3 == 3 {
                descs += 1;
                // One indirect descriptor, its table among the buffers.
                let t = self.buf(q, 16 * bufs.len() as u64);
                let mut table_bytes = Vec::new();
                for (i, &(a, l, wr)) in bufs.iter().enumerate() {
                    let last = i + 1 == bufs.len();
                    let flags = u16::from(!last) | (u16::from(wr) << 1);
                    table_bytes.extend(desc(a, l, flags, i as u16 + 1));
                }
                w.push((t, table_bytes));
                let d = desc(t, 16 * bufs.len() as u32, 4, 0);
                w.push((table + 16 * u64::from(head), d));
                self.next_desc = self.next_desc.wrapping_add(1);
            } else {
                descs += bufs.len() as u32;
                for (i, &(a, l, wr)) in bufs.iter().enumerate() {
                    let idx = self.next_desc.wrapping_add(i as u16) % size;
                    let next = self.next_desc.wrapping_add(i as u16 + 1) % size;
                    let last = i + 1 == bufs.len();
                    let flags = u16::from(!last) | (u16::from(wr) << 1);
                    w.push((table + 16 * u64::from(idx), desc(a, l, flags, next)));
                }
                self.next_desc = self.next_desc.wrapping_add(bufs.len() as u16);
            }
            if inp.rare() {
                // A raw descriptor somewhere in the table.
                let at = table + 16 * inp.below(u64::from(size));
                w.push((at, inp.bytes(16)));
                checkable = false;
            }
            let slot = avail + 4 + 2 * u64::from(self.avail % size);
            w.push((slot, head.to_le_bytes().to_vec()));
            self.avail = self.avail.wrapping_add(1);
        }
        if inp.rare() {
            self.avail = self.avail.wrapping_add(inp.u16());
            checkable = false;
        }
        w.push((avail + 2, self.avail.to_le_bytes().to_vec()));
        Fill {
            q,
            size,
            writes: w,
            avail: self.avail,
            sent,
            checkable: checkable && !self.wrapped && descs <= u32::from(size),
        }
    }
}

/// Make `writes` in `mem` (guest address = file offset) below `len` (past the end of
/// a truncated memfd a write would grow it again).
pub fn apply(mem: &File, len: u64, writes: &Writes) {
    for (at, bytes) in writes {
        let room = len.saturating_sub(*at).min(bytes.len() as u64) as usize;
        if room > 0 {
            let _ = mem.write_at(&bytes[..room], *at);
        }
    }
}

/// Used element `i` of queue `q` of `size` entries: (id, length).
pub fn used_elem(mem: &File, q: usize, size: u16, i: u16) -> Option<(u32, u32)> {
    let mut b = [0u8; 8];
    let (_, _, used) = ring_gpa(q);
    let at = used + 4 + 8 * u64::from(i % size.max(1));
    mem.read_exact_at(&mut b, at).ok()?;
    Some((
        u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
    ))
}

/// The byte at guest address `at`.
pub fn byte_at(mem: &File, at: u64) -> Option<u8> {
    let mut b = [0u8; 1];
    mem.read_exact_at(&mut b, at).ok()?;
    Some(b[0])
}

/// The used index of queue `q`, as the device last published it.
pub fn used_idx(mem: &File, q: usize) -> Option<u16> {
    let mut b = [0u8; 2];
    let (_, _, used) = ring_gpa(q);
    mem.read_exact_at(&mut b, used + 2).ok()?;
    Some(u16::from_le_bytes(b))
}
