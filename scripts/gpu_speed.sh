#!/usr/bin/env bash
# Issue 17's GPU measurements in one device call: restart-to-ready (cold, then warm compile cache),
# the compiled bench at 512²/4 steps, and the --compile GPU tests. Results in ${OUT:-speed-out}.
# Usage: scripts/gpu_speed.sh STEP...   (ready, bench512, tests, sweep, bench1024)
set -uo pipefail
out=${OUT:-speed-out}
mkdir -p "$out"
export XDG_STATE_HOME=${XDG_STATE_HOME:-/tmp/speed-state}
# limit-compiled (in the bench process) and the daemons' workers share one inductor cache
export TORCHINDUCTOR_CACHE_DIR=$XDG_STATE_HOME/diffusiond/compile-cache
serve="--model random:sd15 --device cuda:0 --dtype float16 --log-level info"
bench() {
  local name=$1 limit=$2; shift 2
  echo "=== $name: diffusiond bench $*" >> "$out/tables.md"
  timeout "$limit" python3 -m diffusiond bench "$@" --json > "$out/$name.json" 2> "$out/$name.log"
  echo "rc=$?" >> "$out/tables.md"
  python3 -c "import json,sys; from diffusiond.bench.report import table; print(table(json.load(open(sys.argv[1]))))" \
    "$out/$name.json" >> "$out/tables.md" 2>/dev/null
}
for step in "$@"; do
  case $step in
    ready)
      for k in cold:${COLD_S:-280} warm:${WARM_S:-100}; do
        echo "=== ready ${k%%:*}" >> "$out/ready.txt"
        timeout "${k##*:}" python3 scripts/ready_time.py /tmp/rt.sock "$out/ready-${k%%:*}.log" -- $serve \
          --compile ${MODE:-reduce-overhead} --warmup 512x512:1 >> "$out/ready.txt" 2>&1
      done ;;
    bench512)
      bench sd15-512-compiled ${BENCH_S:-200} --model random:sd15 --size 512x512 --steps 4 --format png \
        --requests 32 --concurrency 4 --compile ${MODE:-reduce-overhead} --rounds 1 --sweep 8 ;;
    sweep)
      bench sd15-512-b8-compiled 400 --model random:sd15 --size 512x512 --steps 4 --format png --requests 64 \
        --batch 8 --concurrency 8 --compile ${MODE:-reduce-overhead} --rounds 1 --sweep 1,2,4,16 --modes limit,async ;;
    bench1024)
      bench sd15-1024-compiled 400 --model random:sd15 --size 1024x1024 --steps 20 --format png --requests 8 \
        --concurrency 2 --compile ${MODE:-default} --rounds 1 ;;
    tests)
      timeout ${TESTS_S:-300} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k "compile or cuda_graph" \
        > "$out/gpu-tests.txt" 2>&1; echo "rc=$?" >> "$out/gpu-tests.txt" ;;
  esac
done
