#!/usr/bin/env python3
"""Write docs/experiments.md (stdout) from one run of bench/experiments/all.sh.

    python3 bench/experiments/render.py OUT_DIR > docs/experiments.md

OUT_DIR holds machine.txt, manifest.tsv (id, title, load average, command per table) and
one ID.json (or ID.json.gz) per table. The fixed text is bench/experiments/page.md; each {{...}} marker
in it is replaced here by what this script computes from the run, so every figure of ours
on the page is this run's. The seeds' figures that the comparisons use are the ones
page.md quotes (../shared/SEEDS.md).
"""
import gzip
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from table import auto_rows, backend_mb_s, human, table  # noqa: E402

# The seeds' ratios, as page.md quotes them.
SEED_S1 = {"read": 1.28, "write": 1.24, "randread": 1.21, "randwrite": 1.16}  # bio/request
SEED_S2 = {  # bio-batch/request, second run
    "write-iops": 1.13, "read-iops": 1.11, "randread-iops": 1.12, "randwrite-iops": 0.98,
    "write-bw": 0.96, "read-bw": 0.75,
}
SEED_S3 = {"s3-qd8-batch4": 1.87, "s3-qd1": 1.12}  # passthru/bio
SEED_S4 = {  # bio/request: QEMU, kvm tool
    "read": (0.98, 0.90), "write": (0.57, 0.90), "randread": (1.00, 1.04), "randwrite": (1.09, 1.01),
}
SEED_S5_COLLAPSE = (32 + 10) / (103 + 27)  # blkback under cfq over noop (its best)
SCHEDS = ["none", "mq-deadline", "bfq"]


def load(out):
    manifest = []
    with open(os.path.join(out, "manifest.tsv")) as f:
        for line in f:
            if line.strip():
                tid, title, loadavg, cmd = line.rstrip("\n").split("\t")
                manifest.append((tid, title, loadavg, cmd))
    data = {}
    for tid, *_ in manifest:
        path = os.path.join(out, f"{tid}.json")
        if os.path.exists(path + ".gz"):
            with gzip.open(path + ".gz", "rt") as f:
                data[tid] = json.load(f)
        else:
            with open(path) as f:
                data[tid] = json.load(f)
    return manifest, data


def variants(doc, job=None):
    """{variant name: variant} of one job (the first if None)."""
    for j in doc:
        if job is None or j["job"] == job:
            return {v["variant"]: v for v in j["variants"]}
    return {}


def ratio(vs, a, b):
    if a in vs and b in vs and vs[b]["iops_mean"]:
        return vs[a]["iops_mean"] / vs[b]["iops_mean"]
    return float("nan")


def spread(vs):
    """The largest relative standard deviation among the variants (0 for single runs)."""
    return max((v["iops_stddev"] / v["iops_mean"] for v in vs.values() if v["iops_mean"]), default=0)


def span(xs):
    """"a-b" over the figures that are numbers, or "–"."""
    xs = [x for x in xs if x == x]
    return f"{min(xs):.2f}-{max(xs):.2f}" if xs else "–"


def f2(x):
    return "–" if x != x else f"{x:.2f}"


def pct(x):
    return f"± {x * 100:.0f} %" if x else "1 run"


def run_block(out, manifest):
    info = dict(
        line.split(": ", 1) for line in open(os.path.join(out, "machine.txt")).read().splitlines() if ": " in line
    )
    return "\n".join([
        f"**This run:** `{info.get('command', 'bash bench/experiments/all.sh')}` at {info.get('commit', '?')}, "
        f"{info.get('started', '?')} to {info.get('finished', '?')}; {info.get('mode', '')}. "
        f"Raw JSON: `{os.path.relpath(out)}/`.",
        "",
        f"Machine: {info.get('machine', '?')}; {info.get('qemu-storage-daemon', '')}; {info.get('rustc', '')}. "
        f"Load average at the start: {info.get('load at start', '?')}; each table gives its own.",
    ])


def tables(manifest, data, prefix):
    out = []
    for tid, title, loadavg, cmd in manifest:
        if not tid.startswith(prefix) or tid.startswith("s5-"):
            continue
        out += ["```", cmd, "```", "", f"(load average at its start: {loadavg})", "", table(data[tid], title)]
    return "\n".join(out) if out else "_This run has no such tables._\n"


REQ = "path=request,elevator=deadline"


def s1(data):
    rows = ["| job | seed bio/request | bio/request | batch/request | largest spread | auto / best block path |",
            "|---|---|---|---|---|---|"]
    for job, seed in SEED_S1.items():
        doc = data.get(f"s1-{job}")
        if not doc:
            continue
        vs = variants(doc)
        autos = auto_rows(doc)
        rows.append(f"| {job} | {seed:.2f} | {f2(ratio(vs, 'path=bio', REQ))} | {f2(ratio(vs, 'path=batch', REQ))} | "
                    f"{pct(spread(vs))} | {f2(autos[0][1]) if autos else '–'} |")
    return "\n".join(rows) + "\n"


