//! libblkio (crates.io `blkio`, pure Rust, its `virtio-blk-vhost-user` driver) as a foreign
//! frontend of `vblk serve` (issue 7, item 7).
//!
//! Each matrix test starts `vblk serve` on a 512 MiB sparse raw image and attaches libblkio
//! with 1 to 4 queues of 64 to 1024 entries. Every queue works, on its own thread, on its
//! own slice of the disk, two cycles of rounds (all requests of a round in flight together,
//! ranges disjoint within a round):
//! - writev with 1 .. N segments, N = min(max-segments, queue-size - 2): libblkio negotiates
//!   no indirect descriptors, so a request of N segments fills the ring (header + N + status);
//!   segment lengths vary, one request has lengths that are not multiples of 512, and buffers
//!   start at 4 KiB, 512-byte and odd-byte addresses (O_DIRECT bounce buffers in the daemon);
//! - read back with another segmentation (single buffers and readv), checked sector by sector;
//! - single buffers of 4 KiB, 1 MiB, 4 MiB, 4 MiB + 512 at an odd address, a 64 KiB FUA write
//!   (libblkio follows it with a FLUSH); read back; FLUSH;
//! - DISCARD of two ranges (a hint: only success is asserted, and the range may then read as
//!   zeroes or as the old data), WRITE_ZEROES with NO_UNMAP and without; read back zeroes.
//!
//! Every sector written is stamped with its write id and its own number (`stamp`). Once per
//! run (the 1 × 512 test) queue 0 first writes one single buffer of libblkio's max-transfer
//! (seg_max 254 × size_max 1 MiB = 254 MiB) and reads it back as 254 segments of 1 MiB.
//! At the end the image file on the host must equal the model of what was written, the
//! daemon's log must hold no WARN or ERROR line, and its per-queue summary at disconnect must
//! show exactly the requests libblkio sent, none rejected and none failed.
//!
//! The matrix (queues × entries, --cache, --engine, --threads): 1 × 64 none io_uring 1;
//! 2 × 128 writeback sync 1; 4 × 256 none sync 2; 1 × 512 none io_uring 1 (+ max-transfer);
//! 2 × 1024 writeback io_uring 1; 4 × 64 writeback io_uring 4.
//!
//! Not tried, because they are the application's business in libblkio 0.5.1: a request of
//! more segments than the ring holds never leaves libblkio's backlog (and blocks the queue:
//! `try_enqueue` maps "Not enough free descriptors" to "retry later"); more than max-segments
//! (254) segments, or a discard longer than max-discard-len, libblkio sends as they are and
//! the device answers IOERR.
//!
//! `read_only` serves `--read-only`: libblkio without its `read-only` property refuses to
//! start ("Device is read-only", EROFS); with it, reads work and writes, writev, discard and
//! write-zeroes fail in libblkio itself with EBADF, never reaching the device; FLUSH does
//! reach it, and succeeds.
//!
//! Run time (debug build, 2 cores shared with other work): 36-45 s for the file with
//! cargo's 2 test threads; one at a time 3-9 s per matrix test, 12 s for the max-transfer
//! one, 1 s for `read_only`.

mod support;

use std::ffi::CStr;
use std::fs;
use std::io::Read;
use std::mem::MaybeUninit;
use std::path::Path;
use std::time::{Duration, Instant};

use blkio::{iovec, Blkio, Blkioq, Completion, Errno, ReqFlags};
use support::daemon::{Backend, Daemon, Export, ShowLogOnPanic};
use support::util::{
    check_stamped, stamp, temp_dir, within, Rng, DISCARDED, SECTOR_BYTES as SECTOR,
};

const MIB: usize = 1 << 20;
const DISK_BYTES: usize = 512 * MIB;
const DISK_SECTORS: usize = DISK_BYTES / SECTOR;
/// What `vblk serve` offers: seg_max 254, size_max 1 MiB.
const SEG_MAX: usize = 254;
const SIZE_MAX: usize = MIB;
/// Memory each queue's worker has for its buffers.
const QUEUE_MEM: usize = 16 * MIB;
/// How long a round of requests may take before the test calls it hung.
const IO_TIMEOUT: Duration = Duration::from_secs(60);
const TEST_LIMIT: Duration = Duration::from_secs(300);

