//! fio in the guest as a data-integrity oracle: job files, the guest-side shell that runs
//! them, and the host-side reading of what they reported.
//!
//! Every job writes its own region of a disk with `verify=crc32c` (blocks carry a header:
//! magic, offset, length, crc32c of the data). Jobs with `verify_backlog` also verify as
//! they write, so that verify reads are in flight among the writes. After all the writes
//! of a run, a reading job per writing job reads the region back into fresh buffers
//! (`iomem=mmap`, or a fresh hugetlb page: zero-filled) and checks every block. Fresh buffers
//! are what catch a read the device dropped: fio does not clear a buffer before it reads
//! into it, so a read that transferred nothing leaves the buffer with whatever it held
//! before — in the writing job, possibly the very block being verified; in a fresh buffer,
//! zeroes (bad magic). A reading job takes the seed from the header it reads (fio does so
//! for read-only jobs), so it checks everything but which write produced the block.
//!
//! Few fio processes, few jobs: under TCG fio takes one or two seconds to start (it links
//! 64 libraries) and tens of milliseconds per job thread. A boot has three runs (`main`,
//! `split`, `largest`), so that the block statistics of the last two can be sampled
//! around them; each run has two groups (`stonewall`): the writes, then the reads.
//!
//! A job writes all the disks of its phase (`filename=/dev/vda:/dev/vdb:...`, one I/O to
//! each in turn), each clone in its own region, at the same offsets on every disk.
//!
//! Block sizes that depend on the device (the largest transfer, `max_segments` pages) are
//! computed in the guest from sysfs and reach the job files as environment variables
//! (fio expands `${NAME}`; Debian's fio has no arithmetic in options, so the sizes come
//! computed too).

use std::collections::BTreeMap;
use std::fmt::Write as _;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

/// A block size: fixed, or computed in the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bs {
    Fixed(u64),
    /// `max_segments` pages of 4 KiB (at most 1024): with fragmented memory, one request
    /// with as many segments as the device allows.
    SegmentPages,
    /// More 4 KiB pages than `max_segments`: 4 MiB, or 8 or 16 MiB for a device that
    /// allows 1024 segments or more; with fragmented memory, the block layer must split it.
    Split,
    /// The largest transfer the device advertises (see [`GUEST_FUNCTIONS`]).
    Largest,
}

impl Bs {
    /// The most bytes this block size can be (sizes the disk regions on the host).
    pub fn bound(self, largest_cap: u64) -> u64 {
        match self {
            Bs::Fixed(b) => b,
            Bs::SegmentPages => 1024 * 4 * KIB,
            Bs::Split => 16 * MIB,
            Bs::Largest => largest_cap,
        }
    }

    /// The guest shell variable holding it, if it is not fixed.
    fn var(self) -> Option<&'static str> {
        match self {
            Bs::Fixed(_) => None,
            Bs::SegmentPages => Some("VBLK_SEGS4K"),
            Bs::Split => Some("VBLK_SPLIT"),
            Bs::Largest => Some("VBLK_LARGEST"),
        }
    }

    /// Its key in the `VBLK-LIMITS` lines.
    fn limits_key(self) -> Option<&'static str> {
        match self {
            Bs::Fixed(_) => None,
            Bs::SegmentPages => Some("segs4k"),
            Bs::Split => Some("split"),
            Bs::Largest => Some("largest"),
        }
    }
}

/// One fio job of a phase.
#[derive(Debug, Clone)]
pub struct Job {
    /// Short name; the fio jobs are `<name>.w` (writes) and `<name>.v` (reads).
    pub name: &'static str,
    pub bs: Bs,
    /// Blocks each clone writes on each disk.
    pub blocks: u64,
    pub rw: &'static str,
    /// fio's `ioengine` in the guest.
    pub engine: &'static str,
    pub iodepth: u32,
    /// `verify_backlog`: verify reads among the writes.
    pub backlog: Option<u32>,
    /// `numjobs`: 2 clones, pinned one per vCPU (so one per virtqueue), or 1.
    pub clones: u32,
    /// The buffer is one 1 GiB hugetlb page (see [`GUEST_FUNCTIONS`]): physically
    /// contiguous.
    pub huge: bool,
}

