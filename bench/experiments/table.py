#!/usr/bin/env python3
"""Turn `vblk bench --compare ... --output-format json` (stdin) into a Markdown table.

One row per job and variant: mean IOPS (± sd over --repeat runs), MiB/s, the ratio to
the job's first variant, and the CPU each side spent per I/O (driver, device), in µs.
When a variant is path=auto, a last column gives auto's IOPS over the best other
variant's and what auto chose. Usage: vblk bench ... --output-format json | table.py TITLE
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


def main():
    data = json.load(sys.stdin)
    title = sys.argv[1] if len(sys.argv) > 1 else ""
    if title:
        print(f"**{title}**\n")
    print("| job | variant | IOPS | MiB/s | ratio | driver µs CPU/IO | device µs CPU/IO | auto |")
    print("|---|---|---|---|---|---|---|---|")
    worst = None
    for job in data:
        vs = job["variants"]
        base = vs[0]["iops_mean"] or 1
        best_other = max(
            (v["iops_mean"] for v in vs if "path=auto" not in v["variant"]), default=0
        )
        for v in vs:
            runs = [r["vblk"] for r in v["runs"]]
            mib = mean([r["bw_bytes"] for r in runs]) / 2**20
            drv = mean([cpu_us(r["driver"]) for r in runs])
            dev = mean([cpu_us(r.get("device", {})) for r in runs])
            sd = v["iops_stddev"]
            iops = human(v["iops_mean"]) + (f" ± {human(sd)}" if sd else "")
            auto = ""
            if "path=auto" in v["variant"] and best_other:
                frac = v["iops_mean"] / best_other
                worst = frac if worst is None else min(worst, frac)
                chose = ""
                for n in runs[-1].get("notes", []):
                    if n.startswith("auto: "):
                        chose = n[len("auto: "):].split(" (")[0]
                auto = f"{frac:.2f} of best ({chose})"
            def us(x):
                return "–" if x != x else f"{x:.2f}"  # NaN: not measured in some run

            print(
                f"| {job['job']} | {v['variant']} | {iops} | {mib:.1f} | "
                f"{v['iops_mean'] / base:.2f} | {us(drv)} | {us(dev)} | {auto} |"
            )
    print()
    if worst is not None:
        print(f"auto's worst row: {worst:.3f} of the best other variant's IOPS")
        print()


main()
