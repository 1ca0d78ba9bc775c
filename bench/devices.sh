#!/usr/bin/env bash
# vblk's device against qemu-storage-daemon, measured the same way: the same driver (vblk
# bench), the same cores (devices pinned to CPU 1, the benchmark to CPU 0), the same disk,
# side by side in one `vblk bench --compare socket=...` run per table, each variant
# repeated (the variants take turns, so drift on a shared machine falls on all alike).
# The columns to read for efficiency are "dev IOPS/CPU-s" (its inverse is the device's CPU
# time per I/O) and "dev CPU" (the device's CPU time per second, % of one CPU: the figure
# for the paced and idle tables). Each table's header has the load average at its start.
# Device CPU comes from /proc/PID/stat in 10 ms ticks: over 5 s, 0.2 % resolution.
#
#   bash bench/devices.sh [REPEAT] [RUNTIME_S] [TABLES]
#   DISK_REPEAT=10 bash bench/devices.sh ...   (rounds of the disk-bound tables that decide goals)
#
# Devices (all pinned to CPU 1; the null tables compare the first five):
#   vblk            vblk serve with its defaults (adaptive polling up to 200 µs, and only
#                   while it pays for itself: docs/design-notes.md)
#   vblk-poll0      vblk serve --poll-us 0 (never spins)
#   vblk-coalesce20 null tables: vblk serve --coalesce-us 20 (a request may wait up to
#                   20 µs so that one wake-up serves several; kept only while cheapest
#                   at the same pace: docs/design-notes.md)
#   vblk-aio        file tables: vblk serve --engine aio (Linux AIO)
#   qsd             qemu-storage-daemon, export in the main loop (no IOThread)
#   qsd-iothread    qemu-storage-daemon, export in an IOThread (--object iothread;
#                   QEMU polls there: poll-max-ns defaults to 32 µs)
#   qsd-native, qsd-io_uring, qsd-threads   file tables: aio=native, io_uring, threads
# Tables (TABLES picks a subset, e.g. "null-100k file-qd32"):
#   null-qd1, null-qd32                 null disk, 4 KiB random reads, at saturation
#   null-100k, null-500k                null disk, QD32, 100 k and 500 k IOPS offered
#   idle                                an attached driver doing 10 I/Os per second: the
#                                       device's CPU while its guest is idle
#   file-qd1, file-qd32                 O_DIRECT file on the host's disk; vblk io_uring
#                                       (default and --poll-us 0) and aio vs
#                                       qemu-storage-daemon aio=native, io_uring, threads
#                                       and io_uring in an IOThread (file-qd1's dev CPU is
#                                       the slow-disk check: polling must not burn a core
#                                       waiting for the disk)
#   file-baseline                       the same file through io_uring with no virtio
#   qcow2-qd1, qcow2-qd32               the same data as a fully allocated qcow2 image
#                                       (qemu-img convert), O_DIRECT: vblk (--format qcow2
#                                       --read-only) vs vblk on the raw file vs
#                                       qemu-storage-daemon's qcow2 driver, in its main
#                                       loop and in an IOThread (both aio=io_uring)
#   qcow2-write-qd1, qcow2-write-qd32   4 KiB random writes to the fully allocated qcow2
#                                       (overwrites: no allocation), a copy per device,
#                                       O_DIRECT: vblk (--format qcow2) vs vblk on a copy
#                                       of the raw file vs qemu-storage-daemon's qcow2
#                                       driver, in its main loop and in an IOThread
#   qcow2-chain3-qd1, qcow2-chain3-qd32 the same file as the base of a chain of three
#                                       qcow2 images, each holding a quarter of the disk
#                                       (top: the first, then the second, the third; the
#                                       last quarter is read from the raw base), O_DIRECT:
#                                       vblk (--backing for each level) vs
#                                       qemu-storage-daemon with the chain spelled out
#                                       (every level aio=io_uring, cache.direct=on)
#   qcow2-alloc-4k, qcow2-alloc-64k     random writes to a fresh, empty 64 GiB qcow2
#                                       image per device (nearly every write is the first
#                                       to its cluster: allocation), O_DIRECT: vblk
#                                       (--format qcow2) vs qemu-storage-daemon's qcow2
#                                       driver in its main loop and in an IOThread
#   qcow2-alloc-seq-4k, -seq-64k        the same with sequential writes: sixteen 4 KiB
#                                       writes in flight at once share each new 64 KiB
#                                       cluster; each 64 KiB write is a cluster's first
# Needs qemu-storage-daemon (Debian: qemu-system-common) and taskset (util-linux).
set -euo pipefail
cd "$(dirname "$0")/.."
REPEAT=${1:-3}
# Rounds of the disk-bound tables (file-qd32, qcow2-qd32, qcow2-write-qd32,
# qcow2-chain3-qd32, and the two QD1 qcow2 tables that decide goals, qcow2-qd1 and
# qcow2-write-qd1): their sides differ by less than the disk drifts from round to round
# (±10 % over minutes), so the goals they decide are judged on paired per-round ratios
# (bench/render.py), which need more rounds than REPEAT to tell 5 % apart (with 3, the
# QD1 rows' intervals spanned 0.4-2x).
DISK_REPEAT=${DISK_REPEAT:-$REPEAT}
unset ROUNDS # set per table below (bench's --repeat), never taken from the caller
RUNTIME=${2:-5}
TABLES=${3:-"null-qd1 null-qd32 null-100k null-500k idle file-qd1 file-qd32 file-baseline qcow2-qd1 qcow2-qd32 qcow2-write-qd1 qcow2-write-qd32 qcow2-chain3-qd1 qcow2-chain3-qd32 qcow2-alloc-4k qcow2-alloc-64k qcow2-alloc-seq-4k qcow2-alloc-seq-64k"}
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