impl Job {
    const fn new(name: &'static str, bs: u64, blocks: u64, rw: &'static str) -> Job {
        Job {
            name,
            bs: Bs::Fixed(bs),
            blocks,
            rw,
            engine: "io_uring",
            iodepth: 1,
            backlog: None,
            clones: 2,
            huge: false,
        }
    }

    const fn engine(mut self, engine: &'static str, iodepth: u32) -> Job {
        self.engine = engine;
        self.iodepth = iodepth;
        self
    }

    const fn backlog(mut self, n: u32) -> Job {
        self.backlog = Some(n);
        self
    }

    /// Bytes of one clone's region on a disk (the most it may write there).
    fn region(&self, largest_cap: u64) -> u64 {
        (self.bs.bound(largest_cap) * self.blocks).next_multiple_of(MIB)
    }
}

/// A group of jobs run by one fio process: every job's writes, then every job's reads;
/// the disks' block statistics are sampled around it.
#[derive(Debug, Clone)]
pub struct Phase {
    pub name: &'static str,
    pub jobs: Vec<Job>,
    /// `Some(i)`: only the `i`-th disk of the boot runs this phase (else all of them).
    pub only_disk: Option<usize>,
}

impl Phase {
    /// The disks (of `disks`) that run this phase.
    pub fn disks<'a>(&self, disks: &'a [String]) -> &'a [String] {
        match self.only_disk {
            Some(i) => &disks[i..=i],
            None => disks,
        }
    }
}

/// The phases every boot runs, in order. All of them run on fragmented guest memory, so
/// that every request carries one segment per 4 KiB page (buffers are not page-aligned
/// for the odd sizes: fio places them `bs` apart). The largest transfer costs the most
/// (crc32c under TCG runs at about 100 MB/s), so only disk `largest_disk` of a boot runs
/// it; the other phases run on every disk.
pub fn phases(largest_disk: usize) -> Vec<Phase> {
    vec![
        Phase {
            name: "main",
            jobs: vec![
                Job::new("512", 512, 128, "randwrite").engine("io_uring", 16),
                Job::new("3584", 3584, 32, "randwrite").engine("io_uring", 8),
                Job::new("4k", 4 * KIB, 64, "randwrite")
                    .engine("psync", 1)
                    .backlog(16),
                Job::new("67072", 67072, 8, "randwrite")
                    .engine("io_uring", 8)
                    .backlog(4),
                Job::new("64k", 64 * KIB, 8, "write").engine("psync", 1),
                Job::new("1m", MIB, 2, "randwrite")
                    .engine("io_uring", 4)
                    .backlog(2),
                Job::new("1280k", 1280 * KIB, 2, "write").engine("psync", 1),
                Job {
                    bs: Bs::SegmentPages,
                    ..Job::new("segs4k", 0, 2, "write").engine("io_uring", 2)
                },
            ],
            only_disk: None,
        },
        Phase {
            name: "split",
            jobs: vec![Job {
                bs: Bs::Split,
                ..Job::new("split", 0, 2, "randwrite").engine("io_uring", 2)
            }],
            only_disk: None,
        },
        Phase {
            name: "largest",
            jobs: vec![Job {
                bs: Bs::Largest,
                clones: 1,
                huge: true,
                ..Job::new("largest", 0, 1, "write").engine("psync", 1)
            }],
            only_disk: Some(largest_disk),
        },
    ]
}

/// Where each job's region starts on every disk, and the bytes a disk needs.
pub fn layout(phases: &[Phase], largest_cap: u64) -> (BTreeMap<String, u64>, u64) {
    let mut offsets = BTreeMap::new();
    let mut at = 0;
    for job in phases.iter().flat_map(|p| &p.jobs) {
        offsets.insert(job.name.to_string(), at);
        at += job.region(largest_cap) * u64::from(job.clones);
    }
    (offsets, at)
}

