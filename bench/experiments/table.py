#!/usr/bin/env python3
"""Turn `vblk bench --compare ... --output-format json` (stdin) into a Markdown table.

One row per job and variant: mean IOPS (± sd over --repeat runs; "1 run" when there was
one), MiB/s, the ratio to the job's first variant, and the CPU each side spent per I/O
(driver, device), in µs. When a variant is path=auto, a last column gives auto's IOPS
over the best other block path's and what auto chose. Usage:
    vblk bench ... --output-format json | table.py TITLE
bench/experiments/render.py imports `table` to write docs/experiments.md.
"""
import json
import sys


def cpu_us(side):
    ips = side.get("iops_per_cpu_sec") or 0
    return 1e6 / ips if ips else float("nan")


def human(x):
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if x >= div:
            return f"{x / div:.3g}{unit}" if x / div < 100 else f"{x / div:.0f}{unit}"
    return f"{x:.0f}"


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def block_path(variant):
    """Whether a variant is one of the block paths auto chooses among."""
    return "path=" in variant and "path=auto" not in variant and "path=passthru" not in variant


def auto_rows(data):
    """Per job with a path=auto variant: (job, auto's IOPS over the best block path's,
    that path, what auto was running at the end)."""
    out = []
    for job in data:
        vs = job["variants"]
        others = [v for v in vs if block_path(v["variant"])]
        for v in vs:
            if "path=auto" not in v["variant"] or not others:
                continue
            best = max(others, key=lambda o: o["iops_mean"])
            chose = ""
            for n in v["runs"][-1]["vblk"].get("notes", []):
                if n.startswith("auto: "):
                    chose = n[len("auto: "):].split(" (")[0]
            frac = v["iops_mean"] / best["iops_mean"] if best["iops_mean"] else float("nan")
            out.append((job["job"], frac, best["variant"], chose))
    return out


def backend_mb_s(variant):
    """A `--compare socket=...` variant's backend name (its socket's file name) and mean
    read and write MB/s (10^6 bytes) over its runs."""
    name = variant["variant"].split("/")[-1].split(".sock@")[0]
    runs = variant["runs"]
    r = sum(j["vblk"]["aggregate"]["read"]["bw_bytes"] for j in runs) / len(runs) / 1e6
    w = sum(j["vblk"]["aggregate"]["write"]["bw_bytes"] for j in runs) / len(runs) / 1e6
    return name, r, w


def table(data, title=""):
    """The Markdown table (and auto's worst row) for one `vblk bench` JSON document."""
    lines = []
    if title:
        lines += [f"**{title}**", ""]
    lines.append("| job | variant | IOPS | MiB/s | ratio | driver µs CPU/IO | device µs CPU/IO | auto |")
    lines.append("|---|---|---|---|---|---|---|---|")
    autos = {(j, "path=auto"): (f, chose) for j, f, _, chose in auto_rows(data)}
    for job in data:
        vs = job["variants"]
        base = vs[0]["iops_mean"] or 1
        for v in vs:
            runs = [r["vblk"] for r in v["runs"]]
            mib = mean([r["bw_bytes"] for r in runs]) / 2**20
            drv = mean([cpu_us(r["driver"]) for r in runs])
            dev = mean([cpu_us(r.get("device", {})) for r in runs])
            iops = human(v["iops_mean"])
            iops += f" ± {human(v['iops_stddev'])}" if len(runs) > 1 else " (1 run)"
            auto = ""
            if "path=auto" in v["variant"] and (job["job"], "path=auto") in autos:
                frac, chose = autos[(job["job"], "path=auto")]
                auto = f"{frac:.2f} of best ({chose})"

            def us(x):
                return "–" if x != x else f"{x:.2f}"  # NaN: not measured in some run

            lines.append(
                f"| {job['job']} | {v['variant']} | {iops} | {mib:.1f} | "
                f"{v['iops_mean'] / base:.2f} | {us(drv)} | {us(dev)} | {auto} |"
            )
    lines.append("")
    fr = [f for _, f, _, _ in auto_rows(data)]
    if fr:
        lines += [f"auto's worst row: {min(fr):.3f} of the best block path's IOPS", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(json.load(sys.stdin), sys.argv[1] if len(sys.argv) > 1 else ""))