def s2(data):
    doc = data.get("s2-matrix")
    if not doc:
        return "_Not in this run._\n"
    rows = ["| job | seed bio-batch/request | bio/request | batch/request | largest spread |", "|---|---|---|---|---|"]
    for j in doc:
        vs = {v["variant"]: v for v in j["variants"]}
        seed = SEED_S2.get(j["job"])
        rows.append(f"| {j['job']} | {f2(seed) if seed else '–'} | {f2(ratio(vs, 'path=bio', 'path=request'))} | "
                    f"{f2(ratio(vs, 'path=batch', 'path=request'))} | {pct(spread(vs))} |")
    return "\n".join(rows) + "\n"


def s3(data):
    rows = ["| job | seed passthru/block | passthru/bio | passthru IOPS | bio IOPS |", "|---|---|---|---|---|"]
    for tid, seed in SEED_S3.items():
        doc = data.get(tid)
        if not doc:
            continue
        vs = variants(doc)
        p, b = vs.get("path=passthru"), vs.get("path=bio")
        rows.append(f"| {doc[0]['job']} | {seed:.2f} | {f2(ratio(vs, 'path=passthru', 'path=bio'))} | "
                    f"{human(p['iops_mean']) if p else '–'} | {human(b['iops_mean']) if b else '–'} |")
    return "\n".join(rows) + "\n"


def s4(data):
    rows = ["| disk | job | seed bio/request (QEMU; kvm tool) | bio/request | request at depth 2 / request | auto / best | auto ran |",
            "|---|---|---|---|---|---|---|"]
    for disk in ("hdd", "norot"):
        for job, seed in SEED_S4.items():
            doc = data.get(f"s4-{disk}-{job}")
            if not doc:
                continue
            vs = variants(doc)
            autos = auto_rows(doc)
            rows.append(
                f"| {'hdd:1G' if disk == 'hdd' else 'hdd:1G:norot'} | {job} | {seed[0]:.2f}; {seed[1]:.2f} | "
                f"{f2(ratio(vs, 'path=bio', 'path=request'))} | "
                f"{f2(ratio(vs, 'path=request,queue_depth=2', 'path=request'))} | "
                f"{f2(autos[0][1]) if autos else '–'} | {autos[0][3] if autos else '–'} |")
    return "\n".join(rows) + "\n"


def s5_cells(data, mix):
    cells, order = {}, []
    for s in SCHEDS:
        doc = data.get(f"s5-mix{mix}-{s}")
        if not doc:
            continue
        for x in doc[0]["variants"]:
            name, r, w = backend_mb_s(x)
            if name not in order:
                order.append(name)
            cells[(name, s)] = (r, w)
    return cells, order


def s5(data, manifest):
    out = []
    for mix in ("80", "1"):
        cells, order = s5_cells(data, mix)
        if not cells:
            continue
        scheds = [s for s in SCHEDS if any((n, s) in cells for n in order)]
        out += [f"rwmixread={mix}{' (99 % writes)' if mix == '1' else ''}: read/write MB/s (10^6 bytes), and the "
                "worst scheduler's total over the best's (the seed's blkback: cfq over noop)", "",
                "| backend | " + " | ".join(scheds) + " | worst / best |", "|---|" + "---|" * (len(scheds) + 1)]
        for n in order:
            tot = {s: sum(cells[(n, s)]) for s in scheds if (n, s) in cells}
            worst = min(tot.values()) / max(tot.values()) if tot and max(tot.values()) else float("nan")
            out.append(f"| {n} | " + " | ".join(
                f"{cells[(n, s)][0]:.0f}/{cells[(n, s)][1]:.0f}" if (n, s) in cells else "–" for s in scheds)
                + f" | {f2(worst)} |")
        out.append("")
        sync_share = [sum(cells[("vblk-sync", s)]) / sum(cells[("vblk-io_uring", s)])
                      for s in scheds if ("vblk-sync", s) in cells and ("vblk-io_uring", s) in cells]
        qsd = [max((sum(cells[(n, s)]) for n in order if n.startswith("qsd-") and (n, s) in cells), default=0)
               for s in scheds]
        ours = [sum(cells[("vblk-io_uring", s)]) if ("vblk-io_uring", s) in cells else 0 for s in scheds]
        vs_qsd = [o / q for o, q in zip(ours, qsd) if q]
        if sync_share:
            out.append(f"- The sync engine moves {min(sync_share):.2f}-{max(sync_share):.2f} of the io_uring "
                       "engine's MB/s across the schedulers.")
        if vs_qsd:
            out.append(f"- vblk's io_uring engine over qemu-storage-daemon's fastest mode: "
                       f"{min(vs_qsd):.2f}-{max(vs_qsd):.2f} across the schedulers.")
        out.append("")
    loads = [(tid, l) for tid, _, l, _ in manifest if tid.startswith("s5-")]
    if loads:
        out.append("Load average at the start of each run: "
                   + ", ".join(f"{tid[3:]} {l}" for tid, l in loads) + ".")
        out.append("")
        out.append("Each run: `" + next(c for tid, _, _, c in manifest if tid.startswith("s5-")) + "` "
                   "(with the `--rwmixread` of its mix), devices started by the script.")
    return "\n".join(out) + "\n" if out else "_Not in this run._\n"


