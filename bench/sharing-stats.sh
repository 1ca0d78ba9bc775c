#!/usr/bin/env bash
# Where the shared daemon's CPU goes in bench/sharing.sh's load: one vblk serve, 16 null
# disks, one worker thread on CPU 1; 16 `vblk bench` jobs paced at 5 k IOPS each (QD 1-4)
# on CPU 0. Over 5 s inside the run: the I/Os completed, the daemon's CPU (/proc/PID/stat),
# and from `vblk stats` the worker's sleeps, polls that found work and polls that did
# not, its polling window and its measure of a sleep's CPU cost.
#
#   bash bench/sharing-stats.sh [SERVE_FLAGS...]     e.g. --poll-us 0
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p vblk
V=$PWD/target/release/vblk
D=$(mktemp -d /var/tmp/vblk-sharing-stats.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$D"; }
trap cleanup EXIT
args=()
for i in $(seq 0 15); do args+=(--disk "socket=$D/d$i.sock,file=null:1G,num-queues=1"); done
taskset -c 1 "$V" --log-level warn serve --threads 1 --image-lock off --control-socket "$D/ctl" \
  "${args[@]}" "$@" &
P=$!
pids+=("$P")
for _ in $(seq 200); do [ -S "$D/d15.sock" ] && break; sleep 0.05; done
jobs=()
for i in $(seq 0 15); do
  taskset -c 0 "$V" --log-level warn bench --socket "$D/d$i.sock" --rw=randread --bs=4k \
    --iodepth=$((1 + i % 4)) --rate_iops=5000 --size=1g --runtime=9 --time_based \
    --output-format=json >"$D/j$i.json" &
  jobs+=($!)
done
sleep 2
"$V" stats "$D/ctl" --json >"$D/s0.json"
t0=$(awk '{print $14 + $15}' /proc/"$P"/stat)
sleep 5
"$V" stats "$D/ctl" --json >"$D/s1.json"
t1=$(awk '{print $14 + $15}' /proc/"$P"/stat)
wait "${jobs[@]}"
echo "== machine: $(nproc) CPUs, $(uname -r), load average $(cut -d' ' -f1-3 /proc/loadavg); serve flags: ${*:-(defaults)}"
python3 - "$D/s0.json" "$D/s1.json" "$((t1 - t0))" "$(getconf CLK_TCK)" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
ticks, hz = int(sys.argv[3]), int(sys.argv[4])
secs = (b["uptime_ns"] - a["uptime_ns"]) / 1e9
done = lambda d: sum(q["completed"] for x in d["disks"] for q in x["queues"])
ios = (done(b) - done(a)) / secs
wa, wb = a["workers"][0], b["workers"][0]
rate = lambda k: (wb[k] - wa[k]) / secs
cpu = ticks / hz / secs
print(f"I/Os per s {ios:.0f}; daemon CPU {100 * cpu:.1f} %, {cpu / ios * 1e6:.2f} µs per I/O")
print(f"sleeps per s {rate('sleeps'):.0f} ({ios / max(rate('sleeps'), 1):.1f} I/Os per wake-up); "
      f"polls that found work per s {rate('poll_hits'):.0f}, that did not {rate('poll_misses'):.0f}")
print(f"polling window {wb['poll_window_ns'] / 1000:.1f} µs; a sleep's CPU cost {wb['sleep_cost_ns'] / 1000:.1f} µs")
PY