/// One `vblk serve` configuration and what libblkio asks of it.
#[derive(Clone, Copy, Debug)]
struct Combo {
    queues: usize,
    queue_size: usize,
    cache: &'static str,
    engine: &'static str,
    threads: usize,
    /// Also write and read one buffer of max-transfer bytes.
    max_transfer: bool,
}

fn combo(queues: usize, queue_size: usize, cache: &'static str, engine: &'static str) -> Combo {
    let threads = queues.div_ceil(2);
    Combo {
        queues,
        queue_size,
        cache,
        engine,
        threads,
        max_transfer: false,
    }
}

#[test]
fn q1_64_direct_uring() {
    run(combo(1, 64, "none", "io_uring"));
}

#[test]
fn q2_128_writeback_sync() {
    run(combo(2, 128, "writeback", "sync"));
}

#[test]
fn q4_256_direct_sync() {
    run(combo(4, 256, "none", "sync"));
}

#[test]
fn q1_512_direct_uring_max_transfer() {
    run(Combo {
        max_transfer: true,
        ..combo(1, 512, "none", "io_uring")
    });
}

#[test]
fn q2_1024_writeback_uring() {
    run(combo(2, 1024, "writeback", "io_uring"));
}

#[test]
fn q4_64_writeback_uring() {
    run(Combo {
        threads: 4,
        ..combo(4, 64, "writeback", "io_uring")
    });
}

fn run(c: Combo) {
    let dir = temp_dir("libblkio-");
    let image = dir.path().join("disk.img");
    let f = fs::File::create(&image).unwrap();
    f.set_len(DISK_BYTES as u64).unwrap();
    let export = Export::new(&image, 4).args(&[
        "--cache",
        c.cache,
        "--engine",
        c.engine,
        "--threads",
        &c.threads.to_string(),
    ]);
    let sock = dir.path().join("vblk.sock");
    let log = dir.path().join("vblk.log");
    let mut daemon = Daemon::start(Backend::Vblk, "vblk serve", &export, &sock, &log);
    let guard = ShowLogOnPanic(&daemon);
    let (model, sent) = within(TEST_LIMIT, &format!("{c:?}"), move || drive(&sock, c));
    check_daemon(&daemon, 1, &sent);
    drop(guard);
    daemon.assert_running("after libblkio disconnected");
    compare_image(&image, &model);
}

/// libblkio's virtio-blk-vhost-user driver, connected to `sock`.
fn attach(sock: &Path, read_only: bool) -> Blkio {
    let mut b = Blkio::new("virtio-blk-vhost-user").unwrap();
    b.set_str("path", sock.to_str().unwrap()).unwrap();
    b.set_bool("read-only", read_only).unwrap();
    b.connect()
        .unwrap_or_else(|e| panic!("connect: {e} ({})", e.errno()));
    b
}

/// Attach libblkio, run the workers, detach; the model and the requests sent per queue.
fn drive(sock: &Path, c: Combo) -> (Vec<u32>, Vec<u64>) {
    let mut b = attach(sock, false);
    // What libblkio read from the device.
    assert_eq!(b.get_u64("capacity").unwrap(), DISK_BYTES as u64);
    assert_eq!(b.get_i32("max-queues").unwrap(), 4);
    assert_eq!(b.get_i32("max-segments").unwrap() as usize, SEG_MAX);
    assert_eq!(b.get_i32("max-segment-len").unwrap() as usize, SIZE_MAX);
    let max_transfer = b.get_i32("max-transfer").unwrap() as usize;
    assert_eq!(max_transfer, SEG_MAX * SIZE_MAX, "max-transfer");
    assert_eq!(b.get_i32("buf-alignment").unwrap(), 1, "buf-alignment");
    assert!(b.get_u64("max-write-zeroes-len").unwrap() >= 64 * MIB as u64);
    assert!(b.get_u64("max-discard-len").unwrap() >= 64 * MIB as u64);
    b.set_i32("num-queues", c.queues as i32).unwrap();
    b.set_i32("queue-size", c.queue_size as i32).unwrap();
    let mut queues = b
        .start()
        .unwrap_or_else(|e| panic!("start with {c:?}: {e} ({})", e.errno()))
        .queues;
    assert_eq!(queues.len(), c.queues);

    let mut model = vec![0u32; DISK_SECTORS];
    let mut sent = vec![0u64; c.queues];
    if c.max_transfer {
        sent[0] += max_transfer_io(&mut b, &mut queues[0], &mut model, max_transfer);
    }
    let regions: Vec<_> = (0..c.queues)
        .map(|_| {
            let r = b.alloc_mem_region(QUEUE_MEM).unwrap();
            b.map_mem_region(&r).unwrap();
            r.addr
        })
        .collect();
    let ring_segments = SEG_MAX.min(c.queue_size - 2);
    let slice = DISK_SECTORS / c.queues;
    std::thread::scope(|s| {
        let workers: Vec<_> = queues
            .drain(..)
            .zip(model.chunks_mut(slice))
            .zip(&regions)
            .enumerate()
            .map(|(i, ((q, model), &addr))| {
                let w = Worker {
                    q,
                    mem: addr,
                    model,
                    first_lba: (i * slice) as u64,
                    next_id: ((i as u32 + 1) << 24) + 1,
                    rng: Rng(0x5EED_0000 + (i as u64) * 7919 + c.queue_size as u64),
                    sent: 0,
                    ring_segments,
                };
                s.spawn(move || w.run())
            })
            .collect();
        for (i, h) in workers.into_iter().enumerate() {
            sent[i] += h.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
        }
    });
    drop(b); // closes the connection: the daemon prints its summary
    (model, sent)
}

