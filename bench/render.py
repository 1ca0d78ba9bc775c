#!/usr/bin/env python3
"""Write BENCHMARKS.md (to stdout) from one run of bench/all.sh: its OUT_DIR holds
machine.txt, manifest.tsv (id, title, load average at the table's start, command), one
`vblk bench --output-format json` file per table, and for full runs sharing.txt and
qos.txt. Every figure printed here is computed from those files; the headline table too.

    python3 bench/render.py OUT_DIR > BENCHMARKS.md
"""
import gzip
import json
import math
import os
import re
import sys

# The document's sections: title, what they measure (no figures: those come from the
# run), and the tables (ids in manifest.tsv) in order.
SECTIONS = [
    (
        "I/O paths of the driver (embedded device)",
        "The driver's paths on the device embedded in the benchmark's process (one worker "
        "thread on its own CPU): bio sends each I/O to the ring and notifies, batch "
        "notifies once per batch, request plugs, merges and dispatches through an "
        "elevator, passthru hands the ring to the caller (polled completions).",
        ["paths-mem-qd32", "paths-mem-write", "paths-null-qd32"],
    ),
    (
        "Embedded device vs `--baseline` (the same job with no virtio in between)",
        "`--baseline` runs the job's I/O straight on the disk through the same engine, "
        "with no ring, no device thread and no notifications: what virtio costs.",
        ["baseline-mem-qd32", "baseline-mem-qd1", "baseline-file-qd32", "baseline-file-qd1"],
    ),
    (
        "The device's polling window",
        "`poll_us` is how long the device spins on its rings after the last request "
        "before it sleeps (0: never spins; the default adapts up to 200 µs and polls only "
        "while that pays, docs/design-notes.md).",
        ["poll-null-qd32", "poll-mem-qd1", "poll-mem-qd32"],
    ),
    (
        "Engines, and the io_uring submission batch",
        "The device's engines on a 1 GiB file of random data with O_DIRECT (`--cache "
        "none`), and how many requests it hands io_uring per submit call (0: auto).",
        ["engines-qd32", "engines-qd1", "engine-threads", "submit-batch-direct",
         "submit-batch-cached"],
    ),
    (
        "`vblk serve` vs qemu-storage-daemon (bench/devices.sh)",
        "The same driver (`vblk bench`, pinned to CPU 0) against each device (pinned to "
        "CPU 1), side by side in one `--compare` per table. vblk: its defaults; "
        "vblk-poll0: `--poll-us 0`; vblk-aio: `--engine aio`; qsd: the export in the main "
        "loop; qsd-iothread: in an IOThread (QEMU polls there, poll-max-ns 32 µs); "
        "qsd-native, qsd-io_uring, qsd-threads: its `aio=` modes. Device CPU is the "
        "whole device process's, from /proc in 10 ms ticks.",
        ["null-qd1", "null-qd32", "null-100k", "null-500k", "idle", "file-qd1", "file-qd32",
         "file-baseline"],
    ),
    (
        "qcow2 images (bench/devices.sh)",
        "The 1 GiB file of the tables above converted to qcow2 (`qemu-img convert -O "
        "qcow2`: every cluster allocated, 64 KiB clusters), read with O_DIRECT. "
        "vblk-qcow2: `--format qcow2 --read-only`; "
        "vblk-raw: the raw file, also read-only; qsd-qcow2 and qsd-qcow2-iothread: "
        "qemu-storage-daemon's qcow2 driver over `aio=io_uring`, in its main loop and in "
        "an IOThread. The write tables write 4 KiB at random over the same qcow2 image, a "
        "copy per device (every cluster allocated: overwrites), vblk with `--format qcow2`, "
        "vblk-raw over a copy of the raw file. "
        "The alloc tables write at random (alloc-4k, alloc-64k) or in order "
        "(alloc-seq-4k, alloc-seq-64k) to a fresh, empty 64 GiB image per "
        "device (vblk-alloc: `--format qcow2`; qsd-alloc and qsd-alloc-iothread: its qcow2 "
        "driver), so that nearly every write is the first to its cluster, or (4 KiB in "
        "order) one of sixteen in flight together into a new cluster. The chain3 "
        "tables read a chain of three qcow2 images over the raw file (each holding a "
        "quarter of the disk; the last quarter comes from the raw base): vblk with a "
        "`--backing` per level, qemu-storage-daemon with the chain spelled out in its "
        "`--blockdev` (every level `aio=io_uring`, O_DIRECT).",
        ["qcow2-qd1", "qcow2-qd32", "qcow2-write-qd1", "qcow2-write-qd32", "qcow2-chain3-qd1",
         "qcow2-chain3-qd32", "qcow2-alloc-4k", "qcow2-alloc-64k", "qcow2-alloc-seq-4k",
         "qcow2-alloc-seq-64k"],
    ),
    (
        "NBD disks: `vblk serve` vs qemu-storage-daemon on one nbdkit export (bench/nbd.sh)",
        "Both devices serve the same nbdkit `memory` export over a Unix socket (devices on "
        "CPU 1, the benchmark on CPU 0, nbdkit where the scheduler puts it). vblk: its "
        "defaults; vblk0: `--poll-us 0` (nbdkit needs the CPU a polling worker would "
        "take); qsd: its NBD client in the main loop. The baseline tables are vblk's NBD "
        "client alone, no virtio: what nbdkit itself gives.",
        ["nbd-randread-qd1", "nbd-randread-qd32", "nbd-randwrite-qd1", "nbd-randwrite-qd32",
         "nbd-baseline-randread", "nbd-baseline-randwrite"],
    ),
    (
        "Simulated 7200 rpm disk (S4), with and without its rotational hint",
        "`hdd:1G` serves one request at a time in arrival order, timed by the model in "
        "crates/storage/src/hdd.rs, and tells the driver it is rotational: `auto` then "
        "takes the request path at depth 2 without trials. `hdd:1G:norot` hides that, "
        "as most virtual disks over a hard disk do: `auto` has to find it by measuring. "
        "Random rows: one run per variant (every I/O pays a seek, so the model's time "
        "hardly depends on timing). Sequential rows: as many runs per variant as the run's "
        "other tables, taking turns, because how many 4 KiB I/Os merge into one request "
        "depends on how many wait in the elevator when the disk finishes one, which depends "
        "on the threads' timing: one run of a variant differs from the next by up to a "
        "third. `auto`'s goal is its paired ratio to the best variant. The norot tables' "
        "ramp covers auto's first choice (about 1 s sequential, 12 s random).",
        ["hdd-read", "hdd-write", "hdd-randread", "hdd-randwrite", "norot-read", "norot-write",
         "norot-randread", "norot-randwrite"],
    ),
]


