#!/usr/bin/env bash
# `make demo`: start a daemon on the embedded tiny model on a temporary socket and state dir,
# generate one image with the CLI, stop the daemon. Its own socket and state dir, so it runs
# beside a daemon you already have and leaves nothing in your history. Needs nothing from the
# network beyond the pip install.
set -euo pipefail
PY=${PY:-.venv/bin/python}
dir=$(mktemp -d)
sock="$dir/diffusiond.sock"
out=${DEMO_OUT:-demo.png}
export DIFFUSIOND_CACHE=${DIFFUSIOND_CACHE:-$dir/cache}
"$PY" -m diffusiond serve --socket "$sock" --state-dir "$dir/state" --model tiny --log-level warning &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 1 60); do  # each status waits up to 5 s in one process; between them, is the daemon alive?
  "$PY" -m diffusiond status --socket "$sock" --wait 5 --json 2>/dev/null | grep -q '"ready": true' && break
  kill -0 $pid 2>/dev/null || { echo "the daemon exited during start-up" >&2; exit 1; }
done
"$PY" -m diffusiond status --socket "$sock"
"$PY" -m diffusiond generate "a lighthouse at dusk, oil painting" --socket "$sock" \
  --size 128x128 --steps 8 --seed 42 -o "$out"
echo "wrote $out (the tiny model has random weights: expect colourful noise, not a lighthouse)"
