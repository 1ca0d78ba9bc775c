//! End-to-end test: a real Linux guest (QEMU, TCG) uses disks served by
//! `vblk serve` over vhost-user-blk.
//!
//! Daemons (child processes, killed on every exit path):
//! - rw: a 64 MiB raw image, 2 queues, 2 workers (`/dev/vda`);
//! - ro: an 8 MiB raw image, `--read-only --cache none --engine sync` (`/dev/vdb`);
//! - mem: `mem:16M`, 2 queues, no polling (`/dev/vdc`, second boot only).
//!
//! Boot 1: size, hardware queues, negotiated features, serial; data placed by
//! the host before boot; O_DIRECT writes (512 B, 64 KiB, 1 MiB requests, the
//! last block, 8 concurrent writers on both queues) read back; discard and
//! write-zeroes; sync, flushbufs and fsync with a FLUSH counted by the guest;
//! the read-only disk refuses writes; ext4 mkfs, mount, copy, compare, umount,
//! fsck. The host then compares the image bytes and reads the copied file back
//! with debugfs.
//!
//! Boot 2: a new QEMU reconnects to the SAME rw and ro daemon processes, finds
//! the file system and raw data intact, writes again; the RAM disk gets raw
//! I/O and a file system.
//!
//! The guest kernel itself refuses writes to a read-only virtio-blk disk, so
//! the daemon's own refusal is not reachable from here; the host checks that
//! the image is unchanged.
//!
//! `VBLK_GUEST_BACKEND=qemu-storage-daemon` runs the same checks against
//! qemu-storage-daemon (the reference backend), to validate the test itself;
//! `VBLK_GUEST_VERBOSE=1` prints the serial logs of passing boots;
//! `VBLK_GUEST_TIMEOUT_SECS` overrides the per-boot limit (300 s).
//! Needs (Debian): qemu-system-x86, qemu-system-common, linux-image-amd64,
//! busybox-static, e2fsprogs, util-linux, xz-utils.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use support::assets::{find_program, require_programs};
use support::daemon::{Backend, Daemon, Export};
use support::guest::{first_difference, pattern, read_at, write_at, Guest, TempDir};

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

/// The writable disk (vda): ext4 lives in the first 32 MiB, raw regions above.
const RW_SIZE: u64 = 64 * MIB;
const FS_SIZE: u64 = 32 * MIB;
/// Written by the host before boot 1, read by the guest.
const HOST_OFF: u64 = 40 * MIB;
/// Written by the guest with O_DIRECT in boot 1, checked by the host and boot 2.
const GUEST_OFF: u64 = 44 * MIB;
/// Filled then discarded by the guest.
const DISCARD_OFF: u64 = 48 * MIB;
/// Filled by the host, zeroed by the guest (`blkdiscard -z`).
const ZERO_OFF: u64 = 52 * MIB;
/// 64 KiB written with `conv=fsync` (a FLUSH).
const FLUSH_OFF: u64 = 56 * MIB;
/// Eight 512-byte O_DIRECT writes.
const SMALL_OFF: u64 = 57 * MIB;
/// 2 MiB written by 8 concurrent O_DIRECT writers, 4 pinned on each CPU
/// (so on each queue), 256 KiB each.
const PAR_OFF: u64 = 58 * MIB;
const PAR_WRITERS: usize = 8;
/// Written by the guest in boot 2.
const GUEST2_OFF: u64 = 60 * MIB;
/// The last 64 KiB of the disk.
const TAIL_OFF: u64 = RW_SIZE - 64 * KIB;
const REGION: usize = MIB as usize;

/// The read-only disk (vdb).
const RO_SIZE: u64 = 8 * MIB;
/// The RAM disk (vdc, boot 2 only), given to `mem:` in bytes.
const MEM_SIZE: u64 = 16 * MIB;

const NUM_QUEUES: u16 = 2;
const SERIAL_RW: &str = "vblk-guest-rw";