def read_manifest(d):
    rows = {}
    order = []
    with open(os.path.join(d, "manifest.tsv")) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 4:
                continue
            tid, title, load, cmd = parts
            rows[tid] = {"title": title, "load": load, "cmd": cmd}
            order.append(tid)
    return rows, order


def load_tables(d, manifest):
    tables = {}
    for tid in manifest:
        # bench/all.sh keeps a run's JSON gzipped once the page is written.
        p = os.path.join(d, tid + ".json")
        if not os.path.exists(p) and os.path.exists(p + ".gz"):
            p += ".gz"
        try:
            with (gzip.open(p, "rt") if p.endswith(".gz") else open(p)) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            sys.exit(f"render.py: {p}: {e}")
        variants = data[0]["variants"] if data else []
        tables[tid] = variants
    return tables


def label(v):
    """socket=/tmp/x/NAME.sock@PID -> NAME; other variants as given."""
    m = re.fullmatch(r"socket=.*/([^/]+)\.sock@\d+", v)
    return m.group(1) if m else v


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def ios_of(run):
    agg = run["vblk"]["aggregate"]
    return agg["read"]["total_ios"] + agg["write"]["total_ios"]


def pct(run, p):
    agg = run["vblk"]["aggregate"]
    side = agg["read"] if agg["read"]["total_ios"] else agg["write"]
    return side["clat_ns"].get("percentile", {}).get(f"{p:.6f}")


def per_io_us(side):
    ips = (side or {}).get("iops_per_cpu_sec") or 0
    return 1e6 / ips if ips else None


def wakeups(run):
    dev = run["vblk"].get("device")
    ios = ios_of(run)
    if not dev or not ios:
        return None
    return dev.get("ctx_voluntary", dev.get("ctx", 0)) / ios


