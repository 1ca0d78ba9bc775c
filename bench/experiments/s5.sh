#!/usr/bin/env bash
# Experiment S5 (seed 001): a kernel thread doing synchronous submits against a userspace
# AIO backend (Xen blkback vs qdisk, 2011), under the host disk's I/O schedulers.
#
# The IOmeter file-server job of the seed (bench/jobs/iometer-file-server.fio: 64 KiB,
# randrw, rwmixread 80, 2 jobs, QD256) and the seed's pathological variant (99 % writes,
# 1 % reads), on an O_DIRECT file on the host's disk, with that disk's scheduler set to
# none, mq-deadline and bfq (CFQ's successor) in turn, for
#   vblk serve --engine sync, threads, aio, io_uring   (--cache none)
#   qemu-storage-daemon aio=threads, native, io_uring  (cache.direct=on)
# side by side in one `vblk bench --compare socket=...` run per scheduler and mix
# (devices pinned to CPU 1, the benchmark to CPU 0). Prints each run's table (MB/s read
# and write per backend, the ratio of total MB/s to the first row), then a summary with
# one cell per backend and scheduler: read/write MB/s (MB = 10^6 bytes, as the seed's).
#
#   bash bench/experiments/s5.sh                # a full run: about 10 minutes
#   RUNTIME=2 RAMP=1 bash bench/experiments/s5.sh   # a smoke run
#
# Environment: RUNTIME (seconds per run, default 10), RAMP (default 2), REPEAT (default 1),
# SIZE (the file, default 4g), DIR (where the file goes, default /var/tmp), SCHEDS (default
# "none mq-deadline bfq"), MIXES (rwmixread values, default "80 1"), KEEP=1 keeps the file
# for the next run; JSON_OUT=DIR (an absolute path; bench/experiments/all.sh sets it)
# keeps each run's JSON there. The disk's scheduler is restored on exit, whatever happens (trap);
# writing it needs root. Needs qemu-storage-daemon (Debian: qemu-system-common), taskset.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNTIME=${RUNTIME:-10}
RAMP=${RAMP:-2}
REPEAT=${REPEAT:-1}
SIZE=${SIZE:-4g}
DIR=${DIR:-/var/tmp}
SCHEDS=${SCHEDS:-"none mq-deadline bfq"}
MIXES=${MIXES:-"80 1"}
JOB=bench/jobs/iometer-file-server.fio

cargo build --release -q -p vblk
V=$PWD/target/release/vblk
IMG=$DIR/vblk-s5.img
D=$(mktemp -d "$DIR/vblk-s5.XXXXXX")

# The block device under the file (a partition's parent), and its scheduler now.
SRC=$(df --output=source "$DIR" | tail -1)
DEV=$(basename "$(readlink -f "$SRC")")
if [ -e "/sys/class/block/$DEV/partition" ]; then
  DEV=$(basename "$(readlink -f "/sys/class/block/$DEV/..")")
fi
SCHED_FILE=/sys/block/$DEV/queue/scheduler
[ -w "$SCHED_FILE" ] || { echo "cannot write $SCHED_FILE (run as root)" >&2; exit 1; }
ORIG=$(sed -e 's/.*\[\(.*\)\].*/\1/' "$SCHED_FILE")
for s in $SCHEDS; do
  grep -qw "$s" "$SCHED_FILE" || { echo "$DEV offers no scheduler $s: $(cat "$SCHED_FILE")" >&2; exit 1; }
done

