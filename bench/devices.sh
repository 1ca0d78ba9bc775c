#!/usr/bin/env bash
# vblk's device against qemu-storage-daemon: the same driver (vblk bench), the same cores
# (devices pinned to CPU 1, the benchmark to CPU 0), the same disk, side by side in one
# `vblk bench --compare socket=...` run per table, each variant repeated.
#
#   bash bench/devices.sh [REPEAT] [RUNTIME_S]
#
# Prints four tables: null disk and O_DIRECT file disk, at QD1 and QD32 (4 KiB random
# reads). Needs qemu-storage-daemon (Debian: qemu-system-common) and taskset (util-linux).
set -euo pipefail
cd "$(dirname "$0")/.."
REPEAT=${1:-3}
RUNTIME=${2:-5}
cargo build --release -q -p vblk
V=$PWD/target/release/vblk
D=$(mktemp -d /var/tmp/vblk-devices.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$D"; }
trap cleanup EXIT

IMG=$D/disk.img
# A file with real blocks (no holes), so O_DIRECT reads reach the disk.
dd if=/dev/urandom of="$IMG" bs=1M count=1024 status=none
sync

wait_sock() { for _ in $(seq 100); do [ -S "$1" ] && return 0; sleep 0.1; done; echo "no socket $1" >&2; exit 1; }

start_pair() { # $1 = null|file
  local kind=$1
  rm -f "$D"/vblk.sock "$D"/qsd.sock
  if [ "$kind" = null ]; then
    taskset -c 1 "$V" --log-level warn serve --socket-path "$D/vblk.sock" --blk-file null:1G &
    pids+=($!); VPID=$!
    taskset -c 1 qemu-storage-daemon \
      --blockdev driver=null-co,node-name=n0,size=1073741824,read-zeroes=on \
      --export type=vhost-user-blk,id=e0,node-name=n0,addr.type=unix,addr.path="$D/qsd.sock",num-queues=1,writable=on &
    pids+=($!); QPID=$!
  else
    taskset -c 1 "$V" --log-level warn serve --socket-path "$D/vblk.sock" --blk-file "$IMG" --cache none &
    pids+=($!); VPID=$!
    taskset -c 1 qemu-storage-daemon \
      --blockdev driver=file,node-name=f0,filename="$IMG",cache.direct=on,aio=io_uring \
      --export type=vhost-user-blk,id=e0,node-name=f0,addr.type=unix,addr.path="$D/qsd.sock",num-queues=1,writable=on &
    pids+=($!); QPID=$!
  fi
  wait_sock "$D/vblk.sock"; wait_sock "$D/qsd.sock"
}

stop_pair() { kill "$VPID" "$QPID"; wait "$VPID" "$QPID" 2>/dev/null || true; }

for kind in null file; do
  start_pair "$kind"
  for qd in 1 32; do
    echo "== $kind disk, 4 KiB random reads, QD$qd (vblk serve = first row, qemu-storage-daemon = second)"
    taskset -c 0 "$V" --log-level warn bench --name "$kind-qd$qd" --rw=randread --bs=4k --iodepth="$qd" \
      --runtime="$RUNTIME" --time_based --ramp_time=1 --size=1g \
      --compare "socket=$D/vblk.sock@$VPID,$D/qsd.sock@$QPID" --repeat "$REPEAT"
  done
  stop_pair
done