/// The data of the test, generated deterministically.
struct Data {
    host: Vec<u8>,
    guest: Vec<u8>,
    zero_fill: Vec<u8>,
    flush: Vec<u8>,
    small: Vec<u8>,
    par: Vec<u8>,
    /// Written with 1 MiB O_DIRECT requests (before mkfs overwrites it).
    big: Vec<u8>,
    guest2: Vec<u8>,
    tail: Vec<u8>,
    ro: Vec<u8>,
    /// Copied into ext4; not a multiple of the block size on purpose.
    file: Vec<u8>,
    file2: Vec<u8>,
}

impl Data {
    fn new() -> Data {
        Data {
            host: pattern(1, REGION),
            guest: pattern(2, REGION),
            zero_fill: pattern(3, REGION),
            flush: pattern(4, 64 * KIB as usize),
            small: pattern(5, 4 * KIB as usize),
            par: pattern(6, 2 * REGION),
            big: pattern(7, 4 * REGION),
            guest2: pattern(8, REGION),
            tail: pattern(9, 64 * KIB as usize),
            ro: pattern(10, RO_SIZE as usize),
            file: pattern(11, 3 * REGION + 1234),
            file2: pattern(12, 200 * KIB as usize + 7),
        }
    }
}

/// Replaces `@NAME@` placeholders (shell keeps its own `$` and braces).
fn fill(template: &str, vars: &[(&str, String)]) -> String {
    let mut s = template.to_string();
    for (k, v) in vars {
        s = s.replace(&format!("@{k}@"), v);
    }
    let unfilled = s.split('@').skip(1).step_by(2).find(|w| {
        !w.is_empty()
            && w.chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
    });
    assert!(
        unfilled.is_none(),
        "unfilled placeholder @{}@ in:\n{s}",
        unfilled.unwrap_or_default()
    );
    s
}

fn vars(backend: Backend) -> Vec<(&'static str, String)> {
    let blk = |off: u64| (off / (64 * KIB)).to_string();
    vec![
        ("RW_SIZE", RW_SIZE.to_string()),
        ("RO_SIZE", RO_SIZE.to_string()),
        ("MEM_SIZE", MEM_SIZE.to_string()),
        ("FS_SIZE_K", (FS_SIZE / KIB).to_string()),
        ("QUEUES", NUM_QUEUES.to_string()),
        ("HOST_BLK", blk(HOST_OFF)),
        ("GUEST_BLK", blk(GUEST_OFF)),
        ("DISCARD_OFF", DISCARD_OFF.to_string()),
        ("DISCARD_BLK", blk(DISCARD_OFF)),
        ("ZERO_OFF", ZERO_OFF.to_string()),
        ("ZERO_BLK", blk(ZERO_OFF)),
        ("FLUSH_BLK", blk(FLUSH_OFF)),
        ("SMALL_SECTOR", (SMALL_OFF / 512).to_string()),
        ("PAR_4K", (PAR_OFF / (4 * KIB)).to_string()),
        ("PAR_WRITERS", PAR_WRITERS.to_string()),
        ("GUEST2_BLK", blk(GUEST2_OFF)),
        ("TAIL_BLK", blk(TAIL_OFF)),
        ("SERIAL_RW", SERIAL_RW.to_string()),
        (
            "CHECK_SERIAL",
            if backend == Backend::Vblk { "1" } else { "0" }.to_string(),
        ),
    ]
}