pids=()
cleanup() {
  echo "$ORIG" > "$SCHED_FILE" || echo "could not restore $SCHED_FILE to $ORIG" >&2
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$D"
  [ "${KEEP:-0}" = 1 ] || rm -f "$IMG"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# A file with real blocks (no holes, no unwritten extents), so reads reach the disk.
want=$(numfmt --from=iec "${SIZE^^}")
if [ ! -f "$IMG" ] || [ "$(stat -c %s "$IMG")" != "$want" ]; then
  echo "writing $SIZE to $IMG ..."
  dd if=/dev/zero of="$IMG" bs=1M count=$((want >> 20)) oflag=direct status=none
fi

wait_sock() { for _ in $(seq 100); do [ -S "$1" ] && return 0; sleep 0.1; done; echo "no socket $1" >&2; exit 1; }

start() { # NAME CMD...: a device pinned to CPU 1; its socket is $D/NAME.sock
  local name=$1; shift
  taskset -c 1 "$@" &
  pids+=($!)
  eval "PID_${name//-/_}=$!"
  wait_sock "$D/$name.sock"
}
sock() { local v="PID_${1//-/_}"; echo "$D/$1.sock@${!v}"; }

NAMES=()
for e in sync threads aio io_uring; do
  start "vblk-$e" "$V" --log-level warn serve --socket-path "$D/vblk-$e.sock" --blk-file "$IMG" \
    --cache none --engine "$e" --num-queues 2 --image-lock off
  NAMES+=("vblk-$e")
done
for a in threads native io_uring; do
  start "qsd-$a" qemu-storage-daemon \
    --blockdev "driver=file,filename=$IMG,cache.direct=on,aio=$a,locking=off,node-name=n0" \
    --export "type=vhost-user-blk,id=e0,node-name=n0,addr.type=unix,addr.path=$D/qsd-$a.sock,num-queues=2,writable=on"
  NAMES+=("qsd-$a")
done
CMP="socket=$(for n in "${NAMES[@]}"; do printf '%s,' "$(sock "$n")"; done)"
CMP=${CMP%,}

echo "S5 on $IMG ($SIZE, $(df --output=fstype "$DIR" | tail -1) on /dev/$DEV), scheduler before: $ORIG"
echo "$(nproc) CPUs, kernel $(uname -r); runs of ${RUNTIME}s after ${RAMP}s, $REPEAT per backend"
for mix in $MIXES; do
  for s in $SCHEDS; do
    echo "$s" > "$SCHED_FILE"
    echo
    LOAD=$(cut -d' ' -f1-3 /proc/loadavg)
    echo "== rwmixread=$mix, scheduler $s (load average: $LOAD)"
    echo "\$ vblk bench $JOB --rwmixread=$mix --runtime=$RUNTIME --time_based --ramp_time=$RAMP --repeat $REPEAT --compare socket=..."
    taskset -c 0 "$V" --log-level warn bench "$JOB" --rwmixread="$mix" --runtime="$RUNTIME" \
      --time_based --ramp_time="$RAMP" --repeat "$REPEAT" --compare "$CMP" \
      --output-format=json > "$D/mix$mix-$s.json"
    if [ -n "${JSON_OUT:-}" ]; then
      cp "$D/mix$mix-$s.json" "$JSON_OUT/s5-mix$mix-$s.json"
      printf '%s\t%s\t%s\t%s\n' "s5-mix$mix-$s" "S5 rwmixread=$mix, scheduler $s" "$LOAD" \
        "vblk bench $JOB --rwmixread=$mix --runtime=$RUNTIME --time_based --ramp_time=$RAMP --repeat $REPEAT --compare socket=vblk-{sync,threads,aio,io_uring},qsd-{threads,native,io_uring}" \
        >> "$JSON_OUT/manifest.tsv"
    fi
    python3 - "$D/mix$mix-$s.json" <<'EOF'
import json, sys
sys.path.insert(0, "bench/experiments")
from table import backend_mb_s
rows = [backend_mb_s(x) for x in json.load(open(sys.argv[1]))[0]["variants"]]
base = rows[0][1] + rows[0][2]
print(f"{'backend':<16} {'read MB/s':>10} {'write MB/s':>11} {'ratio':>7}")
for name, r, w in rows:
    print(f"{name:<16} {r:>10.1f} {w:>11.1f} {(r + w) / base if base else 0:>7.2f}")
EOF
  done
done

echo "$ORIG" > "$SCHED_FILE"
echo
echo "== summary: read/write MB/s per backend and scheduler"
python3 - "$D" "$MIXES" "$SCHEDS" <<'EOF'
import json, sys
sys.path.insert(0, "bench/experiments")
from table import backend_mb_s
d, mixes, scheds = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
for mix in mixes:
    cells = {}
    order = []
    for s in scheds:
        for x in json.load(open(f"{d}/mix{mix}-{s}.json"))[0]["variants"]:
            name, r, w = backend_mb_s(x)
            if name not in order:
                order.append(name)
            cells[(name, s)] = f"{r:.0f}/{w:.0f}"
    print(f"\nrwmixread={mix}")
    print("| backend | " + " | ".join(scheds) + " |")
    print("|---|" + "---|" * len(scheds))
    for name in order:
        print(f"| {name} | " + " | ".join(cells[(name, s)] for s in scheds) + " |")
EOF