/// Queue 0 writes one single buffer of max-transfer bytes at sector 0 and reads it back as
/// 254 segments of size_max each. Returns the requests sent.
fn max_transfer_io(b: &mut Blkio, q: &mut Blkioq, model: &mut [u32], len: usize) -> u64 {
    let r = b.alloc_mem_region(len).unwrap();
    b.map_mem_region(&r).unwrap();
    let p = r.addr as *mut u8;
    let id = 0x7F00_0001;
    // SAFETY: libblkio maps the region read-write until it is freed below, and each slice
    // taken lives only between requests, never while one is in flight.
    let buf = || unsafe { region(p, len) };
    stamp(buf(), id, 0);
    q.write(0, p, len, 0, ReqFlags::empty());
    complete(q, &["a single buffer of max-transfer bytes"]);
    model[..len / SECTOR].fill(id);
    buf().fill(0xEE);
    let iov: Vec<iovec> = (0..len / SIZE_MAX)
        .map(|i| iovec {
            iov_base: p.wrapping_add(i * SIZE_MAX).cast(),
            iov_len: SIZE_MAX,
        })
        .collect();
    assert_eq!(iov.len(), SEG_MAX);
    q.readv(0, iov.as_ptr(), iov.len() as u32, 0, ReqFlags::empty());
    complete(q, &["a readv of 254 segments of size_max"]);
    if let Some(m) = check_stamped(buf(), model, 0) {
        panic!("max-transfer read back: {m}");
    }
    b.unmap_mem_region(&r);
    b.free_mem_region(&r);
    2
}

/// `len` bytes of a libblkio memory region at `p`.
///
/// # Safety
/// They must stay mapped read-write while the slice lives, and no request that uses them
/// may be in flight meanwhile (the device writes them only then).
unsafe fn region<'a>(p: *mut u8, len: usize) -> &'a mut [u8] {
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts_mut(p, len) }
}

/// Wait for the `n` requests in flight on `q` (user_data 0..n); their (errno, message)
/// by user_data, 0 and "" for success.
fn reap(q: &mut Blkioq, n: usize, what: &dyn Fn(usize) -> String) -> Vec<(i32, String)> {
    let deadline = Instant::now() + IO_TIMEOUT;
    let mut rets = vec![None; n];
    let mut out: Vec<MaybeUninit<Completion>> = (0..n).map(|_| MaybeUninit::uninit()).collect();
    let mut got = 0;
    while got < n {
        let mut t = deadline.saturating_duration_since(Instant::now());
        let k = q
            .do_io(&mut out[got..], 1, Some(&mut t), None)
            .unwrap_or_else(|e| {
                let pending: Vec<_> = (0..n).filter(|&i| rets[i].is_none()).map(what).collect();
                panic!(
                    "not completed after {IO_TIMEOUT:?} ({e}, {}): {pending:#?}",
                    e.errno()
                )
            });
        for c in &out[got..got + k] {
            // SAFETY: do_io initialised these `k` completions.
            let c = unsafe { c.assume_init_read() };
            let msg = if c.error_msg.is_null() {
                String::new()
            } else {
                // SAFETY: libblkio's error messages are static NUL-terminated strings.
                unsafe { CStr::from_ptr(c.error_msg) }
                    .to_string_lossy()
                    .into_owned()
            };
            assert!(
                rets[c.user_data].is_none(),
                "{} completed twice",
                what(c.user_data)
            );
            rets[c.user_data] = Some((-c.ret, msg));
        }
        got += k;
    }
    rets.into_iter().map(Option::unwrap).collect()
}