/// Boot 1: everything but reconnection.
const SCRIPT_1: &str = r#"
# --- geometry and features -------------------------------------------------
check_eq rw-size "$(( $(cat /sys/block/vda/size) * 512 ))" @RW_SIZE@
check_eq rw-hw-queues "$(ls /sys/block/vda/mq | wc -l)" @QUEUES@
check_eq rw-ro-flag "$(cat /sys/block/vda/ro)" 0
check_eq rw-feature-mq "$(feature_bit vda 12)" 1
check_eq rw-feature-flush "$(feature_bit vda 9)" 1
check_eq rw-feature-discard "$(feature_bit vda 13)" 1
check_eq rw-feature-write-zeroes "$(feature_bit vda 14)" 1
check_gt rw-discard-max-bytes "$(cat /sys/block/vda/queue/discard_max_bytes)" 0
check_gt rw-write-zeroes-max-bytes "$(cat /sys/block/vda/queue/write_zeroes_max_bytes)" 0
check_eq ro-size "$(( $(cat /sys/block/vdb/size) * 512 ))" @RO_SIZE@
check_eq ro-ro-flag "$(cat /sys/block/vdb/ro)" 1
check_eq ro-feature-ro "$(feature_bit vdb 5)" 1
if [ @CHECK_SERIAL@ = 1 ]; then
    check_eq rw-serial "$(cat /sys/block/vda/serial)" @SERIAL_RW@
fi
echo "features vda=$(cat /sys/block/vda/device/features) vdb=$(cat /sys/block/vdb/device/features)"

# --- data placed by the host ------------------------------------------------
check host-data-read dd if=/dev/vda of=/tmp/host.rd bs=64k skip=@HOST_BLK@ count=16 iflag=direct
check host-data-match cmp /tmp/host.rd /vblk/host.bin

# --- O_DIRECT writes, read back ---------------------------------------------
check direct-write dd if=/vblk/guest.bin of=/dev/vda bs=64k seek=@GUEST_BLK@ count=16 oflag=direct conv=notrunc
check direct-read dd if=/dev/vda of=/tmp/guest.rd bs=64k skip=@GUEST_BLK@ count=16 iflag=direct
check direct-match cmp /tmp/guest.rd /vblk/guest.bin
check small-write dd if=/vblk/small.bin of=/dev/vda bs=512 seek=@SMALL_SECTOR@ count=8 oflag=direct conv=notrunc
check small-read dd if=/dev/vda of=/tmp/small.rd bs=512 skip=@SMALL_SECTOR@ count=8 iflag=direct
check small-match cmp /tmp/small.rd /vblk/small.bin
check tail-write dd if=/vblk/tail.bin of=/dev/vda bs=64k seek=@TAIL_BLK@ count=1 oflag=direct conv=notrunc
check tail-read dd if=/dev/vda of=/tmp/tail.rd bs=64k skip=@TAIL_BLK@ count=1 iflag=direct
check tail-match cmp /tmp/tail.rd /vblk/tail.bin

# --- large requests (1 MiB, long descriptor chains), before mkfs -------------
check big-write dd if=/vblk/big.bin of=/dev/vda bs=1M count=4 oflag=direct conv=notrunc
check big-read dd if=/dev/vda of=/tmp/big.rd bs=1M count=4 iflag=direct
check big-match cmp /tmp/big.rd /vblk/big.bin
rm -f /tmp/big.rd

# --- both queues at once, several requests in flight -------------------------
# Writer k writes 256 KiB slice k, pinned on CPU k % 2 (so on queue k % 2).
# Each virtqueue has its own MSI-X vector; count completions per queue.
vq_irqs() {
    awk -v n="$(basename "$(readlink /sys/block/vda/device)")-req.$1" \
        '$NF == n { s = 0; for (i = 2; i <= NF; i++) if ($i ~ /^[0-9]+$/) s += $i; print s }' /proc/interrupts
}
i0=$(vq_irqs 0); i1=$(vq_irqs 1)
pids=""
k=0
while [ $k -lt @PAR_WRITERS@ ]; do
    taskset $((1 << (k % 2))) dd if=/vblk/par.bin of=/dev/vda bs=4k skip=$((k * 64)) \
        seek=$((@PAR_4K@ + k * 64)) count=64 oflag=direct conv=notrunc 2>/tmp/par$k.err &
    pids="$pids $!"
    k=$((k + 1))