class V:
    """One variant's figures, means over its runs."""

    def __init__(self, v):
        runs = v["runs"]
        self.name = label(v["variant"])
        self.iops = v["iops_mean"]
        self.sd = v["iops_stddev"]
        self.runs = [r["vblk"]["iops"] for r in runs]
        self.n = len(runs)
        self.ratio = v["ratio"]
        self.mibs = mean([r["vblk"]["bw_bytes"] / 2**20 for r in runs])
        self.p50 = mean([pct(r, 50) for r in runs])
        self.p99s = [pct(r, 99) for r in runs]
        self.p99 = mean(self.p99s)
        self.drv = mean([per_io_us(r["vblk"]["driver"]) for r in runs])
        self.dev = mean([per_io_us(r["vblk"].get("device")) for r in runs])
        self.wake = mean([wakeups(r) for r in runs])
        share = v.get("device_cpu_share")
        self.dev_cpu = share * 100 if share is not None else None
        self.auto = None
        for n in runs[-1]["vblk"].get("notes", []):
            if n.startswith("auto: "):
                self.auto = n[len("auto: "):].split(" (")[0]


def human(x):
    if x is None:
        return "–"
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if x >= div:
            v = x / div
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{x:.0f}"


def num(x, fmt="{:.2f}"):
    return "–" if x is None else fmt.format(x)


def us(ns):
    return "–" if ns is None else f"{ns / 1e3:.1f}"


def render_table(tid, meta, variants):
    vs = [V(v) for v in variants]
    out = [f"**{tid}: {meta['title']}** (load average at its start: {meta['load']})", ""]
    out += ["```", meta["cmd"], "```", ""]
    has_auto = any(v.auto for v in vs)
    head = ("| variant | IOPS | ratio | MiB/s | p50 µs | p99 µs | driver µs CPU/IO | "
            "device µs CPU/IO | device wake-ups/IO | device CPU |")
    sep = "|---|---|---|---|---|---|---|---|---|---|"
    if has_auto:
        head += " auto chose |"
        sep += "---|"
    out += [head, sep]
    for v in vs:
        spread = f" ± {human(v.sd)}" if v.n > 1 else " (1 run)"
        row = (f"| {v.name} | {human(v.iops)}{spread} | {v.ratio:.2f} | {num(v.mibs, '{:.1f}')} | "
               f"{us(v.p50)} | {us(v.p99)} | {num(v.drv)} | {num(v.dev)} | "
               f"{num(v.wake, '{:.3g}')} | {num(v.dev_cpu, '{:.1f} %')} |")
        if has_auto:
            row += f" {v.auto or ''} |"
        out.append(row)
    out.append("")
    return out


def find(tables, tid, name):
    for v in tables.get(tid, []):
        if label(v["variant"]) == name:
            return V(v)
    return None


# Two-sided 95 % quantiles of Student's t for 1 to 30 degrees of freedom (rounds - 1);
# beyond, the normal distribution's 1.96 (as `vblk bench`'s paired ratio, report.rs).
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
       2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
       2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


