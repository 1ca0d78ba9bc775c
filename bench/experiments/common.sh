# Sourced by the experiment scripts: builds vblk once, then `run TITLE ARGS...` prints the
# command and its table (bench/experiments/table.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -q -p vblk
VBLK="$PWD/target/release/vblk"
REPEAT=${REPEAT:-3}
RUNTIME=${RUNTIME:-3}
# On a machine shared with other work, PRIO=rt runs the benchmark (driver and embedded
# device threads) under SCHED_FIFO, so that the other work does not take their CPUs in
# the middle of a run (the kernel still leaves others 5 % of each second).
PRIO=${PRIO:-normal}
CHRT=()
[ "$PRIO" = rt ] && CHRT=(chrt -f 10)
echo "# $(date -u +%FT%TZ), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg), $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo '+changes'), REPEAT=$REPEAT RUNTIME=$RUNTIME PRIO=$PRIO"
echo
run() {
    local title=$1
    shift
    echo "\`\`\`"
    echo "vblk bench $(printf '%q ' "$@")"
    echo "\`\`\`"
    echo
    "${CHRT[@]}" "$VBLK" bench "$@" --repeat "$REPEAT" --output-format json |
        python3 bench/experiments/table.py "$title"
}
