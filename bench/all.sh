#!/usr/bin/env bash
# BENCHMARKS.md, regenerated: every table in it from one run of this script, written (not
# edited) by bench/render.py from the raw JSON this run keeps.
#
#   bash bench/all.sh [quick|full] [OUT_DIR]
#
#   quick   about 10 minutes: one run per variant, 2 s each (3 s for the device tables),
#           the hard-disk tables' sequential rows only, no many-disk tables
#   full    about 75 minutes (the default): 3 runs per variant taking turns, 3 s each
#           (5 s for the device tables; 10 rounds for the disk-bound device tables
#           whose paired ratios decide goals: bench/devices.sh, DISK_REPEAT), the random
#           hard-disk rows, and the many-disk sharing and QoS tables (bench/sharing.sh,
#           bench/qos.sh, 10 s windows)
#
# OUT_DIR (default bench/results/DATE-COMMIT-MODE) gets machine.txt (the machine and its
# state), manifest.tsv (per table: id, title, load average at its start, command), one
# ID.json per table (`vblk bench --output-format json`), and for full runs sharing.txt and
# qos.txt with their JSON. Then BENCHMARKS.md is rewritten from OUT_DIR and the JSON
# gzipped; commit both.
# Needs qemu-storage-daemon (qemu-system-common), nbdkit and taskset; run on a quiet
# machine.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-full}
case $MODE in
quick) REPEAT=1 RUNTIME=2 DEV_RUNTIME=3 DISK_REPEAT=1 ;;
full) REPEAT=3 RUNTIME=3 DEV_RUNTIME=5 DISK_REPEAT=10 ;;
*)
  echo "usage: bash bench/all.sh [quick|full] [OUT_DIR]" >&2
  exit 2
  ;;
esac
for tool in qemu-storage-daemon:qemu-system-common nbdkit:nbdkit taskset:util-linux; do
  command -v "${tool%%:*}" > /dev/null || {
    echo "bench/all.sh: ${tool%%:*} is missing (apt-get install ${tool#*:})" >&2
    exit 1
  }
done
COMMIT=$(git rev-parse --short HEAD)
git diff --quiet HEAD -- crates bench Cargo.lock || COMMIT="$COMMIT+changes"
OUT=${2:-bench/results/$(date -u +%F)-$COMMIT-$MODE}
mkdir -p "$OUT"
: > "$OUT/manifest.tsv"
export JSON_OUT
JSON_OUT=$(cd "$OUT" && pwd)
cargo build --release -q -p vblk
V="$PWD/target/release/vblk"
. bench/lib/record.sh
D=$(mktemp -d /var/tmp/vblk-all.XXXXXX)
trap 'rm -rf "$D"' EXIT
START=$(date +%s)

. bench/lib/machine.sh
machine_txt "$MODE (REPEAT=$REPEAT, RUNTIME=${RUNTIME}s, device tables ${DEV_RUNTIME}s, disk-bound device tables that decide goals $DISK_REPEAT rounds)" \
  "bash bench/all.sh $MODE" "$COMMIT" > "$OUT/machine.txt"
cat "$OUT/machine.txt" >&2

IMG=$D/disk.img
dd if=/dev/urandom of="$IMG" bs=1M count=1024 status=none
sync
J=(--bs=4k --runtime="$RUNTIME" --time_based --ramp_time=1 --repeat "$REPEAT")
R=(--rw=randread)
table() { # ID TITLE ARGS... (of vblk bench)
  local id=$1 title=$2
  shift 2
  record "$id" "$title" "$V" --log-level warn bench --name "$id" "$@"
}

echo "== I/O paths, embedded device" >&2
table paths-mem-qd32 "RAM disk, random reads, QD32" "${J[@]}" "${R[@]}" --iodepth=32 \
  --compare path=bio,batch,request
table paths-mem-write "RAM disk, sequential writes, QD32" "${J[@]}" --rw=write --iodepth=32 \
  --compare path=bio,batch,request
table paths-null-qd32 "null disk, random reads, QD32" "${J[@]}" "${R[@]}" --iodepth=32 \
  --disk null:1G --compare path=bio,batch,passthru

echo "== embedded device vs --baseline" >&2
table baseline-mem-qd32 "RAM disk, QD32" "${J[@]}" "${R[@]}" --iodepth=32 \
  --compare target=embedded,baseline
table baseline-mem-qd1 "RAM disk, QD1" "${J[@]}" "${R[@]}" --iodepth=1 \
  --compare target=embedded,baseline
table baseline-file-qd32 "O_DIRECT file, QD32" "${J[@]}" "${R[@]}" --iodepth=32 \
  --disk "$IMG" --cache none --compare target=embedded,baseline
table baseline-file-qd1 "O_DIRECT file, QD1" "${J[@]}" "${R[@]}" --iodepth=1 \
  --disk "$IMG" --cache none --compare target=embedded,baseline