done
rcs=""
for p in $pids; do wait $p; rcs="$rcs $?"; done
check_eq parallel-writes "$rcs" "$(for p in $pids; do printf ' 0'; done)"
check_gt queue0-interrupts "$(( $(vq_irqs 0) - ${i0:-0} ))" 0
check_gt queue1-interrupts "$(( $(vq_irqs 1) - ${i1:-0} ))" 0
check par-read dd if=/dev/vda of=/tmp/par.rd bs=4k skip=@PAR_4K@ count=$((@PAR_WRITERS@ * 64)) iflag=direct
check par-match cmp /tmp/par.rd /vblk/par.bin
grep -- -req /proc/interrupts

# --- discard and write-zeroes -----------------------------------------------
check discard-fill dd if=/vblk/guest.bin of=/dev/vda bs=64k seek=@DISCARD_BLK@ count=16 oflag=direct conv=notrunc
d0=$(awk '{ print $12 }' /sys/block/vda/stat)
check discard $BLKDISCARD -o @DISCARD_OFF@ -l 1048576 /dev/vda
d1=$(awk '{ print $12 }' /sys/block/vda/stat)
check_gt discard-requests "$((d1 - d0))" 0
check zeroout $BLKDISCARD -z -o @ZERO_OFF@ -l 1048576 /dev/vda
check zeroout-read dd if=/dev/vda of=/tmp/zero.rd bs=64k skip=@ZERO_BLK@ count=16 iflag=direct
dd if=/dev/zero of=/tmp/zeros bs=64k count=16 2>/dev/null
check zeroout-is-zero cmp /tmp/zero.rd /tmp/zeros
# The kernel stops using WRITE_ZEROES after the device refused one.
check_gt write-zeroes-still-on "$(cat /sys/block/vda/queue/write_zeroes_max_bytes)" 0

# --- flush ------------------------------------------------------------------
wc=$(cat /sys/block/vda/queue/write_cache)
echo "vda write cache as negotiated: $wc (CONFIG_WCE=$(feature_bit vda 11))"
# The guest only sends FLUSH to a write-back cache: if the device reports
# write-through, switch it to write-back (virtio-blk config write of `wce`).
if [ "$wc" != "write back" ]; then
    check set-cache-write-back sh -c 'echo "write back" > /sys/block/vda/cache_type'
    check_eq write-cache-enabled "$(cat /sys/block/vda/queue/write_cache)" "write back"
fi
f0=$(awk '{ print $16 }' /sys/block/vda/stat)
check sync sync
check flushbufs blockdev --flushbufs /dev/vda
check fsync-write dd if=/vblk/flush.bin of=/dev/vda bs=64k seek=@FLUSH_BLK@ count=1 conv=notrunc,fsync
f1=$(awk '{ print $16 }' /sys/block/vda/stat)
check_gt flush-requests "$((f1 - f0))" 0

# --- read-only disk -----------------------------------------------------------
check ro-read dd if=/dev/vdb of=/tmp/ro.rd bs=64k count=16 iflag=direct
check ro-data-match cmp /tmp/ro.rd /vblk/ro-head.bin
check_fails ro-write-direct dd if=/vblk/guest.bin of=/dev/vdb bs=64k count=1 oflag=direct conv=notrunc
check_fails ro-write-fsync dd if=/vblk/guest.bin of=/dev/vdb bs=64k seek=2 count=1 conv=notrunc,fsync
check_fails ro-zeroout $BLKDISCARD -z -o 0 -l 65536 /dev/vdb
check_fails ro-discard $BLKDISCARD -o 65536 -l 65536 /dev/vdb
check ro-read-again dd if=/dev/vdb of=/tmp/ro.rd bs=64k count=16 iflag=direct
check ro-data-unchanged cmp /tmp/ro.rd /vblk/ro-head.bin

