//! The driver and `vblk info` against a foreign device: qemu-storage-daemon (Debian package
//! qemu-system-common) exporting a raw file as vhost-user-blk. What the driver writes must
//! land in the file byte for byte; what `vblk info` shows must be what the device offers.
//!
//! Every sector the tests write is stamped with the id of its write and its own sector
//! number, and the rest of it follows from those two (see [`stamp`]), so any sector read
//! back, or found in the file, is checked on its own and a misplaced one says where it
//! was meant to go.

mod support;

use support::util::{die_with_parent, stamp, stamp_sector, temp_dir, within, Rng, MAGIC};

use std::collections::HashMap;
use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use driver::{Buffer, Completion, Disk, DiskOptions, ErrorKind, Queue};

const SECTOR: usize = 512;
const MIB: usize = 1 << 20;
/// How long one I/O may take before the test calls it hung (debug build, busy machine).
const IO_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a whole test body may take before the watchdog fails it.
const TEST_LIMIT: Duration = Duration::from_secs(300);

// ---- children ----

/// Where qemu-storage-daemon is, or a failure that names the package to install.
fn qsd_program() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/bin", "/usr/local/bin"].map(PathBuf::from))
        .map(|d| d.join("qemu-storage-daemon"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "qemu-storage-daemon is not installed: this test needs it as the foreign \
                 vhost-user-blk device. Install the Debian package qemu-system-common \
                 (`apt-get install qemu-system-common`; scripts/test does this)"
            )
        })
}

/// A device daemon run as a child; killed and reaped on every way out of the test.
struct Daemon {
    what: &'static str,
    child: Child,
    sock: PathBuf,
    log: PathBuf,
}

impl Daemon {
    fn spawn(what: &'static str, mut cmd: Command, sock: PathBuf, log: PathBuf) -> Daemon {
        let out = fs::File::create(&log).unwrap();
        cmd.stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        die_with_parent(&mut cmd);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
        Daemon {
            what,
            child,
            sock,
            log,
        }
    }

    /// qemu-storage-daemon exporting `image` as a writable vhost-user-blk device with 2
    /// queues on `dir/qsd.sock`; `blockdev_extra` is appended to the --blockdev options.
    fn qsd(dir: &Path, image: &Path, blockdev_extra: &str) -> Daemon {
        let sock = dir.join("qsd.sock");
        let pidfile = dir.join("qsd.pid");
        let mut cmd = Command::new(qsd_program());
        cmd.arg("--blockdev")
            .arg(format!(
                "driver=file,node-name=file0,filename={},cache.direct=off{blockdev_extra}",
                image.display()
            ))
            .arg("--export")
            .arg(format!(
                "type=vhost-user-blk,id=exp0,node-name=file0,addr.type=unix,addr.path={},\
                 num-queues=2,writable=on",
                sock.display()
            ))
            .arg("--pidfile")
            .arg(&pidfile);
        let mut d = Daemon::spawn(
            "qemu-storage-daemon",
            cmd,
            sock.clone(),
            dir.join("qsd.log"),
        );
        // qsd writes its pid file after it has created its exports and before it accepts
        // connections (documented ordering).
        d.wait_until(|| pidfile.exists() && sock.exists());
        d
    }

    /// `vblk serve` on `dir/vblk.sock`.
    fn vblk(dir: &Path, blk_file: &str, num_queues: u16) -> Daemon {
        let sock = dir.join("vblk.sock");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_vblk"));
        cmd.args(["--log-level", "info", "serve", "--socket-path"])
            .arg(&sock)
            .args(["--blk-file", blk_file, "--num-queues"])
            .arg(num_queues.to_string());
        let log = dir.join("vblk.log");
        let mut d = Daemon::spawn("vblk serve", cmd, sock, log.clone());
        d.wait_until(|| {
            fs::read_to_string(&log)
                .unwrap_or_default()
                .contains("listening on")
        });
        d
    }