echo "== the device's polling window" >&2
table poll-null-qd32 "null disk, QD32" "${J[@]}" "${R[@]}" --iodepth=32 --disk null:1G \
  --compare poll_us=0,50,200
table poll-mem-qd1 "RAM disk, QD1" "${J[@]}" "${R[@]}" --iodepth=1 --compare poll_us=0,10,50,200
table poll-mem-qd32 "RAM disk, QD32" "${J[@]}" "${R[@]}" --iodepth=32 \
  --compare poll_us=0,10,50,200

echo "== engines and the io_uring submission batch" >&2
table engines-qd32 "O_DIRECT file, QD32" "${J[@]}" "${R[@]}" --iodepth=32 --disk "$IMG" \
  --cache none --compare engine=io_uring,aio,threads,sync
table engines-qd1 "O_DIRECT file, QD1" "${J[@]}" "${R[@]}" --iodepth=1 --disk "$IMG" \
  --cache none --compare engine=io_uring,aio,threads,sync
table engine-threads "O_DIRECT file, QD32, threads engine pool size" "${J[@]}" "${R[@]}" \
  --iodepth=32 --disk "$IMG" --cache none --engine threads --compare engine_threads=4,16,32
table submit-batch-direct "O_DIRECT file, QD32" "${J[@]}" "${R[@]}" --iodepth=32 \
  --disk "$IMG" --cache none --compare submit_batch=0,1,2,4,8
cat "$IMG" > /dev/null
table submit-batch-cached "page cache (file read once before), QD32" "${J[@]}" "${R[@]}" \
  --iodepth=32 --disk "$IMG" --cache writeback --compare submit_batch=0,1,4

echo "== vblk serve vs qemu-storage-daemon (bench/devices.sh)" >&2
DISK_REPEAT=$DISK_REPEAT bash bench/devices.sh "$REPEAT" "$DEV_RUNTIME"

echo "== NBD: vblk serve vs qemu-storage-daemon on one nbdkit export (bench/nbd.sh)" >&2
bash bench/nbd.sh "$REPEAT" "$DEV_RUNTIME"

echo "== simulated 7200 rpm disk (S4), with and without its rotational hint" >&2
HDD_VARIANTS="path=request;path=request,queue_depth=2;path=bio;path=batch;path=auto"
HDD_RW="read write"
[ "$MODE" = full ] && HDD_RW="read write randread randwrite"
# Random rows: one run (every I/O pays a seek; the model's time hardly depends on timing).
# Sequential rows: $REPEAT runs taking turns (how many I/Os merge into a request depends on
# the threads' timing: one run of a variant differs from the next by up to a third).
hdd_repeat() { case $1 in rand*) echo 1 ;; *) echo "$REPEAT" ;; esac; }
for rw in $HDD_RW; do
  table "hdd-$rw" "hdd:1G, $rw 4 KiB, QD32" --disk hdd:1G --rw="$rw" --bs=4k --iodepth=32 \
    --runtime=$((RUNTIME + 2)) --ramp_time=1 --time_based --repeat "$(hdd_repeat "$rw")" \
    --compare "$HDD_VARIANTS"
done
for rw in $HDD_RW; do
  case $rw in
  rand*) ramp=15 runtime=30 ;;
  *) ramp=3 runtime=$((RUNTIME + 2)) ;;
  esac
  table "norot-$rw" "hdd:1G:norot, $rw 4 KiB, QD32 (ramp ${ramp} s: auto's first choice)" \
    --disk hdd:1G:norot --rw="$rw" --bs=4k --iodepth=32 --runtime="$runtime" \
    --ramp_time="$ramp" --time_based --repeat "$(hdd_repeat "$rw")" --compare "$HDD_VARIANTS"
done

if [ "$MODE" = full ]; then
  echo "== many disks: sharing and QoS (bench/sharing.sh, bench/qos.sh)" >&2
  bash bench/sharing.sh 10 "$JSON_OUT/sharing-json" > "$JSON_OUT/sharing.txt"
  bash bench/sharing.sh 10 "$JSON_OUT/sharing-thread-json" "" thread > "$JSON_OUT/sharing-thread.txt"
  bash bench/qos.sh 10 "$JSON_OUT/qos-json" > "$JSON_OUT/qos.txt"
fi

echo "finished: $(date -u +%FT%TZ) ($(($(date +%s) - START)) s)" >> "$OUT/machine.txt"
# Written through a temporary file: a render that fails leaves the page as it was.
python3 bench/render.py "$OUT" > BENCHMARKS.md.new
mv BENCHMARKS.md.new BENCHMARKS.md
# The raw JSON is kept gzipped (a full run's is 7 MB; render.py reads either).
find "$OUT" -name '*.json' -exec gzip -9f {} +
echo "BENCHMARKS.md rewritten from $OUT ($(($(date +%s) - START)) s)" >&2