/// The job file of `phase` for `disks` (`vda`...): a group (`stonewall`) of every job's
/// writes (so requests of every size meet on the queues), then a group that reads
/// everything back and verifies it.
pub fn job_file(
    phase: &Phase,
    disks: &[String],
    largest_cap: u64,
    offsets: &BTreeMap<String, u64>,
) -> String {
    let mut f = String::from(
        "[global]\nthread=1\ndirect=1\nverify=crc32c\nverify_fatal=1\n\
         cpus_allowed=0-1\ncpus_allowed_policy=split\n",
    );
    let files: Vec<String> = phase
        .disks(disks)
        .iter()
        .map(|d| format!("/dev/{d}"))
        .collect();
    let files = files.join(":");
    for verify in [false, true] {
        for (i, job) in phase.jobs.iter().enumerate() {
            let (bs, size) = match job.bs.var() {
                Some(v) => (format!("${{{v}}}"), format!("${{VBLK_SIZE_{}}}", job.name)),
                None => {
                    let b = job.bs.bound(largest_cap);
                    let n = phase.disks(disks).len() as u64;
                    (b.to_string(), (b * job.blocks * n).to_string())
                }
            };
            let _ = writeln!(f, "\n[{}.{}]", job.name, if verify { 'v' } else { 'w' });
            if i == 0 {
                f.push_str("stonewall\n");
            }
            // `size` is the clone's total over its files, `offset` applies to each file.
            let _ = writeln!(f, "filename={files}\nbs={bs}\nsize={size}");
            let region = job.region(largest_cap);
            let _ = writeln!(f, "offset={}\noffset_increment={region}", offsets[job.name]);
            let _ = writeln!(f, "numjobs={}", job.clones);
            let _ = writeln!(f, "ioengine={}\niodepth={}", job.engine, job.iodepth);
            if verify {
                // Read everything back, in the order it was written or shuffled.
                let rw = if job.rw.starts_with("rand") {
                    "randread"
                } else {
                    "read"
                };
                let _ = writeln!(f, "rw={rw}\ndo_verify=1");
            } else {
                let _ = writeln!(f, "rw={}", job.rw);
                match job.backlog {
                    Some(n) => _ = writeln!(f, "do_verify=1\nverify_backlog={n}"),
                    None => f.push_str("do_verify=0\n"),
                }
            }
            match (job.huge, verify) {
                (true, _) => {
                    let file = if verify { "v" } else { "w" };
                    let _ = writeln!(f, "iomem=mmapshared:/mnt/huge1g/{file}\nthread=0");
                }
                // Fresh, zero-filled buffers for the reads.
                (false, true) => f.push_str("iomem=mmap\n"),
                (false, false) => {}
            }
        }
    }
    f
}

/// Guest shell functions: `vblk_limits DISK` reads a disk's limits from sysfs, raises its
/// `max_sectors_kb` so that only segments limit a request, prints
/// `VBLK-LIMITS <disk> segs=.. segsize=.. hwkb=.. largest=.. segs4k=.. split=..`, exports
/// `$VBLK_LARGEST`, `$VBLK_SEGS4K` and `$VBLK_SPLIT` and appends the limits to
/// `/tmp/limits` (the disks of a boot must be alike: a job writes all of them with one
/// block size); `vblk_huge` mounts the hugetlbfs that holds the buffer of the largest
/// transfer; `vblk_fio RUN JOBFILE` runs fio; `vblk_wstat DISK` prints a disk's write
/// requests and sectors so far.
///
/// The largest transfer is `max_segments × max_segment_size`, bounded by
/// `max_hw_sectors_kb` and by `$VBLK_LARGEST_CAP` (at most 1 GiB less fio's alignment
/// slack: the buffer must fit in one 1 GiB page).
///
/// For the largest transfer to reach the device as one request, its buffer must be
/// physically contiguous in pieces of at least `max_segment_size`, and it must make one
/// bio: a bio has at most 256 vectors, each physically contiguous (2 MiB hugetlb pages
/// would do up to 512 MiB only; several bios merge into one request only if the plug is
/// not flushed in between, which under TCG depends on timing). So the buffer is one
/// 1 GiB page, reserved at boot (`hugepagesz=1G hugepages=1`): a file on a hugetlbfs
/// mounted with `pagesize=1G`, which fio maps (`iomem=mmapshared:FILE`; fio's own
/// `mmaphuge` would round the buffer plus its alignment slack up to two pages). The
/// writing and the reading job use different files and run as processes (`thread=0`):
/// fio removes its file when the job ends, but cannot unmap part of a 1 GiB page, so the
/// page is free for the reader only once the writer has exited; and the reader's buffer
/// starts zeroed.
pub const GUEST_FUNCTIONS: &str = r#"
vblk_limits() {
    d=$1; q=/sys/block/$d/queue
    segs=$(cat $q/max_segments); segsize=$(cat $q/max_segment_size); hwkb=$(cat $q/max_hw_sectors_kb)
    largest=$((segs * segsize))
    [ $largest -gt $((hwkb * 1024)) ] && largest=$((hwkb * 1024))
    [ $largest -gt $VBLK_LARGEST_CAP ] && largest=$VBLK_LARGEST_CAP
    largest=$((largest / 4096 * 4096))
    s4=$segs; [ $s4 -gt 1024 ] && s4=1024
    segs4k=$((s4 * 4096))
    split=4194304
    while [ $((split / 4096)) -le $segs ] && [ $split -lt 16777216 ]; do split=$((split * 2)); done
    kb=$((largest / 1024)); [ $kb -lt $((split / 1024)) ] && kb=$((split / 1024))
    [ $kb -gt $hwkb ] && kb=$hwkb
    echo $kb > $q/max_sectors_kb
    check_eq $d-max-sectors-kb "$(cat $q/max_sectors_kb)" $kb
    l="segs=$segs segsize=$segsize hwkb=$hwkb largest=$largest segs4k=$segs4k split=$split"
    echo "VBLK-LIMITS $d $l"
    echo "$l" >> /tmp/limits
    export VBLK_LARGEST=$largest VBLK_SEGS4K=$segs4k VBLK_SPLIT=$split
}

