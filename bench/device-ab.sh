#!/usr/bin/env bash
# Two builds of `vblk serve` side by side: both devices run at once (pinned to CPU 1), one
# `vblk bench --compare socket=A,B --repeat N` per table drives them in turns from CPU 0
# (the variants alternate, so drift on a shared machine falls on both alike). The driver
# is B's. For "did this change cost the hot path anything": the null disk shows the
# device's own cost per request, the RAM disk adds a copy, the O_DIRECT file adds a disk.
#
#   bash bench/device-ab.sh REV_A REV_B [REPEAT] [RUNTIME_S] [TABLES] [-- SERVE_ARGS...]
#
# REV_A, REV_B: git revisions (built in worktrees under /var/tmp/vblk-ab) or paths to vblk
# binaries. TABLES (default all): null-qd1 null-qd32 mem-qd32 file-qd1 file-qd32. SERVE_ARGS go to
# both devices (flags both builds know). Columns to read: IOPS, and "dev IOPS/CPU-s" (its
# inverse is the device's CPU time per request). Each table's header has the load average
# at its start.
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: bench/device-ab.sh REV_A REV_B [REPEAT] [RUNTIME_S] [TABLES] [-- SERVE_ARGS...]"
A=${1:?$usage}
B=${2:?$usage}
shift 2
POS=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do POS+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
EXTRA=("$@")
REPEAT=${POS[0]:-5}
RUNTIME=${POS[1]:-5}
TABLES=${POS[2]:-"null-qd1 null-qd32 mem-qd32 file-qd1 file-qd32"}

. bench/lib/build-rev.sh
VA=$(build "$A")
VB=$(build "$B")
D=$(mktemp -d /var/tmp/vblk-device-ab.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$D"; }
trap cleanup EXIT

echo "A: $A ($("$VA" --version 2>/dev/null || echo "$VA"))"
echo "B: $B ($("$VB" --version 2>/dev/null || echo "$VB"))"
echo "machine: $(nproc) CPUs, $(uname -r), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"

wait_sock() { for _ in $(seq 100); do [ -S "$1" ] && return 0; sleep 0.1; done; echo "no socket $1" >&2; exit 1; }

# start NAME BINARY DISK ARGS...: a device pinned to CPU 1; prints nothing
start() {
  local name=$1 bin=$2 disk=$3; shift 3
  taskset -c 1 "$bin" --log-level warn serve --socket-path "$D/$name.sock" --blk-file "$disk" \
    --num-queues 1 --image-lock off "$@" "${EXTRA[@]}" &
  pids+=($!)
  eval "PID_$name=$!"
  wait_sock "$D/$name.sock"
}
stop_all() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }
sock() { local v="PID_$1"; echo "$D/$1.sock@${!v}"; }
pair() { # DISK ARGS...
  start A "$VA" "$@"
  start B "$VB" "$@"
  PAIR="socket=$(sock A),$(sock B)"
}
bench() { # TITLE ARGS...
  local title=$1; shift
  echo
  echo "== $title (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
  echo "\$ vblk bench $*"
  taskset -c 0 "$VB" --log-level warn bench --name "${title%%:*}" --bs=4k --rw=randread \
    --runtime="$RUNTIME" --time_based --ramp_time=1 --size=1g --repeat "$REPEAT" "$@"
}
want() { [[ " $TABLES " == *" $1 "* ]]; }

if want null-qd1 || want null-qd32; then
  pair null:1G
  want null-qd1 && bench "null-qd1: null disk, QD1, saturation" --iodepth=1 --compare "$PAIR"
  want null-qd32 && bench "null-qd32: null disk, QD32, saturation" --iodepth=32 --compare "$PAIR"
  stop_all
fi
if want mem-qd32; then
  pair mem:1G --prealloc
  bench "mem-qd32: RAM disk, QD32, saturation" --iodepth=32 --compare "$PAIR"
  stop_all
fi
if want file-qd1 || want file-qd32; then
  IMG=$D/disk.img
  dd if=/dev/urandom of="$IMG" bs=1M count=1024 status=none
  sync
  pair "$IMG" --cache none
  want file-qd1 && bench "file-qd1: O_DIRECT file, QD1" --iodepth=1 --compare "$PAIR"
  want file-qd32 && bench "file-qd32: O_DIRECT file, QD32" --iodepth=32 --compare "$PAIR"
  stop_all
fi