# start NAME CMD...: a device pinned to CPU 1; its socket is $D/NAME.sock
start() {
  local name=$1; shift
  rm -f "$D/$name.sock"
  taskset -c 1 "$@" &
  pids+=($!)
  eval "PID_${name//-/_}=$!"
  wait_sock "$D/$name.sock"
}

stop_all() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }

vblk() { # NAME DISK ARGS...
  local name=$1 disk=$2; shift 2
  start "$name" "$V" --log-level warn serve --socket-path "$D/$name.sock" --blk-file "$disk" \
    --num-queues 1 --image-lock off "$@"
}

qsd() { # NAME BLOCKDEV [iothread]
  local name=$1 blockdev=$2 io=${3:-}
  local obj=() exp="type=vhost-user-blk,id=e0,node-name=n0,addr.type=unix,addr.path=$D/$name.sock,num-queues=1,writable=on"
  if [ -n "$io" ]; then obj=(--object iothread,id=iot0); exp="$exp,iothread=iot0"; fi
  start "$name" qemu-storage-daemon "${obj[@]}" --blockdev "$blockdev,node-name=n0" --export "$exp"
}

# qsd_qcow2 NAME FILE [iothread]: qemu-storage-daemon's qcow2 driver on FILE, O_DIRECT,
# aio=io_uring, writable (a file of its own: the image is locked)
qsd_qcow2() {
  qsd "$1" "driver=qcow2,file.driver=file,file.filename=$2,file.cache.direct=on,file.aio=io_uring" ${3:-}
}

sock() { local v="PID_${1//-/_}"; echo "$D/$1.sock@${!v}"; }

# With JSON_OUT=DIR (bench/all.sh sets it), each table's raw JSON goes to DIR/ID.json
# (bench/lib/record.sh) instead of the text table.
. bench/lib/record.sh

bench() { # TITLE ARGS... (compare key last)
  local title=$1; shift
  local id=${title%%:*}
  record "$id" "${title#*: }" taskset -c 0 "$V" --log-level warn bench --name "$id" --bs=4k \
    --rw=randread --runtime="$RUNTIME" --time_based --ramp_time=1 --size=1g \
    --repeat "${ROUNDS:-$REPEAT}" "$@"
}

want() { [[ " $TABLES " == *" $1 "* ]]; }

null_devices() {
  vblk vblk null:1G
  vblk vblk-poll0 null:1G --poll-us 0
  vblk vblk-coalesce20 null:1G --coalesce-us 20
  qsd qsd "driver=null-co,size=1073741824,read-zeroes=on"
  qsd qsd-iothread "driver=null-co,size=1073741824,read-zeroes=on" iothread
  NULLS="socket=$(sock vblk),$(sock vblk-poll0),$(sock vblk-coalesce20),$(sock qsd),$(sock qsd-iothread)"
}

