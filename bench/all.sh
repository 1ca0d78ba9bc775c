#!/usr/bin/env bash
# Every table of BENCHMARKS.md, in one run: prints the command before each table.
#   bash bench/all.sh [REPEAT] [RUNTIME_S]
set -euo pipefail
cd "$(dirname "$0")/.."
REPEAT=${1:-3}
RUNTIME=${2:-3}
cargo build --release -q -p vblk
V="$PWD/target/release/vblk --log-level warn"
D=$(mktemp -d /var/tmp/vblk-all.XXXXXX)
trap 'rm -rf "$D"' EXIT
IMG=$D/disk.img
dd if=/dev/urandom of="$IMG" bs=1M count=1024 status=none
sync
run() { echo; echo "\$ vblk ${*}"; $V "$@"; }
J="--bs=4k --runtime=$RUNTIME --time_based --ramp_time=1"
R="--rw=randread"

echo "## machine: $(nproc) CPUs, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), kernel $(uname -r), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"

echo; echo "## I/O paths: bio vs batch (embedded RAM disk, 4 KiB random reads, QD32)"
run bench --repeat "$REPEAT"
run bench $J --iodepth=32 --rw=write --compare path=bio,batch --repeat "$REPEAT"

echo; echo "## embedded device vs --baseline (no virtio)"
run bench $J $R --iodepth=32 --compare target=embedded,baseline --repeat "$REPEAT"
run bench $J $R --iodepth=1 --compare target=embedded,baseline --repeat "$REPEAT"
run bench $J $R --iodepth=32 --disk "$IMG" --cache none --compare target=embedded,baseline --repeat "$REPEAT"
run bench $J $R --iodepth=1 --disk "$IMG" --cache none --compare target=embedded,baseline --repeat "$REPEAT"

echo; echo "## null disk at QD32 with polling"
run bench $J $R --iodepth=32 --disk null:1G --compare poll_us=0,50,200 --repeat "$REPEAT"

echo; echo "## polling window of the device (RAM disk)"
run bench $J $R --iodepth=1 --compare poll_us=0,10,50,200 --repeat "$REPEAT"
run bench $J $R --iodepth=32 --compare poll_us=0,10,50,200 --repeat "$REPEAT"

echo; echo "## submission batch of the io_uring engine (O_DIRECT file, then page cache)"
run bench $J $R --iodepth=32 --disk "$IMG" --cache none --compare submit_batch=0,1,4,8 --repeat "$REPEAT"
cat "$IMG" > /dev/null
run bench $J $R --iodepth=32 --disk "$IMG" --cache writeback --compare submit_batch=0,1,4 --repeat "$REPEAT"

echo; echo "## engines on an O_DIRECT file"
run bench $J $R --iodepth=32 --disk "$IMG" --cache none --compare engine=io_uring,aio,threads,sync --repeat "$REPEAT"
run bench $J $R --iodepth=1 --disk "$IMG" --cache none --compare engine=io_uring,aio,threads,sync --repeat "$REPEAT"
run bench $J $R --iodepth=32 --disk "$IMG" --cache none --engine threads --compare engine_threads=4,16,32 --repeat "$REPEAT"

echo; echo "## vblk serve vs qemu-storage-daemon"
bash bench/devices.sh "$REPEAT" "$RUNTIME"