vblk_huge() {
    g=/sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages
    check_eq hugepages-1g "$(cat $g)" 1
    mkdir -p /mnt/huge1g
    check hugetlbfs-1g mount -t hugetlbfs -o pagesize=1G none /mnt/huge1g
}

# Runs fio on job file $2 as run $1, prints one `VBLK-FIO <run> <job> <error> <read KiB>
# <write KiB> ms=<read ms>/<write ms>` line per job (clone) and fio's complaints, and
# checks its exit status.
vblk_fio() {
    r=$1; shift
    echo "VBLK-RUN fio-$r"
    fio --eta=never --output-format=terse --output=/tmp/$r.terse "$@" 2>/tmp/$r.err
    rc=$?
    echo "VBLK-TIME fio-$r done uptime=$(cut -d' ' -f1 /proc/uptime)"
    awk -F';' -v r=$r '/^3;/ { print "VBLK-FIO", r, $3, $5, $6, $47, "ms=" $9 "/" $50 }' /tmp/$r.terse
    # fio warns about numjobs > 1 with verify whatever the offsets; ours do not overlap.
    grep -v -e '^3;' -e 'multiple writers may overwrite' /tmp/$r.terse | head -n 20 |
        sed "s/^/VBLK-FIOLOG $r /"
    head -n 40 /tmp/$r.err | sed "s/^/VBLK-FIOLOG $r /"
    if [ $rc -eq 0 ]; then vblk_report fio-$r ok "exit 0"
    else vblk_report fio-$r fail "fio exited $rc: $(grep -m 3 -E 'verify|err=|error' /tmp/$r.err | vblk_flat)"; fi
}

vblk_wstat() { awk '{ print $5, $7 }' /sys/block/$1/stat; }
"#;

/// One `VBLK-FIO` line: what a job (clone) of a run reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FioLine {
    pub run: String,
    pub job: String,
    pub error: u64,
    pub read_kib: u64,
    pub write_kib: u64,
}

/// The `VBLK-FIO` lines of a serial log.
pub fn fio_lines(serial: &str) -> Vec<FioLine> {
    serial
        .lines()
        .filter_map(|l| {
            let rest = &l[l.find("VBLK-FIO ")? + "VBLK-FIO ".len()..];
            let w: Vec<&str> = rest.split_whitespace().collect();
            let [run, job, error, read, write, ..] = w[..] else {
                return None;
            };
            Some(FioLine {
                run: run.into(),
                job: job.into(),
                error: error.parse().ok()?,
                read_kib: read.parse().ok()?,
                write_kib: write.parse().ok()?,
            })
        })
        .collect()
}

