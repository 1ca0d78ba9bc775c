#!/usr/bin/env bash
# Instructions per I/O of two vblk builds' driver, counted (not timed) with callgrind:
# `vblk bench` of build A and of build B each run a fixed job (4 KiB random writes, QD32,
# --spin-us 0 so no spin loop is counted) against one `vblk serve` on a null disk, under
# valgrind, twice: 100 MiB and 200 MiB. The figures are the difference between the two
# runs over the 25 600 I/Os the second has more: what one more I/O costs, without the
# setup (attach, option parsing, zeroing the latency histograms), which a single run
# would spread over its I/Os. The count is exact and does not depend on the machine's
# load, which timed A/B runs on a shared 2-CPU VM cannot resolve below ±10 %. Prints, per
# path, instructions per I/O of the whole bench process (driver, benchmark loop, latency
# recording, libc) and of the driver crate alone.
#
#   bash bench/driver-instructions.sh BIN_A BIN_B [PATHS]
#   RW=randread bash bench/driver-instructions.sh BIN_A BIN_B     (default randwrite)
#
# Needs valgrind (installed with apt-get when missing).
set -euo pipefail
A=${1:?usage: bench/driver-instructions.sh BIN_A BIN_B [PATHS]}
B=${2:?usage: bench/driver-instructions.sh BIN_A BIN_B [PATHS]}
PATHS=${3:-"bio batch"}
command -v valgrind >/dev/null || apt-get install -y -q valgrind >/dev/null
D=$(mktemp -d /var/tmp/vblk-instr.XXXXXX)
"$B" --log-level warn serve --socket-path "$D/s.sock" --blk-file null:1G --num-queues 1 --image-lock off &
SP=$!
trap 'kill $SP 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$D"' EXIT
for _ in $(seq 100); do [ -S "$D/s.sock" ] && break; sleep 0.1; done
BS=4096
RW=${RW:-randwrite}
SMALL=100
LARGE=200
MORE=$(((LARGE - SMALL) * 1024 * 1024 / BS))

# count BIN PATH MIB: "all driver" instructions of one run
count() {
  local out=$D/cg.$RANDOM
  valgrind --tool=callgrind --callgrind-out-file="$out" "$1" bench --socket "$D/s.sock" \
    --bs=$BS --rw="$RW" --iodepth=32 --size="${3}m" --path "$2" --spin-us 0 >/dev/null 2>"$out.err"
  callgrind_annotate --auto=no --threshold=100 "$out" 2>/dev/null | grep -v "PROGRAM TOTALS" |
    awk '/^ *[0-9,]+ \(/ { x=$1; gsub(",", "", x); t+=x; if ($0 ~ /crates\/driver|vblk_driver/) d+=x }
      END { printf "%.0f %.0f\n", t, d }'
}

printf '%-8s %-4s %14s %16s\n' path build "insn/I/O all" "insn/I/O driver"
for p in $PATHS; do
  for b in A B; do
    if [ $b = A ]; then bin=$A; else bin=$B; fi
    read -r t1 d1 < <(count "$bin" "$p" $SMALL)
    read -r t2 d2 < <(count "$bin" "$p" $LARGE)
    awk -v p="$p" -v b="$b" -v n="$MORE" -v t="$((t2 - t1))" -v d="$((d2 - d1))" \
      'BEGIN { printf "%-8s %-4s %14.0f %16.0f\n", p, b, t/n, d/n }'
  done
done
