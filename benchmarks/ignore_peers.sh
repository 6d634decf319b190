# Sourced by the benchmarks' fetch_*_peer(s).sh scripts: ignore_peers_folder ROOT adds /.peers/ (downloaded
# peer sources, carried to the GPU machine, never committed) to the checkout's .git/info/exclude, once.
ignore_peers_folder() {
  local root=$1 exclude
  exclude="$(git -C "$root" rev-parse --git-path info/exclude 2>/dev/null || true)"
  [ -n "$exclude" ] || return 0
  case "$exclude" in /*) ;; *) exclude="$root/$exclude" ;; esac
  mkdir -p "$(dirname "$exclude")"
  touch "$exclude"
  grep -qxF '/.peers/' "$exclude" || echo '/.peers/' >> "$exclude"
}