/// The `VBLK-LIMITS` key=value pairs per disk.
pub fn limits(serial: &str) -> BTreeMap<String, BTreeMap<String, u64>> {
    let mut out = BTreeMap::new();
    for l in serial.lines() {
        let Some(pos) = l.find("VBLK-LIMITS ") else {
            continue;
        };
        let mut w = l[pos + "VBLK-LIMITS ".len()..].split_whitespace();
        let Some(disk) = w.next() else { continue };
        let kv = w
            .filter_map(|p| p.split_once('='))
            .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
            .collect();
        out.insert(disk.to_string(), kv);
    }
    out
}

/// Checks that every job of every phase ran, its writes and its reads, with no error and
/// the bytes it should have moved. Returns the problems found.
pub fn check_runs(phases: &[Phase], disks: &[String], serial: &str) -> Vec<String> {
    let lines = fio_lines(serial);
    let limits = limits(serial);
    let mut problems = Vec::new();
    for phase in phases {
        let pdisks = phase.disks(disks);
        for job in &phase.jobs {
            // The disks of a boot are alike (the guest checks it).
            let bs = match job.bs.limits_key() {
                None => Some(job.bs.bound(0)),
                Some(key) => limits.get(&pdisks[0]).and_then(|l| l.get(key)).copied(),
            };
            let Some(bs) = bs else {
                problems.push(format!(
                    "{} has no VBLK-LIMITS line: cannot check job {}",
                    pdisks[0], job.name
                ));
                continue;
            };
            let kib = bs * job.blocks * pdisks.len() as u64 / KIB;
            let backlog = if job.backlog.is_some() { kib } else { 0 };
            for (suffix, want_read, want_write) in [("w", backlog, kib), ("v", kib, 0)] {
                let name = format!("{}.{suffix}", job.name);
                let got: Vec<&FioLine> = lines
                    .iter()
                    .filter(|l| l.run == phase.name && l.job == name)
                    .collect();
                if got.len() != job.clones as usize {
                    problems.push(format!(
                        "fio run {}: job {name} reported {} times, want {} (one per clone)",
                        phase.name,
                        got.len(),
                        job.clones
                    ));
                }
                for l in got {
                    if l.error != 0 || l.read_kib != want_read || l.write_kib != want_write {
                        problems.push(format!(
                            "fio run {}: job {name} on {}: error {} (want 0), read {} KiB \
                             (want {want_read}), written {} KiB (want {want_write})",
                            phase.name,
                            pdisks.join(","),
                            l.error,
                            l.read_kib,
                            l.write_kib
                        ));
                    }
                }
            }
        }
    }
    problems
}

/// The guest shell that runs the phases on `disks` and checks the block statistics:
/// the `split` phase's writes (4 MiB, more pages than `max_segments`) must have been cut
/// into smaller requests although `max_sectors_kb` allows them whole (so requests reached
/// the segment limit), and the
/// `largest` phase must have written its disk with exactly one request of the largest
/// transfer.
pub fn run_script(phases: &[Phase], disks: &[String]) -> String {
    let mut s = String::new();
    for phase in phases {
        let p = phase.name;
        let _ = writeln!(s, "\n# ---- phase {p} ----");
        let disks = phase.disks(disks);
        for job in &phase.jobs {
            if let Some(v) = job.bs.var() {
                let n = job.blocks * disks.len() as u64;
                let _ = writeln!(s, "export VBLK_SIZE_{}=$(({v} * {n}))", job.name);
            }
        }
        for d in disks {
            let _ = writeln!(s, "set -- $(vblk_wstat {d}); w0_{d}=$1; s0_{d}=$2");
        }
        let _ = writeln!(s, "vblk_fio {p} /vblk/{p}.fio");
        for d in disks {
            let _ = writeln!(
                s,
                "set -- $(vblk_wstat {d}); w_{d}=$(($1 - w0_{d})); s_{d}=$(($2 - s0_{d}))\n\
                 echo \"VBLK-STAT {p} {d} write_requests=$w_{d} write_sectors=$s_{d}\""
            );
            match p {
                "split" => {
                    let _ = writeln!(
                        s,
                        "check_gt {d}-split-requests $w_{d} $((s_{d} * 512 / VBLK_SPLIT))"
                    );
                }
                "largest" => {
                    let _ = writeln!(
                        s,
                        "check_eq {d}-largest-one-request \"$w_{d} $((s_{d} * 512))\" \
                         \"1 $VBLK_LARGEST\""
                    );
                }
                _ => {}
            }
        }
    }
    s
}