class Paired:
    """vblk's variant against a peer, round by round. With repeats the variants take turns
    (in reverse order every other round, `vblk bench`'s run order), so one round's ratio
    sees the disk in about the same state on both sides, and a steady drift cancels over
    two rounds; a ratio of the two means keeps it. The figure is the geometric mean of the
    rounds' ratios (the same as `vblk bench`'s paired ratio), with its 95 % interval
    (Student's t on the log ratios) when there are at least 2 rounds. A round with no I/O
    on either side, or sides with different numbers of rounds, leave only the ratio of
    the means (a stalled round then counts against its side). Paired on p99s, a round
    without one leaves the ratio of the means of the rounds that have one, and a side
    with none (or a zero) fails the goal."""

    def __init__(self, v, q, of="iops"):
        """`of`: "iops", or "p99" to pair the rounds' p99 latencies instead."""
        self.n = 0
        self.low = self.high = None
        a_runs, b_runs, a, b = ((v.runs, q.runs, v.iops, q.iops) if of == "iops"
                                else (v.p99s, q.p99s, v.p99, q.p99))
        pairs = list(zip(a_runs, b_runs))
        if (len(a_runs) != len(b_runs) or not pairs
                or any(x is None or y is None or x <= 0 or y <= 0 for x, y in pairs)):
            # What fails the goal: no IOPS (0) or no tail to compare (infinite).
            usable = a is not None and b is not None and a > 0 and b > 0
            self.ratio = a / b if usable else (0.0 if of == "iops" else math.inf)
            return
        logs = [math.log(a / b) for a, b in pairs]
        self.n = len(logs)
        m = sum(logs) / self.n
        self.ratio = math.exp(m)
        if self.n >= 2:
            sd = math.sqrt(sum((x - m) ** 2 for x in logs) / (self.n - 1))
            df = self.n - 1
            t = T95[df - 1] if df <= len(T95) else 1.96
            half = t * sd / math.sqrt(self.n)
            self.low, self.high = math.exp(m - half), math.exp(m + half)

    def text(self):
        if self.n == 0:
            return f"{self.ratio:.2f}× (ratio of the means)"
        if self.low is None:
            return f"{self.ratio:.2f}× (1 round)"
        return f"{self.ratio:.2f}× (95 %: {self.low:.2f}-{self.high:.2f}, {self.n} rounds)"

    def verdict(self, goal, ok=True):
        """"yes" when the interval lies at or above the goal (and `ok`, the row's other
        conditions hold), **no** when it lies below it, otherwise "within noise": the
        rounds cannot tell the two sides apart at the goal. Without an interval (one round,
        or only the means' ratio) the figure alone decides."""
        if not ok:
            return False
        if self.low is None:
            return self.ratio >= goal
        if self.low >= goal:
            return True
        if self.high < goal:
            return False
        return "within noise"

    def verdict_at_most(self, goal):
        """For a figure that must not exceed `goal` (a tail latency's ratio): "yes" when
        the interval lies at or below it, **no** when it lies above, otherwise "within
        noise"; without an interval the figure alone decides."""
        if self.low is None:
            return self.ratio <= goal
        if self.high <= goal:
            return True
        if self.low > goal:
            return False
        return "within noise"


def both(a, b):
    """Two verdicts of one row: no if either is no, yes if both are yes, else within noise."""
    if a is False or b is False:
        return False
    return True if a is True and b is True else "within noise"


def fastest(*peers):
    """The peer with the most IOPS on average (the one vblk is compared with)."""
    return max(peers, key=lambda x: x.iops)


