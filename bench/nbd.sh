#!/usr/bin/env bash
# vblk serve against qemu-storage-daemon, both serving the same nbdkit memory export over a
# Unix socket: the same driver (vblk bench), the same cores (devices pinned to CPU 1, the
# benchmark to CPU 0, nbdkit wherever the scheduler puts it), side by side in one
# `vblk bench --compare socket=...` run per table, each variant repeated. vblk serve runs
# twice: with its default polling window and with --poll-us 0 (nbdkit needs the CPU a
# polling worker would take). A last table is our NBD client alone (`--baseline`: no virtio),
# which shows what nbdkit itself gives.
#
#   bash bench/nbd.sh [REPEAT] [RUNTIME_S]
#
# With JSON_OUT=DIR (bench/all.sh sets it), each table's raw JSON goes to DIR/ID.json
# (bench/lib/record.sh) instead of the text table.
#
# Needs nbdkit (Debian: nbdkit), qemu-storage-daemon (qemu-system-common), taskset.
set -euo pipefail
cd "$(dirname "$0")/.."
REPEAT=${1:-3}
RUNTIME=${2:-5}
cargo build --release -q -p vblk
V=$PWD/target/release/vblk
D=$(mktemp -d /var/tmp/vblk-nbd.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$D"; }
trap cleanup EXIT

wait_sock() { for _ in $(seq 100); do [ -S "$1" ] && return 0; sleep 0.1; done; echo "no socket $1" >&2; exit 1; }

nbdkit -f -U "$D/nbd.sock" memory 1G &
pids+=($!)
wait_sock "$D/nbd.sock"
URI="nbd+unix:///?socket=$D/nbd.sock"
# Write the whole export once so reads find allocated pages.
taskset -c 0 "$V" --log-level warn bench --disk "$URI" --baseline --rw=write --bs=1m --iodepth=4 \
  --size=1g >/dev/null

taskset -c 1 "$V" --log-level warn serve --socket-path "$D/vblk.sock" --blk-file "$URI" --num-queues 1 &
pids+=($!); VPID=$!
taskset -c 1 "$V" --log-level warn serve --socket-path "$D/vblk0.sock" --blk-file "$URI" --num-queues 1 --poll-us 0 &
pids+=($!); V0PID=$!
taskset -c 1 qemu-storage-daemon \
  --blockdev driver=nbd,node-name=n0,server.type=unix,server.path="$D/nbd.sock" \
  --export type=vhost-user-blk,id=e0,node-name=n0,addr.type=unix,addr.path="$D/qsd.sock",num-queues=1,writable=on &
pids+=($!); QPID=$!
wait_sock "$D/vblk.sock"; wait_sock "$D/vblk0.sock"; wait_sock "$D/qsd.sock"

. bench/lib/record.sh
for rw in randread randwrite; do
  for qd in 1 32; do
    record "nbd-$rw-qd$qd" "nbdkit memory export, 4 KiB $rw, QD$qd (vblk serve, vblk serve --poll-us 0, qemu-storage-daemon)" \
      taskset -c 0 "$V" --log-level warn bench --name "nbd-$rw-qd$qd" --rw="$rw" --bs=4k --iodepth="$qd" \
      --runtime="$RUNTIME" --time_based --ramp_time=1 --size=1g \
      --compare "socket=$D/vblk.sock@$VPID,$D/vblk0.sock@$V0PID,$D/qsd.sock@$QPID" --repeat "$REPEAT"
  done
done
for rw in randread randwrite; do
  record "nbd-baseline-$rw" "nbdkit memory export, 4 KiB $rw, our NBD client alone (--baseline, no virtio), QD1 and QD32" \
    taskset -c 0 "$V" --log-level warn bench --name "nbd-baseline-$rw" --disk "$URI" --baseline --rw="$rw" --bs=4k \
    --runtime="$RUNTIME" --time_based --ramp_time=1 --size=1g --compare iodepth=1,32 --repeat "$REPEAT"
done
