#!/usr/bin/env bash
# QoS accuracy: configured vs measured, each over a RUNTIME-second window after a 1 s ramp
# (the bucket's initial credit, a tenth of a second of the rate, goes in the ramp).
# One vblk serve (release, one worker thread, CPU 1) serves null disks; `vblk bench`
# (CPU 0) saturates one at QD32 while `vblk disk set` changes its limit between runs:
#   IOPS     1 k, 10 k, 50 k, 100 k, 200 k: 4 KiB random and sequential reads
#   bytes    1, 10, 100, 1000 MiB/s: 4 KiB, 64 KiB, 256 KiB, 1 MiB reads, random and
#            sequential; 100 MiB/s of 256 KiB random writes
#   bursts   iops 1000, -max 5000, -max-length 2: the first RUNTIME seconds from a fresh
#            limit (QEMU's model: min(avg*T + max*len, max*T + max/10) requests), then the
#            base rate
#   groups   two disks saturating a group of 20 k IOPS (both at QD32, then one at QD1):
#            each one's share of it, from the daemon's counters over a window in which
#            both run. Their two jobs share CPU 0 and sleep on their completions
#            (`--spin-us 0`, as a guest taking interrupts): a job spinning 50 µs after
#            each submission kept the other off the CPU for milliseconds, and the QD1
#            disk, having nothing waiting meanwhile, rightly lost the group's time
#            (-15 % in the full run at a5e5c78; by hand -3.2 and -4.0 % spinning,
#            -0.02 and -0.18 % sleeping)
# Prints configured, measured and the error; the raw JSON goes to OUT_DIR.
#
#   bash bench/qos.sh [RUNTIME_S] [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
RUNTIME=${1:-10}
OUT=${2:-$(mktemp -d /var/tmp/vblk-qos.XXXXXX)}
mkdir -p "$OUT"
cargo build --release -q -p vblk
V=$PWD/target/release/vblk
D=$(mktemp -d /var/tmp/vblk-qos.XXXXXX)
pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$D"; }
trap cleanup EXIT
CTL=$D/ctl.sock

taskset -c 1 "$V" --log-level warn serve --threads 1 --control-socket "$CTL" \
  --group g:iops-total=20000 \
  --disk "socket=$D/q.sock,file=null:64G,num-queues=1" \
  --disk "socket=$D/a.sock,file=null:64G,num-queues=1,throttle.group=g" \
  --disk "socket=$D/b.sock,file=null:64G,num-queues=1,throttle.group=g" &
pid=$!
for _ in $(seq 200); do [ -S "$D/b.sock" ] && break; sleep 0.05; done

# job NAME SOCKET RW BS [RAMP]: a saturating job; prints its JSON's path
job() {
  local name=$1 sock=$2 rw=$3 bs=$4 ramp=${5:-1}
  local ramp_arg=()
  [ "$ramp" != 0 ] && ramp_arg=(--ramp_time="$ramp")
  taskset -c 0 "$V" --log-level warn bench --socket "$sock" --name "$name" --rw="$rw" --bs="$bs" \
    --iodepth="${DEPTH:-32}" --spin-us="${SPIN_US:-50}" --size=64g --runtime="$RUNTIME" --time_based "${ramp_arg[@]}" \
    --output-format=json >"$OUT/$name.json"
  echo "$OUT/$name.json"
}

# field JSON WHAT: iops, mibs or ios of the job (reads and writes)
field() {
  python3 - "$1" "$2" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
r, w = j["read"], j["write"]
what = sys.argv[2]
if what == "iops": print(r["iops"] + w["iops"])
elif what == "mibs": print((r["bw_bytes"] + w["bw_bytes"]) / 2**20)
else: print(r["total_ios"] + w["total_ios"])
EOF
}

row() { # LIMIT JOB CONFIGURED MEASURED UNIT
  python3 - "$@" <<'EOF'
import sys
limit, job, want, got, unit = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
print(f"{limit:<44} {job:<16} {want:>10.0f} {got:>12.1f} {unit:<6} {100 * (got - want) / want:>+7.2f} %")
EOF
}

set_limit() { "$V" disk set "$CTL" q "$1" >/dev/null; }

echo "== QoS accuracy: ${RUNTIME}s windows after a 1 s ramp, QD32, null disks; device on CPU 1 (one worker thread), bench on CPU 0"
echo "== machine: $(nproc) CPUs, $(uname -r), load average $(cut -d' ' -f1-3 /proc/loadavg); $("$V" --version)"
printf '%-44s %-16s %10s %12s %-6s %9s\n' limit job configured measured unit error
for iops in 1000 10000 50000 100000 200000; do
  set_limit "throttle.iops-total=$iops"
  for rw in randread read; do
    f=$(job "iops-$iops-$rw" "$D/q.sock" "$rw" 4k)
    row "iops-total=$iops" "$rw 4k" "$iops" "$(field "$f" iops)" IOPS
  done