# --- ext4 in the first @FS_SIZE_K@ KiB ----------------------------------------------
check mkfs $MKE2FS -t ext4 -F -q /dev/vda @FS_SIZE_K@k
check mount mount -t ext4 /dev/vda /mnt
check copy cp /vblk/file.bin /mnt/file.bin
check copy-match cmp /mnt/file.bin /vblk/file.bin
check fs-sync sync
check umount umount /mnt
check fsck $E2FSCK -f -n /dev/vda
check remount mount -t ext4 -o ro /dev/vda /mnt
check file-match-after-remount cmp /mnt/file.bin /vblk/file.bin
check umount-2 umount /mnt

check_eq vda-io-errors "$(dmesg | grep -c -i -E 'error.*dev vda|vda.*error|buffer i/o')" 0
dmesg | grep -i -E 'dev vd|vd[ab]' | tail -n 20
"#;

/// Boot 2: the same daemons, reconnected.
const SCRIPT_2: &str = r#"
check_eq rw-size "$(( $(cat /sys/block/vda/size) * 512 ))" @RW_SIZE@
check_eq rw-hw-queues "$(ls /sys/block/vda/mq | wc -l)" @QUEUES@
check_eq ro-ro-flag "$(cat /sys/block/vdb/ro)" 1
check mount mount -t ext4 /dev/vda /mnt
check file-intact cmp /mnt/file.bin /vblk/file.bin
check copy-2 cp /vblk/file2.bin /mnt/file2.bin
check fs-sync sync
check umount umount /mnt
check fsck $E2FSCK -f -n /dev/vda
check direct-read dd if=/dev/vda of=/tmp/guest.rd bs=64k skip=@GUEST_BLK@ count=16 iflag=direct
check direct-intact cmp /tmp/guest.rd /vblk/guest.bin
check direct-write-2 dd if=/vblk/guest2.bin of=/dev/vda bs=64k seek=@GUEST2_BLK@ count=16 oflag=direct conv=notrunc
check direct-read-2 dd if=/dev/vda of=/tmp/guest2.rd bs=64k skip=@GUEST2_BLK@ count=16 iflag=direct
check direct-match-2 cmp /tmp/guest2.rd /vblk/guest2.bin
check ro-read dd if=/dev/vdb of=/tmp/ro.rd bs=64k count=16 iflag=direct
check ro-data-match cmp /tmp/ro.rd /vblk/ro-head.bin

# --- the RAM disk -------------------------------------------------------------
check_eq mem-size "$(( $(cat /sys/block/vdc/size) * 512 ))" @MEM_SIZE@
check_eq mem-hw-queues "$(ls /sys/block/vdc/mq | wc -l)" @QUEUES@
check mem-write dd if=/vblk/guest2.bin of=/dev/vdc bs=64k seek=1 count=16 oflag=direct conv=notrunc
check mem-read dd if=/dev/vdc of=/tmp/mem.rd bs=64k skip=1 count=16 iflag=direct
check mem-match cmp /tmp/mem.rd /vblk/guest2.bin
check mem-zeroout $BLKDISCARD -z -o 65536 -l 1048576 /dev/vdc
check mem-zeroout-read dd if=/dev/vdc of=/tmp/mem.rd bs=64k skip=1 count=16 iflag=direct
dd if=/dev/zero of=/tmp/zeros bs=64k count=16 2>/dev/null
check mem-zeroout-is-zero cmp /tmp/mem.rd /tmp/zeros
check mem-mkfs $MKE2FS -t ext4 -F -q /dev/vdc
check mem-mount mount -t ext4 /dev/vdc /mnt
check mem-copy cp /vblk/file.bin /mnt/file.bin
check mem-umount umount /mnt
check mem-fsck $E2FSCK -f -n /dev/vdc
check mem-remount mount -t ext4 -o ro /dev/vdc /mnt
check mem-file-match cmp /mnt/file.bin /vblk/file.bin
check mem-umount-2 umount /mnt

check_eq io-errors "$(dmesg | grep -c -i -E 'error.*dev vd|vd[a-z].*error|buffer i/o')" 0
"#;