def auto(data, manifest):
    rows = ["| table | job | auto / best block path | best block path | auto ran |", "|---|---|---|---|---|"]
    worst = None
    for tid, title, _, _ in manifest:
        if tid.startswith("s5-"):
            continue
        for job, frac, best, chose in auto_rows(data[tid]):
            worst = frac if worst is None else min(worst, frac)
            rows.append(f"| {title} | {job} | {f2(frac)} | {best} | {chose or '–'} |")
    if worst is None:
        return "_No table of this run has `path=auto`._\n"
    return "\n".join(rows) + f"\n\nauto's worst row in this run: {worst:.2f} of the best block path.\n"


def headline(data):
    lines = ["| experiment | the seed | this run |", "|---|---|---|"]
    b = [ratio(variants(data[f"s1-{j}"]), "path=bio", REQ) for j in SEED_S1 if f"s1-{j}" in data]
    if b:
        lines.append(f"| S1 RAM disk, bio/request | 1.16-1.28 | {span(b)} |")
    if "s2-matrix" in data:
        r = [ratio({v["variant"]: v for v in j["variants"]}, "path=batch", "path=request")
             for j in data["s2-matrix"] if j["job"].endswith("-iops") and j["job"] in SEED_S2]
        lines.append(f"| S2 16 jobs, batch/request, 4 KiB read, write, randread, randwrite | 0.98-1.13 | {span(r)} |")
    for tid, seed in SEED_S3.items():
        if tid in data:
            lines.append(f"| S3 {data[tid][0]['job']}, passthru/bio | {seed:.2f} | "
                         f"{f2(ratio(variants(data[tid]), 'path=passthru', 'path=bio'))} |")

    def s4(job, a, b):
        doc = data.get(f"s4-hdd-{job}")
        return ratio(variants(doc), a, b) if doc else float("nan")

    if any(f"s4-hdd-{j}" in data for j in ("read", "write")):
        lines.append("| S4 slow disk, bio/request, sequential read; write | 0.98; 0.57 (QEMU) | "
                     f"{f2(s4('read', 'path=bio', 'path=request'))}; {f2(s4('write', 'path=bio', 'path=request'))} |")
        lines.append("| S4 slow disk, request at depth 2 / at the ring's depth, sequential read; write "
                     "| – (the seed did not vary it) | "
                     f"{f2(s4('read', 'path=request,queue_depth=2', 'path=request'))}; "
                     f"{f2(s4('write', 'path=request,queue_depth=2', 'path=request'))} |")
    cells, order = s5_cells(data, "80")
    tot = {s: sum(cells[("vblk-sync", s)]) for s in SCHEDS if ("vblk-sync", s) in cells}
    if tot and max(tot.values()):
        lines.append(f"| S5 synchronous submits, 80 % reads, worst scheduler / best | {SEED_S5_COLLAPSE:.2f} "
                     f"(cfq / noop) | {min(tot.values()) / max(tot.values()):.2f} |")
    fr = [f for tid in data if not tid.startswith("s5-") for _, f, _, _ in auto_rows(data[tid])]
    if fr:
        worst = min((x for x in fr if x == x), default=float("nan"))
        lines.append(f"| `auto`, worst row of S1-S4 / best block path | – | {f2(worst)} |")
    return "\n".join(lines) + "\n"


def main():
    out = sys.argv[1]
    manifest, data = load(out)
    page = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "page.md")).read()
    page = re.sub(r"<!--.*?-->\n\n", "", page, flags=re.S)
    subs = {
        "run": lambda: run_block(out, manifest),
        "headline": lambda: headline(data),
        "s1": lambda: s1(data),
        "s2": lambda: s2(data),
        "s3": lambda: s3(data),
        "s4": lambda: s4(data),
        "s5": lambda: s5(data, manifest),
        "auto": lambda: auto(data, manifest),
    }

    def fill(m):
        key = m.group(1)
        if key.startswith("tables "):
            return tables(manifest, data, key.split(" ", 1)[1])
        return subs[key]()

    text = re.sub(r"\{\{([^}]+)\}\}", fill, page)
    sys.stdout.write("<!-- Generated by bench/experiments/render.py from " + os.path.relpath(out)
                     + "; do not edit: change bench/experiments/page.md or the scripts, and rerun "
                     "bash bench/experiments/all.sh. -->\n" + text)


main()
