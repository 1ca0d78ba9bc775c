# Sourced by bench/all.sh and bench/devices.sh. record ID TITLE COMMAND...: with JSON_OUT
# set, runs COMMAND with `--output-format json` into JSON_OUT/ID.json and appends a line to
# JSON_OUT/manifest.tsv (ID, title, load average at its start, the command with the vblk
# binary's path written `vblk`, without --log-level); bench/render.py makes BENCHMARKS.md from them. Without
# JSON_OUT it prints the title, the command and the text table. V: the vblk binary.
JSON_OUT=${JSON_OUT:-}
record() {
  local id=$1 title=$2; shift 2
  local load cmd="$*"
  load=$(cut -d' ' -f1-3 /proc/loadavg)
  cmd=${cmd//$V/vblk}
  cmd=${cmd//--log-level warn /}
  if [ -n "$JSON_OUT" ]; then
    printf '%s\t%s\t%s\t%s\n' "$id" "$title" "$load" "$cmd" >> "$JSON_OUT/manifest.tsv"
    echo "  $id: $title" >&2
    "$@" --output-format json > "$JSON_OUT/$id.json"
  else
    echo
    echo "== $id: $title (load average: $load)"
    echo "\$ $cmd"
    "$@"
  fi
}
