# Sourced by the A/B scripts. build REV: the path of a release `vblk` built from REV (a
# git revision, built once in a worktree under /var/tmp/vblk-ab and kept), or REV itself
# when it is an executable.
build() {
  if [ -x "$1" ]; then echo "$1"; return; fi
  local sha dir
  sha=$(git rev-parse --short "$1")
  dir=/var/tmp/vblk-ab/$sha
  if [ ! -x "$dir/target/release/vblk" ]; then
    mkdir -p /var/tmp/vblk-ab
    [ -d "$dir" ] || git worktree add --detach "$dir" "$sha" >&2
    (cd "$dir" && cargo build --release -q -p vblk >&2)
  fi
  echo "$dir/target/release/vblk"
}
