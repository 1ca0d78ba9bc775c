#!/usr/bin/env bash
# docs/experiments.md, regenerated: the seeds' experiments S1-S5 from one run of this
# script, written (not edited) by bench/experiments/render.py from the raw JSON the run
# keeps and the page's fixed text (bench/experiments/page.md: the seeds' figures, the
# setups, what a comparison means).
#
#   bash bench/experiments/all.sh [quick|full] [OUT_DIR]
#
#   quick   about 12 minutes: one run per variant, 2 s each; S4 without the hidden-hint
#           random rows; S5 on a 1 GiB file, 3 s per run
#   full    about 40 minutes (the default): 5 runs per variant taking turns (S2: 3; S4,
#           deterministic: 1), 2 s each; S5 as bench/experiments/s5.sh runs it
#
# OUT_DIR (relative to the repository's root; default
# bench/results/DATE-COMMIT-experiments-MODE) gets machine.txt (the
# machine and its state), manifest.tsv (per table: id, title, load average at its start,
# command), one ID.json.gz per table (`vblk bench --output-format json`) and s5.txt (S5's
# text output). Then docs/experiments.md is rewritten from OUT_DIR; commit both. Runs the
# embedded benchmarks of S1-S4 under SCHED_FIFO (PRIO=rt, as the scripts' PRIO) and S5
# sets the host disk's scheduler (restored on exit): root. Needs qemu-storage-daemon
# (qemu-system-common), taskset and chrt (util-linux); run on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODE=${1:-full}
case $MODE in
quick) R=1 R2=1 RT=2 S5=(RUNTIME=3 RAMP=1 SIZE=1g) NOROT_RANDOM=0 ;;
full) R=5 R2=3 RT=2 S5=() NOROT_RANDOM=1 ;;
*)
  echo "usage: bash bench/experiments/all.sh [quick|full] [OUT_DIR]" >&2
  exit 2
  ;;
esac
for tool in qemu-storage-daemon:qemu-system-common taskset:util-linux chrt:util-linux; do
  command -v "${tool%%:*}" > /dev/null || {
    echo "bench/experiments/all.sh: ${tool%%:*} is missing (apt-get install ${tool#*:})" >&2
    exit 1
  }
done
[ "$(id -u)" = 0 ] || { echo "bench/experiments/all.sh: run as root (SCHED_FIFO, S5's scheduler)" >&2; exit 1; }
COMMIT=$(git rev-parse --short HEAD)
git diff --quiet HEAD -- crates bench Cargo.lock || COMMIT="$COMMIT+changes"
OUT=${2:-bench/results/$(date -u +%F)-$COMMIT-experiments-$MODE}
mkdir -p "$OUT"
: > "$OUT/manifest.tsv"
JSON_OUT=$(cd "$OUT" && pwd)
export JSON_OUT PRIO=rt
cargo build --release -q -p vblk
START=$(date +%s)
{
  echo "mode: $MODE (runs per variant: S1 and S3 $R, S2 $R2, S4 1, S5 1; ${RT} s per run in S1 and S3's QD1, the job files' and S4's and S5's own elsewhere)"
  echo "command: bash bench/experiments/all.sh $MODE"
  echo "commit: $COMMIT"
  echo "started: $(date -u +%FT%TZ)"
  echo "machine: $(nproc) CPUs, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), kernel $(uname -r), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
  echo "load at start: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "qemu-storage-daemon: $(qemu-storage-daemon --version | head -1)"
  echo "rustc: $(rustc --version)"
} > "$OUT/machine.txt"
cat "$OUT/machine.txt" >&2

echo "== S1" >&2
REPEAT=$R RUNTIME=$RT bash bench/experiments/s1.sh
echo "== S2" >&2
REPEAT=$R2 bash bench/experiments/s2.sh
echo "== S3" >&2
REPEAT=$R RUNTIME=$RT bash bench/experiments/s3.sh
echo "== S4" >&2
REPEAT=1 RUNTIME=3 NOROT_RANDOM=$NOROT_RANDOM bash bench/experiments/s4.sh
echo "== S5" >&2
env "${S5[@]}" bash bench/experiments/s5.sh > "$OUT/s5.txt"

echo "finished: $(date -u +%FT%TZ) ($(($(date +%s) - START)) s)" >> "$OUT/machine.txt"
# The JSON keeps every run's full report (S2's is tens of MB): compressed, as render.py reads it.
gzip -9f "$OUT"/*.json
python3 bench/experiments/render.py "$OUT" > "$OUT/experiments.md"
mv "$OUT/experiments.md" docs/experiments.md
echo "docs/experiments.md rewritten from $OUT ($(($(date +%s) - START)) s)" >&2