def goal_rows(tables):
    """The headline: issue 23's goals (and issue 22's qcow2 read goals), each computed from
    this run's tables."""
    rows = []

    def row(measure, figure, ratio, goal, met):
        rows.append((measure, figure, ratio, goal, met))

    def missing(measure, goal, tids):
        row(measure, f"not measured in this run ({', '.join(tids)})", "–", goal, "–")

    n32 = [find(tables, "null-qd32", x) for x in ("vblk", "qsd", "qsd-iothread")]
    if all(n32):
        v, q, qi = n32
        r = v.iops / max(q.iops, qi.iops)
        row("null disk QD32, `vblk serve` vs qsd (no IOThread / IOThread)",
            f"{human(v.iops)} vs {human(q.iops)} / {human(qi.iops)}", f"{r:.2f}×", "≥ 2.5×",
            r >= 2.5)
    else:
        missing("null disk QD32, `vblk serve` vs qsd", "≥ 2.5×", ["null-qd32"])
    n1 = [find(tables, "null-qd1", x) for x in ("vblk", "qsd", "vblk-poll0")]
    if all(n1):
        v, q, p0 = n1
        r = v.iops / q.iops
        row("null disk QD1, `vblk serve` vs qsd's main loop", f"{human(v.iops)} vs {human(q.iops)}",
            f"{r:.2f}×", "≥ 3×", r >= 3)
        r0 = p0.iops / q.iops
        dev0 = p0.dev
        row("null disk QD1, `--poll-us 0` vs qsd's main loop (no polling either), and device "
            "µs CPU per I/O", f"{human(p0.iops)} vs {human(q.iops)}; {num(dev0)} vs {num(q.dev)} µs",
            f"{r0:.2f}×", "≥ 1× at no more CPU per I/O",
            r0 >= 1 and dev0 is not None and q.dev is not None and dev0 <= q.dev)
    else:
        missing("null disk QD1, `vblk serve` vs qsd", "≥ 3×", ["null-qd1"])
    p = [find(tables, "paths-null-qd32", x) for x in ("path=bio", "path=batch", "path=passthru")]
    if all(p):
        b, ba, pt = p
        row("null disk QD32 embedded: bio / batch / passthru",
            f"{human(b.iops)} / {human(ba.iops)} / {human(pt.iops)}", "–",
            "≥ 5 M bio, ≥ 8 M passthru", b.iops >= 5e6 and pt.iops >= 8e6)
    else:
        missing("null disk QD32 embedded: bio / batch / passthru", "≥ 5 M / ≥ 8 M",
                ["paths-null-qd32"])
    for tid, goal in (("baseline-mem-qd32", 0.95), ("baseline-mem-qd1", 0.75),
                      ("baseline-file-qd32", 0.95)):
        e, b = find(tables, tid, "target=embedded"), find(tables, tid, "target=baseline")
        what = tid.replace("baseline-", "").replace("mem", "RAM disk").replace(
            "file", "O_DIRECT file").replace("-qd", " QD")
        if e and b:
            r = e.iops / b.iops
            row(f"{what}, embedded vs `--baseline`", f"{human(e.iops)} vs {human(b.iops)}",
                f"{r:.2f}", f"≥ {goal}", r >= goal)
        else:
            missing(f"{what}, embedded vs `--baseline`", f"≥ {goal}", [tid])
    f32 = tables.get("file-qd32", [])
    v = find(tables, "file-qd32", "vblk")
    qs = [V(x) for x in f32 if label(x["variant"]).startswith("qsd")]
    if v and qs:
        q = fastest(*qs)
        pr, tail = Paired(v, q), Paired(v, q, of="p99")
        has_tail = math.isfinite(tail.ratio)
        paired = f", paired {tail.text()}" if has_tail else " (no tail to compare)"
        row(f"O_DIRECT file QD32, `vblk serve` vs qsd's fastest mode ({q.name}); p99",
            f"{human(v.iops)} vs {human(q.iops)}; p99 {us(v.p99)} vs {us(q.p99)} µs{paired}",
            pr.text(), "≥ 1.0×, p99 ≤ qsd's",
            both(pr.verdict(1.0), tail.verdict_at_most(1.0)) if has_tail else False)
    else:
        missing("O_DIRECT file QD32, `vblk serve` vs qsd", "≥ 1.0×", ["file-qd32"])
    for tid, rate in (("null-100k", "100 k"), ("null-500k", "500 k")):
        v, p0, q = (find(tables, tid, x) for x in ("vblk", "vblk-poll0", "qsd"))
        c = find(tables, tid, "vblk-coalesce20")
        if v and p0 and q and v.dev and q.dev:
            r = v.dev / q.dev
            ok = r <= 0.5
            extra = ""
            if p0.dev:
                extra = f"; `--poll-us 0` {num(p0.dev)} µs, p50 {us(v.p50)} vs {us(p0.p50)} µs"
                # Above --poll-us 0's CPU only if it buys a median ≥ 30 % lower.
                if v.dev > p0.dev and not (v.p50 and p0.p50 and v.p50 <= 0.7 * p0.p50):
                    ok = False
            if c and c.dev:
                # Not the default: shown beside it, the goal is judged on the default.
                extra += (f"; `--coalesce-us 20` {num(c.dev)} µs ({c.dev / q.dev:.2f} of qsd), "
                          f"p50 {us(c.p50)} µs")
            row(f"null disk, {rate} IOPS offered at QD32: device µs CPU per I/O, default vs qsd",
                f"{num(v.dev)} vs {num(q.dev)} µs{extra}", f"{r:.2f}",
                "≤ 0.5; above `--poll-us 0` only for a ≥ 30 % lower median", ok)
        else:
            missing(f"null disk, {rate} IOPS offered: device CPU per I/O", "≤ 0.5", [tid])
    worst = None
    seen = []
    verdicts = []
    for tid in ("norot-read", "norot-write", "norot-randread", "norot-randwrite"):
        vs = [V(x) for x in tables.get(tid, [])]
        auto = [x for x in vs if x.name == "path=auto"]
        others = [x for x in vs if x.name != "path=auto"]
        if auto and others:
            p = Paired(auto[0], fastest(*others))
            seen.append(f"{tid.split('-')[1]} {p.text()}")
            verdicts.append(p.verdict(0.95))
            worst = p if worst is None or p.ratio < worst.ratio else worst
    if worst is not None:
        met = (False if False in verdicts
               else "within noise" if "within noise" in verdicts else True)
        row("`auto` on `hdd:1G:norot` (no rotational hint): auto / best of bio, batch, request "
            "at any depth, paired by round", "; ".join(seen), f"{worst.ratio:.2f}", "≥ 0.95",
            met)
    else:
        missing("`auto` on `hdd:1G:norot`", "≥ 0.95", ["norot-*"])
    # Issue 22's goals on a fully allocated image, reads and (over a copy each) writes.
    for tid in ("qcow2-qd1", "qcow2-qd32", "qcow2-write-qd1", "qcow2-write-qd32"):
        v, raw, q, qi = (find(tables, tid, x)
                         for x in ("vblk-qcow2", "vblk-raw", "qsd-qcow2", "qsd-qcow2-iothread"))
        qd = tid.rsplit("-", 1)[1].upper()
        what = "writes" if "write" in tid else "reads"
        if v and raw and q and qi:
            peer = fastest(q, qi)
            pr, praw = Paired(v, peer), Paired(v, raw)
            row(f"qcow2 (issue 22), fully allocated, O_DIRECT, {qd} {what}: vblk vs qsd's "
                "qcow2 (main loop / IOThread), and vs vblk on the raw file",
                f"{human(v.iops)} vs {human(q.iops)} / {human(qi.iops)}; raw {human(raw.iops)}",
                f"{pr.text()} vs {peer.name}; raw {praw.ratio:.2f}", "≥ 1.0× qsd, ≥ 0.9 raw",
                both(pr.verdict(1.0), praw.verdict(0.9)))
        else:
            missing(f"qcow2 {qd} {what} vs qsd and raw", "≥ 1.0×, ≥ 0.9", [tid])
    for tid in ("qcow2-chain3-qd1", "qcow2-chain3-qd32"):
        v, q, qi = (find(tables, tid, x)
                    for x in ("vblk-chain3", "qsd-chain3", "qsd-chain3-iothread"))
        qd = tid.rsplit("-", 1)[1].upper()
        if v and q and qi:
            row(f"qcow2 (issue 22), reads through a chain of three qcow2 images over raw, "
                f"O_DIRECT, {qd}: vblk vs qsd (main loop / IOThread)",
                f"{human(v.iops)} vs {human(q.iops)} / {human(qi.iops)}",
                Paired(v, fastest(q, qi)).text(), "measured (no goal)", "–")
        else:
            missing(f"qcow2 chain of three, {qd} reads vs qsd", "measured", [tid])
    for tid in ("qcow2-alloc-4k", "qcow2-alloc-64k", "qcow2-alloc-seq-4k",
                "qcow2-alloc-seq-64k"):
        v, q, qi = (find(tables, tid, x) for x in ("vblk-alloc", "qsd-alloc", "qsd-alloc-iothread"))
        bs = tid.rsplit("-", 1)[1]
        order = "sequential" if "-seq-" in tid else "random"
        if v and q and qi:
            pr = Paired(v, fastest(q, qi))
            row(f"qcow2 (issue 22), allocating {order} {bs} writes, QD32: vblk vs qsd's "
                "qcow2 (main loop / IOThread)",
                f"{human(v.iops)} vs {human(q.iops)} / {human(qi.iops)}",
                pr.text(), "≥ 1.0×", pr.verdict(1.0))
        else:
            missing(f"qcow2 allocating {order} {bs} writes vs qsd", "≥ 1.0×", [tid])
    return rows


