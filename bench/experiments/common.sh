# Sourced by the experiment scripts: builds vblk once, then `run ID TITLE ARGS...` runs
# `vblk bench ARGS... --repeat $REPEAT`. By itself it prints the command and its table
# (bench/experiments/table.py); with JSON_OUT=DIR (bench/experiments/all.sh sets it) it
# writes the JSON to DIR/ID.json and a line to DIR/manifest.tsv (ID, title, load average
# at its start, the command) for bench/experiments/render.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -q -p vblk
VBLK="$PWD/target/release/vblk"
REPEAT=${REPEAT:-3}
RUNTIME=${RUNTIME:-3}
JSON_OUT=${JSON_OUT:-}
# On a machine shared with other work, PRIO=rt runs the benchmark (driver and embedded
# device threads) under SCHED_FIFO, so that the other work does not take their CPUs in
# the middle of a run (the kernel still leaves others 5 % of each second).
PRIO=${PRIO:-normal}
CHRT=()
[ "$PRIO" = rt ] && CHRT=(chrt -f 10)
[ -n "$JSON_OUT" ] ||
    echo "# $(date -u +%FT%TZ), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg), $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo '+changes'), REPEAT=$REPEAT RUNTIME=$RUNTIME PRIO=$PRIO"
run() {
    local id=$1 title=$2
    shift 2
    local cmd="vblk bench" a
    # The command as one would type it: an argument with a shell metacharacter in quotes.
    for a in "$@" --repeat "$REPEAT"; do
        if [[ $a =~ ^[A-Za-z0-9_./=:,+@%-]+$ ]]; then cmd+=" $a"; else cmd+=" \"$a\""; fi
    done
    if [ -n "$JSON_OUT" ]; then
        printf '%s\t%s\t%s\t%s\n' "$id" "$title" "$(cut -d' ' -f1-3 /proc/loadavg)" "$cmd" \
            >> "$JSON_OUT/manifest.tsv"
        echo "  $id: $title" >&2
        "${CHRT[@]}" "$VBLK" --log-level warn bench "$@" --repeat "$REPEAT" \
            --output-format json > "$JSON_OUT/$id.json"
    else
        echo
        echo "\`\`\`"
        echo "$cmd"
        echo "\`\`\`"
        echo
        "${CHRT[@]}" "$VBLK" bench "$@" --repeat "$REPEAT" --output-format json |
            python3 bench/experiments/table.py "$title"
    fi
}