const CHECKS_1: &[&str] = &[
    "guest-disks",
    "rw-size",
    "rw-hw-queues",
    "rw-feature-flush",
    "rw-feature-discard",
    "rw-feature-write-zeroes",
    "rw-write-zeroes-max-bytes",
    "ro-size",
    "ro-ro-flag",
    "ro-feature-ro",
    "host-data-match",
    "direct-match",
    "small-match",
    "tail-match",
    "parallel-writes",
    "big-match",
    "par-match",
    "queue0-interrupts",
    "queue1-interrupts",
    "discard",
    "discard-requests",
    "zeroout",
    "zeroout-is-zero",
    "sync",
    "flushbufs",
    "fsync-write",
    "flush-requests",
    "ro-data-match",
    "ro-write-direct",
    "ro-zeroout",
    "ro-data-unchanged",
    "mkfs",
    "mount",
    "copy-match",
    "umount",
    "fsck",
    "file-match-after-remount",
    "vda-io-errors",
];

const CHECKS_2: &[&str] = &[
    "guest-disks",
    "rw-size",
    "rw-hw-queues",
    "mount",
    "file-intact",
    "copy-2",
    "umount",
    "fsck",
    "direct-intact",
    "direct-match-2",
    "ro-data-match",
    "mem-size",
    "mem-match",
    "mem-zeroout-is-zero",
    "mem-fsck",
    "mem-file-match",
    "io-errors",
];

/// `VBLK_GUEST_VERBOSE=1`: print the full boot reports (serial logs) even
/// when the test passes (run with `--nocapture`).
fn verbose() -> bool {
    std::env::var_os("VBLK_GUEST_VERBOSE").is_some_and(|v| v != "0")
}

/// Asserts that `image[offset..]` holds `want`.
fn assert_image(image: &Path, offset: u64, want: &[u8], what: &str, context: &str) {
    let got = read_at(image, offset, want.len());
    if let Some(at) = first_difference(&got, want) {
        panic!(
            "{what}: {} differs at byte {} (offset {offset} + {at}): got {:02x?}, want {:02x?}\n{context}",
            image.display(),
            offset + at as u64,
            &got[at..(at + 16).min(got.len())],
            &want[at..(at + 16).min(want.len())],
        );
    }
}

/// Reads a file out of the ext4 image with the host's debugfs.
fn host_debugfs_dump(image: &Path, file: &str, out: &Path) -> Vec<u8> {
    let _ = std::fs::remove_file(out);
    let debugfs = find_program("debugfs").expect("checked");
    let res = Command::new(debugfs)
        .arg("-R")
        .arg(format!("dump {file} {}", out.display()))
        .arg(image)
        .output()
        .expect("run debugfs");
    std::fs::read(out).unwrap_or_else(|e| {
        panic!(
            "debugfs could not dump {file} from {}: {e}\n{}",
            image.display(),
            String::from_utf8_lossy(&res.stderr)
        )
    })
}