def sharing_rows(d, sub, client, alone, rows):
    """The headline rows of one bench/sharing.sh run (its goals.json in `sub`), whose
    client is `client` (the tail rows' words for it) and `alone` (the one-disk run's)."""
    goals = os.path.join(d, sub, "goals.json")
    if not os.path.exists(goals) and os.path.exists(goals + ".gz"):
        goals += ".gz"  # bench/all.sh gzips a run's JSON once the page is written
    if not os.path.exists(goals):
        return
    with (gzip.open(goals, "rt") if goals.endswith(".gz") else open(goals)) as f:
        g = json.load(f)
    c = g["cpu_per_io_us"]
    unmeasured = "not measured in this run (bench/sharing.sh)"

    def cpu_row(measure, other, key, goal, bound):
        r = g.get(key)
        if r is None:
            rows.append((measure, unmeasured, "–", goal, "–"))
        else:
            rows.append((measure, f"{num(c.get('vblk-1x16'))} vs {num(c.get(other))}",
                         f"{r:.2f}×", goal, r <= bound))

    steal = g.get("steal_pct", {})

    def tail_row(measure, key, figure, setups):
        t = g.get(key)
        if t is None:
            rows.append((measure, unmeasured, "–", "≤ 2×", "–"))
            return
        shown = figure(t)
        if all(s in steal for s in setups):
            # Under steal a wake-up waits for the host: say how much there was.
            shown += " (host steal " + " / ".join(f"{steal[s]:.1f} %" for s in setups) + ")"
        rows.append((measure, shown, f"{t['ratio']:.2f}×", "≤ 2×", t["ratio"] <= 2))

    cpu_row(f"16 disks at 5 k IOPS ({client}): device µs CPU per I/O, one daemon vs 16 "
            "daemons", "vblk-16x1", "cpu_vs_16x1", "≤ 0.5×", 0.5)
    cpu_row(f"16 disks ({client}): device µs CPU per I/O, one daemon vs qsd with 16 exports",
            "qsd-1x16", "cpu_vs_qsd", "≤ 1×", 1)
    tail_row(f"16 disks ({client}): p99 of the disk it grows most for, one daemon vs a "
             "daemon of its own", "tail_vs_own",
             lambda t: f"disk {t['disk']}: {t['shared_us']:.1f} vs {t['own_us']:.1f} µs",
             ("vblk-1x16", "vblk-16x1"))
    tail_row(f"16 disks ({client}): worst disk's p99 in one daemon vs one disk alone "
             f"({alone})", "tail_vs_alone",
             lambda t: f"{t['worst_us']:.1f} vs {t['alone_us']:.1f} µs",
             ("vblk-1x16", "vblk-1x1"))