/// Wait for the requests `what` (user_data = index) and require that each succeeded.
fn complete(q: &mut Blkioq, what: &[&str]) {
    for (i, (errno, msg)) in reap(q, what.len(), &|i| what[i].to_string())
        .iter()
        .enumerate()
    {
        if *errno != 0 {
            let e = Errno::from_raw_os_error(*errno);
            panic!("{} failed: {e} {msg}", what[i]);
        }
    }
}

/// A buffer in the worker's memory region: where it starts, how long.
#[derive(Clone, Copy, Debug)]
struct Seg {
    off: usize,
    len: usize,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Write { fua: bool },
    Read,
    Discard,
    WriteZeroes { unmap: bool },
    Flush,
}

/// A request on `sectors` sectors at `lba` (of the worker's slice) with buffers `segs`.
#[derive(Debug)]
struct Op {
    kind: Kind,
    lba: u64,
    sectors: u64,
    segs: Vec<Seg>,
}

impl Op {
    fn describe(&self, first_lba: u64) -> String {
        let (kind, lba, n, segs) = (
            self.kind,
            first_lba + self.lba,
            self.sectors,
            self.segs.len(),
        );
        format!("{kind:?} of sectors {lba}+{n} in {segs} segment(s)")
    }

    fn new(kind: Kind, lba: u64, sectors: u64, segs: Vec<Seg>) -> Op {
        Op {
            kind,
            lba,
            sectors,
            segs,
        }
    }
}

/// One queue's thread: its queue, memory, and slice of the model (sector 0 of `model` is
/// disk sector `first_lba`).
struct Worker<'a> {
    q: Blkioq,
    mem: usize,
    model: &'a mut [u32],
    first_lba: u64,
    next_id: u32,
    rng: Rng,
    /// Requests the device has been sent.
    sent: u64,
    /// The most segments a request can have: seg_max, and the ring without indirect
    /// descriptors (header + segments + status).
    ring_segments: usize,
}