if want null-qd1 || want null-qd32 || want null-100k || want null-500k || want idle; then
  null_devices
  want null-qd1 && bench "null-qd1: null disk, QD1, saturation" --iodepth=1 --compare "$NULLS"
  want null-qd32 && bench "null-qd32: null disk, QD32, saturation" --iodepth=32 --compare "$NULLS"
  want null-100k && bench "null-100k: null disk, QD32, 100 k IOPS offered" --iodepth=32 --rate_iops=100000 --compare "$NULLS"
  want null-500k && bench "null-500k: null disk, QD32, 500 k IOPS offered" --iodepth=32 --rate_iops=500000 --compare "$NULLS"
  want idle && bench "idle: null disk, an attached driver doing 10 I/Os per second" --iodepth=1 --rate_iops=10 --compare "$NULLS"
  stop_all
fi

if want file-qd1 || want file-qd32 || want file-baseline; then
  vblk vblk "$IMG" --cache none
  vblk vblk-poll0 "$IMG" --cache none --poll-us 0
  vblk vblk-aio "$IMG" --cache none --engine aio
  qsd qsd-native "driver=file,filename=$IMG,cache.direct=on,aio=native"
  qsd qsd-io_uring "driver=file,filename=$IMG,cache.direct=on,aio=io_uring"
  qsd qsd-threads "driver=file,filename=$IMG,cache.direct=on,aio=threads"
  qsd qsd-iothread "driver=file,filename=$IMG,cache.direct=on,aio=io_uring" iothread
  FILES="socket=$(sock vblk),$(sock vblk-poll0),$(sock vblk-aio),$(sock qsd-native),$(sock qsd-io_uring),$(sock qsd-threads),$(sock qsd-iothread)"
  want file-qd1 && bench "file-qd1: O_DIRECT file, QD1" --iodepth=1 --compare "$FILES"
  want file-qd32 && ROUNDS=$DISK_REPEAT bench "file-qd32: O_DIRECT file, QD32" --iodepth=32 --compare "$FILES"
  stop_all
  if want file-baseline; then
    # Not under taskset: the benchmark pins its job thread and the embedded device's
    # worker to separate CPUs itself (under taskset -c 0 both would share CPU 0).
    record file-baseline "the same file and job with no virtio (io_uring on the file), QD32" \
      "$V" --log-level warn bench --name baseline --bs=4k --rw=randread --iodepth=32 \
      --runtime="$RUNTIME" --time_based --ramp_time=1 --size=1g --repeat "$REPEAT" \
      --disk "$IMG" --cache none --compare target=embedded,baseline
  fi
fi

if want qcow2-qd1 || want qcow2-qd32; then
  QIMG=$D/disk.qcow2
  qemu-img convert -O qcow2 "$IMG" "$QIMG"
  sync
  vblk vblk-qcow2 "$QIMG" --cache none --format qcow2 --read-only
  vblk vblk-raw "$IMG" --cache none --read-only
  Q="driver=qcow2,file.driver=file,file.filename=$QIMG,file.cache.direct=on,file.aio=io_uring,file.locking=off"
  qsd qsd-qcow2 "$Q"
  qsd qsd-qcow2-iothread "$Q" iothread
  QCOW="socket=$(sock vblk-qcow2),$(sock vblk-raw),$(sock qsd-qcow2),$(sock qsd-qcow2-iothread)"
  want qcow2-qd1 && ROUNDS=$DISK_REPEAT bench "qcow2-qd1: fully allocated qcow2 on an O_DIRECT file, QD1" --iodepth=1 --compare "$QCOW"
  want qcow2-qd32 && ROUNDS=$DISK_REPEAT bench "qcow2-qd32: fully allocated qcow2 on an O_DIRECT file, QD32" --iodepth=32 --compare "$QCOW"
  stop_all
fi

if want qcow2-write-qd1 || want qcow2-write-qd32; then
  # A copy per device: each writes its own (a qcow2 is never written by two daemons).
  qemu-img convert -O qcow2 "$IMG" "$D/w-vblk.qcow2"
  for v in w-qsd w-qsd-iothread; do cp "$D/w-vblk.qcow2" "$D/$v.qcow2"; done
  cp "$IMG" "$D/w-raw.img"
  sync
  vblk vblk-qcow2 "$D/w-vblk.qcow2" --cache none --format qcow2
  vblk vblk-raw "$D/w-raw.img" --cache none
  qsd_qcow2 qsd-qcow2 "$D/w-qsd.qcow2"
  qsd_qcow2 qsd-qcow2-iothread "$D/w-qsd-iothread.qcow2" iothread
  WRITE="socket=$(sock vblk-qcow2),$(sock vblk-raw),$(sock qsd-qcow2),$(sock qsd-qcow2-iothread)"
  for qd in 1 32; do
    want "qcow2-write-qd$qd" || continue
    record "qcow2-write-qd$qd" "random 4k writes to a fully allocated qcow2 (overwrites), O_DIRECT, QD$qd" \
      taskset -c 0 "$V" --log-level warn bench --name "qcow2-write-qd$qd" --bs=4k \
      --rw=randwrite --runtime="$RUNTIME" --time_based --ramp_time=1 --size=1g --iodepth="$qd" \
      --repeat "$DISK_REPEAT" --compare "$WRITE"
  done
  stop_all
  rm -f "$D"/w-*.qcow2 "$D/w-raw.img"
