# Sourced by the experiment scripts: builds vblk once, then `run TITLE ARGS...` prints the
# command and its table (bench/experiments/table.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -q -p vblk
VBLK="$PWD/target/release/vblk"
REPEAT=${REPEAT:-3}
RUNTIME=${RUNTIME:-3}
echo "# $(date -u +%FT%TZ), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg), $(git rev-parse --short HEAD)"
echo
run() {
    local title=$1
    shift
    echo "\`\`\`"
    echo "vblk bench $*"
    echo "\`\`\`"
    echo
    "$VBLK" bench "$@" --repeat "$REPEAT" --output-format json |
        python3 bench/experiments/table.py "$title"
}
