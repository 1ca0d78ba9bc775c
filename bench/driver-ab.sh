#!/usr/bin/env bash
# Two builds of vblk's driver side by side, against one device: `vblk bench` of build A and
# of build B alternate ROUNDS times on the same `vblk serve` (device pinned to CPU 1, the
# benchmark to CPU 0), so that drift on a shared machine hits both alike. Prints, per path
# and job, the median IOPS and driver IOPS per CPU-second of each build and B/A.
#
#   bash bench/driver-ab.sh REV_A REV_B [ROUNDS] [RUNTIME_S] [PATHS]
#
# REV_A, REV_B: git revisions (built in worktrees under /var/tmp/vblk-ab), or paths to vblk
# binaries. PATHS: the I/O paths to compare (default "bio batch"); both builds must know
# them. The device is always B's (a null disk: it costs the least, so the driver's share
# shows).
set -euo pipefail
cd "$(dirname "$0")/.."
A=${1:?usage: bench/driver-ab.sh REV_A REV_B [ROUNDS] [RUNTIME_S] [PATHS]}
B=${2:?usage: bench/driver-ab.sh REV_A REV_B [ROUNDS] [RUNTIME_S] [PATHS]}
ROUNDS=${3:-5}
RUNTIME=${4:-3}
PATHS=${5:-"bio batch"}

. bench/lib/build-rev.sh
VA=$(build "$A")
VB=$(build "$B")
D=$(mktemp -d /var/tmp/vblk-driver-ab.XXXXXX)
pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$D"; }
trap cleanup EXIT

taskset -c 1 "$VB" serve --socket-path "$D/dev.sock" --blk-file null:4G --num-queues 1 \
  --log-level warn &
pid=$!
for _ in $(seq 100); do [ -S "$D/dev.sock" ] && break; sleep 0.1; done

JOBS=("randread 1" "randread 32" "randwrite 32")
for r in $(seq "$ROUNDS"); do
  for path in $PATHS; do
    for job in "${JOBS[@]}"; do
      set -- $job
      for side in A B; do
        bin=$VA; [ $side = B ] && bin=$VB
        taskset -c 0 "$bin" bench --socket "$D/dev.sock" --device-pid "$pid" --no-pin \
          --rw="$1" --bs=4k --iodepth="$2" --runtime="$RUNTIME" --time_based --ramp_time=500ms \
          --path "$path" --output-format json 2>/dev/null |
          python3 -c "import json,sys; d=json.load(sys.stdin); v=d['vblk'] if 'vblk' in d else d['rows'][0]['runs'][0]['vblk']; print('$side $path $1-qd$2', v['iops'], v['driver']['iops_per_cpu_sec'])" >>"$D/results"
      done
    done
  done
  echo "round $r of $ROUNDS done" >&2
done

python3 - "$D/results" "$A" "$B" <<'EOF'
import statistics, sys
from collections import defaultdict
runs = defaultdict(list)
for line in open(sys.argv[1]):
    side, path, job, iops, eff = line.split()
    runs[(path, job, side)].append((float(iops), float(eff)))
print(f"A = {sys.argv[2]}, B = {sys.argv[3]}; medians of {len(next(iter(runs.values())))} alternating runs")
print(f"{'path':8} {'job':16} {'A IOPS':>9} {'B IOPS':>9} {'B/A':>6} {'A drv/CPU-s':>12} {'B drv/CPU-s':>12} {'B/A':>6}")
for (path, job) in sorted({(p, j) for p, j, _ in runs}):
    a = runs[(path, job, "A")]; b = runs[(path, job, "B")]
    ai = statistics.median(x for x, _ in a); bi = statistics.median(x for x, _ in b)
    ae = statistics.median(y for _, y in a); be = statistics.median(y for _, y in b)
    print(f"{path:8} {job:16} {ai/1e3:8.0f}k {bi/1e3:8.0f}k {bi/ai:6.2f} {ae/1e3:11.0f}k {be/1e3:11.0f}k {be/ae:6.2f}")
EOF