fi

if want qcow2-chain3-qd1 || want qcow2-chain3-qd32; then
  # top.qcow2 -> l2.qcow2 -> l1.qcow2 -> the raw file; each qcow2 level writes its own
  # quarter of the disk.
  prev=$IMG prevfmt=raw
  for level in l1:512M l2:256M top:0; do
    name=${level%%:*} at=${level#*:}
    qemu-img create -q -f qcow2 -b "$prev" -F "$prevfmt" "$D/$name.qcow2" 1G
    qemu-io -f qcow2 -c "write -q -P 0x5a $at 256M" "$D/$name.qcow2" >/dev/null
    prev=$D/$name.qcow2 prevfmt=qcow2
  done
  sync
  vblk vblk-chain3 "$D/top.qcow2" --cache none --format qcow2 --read-only \
    --backing "$D/l2.qcow2" --backing "$D/l1.qcow2" --backing "$IMG,format=raw"
  level() { echo "file.driver=file,file.filename=$1,file.cache.direct=on,file.aio=io_uring,file.locking=off"; }
  C="driver=qcow2,$(level "$D/top.qcow2")"
  C="$C,backing.driver=qcow2,$(level "$D/l2.qcow2" | sed 's/file\./backing.file./g')"
  C="$C,backing.backing.driver=qcow2,$(level "$D/l1.qcow2" | sed 's/file\./backing.backing.file./g')"
  C="$C,backing.backing.backing.driver=raw,$(level "$IMG" | sed 's/file\./backing.backing.backing.file./g')"
  qsd qsd-chain3 "$C"
  qsd qsd-chain3-iothread "$C" iothread
  CHAIN="socket=$(sock vblk-chain3),$(sock qsd-chain3),$(sock qsd-chain3-iothread)"
  want qcow2-chain3-qd1 && bench "qcow2-chain3-qd1: a chain of three qcow2 images over a raw file, O_DIRECT, QD1" --iodepth=1 --compare "$CHAIN"
  want qcow2-chain3-qd32 && ROUNDS=$DISK_REPEAT bench "qcow2-chain3-qd32: a chain of three qcow2 images over a raw file, O_DIRECT, QD32" --iodepth=32 --compare "$CHAIN"
  stop_all
  rm -f "$D"/top.qcow2 "$D"/l1.qcow2 "$D"/l2.qcow2
fi

for alloc in 4k:randwrite 64k:randwrite seq-4k:write seq-64k:write; do
  bs=${alloc%%:*} rw=${alloc#*:} bs=${bs#seq-}
  id=qcow2-alloc-${alloc%%:*}
  want "$id" || continue
  for v in vblk-alloc qsd-alloc qsd-alloc-iothread; do
    rm -f "$D/$v.qcow2"
    qemu-img create -q -f qcow2 "$D/$v.qcow2" 64G
  done
  vblk vblk-alloc "$D/vblk-alloc.qcow2" --cache none --format qcow2
  qsd_qcow2 qsd-alloc "$D/qsd-alloc.qcow2"
  qsd_qcow2 qsd-alloc-iothread "$D/qsd-alloc-iothread.qcow2" iothread
  ALLOC="socket=$(sock vblk-alloc),$(sock qsd-alloc),$(sock qsd-alloc-iothread)"
  order=random
  [ "$rw" = write ] && order=sequential
  record "$id" "allocating $order writes of $bs to an empty 64 GiB qcow2, QD32" \
    taskset -c 0 "$V" --log-level warn bench --name "$id" --bs="$bs" \
    --rw="$rw" --runtime="$RUNTIME" --time_based --ramp_time=1 --size=64g --iodepth=32 \
    --repeat "$REPEAT" --compare "$ALLOC"
  stop_all
  rm -f "$D"/*-alloc*.qcow2
done