impl Worker<'_> {
    fn run(mut self) -> u64 {
        for _ in 0..2 {
            self.cycle();
        }
        self.sent
    }

    fn cycle(&mut self) {
        // writev: every segment count up to the ring's limit, lengths and addresses varied.
        let mut counts: Vec<usize> = [1, 2, 3, 4, 7, 16, 31, 64, 100, 200, 253]
            .into_iter()
            .filter(|&n| n < self.ring_segments)
            .collect();
        counts.push(self.ring_segments);
        let (mut alloc, mut cursor) = (self.alloc(), 0);
        let mut writes = Vec::new();
        for (i, &n) in counts.iter().enumerate() {
            let lens: Vec<usize> = if i == 4 {
                self.odd_lengths(n)
            } else {
                (0..n)
                    .map(|_| (1 + self.rng.below(8) as usize) * SECTOR)
                    .collect()
            };
            let segs = self.place(&mut cursor, &lens);
            let sectors = (lens.iter().sum::<usize>() / SECTOR) as u64;
            let lba = alloc.take(&mut self.rng, sectors);
            writes.push(Op::new(Kind::Write { fua: false }, lba, sectors, segs));
        }
        self.round(&writes);
        // Read them back, cut differently.
        let mut cursor = 0;
        let reads: Vec<Op> = writes
            .iter()
            .map(|w| self.read_op(&mut cursor, w.lba, w.sectors))
            .collect();
        self.round(&reads);

        // Single buffers (one at an odd address), and a FUA write.
        let (mut alloc, mut cursor) = (self.alloc(), 0);
        let mut singles = Vec::new();
        for (len, skew, fua) in [
            (4096, 0, false),
            (MIB, 0, false),
            (4 * MIB, 0, false),
            (4 * MIB + SECTOR, 1, false),
            (64 << 10, 0, true),
        ] {
            let sectors = (len / SECTOR) as u64;
            let lba = alloc.take(&mut self.rng, sectors);
            let segs = vec![place_at(&mut cursor, len, skew)];
            singles.push(Op::new(Kind::Write { fua }, lba, sectors, segs));
        }
        self.round(&singles);
        let mut cursor = 0;
        let mut reads = Vec::new();
        for (i, w) in singles.iter().enumerate() {
            reads.push(if i == 2 {
                self.read_op(&mut cursor, w.lba, w.sectors)
            } else {
                let seg = place_at(&mut cursor, w.sectors as usize * SECTOR, i % 2 * 513);
                Op::new(Kind::Read, w.lba, w.sectors, vec![seg])
            });
        }
        self.round(&reads);
        self.round(&[Op::new(Kind::Flush, 0, 0, vec![])]);

        // Discard and write-zeroes over written data (the 1 MiB, 4 KiB and 4 MiB writes and
        // the writev at the ring's limit) and over a range that may never have been written.
        let last = writes.last().unwrap();
        let mut alloc = self.alloc();
        let mut zeroing = Vec::new();
        for (kind, w) in [
            (Kind::Discard, &singles[1]),
            (Kind::WriteZeroes { unmap: false }, last),
            (Kind::WriteZeroes { unmap: true }, &singles[2]),
            (Kind::WriteZeroes { unmap: false }, &singles[0]),
        ] {
            if alloc.try_put(w.lba, w.sectors) {
                zeroing.push(Op::new(kind, w.lba, w.sectors, vec![]));
            }
        }
        let lba = alloc.take(&mut self.rng, 2048);
        zeroing.push(Op::new(Kind::Discard, lba, 2048, vec![]));
        self.round(&zeroing);
        let mut cursor = 0;
        let reads: Vec<Op> = zeroing
            .iter()
            .map(|z| self.read_op(&mut cursor, z.lba, z.sectors))
            .collect();
        self.round(&reads);
    }

    fn alloc(&self) -> Alloc {
        Alloc {
            sectors: self.model.len() as u64,
            used: Vec::new(),
        }
    }

    /// `n` segment lengths, not multiples of 512, that add up to one.
    fn odd_lengths(&mut self, n: usize) -> Vec<usize> {
        let mut lens: Vec<usize> = (0..n - 1)
            .map(|_| 1 + self.rng.below(3000) as usize)
            .collect();
        let sum: usize = lens.iter().sum();
        lens.push(SECTOR - sum % SECTOR + SECTOR * self.rng.below(3) as usize);
        lens
    }

    /// A read of `sectors` at `lba`: a single buffer or a readv of up to the ring's limit
    /// of segments, at varied addresses.
    fn read_op(&mut self, cursor: &mut usize, lba: u64, sectors: u64) -> Op {
        let max = self.ring_segments.min(sectors as usize) as u64;
        let n = if self.rng.below(3) == 0 {
            1
        } else {
            1 + self.rng.below(max)
        };
        let mut cuts: Vec<usize> = (1..n)
            .map(|_| SECTOR * (1 + self.rng.below(sectors - 1) as usize))
            .collect();
        cuts.extend([0, sectors as usize * SECTOR]);
        cuts.sort_unstable();
        cuts.dedup();
        let lens: Vec<usize> = cuts.windows(2).map(|w| w[1] - w[0]).collect();
        Op::new(Kind::Read, lba, sectors, self.place(cursor, &lens))
    }

    /// Segments of `lens` bytes in this worker's memory from `cursor` on, each at a 4 KiB
    /// boundary, plus sometimes 512 bytes or an odd number of bytes.
    fn place(&mut self, cursor: &mut usize, lens: &[usize]) -> Vec<Seg> {
        lens.iter()
            .map(|&len| {
                place_at(
                    cursor,
                    len,
                    [0, 0, 512, 1536, 1, 7, 333][self.rng.below(7) as usize],
                )
            })
            .collect()
    }

    /// The worker's memory region.
    fn mem(&mut self) -> &mut [u8] {
        // SAFETY: libblkio maps the region read-write until the Blkio and every Blkioq are
        // dropped, and this worker owns a Blkioq. Only this worker uses the region, and it
        // takes the slice only between rounds, when none of its requests is in flight.
        unsafe { region(self.mem as *mut u8, QUEUE_MEM) }
    }

    /// Submit all `ops` (disjoint ranges), wait for all, update and check the model.
    fn round(&mut self, ops: &[Op]) {
        // Fill write buffers and update the model before anything is in flight.
        for op in ops {
            let at = op.lba as usize;
            let range = at..at + op.sectors as usize;
            match op.kind {
                Kind::Write { .. } => {
                    let id = self.next_id;
                    self.next_id += 1;
                    let mut data = vec![0u8; op.sectors as usize * SECTOR];
                    stamp(&mut data, id, self.first_lba + op.lba);
                    let mem = self.mem();
                    let mut from = 0;
                    for s in &op.segs {
                        mem[s.off..s.off + s.len].copy_from_slice(&data[from..from + s.len]);
                        from += s.len;
                    }
                    self.model[range].fill(id);
                }
                Kind::Read => {
                    let mem = self.mem();
                    for s in &op.segs {
                        mem[s.off..s.off + s.len].fill(0xEE);
                    }
                }
                Kind::Discard => self.model[range].iter_mut().for_each(|m| *m |= DISCARDED),
                Kind::WriteZeroes { .. } => self.model[range].fill(0),
                Kind::Flush => {}
            }
        }
        let iov = |s: &Seg| iovec {
            iov_base: (self.mem + s.off) as *mut _,
            iov_len: s.len,
        };
        let iovs: Vec<Vec<iovec>> = ops
            .iter()
            .map(|op| op.segs.iter().map(iov).collect())
            .collect();
        let what: Vec<String> = ops.iter().map(|o| o.describe(self.first_lba)).collect();
        for (i, (op, iov)) in ops.iter().zip(&iovs).enumerate() {
            let start = (self.first_lba + op.lba) * SECTOR as u64;
            let len = op.sectors * SECTOR as u64;
            let flags = match op.kind {
                Kind::Write { fua: true } => ReqFlags::FUA,
                Kind::WriteZeroes { unmap: false } => ReqFlags::NO_UNMAP,
                _ => ReqFlags::empty(),
            };
            // libblkio keeps a pointer to the iovec array while a request waits in its
            // backlog for ring space: the arrays live until the round is over.
            let (p, n) = (iov.as_ptr(), iov.len() as u32);
            let (base, blen) = iov.first().map_or((std::ptr::null_mut(), 0), |v| {
                (v.iov_base.cast(), v.iov_len)
            });
            // A FUA write is followed by a FLUSH from libblkio.
            self.sent += 1 + u64::from(op.kind == Kind::Write { fua: true });
            match op.kind {
                Kind::Write { .. } if n == 1 => self.q.write(start, base, blen, i, flags),
                Kind::Write { .. } => self.q.writev(start, p, n, i, flags),
                Kind::Read if n == 1 => self.q.read(start, base, blen, i, flags),
                Kind::Read => self.q.readv(start, p, n, i, flags),
                Kind::Discard => self.q.discard(start, len, i, flags),
                Kind::WriteZeroes { .. } => self.q.write_zeroes(start, len, i, flags),
                Kind::Flush => self.q.flush(i, flags),
            }
        }
        let names: Vec<&str> = what.iter().map(String::as_str).collect();
        complete(&mut self.q, &names);
        for (op, w) in ops.iter().zip(&what) {
            if op.kind != Kind::Read {
                continue;
            }
            let mut data = Vec::with_capacity(op.sectors as usize * SECTOR);
            let mem = self.mem();
            for s in &op.segs {
                data.extend_from_slice(&mem[s.off..s.off + s.len]);
            }
            let model = &self.model[op.lba as usize..][..op.sectors as usize];
            if let Some(m) = check_stamped(&data, model, self.first_lba + op.lba) {
                panic!("{w}: {m}");
            }
        }
    }
}

