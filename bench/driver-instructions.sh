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
#   SIDE=device bash bench/driver-instructions.sh BIN_A BIN_B     (the device's instead)
#
# SIDE=device counts `vblk serve` (null disk, --poll-us 0 so no spin is counted, --seccomp
# off because valgrind makes system calls the filter refuses) of each build, under
# valgrind, driven by build B's bench: whole process and the device crate alone. Reads
# of the null disk zero the guest's buffer with `rep stosb`, which callgrind counts byte
# by byte (4,096 "instructions" per 4 KiB read): keep the default, random writes.
#
# Needs valgrind (installed with apt-get when missing).
set -euo pipefail
A=${1:?usage: bench/driver-instructions.sh BIN_A BIN_B [PATHS]}
B=${2:?usage: bench/driver-instructions.sh BIN_A BIN_B [PATHS]}
PATHS=${3:-"bio batch"}
command -v valgrind >/dev/null || apt-get install -y -q valgrind >/dev/null
D=$(mktemp -d /var/tmp/vblk-instr.XXXXXX)
SIDE=${SIDE:-driver}
SP=
trap 'kill $SP 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$D"' EXIT
wait_sock() { for _ in $(seq 600); do [ -S "$D/s.sock" ] && return 0; sleep 0.1; done; echo "no socket $D/s.sock" >&2; cat "$D"/cg.*.err >&2 2>/dev/null; exit 1; }
if [ "$SIDE" = driver ]; then
  "$B" --log-level warn serve --socket-path "$D/s.sock" --blk-file null:1G --num-queues 1 --image-lock off &
  SP=$!
  wait_sock
fi
BS=4096
RW=${RW:-randwrite}
SMALL=100
LARGE=200
MORE=$(((LARGE - SMALL) * 1024 * 1024 / BS))

# count BIN PATH MIB: "all crate" instructions of one run (crate: the driver's, or with
# SIDE=device the device's), into $D/count. Runs in this shell, not a subshell, so that
# the EXIT trap can stop a valgrind'd device a failure leaves behind.
count() {
  local out=$D/cg.$RANDOM crate=driver
  if [ "$SIDE" = driver ]; then
    valgrind --tool=callgrind --callgrind-out-file="$out" "$1" bench --socket "$D/s.sock" \
      --bs=$BS --rw="$RW" --iodepth=32 --size="${3}m" --path "$2" --spin-us 0 >/dev/null \
      2>"$out.err" || {
      cat "$out.err" >&2
      exit 1
    }
  else
    crate=device
    valgrind --tool=callgrind --callgrind-out-file="$out" "$1" --log-level warn serve \
      --socket-path "$D/s.sock" --blk-file null:1G --num-queues 1 --image-lock off \
      --poll-us 0 --seccomp off 2>"$out.err" &
    SP=$!
    wait_sock
    "$B" bench --socket "$D/s.sock" --bs=$BS --rw="$RW" --iodepth=32 --size="${3}m" \
      --path "$2" >/dev/null 2>>"$out.err" || {
      cat "$out.err" >&2
      exit 1
    }
    kill -TERM $SP
    wait $SP || true
    SP=
    rm -f "$D/s.sock"
  fi
  callgrind_annotate --auto=no --threshold=100 "$out" 2>/dev/null | grep -v "PROGRAM TOTALS" |
    awk -v c="$crate" '/^ *[0-9,]+ \(/ { x=$1; gsub(",", "", x); t+=x; if ($0 ~ "crates/" c "|vblk_" c) d+=x }
      END { printf "%.0f %.0f\n", t, d }' > "$D/count"
}

printf '%-8s %-4s %14s %16s\n' path build "insn/I/O all" "insn/I/O $SIDE"
for p in $PATHS; do
  for b in A B; do
    if [ $b = A ]; then bin=$A; else bin=$B; fi
    count "$bin" "$p" $SMALL
    read -r t1 d1 < "$D/count"
    count "$bin" "$p" $LARGE
    read -r t2 d2 < "$D/count"
    awk -v p="$p" -v b="$b" -v n="$MORE" -v t="$((t2 - t1))" -v d="$((d2 - d1))" \
      'BEGIN { printf "%-8s %-4s %14.0f %16.0f\n", p, b, t/n, d/n }'
  done
done
