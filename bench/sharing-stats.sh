#!/usr/bin/env bash
# Where the devices' CPU goes in bench/sharing.sh's load: 16 null disks, 16 `vblk bench`
# jobs paced at 5 k IOPS each (QD 1-4) on CPU 0, served on CPU 1 either by one vblk serve
# with one worker thread (`shared`, the default) or by 16 vblk serve daemons (`each`).
# Over 5 s inside the run: the I/Os completed, the daemons' CPU (/proc/PID/stat), and from
# `vblk stats` their worker threads' sleeps, polls that found work and polls that did not,
# and the CPU a sleep costs (each worker's own measure; for `each`, the mean over 16),
# and the daemons' write system calls (/proc/PID/io syscw: their eventfd writes, each a
# completion signalled to a job that went to sleep waiting for it). The environment
# reaches the daemons: VBLK_TEST_POLL_REGIME=coalesce pins the coalescing regime.
#
#   bash bench/sharing-stats.sh [shared|each] [SERVE_FLAGS...]     e.g. shared --poll-us 0
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-shared}
[ $# -gt 0 ] && shift
case "$MODE" in shared | each) ;; *) echo "usage: bench/sharing-stats.sh [shared|each] [SERVE_FLAGS...]" >&2; exit 2 ;; esac
cargo build --release -q -p vblk
V=$PWD/target/release/vblk
D=$(mktemp -d /var/tmp/vblk-sharing-stats.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$D"; }
trap cleanup EXIT
wait_sock() { for _ in $(seq 200); do [ -S "$1" ] && return 0; sleep 0.05; done; echo "no socket $1" >&2; exit 1; }
ctls=()
if [ "$MODE" = shared ]; then
  args=()
  for i in $(seq 0 15); do args+=(--disk "socket=$D/d$i.sock,file=null:1G,num-queues=1"); done
  taskset -c 1 "$V" --log-level warn serve --threads 1 --image-lock off --control-socket "$D/ctl" \
    "${args[@]}" "$@" &
  pids+=($!)
  ctls+=("$D/ctl")
else
  for i in $(seq 0 15); do
    taskset -c 1 "$V" --log-level warn serve --socket-path "$D/d$i.sock" --blk-file null:1G \
      --num-queues 1 --control-socket "$D/ctl$i" "$@" &
    pids+=($!)
    ctls+=("$D/ctl$i")
  done
fi
for i in $(seq 0 15); do wait_sock "$D/d$i.sock"; done
jobs=()
for i in $(seq 0 15); do
  taskset -c 0 "$V" --log-level warn bench --socket "$D/d$i.sock" --rw=randread --bs=4k \
    --iodepth=$((1 + i % 4)) --rate_iops=5000 --size=1g --runtime=9 --time_based \
    --output-format=json >"$D/j$i.json" &
  jobs+=($!)
done
ticks() { local t=0; for p in "${pids[@]}"; do t=$((t + $(awk '{print $14 + $15}' /proc/"$p"/stat))); done; echo "$t"; }
writes() { local w=0; for p in "${pids[@]}"; do w=$((w + $(awk '/^syscw:/ {print $2}' /proc/"$p"/io))); done; echo "$w"; }
snap() { local k=0; for c in "${ctls[@]}"; do "$V" stats "$c" --json >"$D/$1-$k.json"; k=$((k + 1)); done; }
sleep 2
snap s0
t0=$(ticks)
w0=$(writes)
sleep 5
snap s1
t1=$(ticks)
w1=$(writes)
wait "${jobs[@]}"
echo "== $MODE: machine $(nproc) CPUs, $(uname -r), load average $(cut -d' ' -f1-3 /proc/loadavg); serve flags: ${*:-(defaults)}"
python3 - "$D" "${#ctls[@]}" "$((t1 - t0))" "$(getconf CLK_TCK)" "$((w1 - w0))" <<'PY'
import json, sys
d, n, ticks, hz, writes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
load = lambda tag, k: json.load(open(f"{d}/{tag}-{k}.json"))
ios = sleeps = hits = misses = 0.0
costs, secs_all = [], []
for k in range(n):
    a, b = load("s0", k), load("s1", k)
    secs = (b["uptime_ns"] - a["uptime_ns"]) / 1e9
    secs_all.append(secs)
    done = lambda doc: sum(q["completed"] for x in doc.get("disks", [doc]) for q in x["queues"])
    ios += (done(b) - done(a)) / secs
    for wa, wb in zip(a["workers"], b["workers"]):
        sleeps += (wb["sleeps"] - wa["sleeps"]) / secs
        hits += (wb["poll_hits"] - wa["poll_hits"]) / secs
        misses += (wb["poll_misses"] - wa["poll_misses"]) / secs
        if wb["sleep_cost_ns"]:
            costs.append(wb["sleep_cost_ns"])
cpu = ticks / hz / (sum(secs_all) / n)
print(f"I/Os per s {ios:.0f}; device CPU {100 * cpu:.1f} %, {cpu / ios * 1e6:.2f} µs per I/O")
print(f"sleeps per s {sleeps:.0f} ({ios / max(sleeps, 1):.1f} I/Os per wake-up); "
      f"polls that found work per s {hits:.0f}, that did not {misses:.0f}")
wps = writes / (sum(secs_all) / n)
print(f"write system calls per s {wps:.0f} ({wps / max(ios, 1):.3f} per I/O: completions signalled)")
if costs:
    print(f"a sleep's CPU cost (the workers' own measure, mean of {len(costs)}): {sum(costs) / len(costs) / 1000:.1f} µs")
PY