/// A buffer of `len` bytes at a 4 KiB boundary plus `skew` from `cursor` on.
fn place_at(cursor: &mut usize, len: usize, skew: usize) -> Seg {
    let off = cursor.next_multiple_of(4096) + skew;
    *cursor = off + len;
    assert!(*cursor <= QUEUE_MEM, "buffers past QUEUE_MEM");
    Seg { off, len }
}

/// Disjoint sector ranges within one round.
struct Alloc {
    sectors: u64,
    used: Vec<(u64, u64)>,
}

impl Alloc {
    fn try_put(&mut self, lba: u64, n: u64) -> bool {
        if self.used.iter().any(|&(a, m)| lba < a + m && a < lba + n) {
            return false;
        }
        self.used.push((lba, n));
        true
    }

    /// A random free range of `n` sectors.
    fn take(&mut self, rng: &mut Rng, n: u64) -> u64 {
        for _ in 0..1000 {
            let lba = rng.below(self.sectors - n);
            if self.try_put(lba, n) {
                return lba;
            }
        }
        panic!("no free range of {n} sectors");
    }
}

/// The image file on the host must be what the model says.
fn compare_image(image: &Path, model: &[u32]) {
    let mut f = fs::File::open(image).unwrap();
    assert_eq!(f.metadata().unwrap().len(), DISK_BYTES as u64);
    let mut buf = vec![0u8; 8 * MIB];
    for (i, m) in model.chunks(buf.len() / SECTOR).enumerate() {
        f.read_exact(&mut buf).unwrap();
        let lba = (i * buf.len() / SECTOR) as u64;
        if let Some(m) = check_stamped(&buf, m, lba) {
            panic!("the image file {}: {m}", image.display());
        }
    }
}