done
for spec in 1:4k 10:64k 100:256k 1000:1m; do
  mib=${spec%%:*}
  bs=${spec##*:}
  set_limit "throttle.bps-total=${mib}M"
  for rw in randread read; do
    f=$(job "bps-$mib-$rw" "$D/q.sock" "$rw" "$bs")
    row "bps-total=${mib}M" "$rw $bs" "$mib" "$(field "$f" mibs)" MiB/s
  done
done
set_limit "throttle.bps-write=100M"
f=$(job "bps-write-100-randwrite" "$D/q.sock" randwrite 256k)
row "bps-write=100M" "randwrite 256k" 100 "$(field "$f" mibs)" MiB/s
# A burst from a fresh limit (a change makes new, empty buckets).
set_limit "throttle.iops-total=1000,throttle.iops-total-max=5000,throttle.iops-total-max-length=2"
want=$(python3 -c "r=$RUNTIME; print(min(1000*r + 5000*2, 5000*r + 500))")
f=$(job "burst-first" "$D/q.sock" randread 4k 0)
row "iops 1000, max 5000, max-length 2" "first ${RUNTIME}s" "$want" "$(field "$f" ios)" I/Os
f=$(job "burst-then" "$D/q.sock" randread 4k)
row "iops 1000, max 5000, max-length 2" "then, IOPS" 1000 "$(field "$f" iops)" IOPS
set_limit "throttle=none"
# Two disks saturating one group. Two processes never start at the same instant (and a
# disk alone in the group rightly gets all of it): the shares come from the daemon's
# counters over a RUNTIME-second window inside the time both jobs run.
snap() { "$V" stats "$CTL" --json >"$OUT/$1.json"; }
# group_pass NAME DEPTH_A: disk a at queue depth DEPTH_A, b at 32, both jobs sleeping on
# their completions (the header says why); prints "a b fa fb":
# their IOPS, and the group time each gave up in the window (ms: `vblk stats`' forfeited,
# time a disk was behind beyond two quanta when it came back from having nothing
# waiting, which its job's pauses cost it).
group_pass() {
  local name=$1 depth_a=$2
  RUNTIME_JOBS=$((RUNTIME + 4))
  (RUNTIME=$RUNTIME_JOBS DEPTH=$depth_a SPIN_US=0; job "$name-a" "$D/a.sock" randread 4k 0 >/dev/null) &
  local ja=$!
  (RUNTIME=$RUNTIME_JOBS SPIN_US=0; job "$name-b" "$D/b.sock" randread 4k 0 >/dev/null) &
  local jb=$!
  sleep 2
  snap "$name-start"
  sleep "$RUNTIME"
  snap "$name-end"
  wait "$ja" "$jb"
  python3 - "$OUT/$name-start.json" "$OUT/$name-end.json" <<'EOF'
import json, sys
s, e = (json.load(open(p)) for p in sys.argv[1:3])
secs = (e["uptime_ns"] - s["uptime_ns"]) / 1e9
def done(doc, id):
    d = next(d for d in doc["disks"] if d["id"] == id)
    return sum(q["completed"] for q in d["queues"])
def gave_up(doc, id):
    return doc["throttle_groups"][0]["forfeited_ns"].get(id, 0)
print(*((done(e, id) - done(s, id)) / secs for id in ("a", "b")),
      *(f"{(gave_up(e, id) - gave_up(s, id)) / 1e6:.1f}" for id in ("a", "b")))
EOF
}
read -r a b _ _ < <(group_pass group 32)
row "group iops-total=20000, disk a" "randread 4k" 10000 "$a" IOPS
row "group iops-total=20000, disk b" "randread 4k" 10000 "$b" IOPS
row "group iops-total=20000, both" "randread 4k" 20000 "$(python3 -c "print($a + $b)")" IOPS
# A disk at QD1 beside one at QD32: it stops waiting between its requests, and must
# still get its half.
read -r a b fa fb < <(group_pass group-qd1 1)
row "group iops-total=20000, disk a at QD1" "randread 4k" 10000 "$a" IOPS
row "group iops-total=20000, disk b at QD32" "randread 4k" 10000 "$b" IOPS
echo "(in that window disk a gave up $fa ms of the group's time and disk b $fb ms: behind by more than 2 ms when it came back from having nothing waiting, its job having sent nothing meanwhile)"
echo "(JSON in $OUT)"
