#!/usr/bin/env bash
# Instructions per I/O of two vblk builds' driver, counted (not timed) with callgrind:
# `vblk bench` of build A and of build B each run a fixed job (4 KiB random writes, QD32,
# 200 MiB, --spin-us 0 so no spin loop is counted) against one `vblk serve` on a null
# disk, under valgrind. The count is exact and does not depend on the machine's load,
# which timed A/B runs on a shared 2-CPU VM cannot resolve below ±10 %. Prints, per path,
# instructions per I/O of the whole bench process and of the driver crate.
#
#   bash bench/driver-instructions.sh BIN_A BIN_B [PATHS]
#   RW=randread bash bench/driver-instructions.sh BIN_A BIN_B     (default randwrite)
#
# Needs valgrind (apt-get install valgrind). Instructions spent in setup (attach, option
# parsing) are spread over the 51 200 I/Os: a few per I/O, the same for both builds.
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
SIZE_MIB=200
BS=4096
RW=${RW:-randwrite}
IOS=$((SIZE_MIB * 1024 * 1024 / BS))
printf '%-6s %-4s %14s %14s\n' path build "insn/I/O all" "insn/I/O driver"
for p in $PATHS; do
  for b in A B; do
    if [ $b = A ]; then bin=$A; else bin=$B; fi
    out=$D/cg.$b.$p
    valgrind --tool=callgrind --callgrind-out-file="$out" "$bin" bench --socket "$D/s.sock" \
      --bs=$BS --rw=$RW --iodepth=32 --size=${SIZE_MIB}m --path "$p" --spin-us 0 >/dev/null 2>"$out.err"
    callgrind_annotate --auto=no --threshold=100 "$out" 2>/dev/null | grep -v "PROGRAM TOTALS" |
      awk -v p="$p" -v b="$b" -v n="$IOS" '/^ *[0-9,]+ \(/ { x=$1; gsub(",", "", x); t+=x; if ($0 ~ /crates\/driver|vblk_driver/) d+=x }
        END { printf "%-6s %-4s %14.0f %14.0f\n", p, b, t/n, d/n }'
  done
done