/// Connection `nth` (1-based) ended with queue i having completed `sent[i]` requests, none
/// rejected or failed, and the daemon logged no warning or error.
fn check_daemon(d: &Daemon, nth: usize, sent: &[u64]) {
    let want: Vec<_> = (0..sent.len())
        .filter(|&q| sent[q] > 0)
        .map(|q| (q, sent[q], 0, 0))
        .collect();
    let got = d.queue_summary(nth, want.len());
    assert_eq!(got, want, "(queue, completed, rejected, failed)");
    assert_eq!(d.warnings(), Vec::<String>::new(), "the daemon's warnings");
}

#[test]
fn read_only() {
    let dir = temp_dir("libblkio-ro-");
    let image = dir.path().join("ro.img");
    let mut data = vec![0u8; 8 * MIB];
    stamp(&mut data, 7, 0);
    data.resize(64 * MIB, 0);
    fs::write(&image, &data).unwrap();
    let sock = dir.path().join("vblk.sock");
    let export = Export::new(&image, 1).read_only();
    let log = dir.path().join("vblk.log");
    let daemon = Daemon::start(Backend::Vblk, "vblk serve", &export, &sock, &log);
    let guard = ShowLogOnPanic(&daemon);
    let flush_ret = within(TEST_LIMIT, "read-only", move || {
        // Without `read-only`, libblkio refuses a device that offers VIRTIO_BLK_F_RO.
        let e = attach(&sock, false)
            .start()
            .err()
            .expect("libblkio started read-write on a read-only device");
        assert_eq!(
            (e.errno(), e.message()),
            (Errno::ROFS, "Device is read-only")
        );

        let mut b = attach(&sock, true);
        let mut q = b.start().unwrap().queues.remove(0);
        let r = b.alloc_mem_region(8 * MIB).unwrap();
        b.map_mem_region(&r).unwrap();
        let p = r.addr as *mut u8;
        q.read(0, p, 8 * MIB, 0, ReqFlags::empty());
        complete(&mut q, &["read 8 MiB"]);
        // SAFETY: libblkio maps the region read-write until `b` and `q` are dropped, and no
        // request is in flight while the slice lives.
        let got = unsafe { region(p, 8 * MIB) };
        assert_eq!(check_stamped(got, &vec![7; 8 * MIB / SECTOR], 0), None);
        let iov = [iovec {
            iov_base: p.cast(),
            iov_len: 4096,
        }];
        q.write(0, p, 4096, 0, ReqFlags::empty());
        q.writev(0, iov.as_ptr(), 1, 1, ReqFlags::empty());
        q.discard(0, 4096, 2, ReqFlags::empty());
        q.write_zeroes(0, 4096, 3, ReqFlags::empty());
        q.write_zeroes(0, 4096, 4, ReqFlags::NO_UNMAP);
        q.flush(5, ReqFlags::empty());
        let names: Vec<_> = "write writev discard write-zeroes write-zeroes,NO_UNMAP flush"
            .split(' ')
            .collect();
        let rets = reap(&mut q, 6, &|i| names[i].to_string());
        for (name, ret) in names.iter().zip(&rets).take(5) {
            let want = (libc::EBADF, "device is read-only".to_string());
            assert_eq!(*ret, want, "{name} on a read-only libblkio");
        }
        rets[5].clone()
    });
    // Only the read and the flush reach the device.
    assert_eq!(flush_ret, (0, String::new()), "FLUSH on a read-only export");
    check_daemon(&daemon, 2, &[2]);
    drop(guard);
    assert!(
        fs::read(&image).unwrap() == data,
        "the read-only image changed"
    );
}