    fn wait_until(&mut self, ready: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !ready() {
            if let Some(st) = self.child.try_wait().unwrap() {
                panic!(
                    "{} exited ({st}) before it was ready:\n{}",
                    self.what,
                    self.log_text()
                );
            }
            assert!(
                Instant::now() < deadline,
                "{} not ready after 20 s:\n{}",
                self.what,
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Ask the daemon to quit (SIGTERM) and wait for it: everything it wrote is then in the
    /// file.
    fn stop(mut self) -> ExitStatus {
        signal(&self.child, libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            assert!(
                Instant::now() < deadline,
                "{} did not exit within 20 s of SIGTERM:\n{}",
                self.what,
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // Errors here mean it is already gone, which is what we want.
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// Send `sig` to our child.
fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) touches no memory of ours. The pid is that of a child we have not
    // reaped (Daemon reaps only in stop/Drop), so it cannot name another process.
    let r = unsafe { libc::kill(child.id() as i32, sig) };
    assert_eq!(r, 0, "kill: {}", std::io::Error::last_os_error());
}

/// A zero-filled (sparse) raw image of `len` bytes.
fn image(dir: &Path, name: &str, len: usize) -> PathBuf {
    let p = dir.join(name);
    fs::File::create(&p).unwrap().set_len(len as u64).unwrap();
    p
}

fn options(pool_size: usize) -> DiskOptions {
    DiskOptions {
        pool_size,
        ..Default::default()
    }
}

// ---- stamped data ----

/// What a sector holds, in words.
fn describe(s: &[u8]) -> String {
    if s.iter().all(|&b| b == 0) {
        return "zeroes".into();
    }
    if &s[..4] != MAGIC {
        return format!("unstamped bytes {:02x?}...", &s[..16]);
    }
    let id = u32::from_le_bytes(s[4..8].try_into().unwrap());
    let lba = u64::from_le_bytes(s[8..16].try_into().unwrap());
    let mut want = [0u8; SECTOR];
    stamp_sector(&mut want, id, lba);
    if want[..] == *s {
        format!("write #{id}'s data for sector {lba}")
    } else {
        format!("a corrupt sector (its header says write #{id}, sector {lba}, its body disagrees)")
    }
}

/// None if `got == want`; else where and how they first differ. `lba` is the first sector.
fn mismatch(got: &[u8], want: &[u8], lba: u64) -> Option<String> {
    assert_eq!(got.len(), want.len());
    if got == want {
        return None;
    }
    let (i, (g, w)) = got
        .chunks(SECTOR)
        .zip(want.chunks(SECTOR))
        .enumerate()
        .find(|(_, (g, w))| g != w)?;
    let bad = got
        .chunks(SECTOR)
        .zip(want.chunks(SECTOR))
        .filter(|(g, w)| g != w)
        .count();
    let at = lba + i as u64;
    Some(format!(
        "{bad} sector(s) differ; the first is sector {at} (byte {}): expected {}, found {}",
        at * SECTOR as u64,
        describe(w),
        describe(g)
    ))
}

// ---- I/O helpers ----

fn wait(q: &mut Queue) -> Completion {
    q.wait(Some(IO_TIMEOUT))
        .unwrap_or_else(|e| panic!("queue {}: no completion: {e}", q.index()))
}

fn concat(bufs: &[Buffer]) -> Vec<u8> {
    bufs.iter().flat_map(|b| b.iter().copied()).collect()
}

/// `total` bytes cut into pieces of whole sectors, each at most `max_sectors` long.
fn pieces(rng: &mut Rng, total: usize, max_sectors: u64) -> Vec<usize> {
    let mut left = total / SECTOR;
    let mut v = Vec::new();
    while left > 0 {
        let n = (1 + rng.below(max_sectors)).min(left as u64) as usize;
        v.push(n * SECTOR);
        left -= n;
    }
    v
}

/// Stamped buffers for write `id` at sector `lba`, one per piece.
fn stamped(q: &Queue, sizes: &[usize], id: u32, lba: u64) -> Vec<Buffer> {
    let mut at = lba;
    sizes
        .iter()
        .map(|&n| {
            let mut b = q.alloc(n).unwrap();
            stamp(&mut b, id, at);
            at += (n / SECTOR) as u64;
            b
        })
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    Write,
    Writev,
    Read,
    Readv,
}

#[derive(Debug)]
struct Pending {
    op: Op,
    off: u64,
    len: usize,
    pieces: usize,
    id: u32,
}

/// Random reads and writes, single and vectored, on queue `q` inside `[base, base +
/// model.len())`, in batches of up to 12 I/Os on disjoint ranges (so that each result is
/// determined); every read is compared with the model, every completed write goes into
/// it. Then one large writev with more buffers than the device's seg_max (the driver
/// must split it), read back whole and vectored, and a flush.
fn exercise(q: &mut Queue, base: u64, model: &mut [u8], seed: u64, seg_max: u32) {
    let qi = q.index();
    let mut rng = Rng(seed);
    let id_base = u32::from(qi) * 1_000_000;
    let mut next_id = id_base;
    let mut pending: HashMap<u64, Pending> = HashMap::new();
    let stripe = model.len() as u64;
    let (mut writes, mut reads) = (0u32, 0u32);
    for round in 0..60 {
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        let mut big = false;
        for _ in 0..1 + rng.below(12) {
            let r = rng.below(100);
            let sectors = if r < 70 {
                1 + rng.below(16)
            } else if r < 95 || big {
                17 + rng.below(496)
            } else {
                big = true;
                2048 + rng.below(14 * 1024)
            };
            let len = sectors * SECTOR as u64;
            let Some(rel) = (0..20).find_map(|_| {
                let o = rng.below((stripe - len) / SECTOR as u64 + 1) * SECTOR as u64;
                ranges
                    .iter()
                    .all(|&(a, b)| o + len <= a || b <= o)
                    .then_some(o)
            }) else {
                continue;
            };
            ranges.push((rel, rel + len));
            let op = match rng.below(100) {
                0..40 => Op::Write,
                40..60 => Op::Writev,
                60..85 => Op::Read,
                _ => Op::Readv,
            };
            let sizes = match op {
                Op::Write | Op::Read => vec![len as usize],
                Op::Writev | Op::Readv => pieces(&mut rng, len as usize, sectors.div_ceil(3)),
            };
            let id = next_id;
            next_id += 1;
            let off = base + rel;
            let token = u64::from(id);
            let submitted = match op {
                Op::Write => q.write(off, stamped(q, &sizes, id, off / 512).pop().unwrap(), token),
                Op::Writev => q.writev(off, stamped(q, &sizes, id, off / 512), token),
                Op::Read => q.read(off, q.alloc(sizes[0]).unwrap(), token),
                Op::Readv => {
                    let bufs = sizes.iter().map(|&n| q.alloc(n).unwrap()).collect();
                    q.readv(off, bufs, token)
                }
            };
            submitted.unwrap_or_else(|e| panic!("queue {qi}: {op:?} {off} + {len}: {e}"));
            pending.insert(
                token,
                Pending {
                    op,
                    off,
                    len: len as usize,
                    pieces: sizes.len(),
                    id,
                },
            );
        }
        while q.in_flight() > 0 {
            let c = wait(q);
            let p = pending.remove(&c.token).unwrap_or_else(|| {
                panic!("queue {qi}: token {} unknown or completed twice", c.token)
            });
            if let Err(e) = c.result {
                panic!("queue {qi}, round {round}: {p:?} failed: {e}");
            }
            let bufs = c.bufs.into_vec();
            assert_eq!(bufs.len(), p.pieces, "queue {qi}: {p:?}: buffers came back");
            let rel = (p.off - base) as usize;
            let lba = p.off / SECTOR as u64;
            match p.op {
                Op::Write | Op::Writev => {
                    stamp(&mut model[rel..rel + p.len], p.id, lba);
                    writes += 1;
                }
                Op::Read | Op::Readv => {
                    if let Some(m) = mismatch(&concat(&bufs), &model[rel..rel + p.len], lba) {
                        panic!("queue {qi}, round {round}: {p:?} read back wrong data: {m}");
                    }
                    reads += 1;
                }
            }
        }
        assert!(pending.is_empty());
    }
    assert!(writes > 50 && reads > 50, "{writes} writes, {reads} reads");

    // A large writev: more buffers than seg_max, so it needs several requests.
    let total = 24 * MIB;
    let sizes = pieces(&mut rng, total, 320);
    assert!(
        sizes.len() > seg_max as usize,
        "{} buffers do not exceed seg_max {seg_max}",
        sizes.len()
    );
    let rel = rng.below((stripe - total as u64) / 4096 + 1) * 4096;
    let off = base + rel;
    let lba = off / SECTOR as u64;
    let id = next_id;
    q.writev(off, stamped(q, &sizes, id, lba), 1)
        .unwrap_or_else(|e| panic!("queue {qi}: large writev: {e}"));
    let c = wait(q);
    assert_eq!((c.token, c.result), (1, Ok(())), "queue {qi}: large writev");
    assert_eq!(c.bufs.into_vec().len(), sizes.len());
    assert!(q.poll().is_none(), "one completion for one I/O");
    let rel = rel as usize;
    stamp(&mut model[rel..rel + total], id, lba);
    // Read it back in one buffer and in buffers cut elsewhere.
    q.read(off, q.alloc(total).unwrap(), 2).unwrap();
    let c = wait(q);
    assert_eq!((c.token, c.result), (2, Ok(())));
    if let Some(m) = mismatch(&c.bufs.into_one().unwrap(), &model[rel..rel + total], lba) {
        panic!("queue {qi}: large read: {m}");
    }
    let sizes = pieces(&mut rng, total, 9000);
    let bufs = sizes.iter().map(|&n| q.alloc(n).unwrap()).collect();
    q.readv(off, bufs, 3).unwrap();
    let c = wait(q);
    assert_eq!((c.token, c.result), (3, Ok(())));
    if let Some(m) = mismatch(&concat(&c.bufs.into_vec()), &model[rel..rel + total], lba) {
        panic!("queue {qi}: large readv: {m}");
    }
    q.flush_sync()
        .unwrap_or_else(|e| panic!("queue {qi}: flush: {e}"));
}

/// Every I/O of the test against qsd; returns the model of the whole disk.
fn integrity_io(sock: &Path, capacity: usize) -> Vec<u8> {
    let mut model = vec![0u8; capacity];
    let disk = Disk::attach(sock, &options(256 * MIB)).unwrap();
    let info = disk.info().clone();
    assert_eq!(info.capacity_bytes, capacity as u64);
    assert_eq!(info.num_queues, 2, "qsd exports 2 queues: {info:?}");
    assert!(info.flush, "qsd offers FLUSH");
    let half = capacity / 2;
    let (m0, m1) = model.split_at_mut(half);
    let mut queues = disk.take_queues();
    let mut q1 = queues.pop().unwrap();
    let mut q0 = queues.pop().unwrap();
    std::thread::scope(|s| {
        let t0 = s.spawn(|| exercise(&mut q0, 0, m0, 0x5EED_0001, info.seg_max));
        let t1 = s.spawn(|| exercise(&mut q1, half as u64, m1, 0x5EED_0002, info.seg_max));
        for t in [t0, t1] {
            t.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
        }
    });
    drop((q0, q1));
    drop(disk);

    // Again with a ring of 16 and no indirect descriptors: a request carries at most 14
    // buffers, so one 32 MiB buffer (1 MiB segments) takes 3 requests.
    let opts = DiskOptions {
        queue_size: 16,
        indirect: false,
        ..options(80 * MIB)
    };
    let disk = Disk::attach(sock, &opts).unwrap();
    let mut q = disk.take_queue(1).unwrap();
    assert_eq!(q.size(), 16);
    let per_request = disk.info().size_max as usize * 14;
    let (off, len) = (half - 16 * MIB, 32 * MIB);
    assert!(len > per_request, "{len} fits one request of {per_request}");
    let mut b = q.alloc(len).unwrap();
    let id = 3_000_000;
    stamp(&mut b, id, (off / SECTOR) as u64);
    q.write(off as u64, b, 9).unwrap();
    let c = wait(&mut q);
    assert_eq!((c.token, c.result), (9, Ok(())));
    assert!(q.poll().is_none(), "one completion for one I/O");
    stamp(&mut model[off..off + len], id, (off / SECTOR) as u64);
    let bufs = vec![
        q.alloc(SECTOR).unwrap(),
        q.alloc(3 * MIB + 1536).unwrap(),
        q.alloc(len - 3 * MIB - 2048).unwrap(),
    ];
    q.readv(off as u64, bufs, 10).unwrap();
    let c = wait(&mut q);
    assert_eq!((c.token, c.result), (10, Ok(())));
    if let Some(m) = mismatch(
        &concat(&c.bufs.into_vec()),
        &model[off..off + len],
        (off / SECTOR) as u64,
    ) {
        panic!("32 MiB readv on a ring of 16: {m}");
    }
    q.flush_sync().unwrap();
    model
}

/// The whole file equals the model: what the driver wrote where it wrote it, zeroes
/// elsewhere.
fn assert_file_is(image: &Path, model: &[u8]) {
    let file = fs::read(image).unwrap();
    assert_eq!(file.len(), model.len(), "the image changed size");
    if let Some(m) = mismatch(&file, model, 0) {
        panic!(
            "{} does not hold what the driver wrote: {m}",
            image.display()
        );
    }
    let stamped = model
        .chunks(SECTOR)
        .filter(|s| s.starts_with(MAGIC))
        .count();
    assert!(stamped > 100_000, "only {stamped} sectors were written");
}

#[test]
fn what_the_driver_writes_on_two_queues_is_in_the_file() {
    let dir = temp_dir("qsd");
    let capacity = 128 * MIB;
    let img = image(dir.path(), "disk.img", capacity);
    let qsd = Daemon::qsd(dir.path(), &img, "");
    let sock = qsd.sock.clone();
    let model = within(TEST_LIMIT, "I/O against qemu-storage-daemon", move || {
        integrity_io(&sock, capacity)
    });
    let st = qsd.stop();
    assert!(st.success(), "qemu-storage-daemon exited with {st}");
    assert_file_is(&img, &model);
}

/// `(offset of the first data at or after from, offset of the first hole at or after
/// from)` in the file.
fn data_and_hole(file: &fs::File, from: u64) -> (i64, i64) {
    let seek = |whence| {
        // SAFETY: lseek on a file descriptor we own; it only moves the file offset.
        unsafe { libc::lseek(file.as_raw_fd(), from as libc::off_t, whence) }
    };
    (seek(libc::SEEK_DATA), seek(libc::SEEK_HOLE))
}

#[test]
fn discard_and_write_zeroes_reach_the_file() {
    let dir = temp_dir("qsd");
    let capacity = 64 * MIB;
    let img = image(dir.path(), "disk.img", capacity);
    // discard=unmap: qsd passes discards on to the file (it punches holes), so the test can
    // see in the file which sectors the driver's discard segments named.
    let qsd = Daemon::qsd(dir.path(), &img, ",discard=unmap");
    let sock = qsd.sock.clone();
    let img2 = img.clone();
    let (model, discarded) = within(
        TEST_LIMIT,
        "discard / write-zeroes against qsd",
        move || {
            let img = img2;
            let disk = Disk::attach(&sock, &options(64 * MIB)).unwrap();
            let info = disk.info().clone();
            // qsd offers both on a writable export; the driver must see and negotiate them.
            assert!(info.discard && info.write_zeroes, "{info:?}");
            for f in ["DISCARD", "WRITE_ZEROES"] {
                assert!(info.feature_names.iter().any(|n| n == f), "{f}: {info:?}");
            }
            assert!(info.max_discard_sectors > 0 && info.max_write_zeroes_sectors > 0);
            let mut q = disk.take_queue(0).unwrap();
            let mut model = vec![0u8; capacity];
            // Data everywhere but the last 4 MiB.
            for (i, chunk) in model[..60 * MIB].chunks_mut(4 * MIB).enumerate() {
                let lba = (i * 4 * MIB / SECTOR) as u64;
                stamp(chunk, i as u32, lba);
                q.write_at(lba * SECTOR as u64, chunk).unwrap();
            }
            q.flush_sync().unwrap();
            let blocks_before = fs::metadata(&img).unwrap().blocks();

            // Write zeroes over more than two of the device's largest segments, at an odd
            // sector: three requests, one completion.
            let max_wz = u64::from(info.max_write_zeroes_sectors) * SECTOR as u64;
            let (wz_off, wz_len) = (3 * SECTOR as u64, 2 * max_wz + 7 * SECTOR as u64);
            assert!(
                wz_off + wz_len < 34 * MIB as u64,
                "max_write_zeroes_sectors {} is larger than this test expects",
                info.max_write_zeroes_sectors
            );
            q.write_zeroes(wz_off, wz_len, false, 1).unwrap();
            let c = wait(&mut q);
            assert_eq!((c.token, c.result), (1, Ok(())));
            assert!(q.poll().is_none(), "one completion for one write-zeroes");
            model[wz_off as usize..(wz_off + wz_len) as usize].fill(0);
            // And with unmap asked for (the driver drops the flag unless the device allows it).
            q.write_zeroes_sync(34 * MIB as u64, MIB as u64, true)
                .unwrap();
            model[34 * MIB..35 * MIB].fill(0);

            // Discard more than one largest segment: two requests.
            let max_d = u64::from(info.max_discard_sectors) * SECTOR as u64;
            let d_off = 36 * MIB as u64;
            let d_len = (max_d + MIB as u64).min(20 * MIB as u64);
            q.discard(d_off, d_len, 2).unwrap();
            let c = wait(&mut q);
            assert_eq!((c.token, c.result), (2, Ok(())));
            assert!(q.poll().is_none(), "one completion for one discard");
            q.flush_sync().unwrap();

            // The driver refuses bad ranges before sending anything.
            let e = q.discard(capacity as u64 - 4096, 8192, 3).unwrap_err();
            assert_eq!(e.error.kind(), ErrorKind::OutOfRange, "{}", e.error);
            let e = q.write_zeroes(100, 512, false, 4).unwrap_err();
            assert_eq!(e.error.kind(), ErrorKind::InvalidInput, "{}", e.error);
            assert_eq!(q.in_flight(), 0);

            // Read everything back: zeroes where zeroes were written; a discarded sector reads
            // as zeroes or as what it held (a discard is a hint); the rest unchanged.
            let mut got = vec![0u8; capacity];
            for (i, chunk) in got.chunks_mut(8 * MIB).enumerate() {
                q.read_at((i * 8 * MIB) as u64, chunk).unwrap();
            }
            let d = d_off as usize..(d_off + d_len) as usize;
            for (i, (g, w)) in got.chunks(SECTOR).zip(model.chunks(SECTOR)).enumerate() {
                let in_discard = d.contains(&(i * SECTOR));
                let zero = g.iter().all(|&b| b == 0);
                assert!(
                    g == w || (in_discard && zero),
                    "sector {i}: expected {}{}, read {}",
                    describe(w),
                    if in_discard { " or zeroes" } else { "" },
                    describe(g)
                );
            }
            // The discards reached the file: its blocks there were freed.
            let blocks_after = fs::metadata(&img).unwrap().blocks();
            let freed = (blocks_before.saturating_sub(blocks_after) * 512) as usize;
            assert!(
                freed >= d_len as usize - MIB,
                "discarding {d_len} bytes freed only {freed} bytes of the image"
            );
            drop(q);
            drop(disk);
            (model, d)
        },
    );
    let st = qsd.stop();
    assert!(st.success(), "qemu-storage-daemon exited with {st}");
    // In the file: the discarded range is a hole, exactly, and reads as zeroes; everything
    // else is what was written.
    let f = fs::File::open(&img).unwrap();
    let (data, _) = data_and_hole(&f, discarded.start as u64);
    assert!(
        data >= discarded.end as i64,
        "data at {data} inside the discarded range {discarded:?}"
    );
    let (_, hole) = data_and_hole(&f, discarded.start as u64 - 4096);
    assert_eq!(
        hole, discarded.start as i64,
        "the hole should start where the discard did"
    );
    let mut model = model;
    model[discarded].fill(0);
    assert_file_is_exactly(&img, &model);
}

fn assert_file_is_exactly(image: &Path, model: &[u8]) {
    let file = fs::read(image).unwrap();
    assert_eq!(file.len(), model.len(), "the image changed size");
    if let Some(m) = mismatch(&file, model, 0) {
        panic!("{}: {m}", image.display());
    }
}

/// `vblk info --json` against `sock`.
fn vblk_info(sock: &Path, json: bool) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vblk"));
    cmd.args(["--log-level", "error", "info", "--socket"])
        .arg(sock);
    if json {
        cmd.arg("--json");
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "vblk info --socket {} failed ({}): {}",
        sock.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// What `vblk info` shows for `sock`, checked against what the driver reports in-process.
fn info_both_ways(sock: PathBuf) -> driver::DiskInfo {
    within(Duration::from_secs(60), "vblk info", move || {
        let json: serde_json::Value = serde_json::from_str(&vblk_info(&sock, true)).unwrap();
        let text = vblk_info(&sock, false);
        let disk = Disk::attach(&sock, &DiskOptions::default()).unwrap();
        let info = disk.info().clone();
        drop(disk);
        assert_eq!(
            json,
            serde_json::to_value(&info).unwrap(),
            "vblk info --json and the driver disagree about {}",
            sock.display()
        );
        let capacity = format!(
            "capacity               {} bytes ({} sectors of 512)",
            info.capacity_bytes, info.capacity_sectors
        );
        let queues = format!(
            "queues                 {} offered, {} attached",
            info.device_queues, info.num_queues
        );
        for line in [&capacity, &queues] {
            assert!(
                text.contains(line.as_str()),
                "{line:?} missing from:\n{text}"
            );
        }
        for f in &info.feature_names {
            assert!(text.contains(f.as_str()), "{f} missing from:\n{text}");
        }
        info
    })
}

fn has(info: &driver::DiskInfo, names: &[&str]) {
    for n in names {
        assert!(
            info.feature_names.iter().any(|f| f == n),
            "{} does not offer {n}: {:?}",
            info.socket,
            info.feature_names
        );
    }
}

#[test]
fn vblk_info_shows_what_qsd_and_vblk_serve_offer() {
    let dir = temp_dir("qsd");
    let capacity = 48 * MIB;
    let qsd_img = image(dir.path(), "qsd.img", capacity);
    let vblk_img = image(dir.path(), "vblk.img", capacity);
    let qsd = Daemon::qsd(dir.path(), &qsd_img, "");
    let vblk = Daemon::vblk(dir.path(), vblk_img.to_str().unwrap(), 3);

    let q = info_both_ways(qsd.sock.clone());
    let v = info_both_ways(vblk.sock.clone());
    assert_eq!(q.capacity_bytes, capacity as u64);
    assert_eq!(
        v.capacity_bytes, q.capacity_bytes,
        "same size, same capacity"
    );
    assert_eq!((q.logical_block_size, v.logical_block_size), (512, 512));

    // qemu-storage-daemon: 2 queues as exported, writable, the usual libvhost-user set.
    assert_eq!((q.device_queues, q.num_queues), (2, 2));
    assert!(
        !q.read_only && q.flush && q.discard && q.write_zeroes,
        "{q:?}"
    );
    has(
        &q,
        &[
            "SEG_MAX",
            "BLK_SIZE",
            "FLUSH",
            "TOPOLOGY",
            "CONFIG_WCE",
            "MQ",
            "DISCARD",
            "WRITE_ZEROES",
            "RING_INDIRECT_DESC",
            "RING_EVENT_IDX",
            "VERSION_1",
        ],
    );
    assert!(q.seg_max > 0 && q.indirect && q.event_idx);
    assert_eq!(q.serial, "vhost_user_blk", "qsd's GET_ID answer");

    // vblk serve: what it was asked for, DISCARD / WRITE_ZEROES / FLUSH, serial = file name.
    // The driver sets up one queue per CPU, at most what the device offers.
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u16;
    assert_eq!((v.device_queues, v.num_queues), (3, 3.min(cpus)));
    assert!(
        !v.read_only && v.flush && v.discard && v.write_zeroes,
        "{v:?}"
    );
    has(
        &v,
        &[
            "FLUSH",
            "DISCARD",
            "WRITE_ZEROES",
            "MQ",
            "SEG_MAX",
            "VERSION_1",
        ],
    );
    assert_eq!(v.serial, "vblk.img");

    // Each lists the features its device offers, and only those.
    assert_eq!(
        q.feature_names,
        driver::disk::feature_names(q.device_features)
    );
    assert_eq!(
        v.feature_names,
        driver::disk::feature_names(v.device_features)
    );
    drop(vblk);
    let st = qsd.stop();
    assert!(st.success(), "qemu-storage-daemon exited with {st}");
}

/// `vblk bench --compare path=...` runs every I/O path against qemu-storage-daemon and
/// `vblk serve`, with every block it writes verified when read back: the paths that
/// merge, reorder or pass raw commands through (request, passthru, auto) work on a device
/// that is not ours.
#[test]
fn every_io_path_verifies_against_qsd_and_vblk_serve() {
    within(TEST_LIMIT, "every path against both devices", || {
        let dir = temp_dir("qsd");
        let img = image(dir.path(), "qsd.img", 32 * MIB);
        let qsd = Daemon::qsd(dir.path(), &img, "");
        let img2 = image(dir.path(), "vblk.img", 32 * MIB);
        let vblk = Daemon::vblk(dir.path(), img2.to_str().unwrap(), 2);
        for d in [&qsd, &vblk] {
            let out = Command::new(env!("CARGO_BIN_EXE_vblk"))
                .args(["bench", "--socket"])
                .arg(&d.sock)
                .args([
                    "--rw=randrw",
                    "--bs=4k",
                    "--iodepth=8",
                    "--size=16m",
                    "--runtime=400ms",
                    "--time_based",
                    "--verify=crc32c",
                    "--compare",
                    "path=bio,batch,request,passthru,auto",
                ])
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "{}: {text}\n{}",
                d.what,
                String::from_utf8_lossy(&out.stderr)
            );
            for p in ["bio", "batch", "request", "passthru", "auto"] {
                let row = text
                    .lines()
                    .find(|l| l.starts_with(&format!("path={p} ")))
                    .unwrap_or_else(|| panic!("{}: no row for {p}:\n{text}", d.what));
                let iops: f64 = row
                    .split_whitespace()
                    .nth(1)
                    .unwrap()
                    .trim_end_matches(['k', 'M'])
                    .parse()
                    .unwrap();
                assert!(iops > 0.0, "{}: {row}", d.what);
            }
        }
        assert!(qsd.stop().success());
        assert!(vblk.stop().success());
    });
}