def many_disk_rows(d):
    """Issue 21's measured goals, from this run's bench/sharing.sh (both clients) and
    bench/qos.sh output (full runs only)."""
    rows = []
    sharing_rows(d, "sharing-json", "16 jobs, a process each, on CPU 0",
                 "one job; the 16 keep CPU 0 busy: see the sharing table", rows)
    sharing_rows(d, "sharing-thread-json", "one client thread drives all 16",
                 "the same client, one disk", rows)
    qos = os.path.join(d, "qos.txt")
    if os.path.exists(qos):
        # A limit's rate (the group's total too) is held to 2 %; a member's share of a
        # group to 5 % (the "50 % ± 5 %").
        errors, shares = [], []
        with open(qos) as f:
            for line in f:
                m = re.search(r"([+-]\d+\.\d+) %$", line.rstrip())
                if m:
                    share = line.startswith("group") and ", disk " in line
                    (shares if share else errors).append(abs(float(m.group(1))))
        if errors:
            worst = max(errors)
            rows.append((f"QoS: configured vs measured, {len(errors)} limits, bursts and group "
                         "totals (10 s windows)", f"worst error {worst:.2f} %", "–", "within 2 %",
                         worst <= 2))
        if shares:
            worst = max(shares)
            rows.append((f"QoS groups: each member's share, {len(shares)} members (two at QD32; "
                         "one at QD1 beside one at QD32)", f"worst error {worst:.2f} %", "–",
                         "within 5 %", worst <= 5))
    return rows


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: python3 bench/render.py OUT_DIR > BENCHMARKS.md")
    d = sys.argv[1].rstrip("/")
    with open(os.path.join(d, "machine.txt")) as f:
        machine = f.read().strip().splitlines()
    manifest, order = read_manifest(d)
    tables = load_tables(d, order)
    info = dict(line.split(": ", 1) for line in machine if ": " in line)
    out = ["# vblk benchmarks", ""]
    out += [
        "<!-- Generated by bench/render.py from one run; do not edit. "
        f"Regenerate: {info.get('command', 'bash bench/all.sh full')} -->",
        "",
        f"Every figure on this page comes from **one run** of `{info.get('command', '?')}` "
        f"({info.get('mode', '?')}), at commit {info.get('commit', '?')}, started "
        f"{info.get('started', '?')}, {info.get('finished', 'unfinished')}. The raw JSON of "
        f"every table is in `{d}/`; this page is written from it by `bench/render.py`, "
        "tables and headline alike, and never edited by hand.",
        "",
        "Machine and its state:",
        "",
    ]
    out += [f"- {line}" for line in machine]
    out += [
        "",
        "How to read the tables: every table is one `vblk bench --compare` invocation, its "
        "variants run side by side (with repeats, they take turns, so drift falls on all "
        "alike). IOPS is the mean ± the standard deviation over the repeats, or \"(1 run)\". "
        "Ratio is to the table's first variant. Latency is completion latency (p50, p99, "
        "means over the repeats). CPU per I/O is the driver's (the job threads) and the "
        "device's (its worker threads, or the whole device process for an external "
        "device) CPU time divided by the I/Os completed; wake-ups per I/O are the device's "
        "voluntary context switches per I/O (less host-dependent than CPU time); device "
        "CPU is its CPU time per second of the window, in % of one CPU. Unless a table says "
        "otherwise: 4 KiB random reads after a 1 s ramp. In the headline, where a row "
        "compares vblk with a peer on a disk, the ratio is paired: the geometric mean of "
        "the rounds' ratios (a round runs every variant once, so most of the disk's drift "
        "over a table, which a ratio of the means keeps, cancels out of a round's ratio), "
        "with its 95 % interval; a goal is met when the interval "
        "lies at or above it, missed when it lies below, and \"within noise\" when it "
        "straddles the goal (a p99 that must not exceed the peer's is paired the same "
        "way, the other way round). Absolute figures belong to this "
        "machine at that hour (a shared 2-vCPU VM: the same job drifts by tens of per cent "
        "over minutes); compare within a table.",
        "",
        "## Where we stand against the goals (issues 23, 22 and 21), from this run",
        "",
        "| measure | this run | ratio | goal | met |",
        "|---|---|---|---|---|",
    ]
    for measure, figure, ratio, goal, met in goal_rows(tables) + many_disk_rows(d):
        mark = met if isinstance(met, str) else ("yes" if met else "**no**")
        out.append(f"| {measure} | {figure} | {ratio} | {goal} | {mark} |")
    out.append("")
    placed = set()
    for title, intro, ids in SECTIONS:
        present = [t for t in ids if t in tables]
        if not present:
            continue
        out += [f"## {title}", "", intro, ""]
        for tid in present:
            out += render_table(tid, manifest[tid], tables[tid])
            placed.add(tid)
    rest = [t for t in order if t not in placed]
    if rest:
        out += ["## Other tables", ""]
        for tid in rest:
            out += render_table(tid, manifest[tid], tables[tid])
    for name, title, script in (
        ("sharing.txt", "Many disks, one daemon", "bench/sharing.sh 10"),
        ("sharing-thread.txt", "Many disks, one daemon, driven by one client thread",
         'bench/sharing.sh 10 DIR "" thread'),
        ("qos.txt", "QoS accuracy", "bench/qos.sh 10"),
    ):
        p = os.path.join(d, name)
        if os.path.exists(p):
            with open(p) as f:
                text = f.read().rstrip()
            out += [f"## {title}", "", f"The output of `bash {script}` in this run, as printed "
                    f"(raw JSON in `{d}/{name.split('.')[0]}-json/`):", "", "```", text, "```", ""]
    out += [
        "## What is not on this page",
        "",
        "The seed experiments are a page of their own, docs/experiments.md, generated the "
        "same way from one run of `bash bench/experiments/all.sh` (raw JSON in "
        "bench/results/DATE-COMMIT-experiments-MODE/). A/B comparisons between commits "
        "(`bench/device-ab.sh REV_A REV_B`, `bench/driver-ab.sh`) are runs of their own: "
        "their output is kept under bench/results/ as the scripts printed it, and the design "
        "notes cite them there. The A/B runs kept:",
        "",
    ]
    root = os.path.dirname(os.path.abspath(d))
    for sub in sorted(os.listdir(root)):
        full = os.path.join(root, sub)
        if not os.path.isdir(full):
            continue
        for name in sorted(os.listdir(full)):
            if name.startswith(("device-ab", "driver-ab")) and name.endswith(".txt"):
                out.append(f"- `bench/results/{sub}/{name}`")
    out.append("")
    print("\n".join(out))


main()