fn host_fsck(image: &Path, context: &str) {
    let out = Command::new(find_program("e2fsck").expect("checked"))
        .args(["-f", "-n"])
        .arg(image)
        .output()
        .expect("run e2fsck");
    assert!(
        out.status.success(),
        "host e2fsck -f -n {} failed ({}):\n{}{}\n{context}",
        image.display(),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn guest_uses_vblk_serve_disks_across_two_boots() {
    let backend = Backend::from_env();
    require_programs(&[
        ("qemu-system-x86_64", "qemu-system-x86"),
        ("timeout", "coreutils"),
        ("mke2fs", "e2fsprogs"),
        ("e2fsck", "e2fsprogs"),
        ("debugfs", "e2fsprogs"),
        ("blkdiscard", "util-linux"),
    ]);
    let started = Instant::now();
    let assets = support::assets::assets();
    eprintln!(
        "guest assets ({}) ready in {:.1?}: {}",
        assets.kernel_version,
        started.elapsed(),
        assets.dir.display()
    );

    // Sockets (short paths) and logs in the system temp dir; images under the
    // target dir, on a real file system (the read-only daemon uses O_DIRECT).
    let dir = TempDir::new("guest");
    let images = TempDir::new_in(&support::assets::target_dir().join("tmp"), "images");
    let data = Data::new();

    // The writable image: host data at HOST_OFF, non-zero data where the guest
    // will write zeroes.
    let rw_image = images.join("rw.img");
    std::fs::File::create(&rw_image)
        .and_then(|f| f.set_len(RW_SIZE))
        .expect("create rw image");
    write_at(&rw_image, HOST_OFF, &data.host);
    write_at(&rw_image, ZERO_OFF, &data.zero_fill);
    // The read-only image, full of a pattern.
    let ro_image = images.join("ro.img");
    std::fs::write(&ro_image, &data.ro).expect("create ro image");

    // Some variety in the daemons' settings (vblk only): two workers for the
    // two queues; O_DIRECT and the synchronous engine for the read-only disk.
    let rw_export = Export::new(&rw_image, NUM_QUEUES)
        .serial(SERIAL_RW)
        .args(&["--threads", "2"]);
    let ro_export = Export::new(&ro_image, 1)
        .read_only()
        .args(&["--engine", "sync", "--cache", "none"]);
    let mut rw = Daemon::start(
        backend,
        "rw-daemon",
        &rw_export,
        &dir.join("rw.sock"),
        &dir.join("rw.log"),
    );
    let mut ro = Daemon::start(
        backend,
        "ro-daemon",
        &ro_export,
        &dir.join("ro.sock"),
        &dir.join("ro.log"),
    );
    let (rw_pid, ro_pid) = (rw.pid(), ro.pid());

    let (rw_socket, ro_socket, rw_log, ro_log) = (
        rw.socket.clone(),
        ro.socket.clone(),
        rw.log.clone(),
        ro.log.clone(),
    );
    let guest = |name: &str, script: &str| {
        Guest::new(name)
            .disk(&rw_socket, NUM_QUEUES)
            .disk(&ro_socket, 1)
            .attach_log("rw-daemon", &rw_log)
            .attach_log("ro-daemon", &ro_log)
            .watch("rw-daemon", rw_pid)
            .watch("ro-daemon", ro_pid)
            .script(fill(script, &vars(backend)))
            .file("vblk/host.bin", data.host.clone())
            .file("vblk/guest.bin", data.guest.clone())
            .file("vblk/guest2.bin", data.guest2.clone())
            .file("vblk/flush.bin", data.flush.clone())
            .file("vblk/small.bin", data.small.clone())
            .file("vblk/par.bin", data.par.clone())
            .file("vblk/big.bin", data.big.clone())
            .file("vblk/tail.bin", data.tail.clone())
            .file("vblk/ro-head.bin", data.ro[..REGION].to_vec())
            .file("vblk/file.bin", data.file.clone())
            .file("vblk/file2.bin", data.file2.clone())
            .timeout(Duration::from_secs(300))
    };

    // ---- boot 1 ----
    let boot1 = guest("boot1", SCRIPT_1).boot();
    eprintln!(
        "boot 1 ({backend:?}): {:.1?}, {} checks",
        boot1.elapsed,
        boot1.checks.len()
    );
    if verbose() {
        eprintln!("{}", boot1.report());
    }
    let ctx1 = boot1.report();
    rw.assert_running(&format!("after boot 1\n{ctx1}"));
    ro.assert_running(&format!("after boot 1\n{ctx1}"));
    boot1.assert_ok(CHECKS_1);

    let short = format!("(after boot 1; serial log of boot 1:)\n{}", boot1.serial);
    assert_image(
        &rw_image,
        HOST_OFF,
        &data.host,
        "host data (guest must not change it)",
        &short,
    );
    assert_image(
        &rw_image,
        GUEST_OFF,
        &data.guest,
        "guest O_DIRECT write",
        &short,
    );
    assert_image(
        &rw_image,
        SMALL_OFF,
        &data.small,
        "guest 512-byte O_DIRECT writes",
        &short,
    );
    assert_image(
        &rw_image,
        PAR_OFF,
        &data.par,
        "guest concurrent writes from both CPUs",
        &short,
    );
    assert_image(
        &rw_image,
        TAIL_OFF,
        &data.tail,
        "guest write at the end of the disk",
        &short,
    );
    assert_image(
        &rw_image,
        ZERO_OFF,
        &vec![0; REGION],
        "guest write-zeroes",
        &short,
    );
    assert_image(
        &rw_image,
        FLUSH_OFF,
        &data.flush,
        "guest write + fsync",
        &short,
    );
    assert_image(
        &ro_image,
        0,
        &data.ro,
        "read-only image (must be unchanged)",
        &short,
    );
    assert_eq!(
        std::fs::metadata(&rw_image).unwrap().len(),
        RW_SIZE,
        "rw image size changed"
    );
    assert_eq!(
        std::fs::metadata(&ro_image).unwrap().len(),
        RO_SIZE,
        "ro image size changed"
    );
    let dumped = host_debugfs_dump(&rw_image, "/file.bin", &dir.join("file.out"));
    assert!(
        dumped == data.file,
        "the file copied by the guest differs when read on the host with debugfs\n{short}"
    );
    host_fsck(&rw_image, &short);

    // ---- boot 2: same daemon processes ----
    // A third disk, in RAM (vblk) or a file (reference backend), served by a
    // third daemon: attached as /dev/vdc in boot 2 only.
    let mem_export = match backend {
        Backend::Vblk => Export::new(format!("mem:{}M", MEM_SIZE / MIB), NUM_QUEUES).args(&[
            "--poll-us",
            "0",
            "--queue-size",
            "128",
        ]),
        Backend::QemuStorageDaemon => {
            let img = images.join("mem.img");
            std::fs::File::create(&img)
                .and_then(|f| f.set_len(MEM_SIZE))
                .expect("create mem image");
            Export::new(&img, NUM_QUEUES)
        }
    };
    let mut mem = Daemon::start(
        backend,
        "mem-daemon",
        &mem_export,
        &dir.join("mem.sock"),
        &dir.join("mem.log"),
    );
    let boot2 = guest("boot2", SCRIPT_2)
        .disk(&mem.socket, NUM_QUEUES)
        .attach_log("mem-daemon", &mem.log)
        .watch("mem-daemon", mem.pid())
        .boot();
    eprintln!(
        "boot 2 ({backend:?}): {:.1?}, {} checks",
        boot2.elapsed,
        boot2.checks.len()
    );
    if verbose() {
        eprintln!("{}", boot2.report());
    }
    let ctx2 = boot2.report();
    rw.assert_running(&format!("after boot 2\n{ctx2}"));
    mem.assert_running(&format!("after boot 2\n{ctx2}"));
    ro.assert_running(&format!("after boot 2\n{ctx2}"));
    assert_eq!(
        (rw.pid(), ro.pid()),
        (rw_pid, ro_pid),
        "boot 2 must be served by the same daemon processes"
    );
    boot2.assert_ok(CHECKS_2);

    let short = format!("(after boot 2; serial log of boot 2:)\n{}", boot2.serial);
    assert_image(
        &rw_image,
        GUEST_OFF,
        &data.guest,
        "boot-1 O_DIRECT write",
        &short,
    );
    assert_image(
        &rw_image,
        GUEST2_OFF,
        &data.guest2,
        "boot-2 O_DIRECT write",
        &short,
    );
    assert_image(
        &ro_image,
        0,
        &data.ro,
        "read-only image (must be unchanged)",
        &short,
    );
    let dumped = host_debugfs_dump(&rw_image, "/file2.bin", &dir.join("file2.out"));
    assert!(
        dumped == data.file2,
        "file2 copied in boot 2 differs when read on the host\n{short}"
    );
    host_fsck(&rw_image, &short);

    eprintln!(
        "guest test ({backend:?}) passed in {:.1?}",
        started.elapsed()
    );
}
