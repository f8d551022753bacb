#!/usr/bin/env bash
# The H200 figures of residency (docs/benchmarks.md, "Residency moves"): the GPU tests of the moves
# and the output path, then each preset's weights off the GPU and back (scripts/bench_moves.py).
# Results in ${OUT:-residency-out}. Usage on a device call, wheels carried in .whl/:
#   scripts/gpu_residency.sh setup tests moves
set -uo pipefail
out=${OUT:-residency-out}
mkdir -p "$out"
export PYTHONPATH=$PWD:/tmp/site
for step in "$@"; do
  case $step in
    setup)
      pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > "$out/setup.log" 2>&1; echo "setup rc=$?" ;;
    tests)
      timeout ${TESTS_S:-300} python3 -m pytest -q -p no:cacheprovider tests/test_gpu_residency.py tests/test_gpu.py \
        > "$out/gpu-tests.txt" 2>&1; echo "tests rc=$?"; tail -3 "$out/gpu-tests.txt" ;;
    moves)
      for p in sdxl:float16 flux-dev:bfloat16; do
        timeout ${MOVES_S:-240} python3 scripts/bench_moves.py --preset random:${p%%:*} --dtype ${p##*:} \
          --json "$out/moves-${p%%:*}.json" > "$out/moves-${p%%:*}.log" 2>&1
        echo "moves ${p%%:*} rc=$?"; grep -v '^{' "$out/moves-${p%%:*}.log" | tail -8
      done ;;
  esac
done
