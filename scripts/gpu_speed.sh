#!/usr/bin/env bash
# The H200 measurements of docs/benchmarks.md that need compiled models, sweeps or A/B designs, as
# steps a device call runs in order; each step is bounded by `timeout` so one that overruns leaves
# the others their time. Results (JSON, logs, tables.md) in ${OUT:-speed-out}.
# Usage: scripts/gpu_speed.sh STEP...
#   ready bench512 bench1024 tests     restart-to-ready, the compiled benches, the --compile GPU tests
#   sweep                              batch 8 compiled at several concurrencies (old form of b8compiled)
#   curve512 curve1024                 throughput and p50/p99 per --max-batch x client concurrency, eager
#   b8compiled                         --max-batch 8 with --compile reduce-overhead at concurrency 8 and 16
#   flux                               random:flux-dev 1024², 28 steps, bf16, regional compile against eager
#   persist                            the daemon with its state dir against --no-persist, same rounds (TRACE=1: --trace)
#   previews-ab                        previews' cost, interleaved request by request (bench_preview_ab.py)
#   ray                                one Ray Serve replica against its own daemon's socket (bench_ray.py)
#   profile-previews                   kernel traces of forwards with and without previews, summarised
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
      timeout ${TESTS_S:-300} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
        -k "${TESTS_K:-compile or cuda_graph or lora}" > "$out/gpu-tests.txt" 2>&1; echo "rc=$?" >> "$out/gpu-tests.txt" ;;
    curve512)
      for b in ${BATCHES:-1 4 8}; do
        bench sd15-512-curve-b$b ${CURVE_S:-110} --model random:sd15 --size 512x512 --steps 4 --format png \
          --requests 32 --batch $b --concurrency 1 --sweep 2,4,8,16 --modes limit,async --rounds 1 \
          --batch-wait-ms ${WAIT:-0}
      done ;;
    curve1024)
      for b in ${BATCHES:-1 4}; do
        bench sd15-1024-curve-b$b ${CURVE_S:-150} --model random:sd15 --size 1024x1024 --steps 20 --format png \
          --requests 8 --batch $b --concurrency 1 --sweep 2,4,8 --modes limit,async --rounds 1
      done ;;
    b8compiled)
      bench sd15-512-b8-compiled ${BENCH_S:-280} --model random:sd15 --size 512x512 --steps 4 --format png \
        --requests 64 --batch 8 --concurrency 8 --sweep 16 --compile reduce-overhead --modes limit,async --rounds 1 ;;
    flux)
      bench flux-dev-1024-compiled ${FLUX_S:-450} --model random:flux-dev,save=0 --dtype bfloat16 --size 1024x1024 \
        --steps 28 --guidance 3.5 --format png --requests 3 --concurrency 2 --compile default --modes limit,async \
        --rounds 1 ;;
    persist)
      bench sd15-512-persist ${PERSIST_S:-150} --model random:sd15 --size 512x512 --steps 4 --format png \
        --requests 32 --concurrency 4 --modes async,async-memory --rounds ${ROUNDS:-4} ${TRACE:+--trace} ;;
    previews-ab)
      timeout ${AB_S:-260} python3 scripts/bench_preview_ab.py --model random:sdxl --size 1024x1024 --steps 20 \
        --cycles ${CYCLES:-16} --budget-s $(( ${AB_S:-260} - 60 )) --json > "$out/previews-ab.json" 2> "$out/previews-ab.log"
      echo "=== previews-ab rc=$?" >> "$out/tables.md"
      python3 -c "import json,sys; sys.path.insert(0, 'scripts'); from bench_preview_ab import table; \
print(table(json.load(open(sys.argv[1]))['summary']))" "$out/previews-ab.json" >> "$out/tables.md" 2>&1 ;;
    profile-previews)
      DIFFUSIOND_TORCH_PROFILE=$out/prof:3:${PROF_N:-12} timeout ${PROF_S:-200} python3 scripts/bench_preview_ab.py \
        --model random:sdxl --size 1024x1024 --steps 20 --cycles ${PROF_CYCLES:-5} --budget-s $(( ${PROF_S:-200} - 40 )) \
        --json > "$out/profile-ab.json" 2> "$out/profile-ab.log"
      echo "=== profile-previews rc=$?" >> "$out/tables.md"
      python3 scripts/profile_summary.py "$out/prof" >> "$out/tables.md" 2>&1
      for p in p0 p1 p5; do ls "$out"/prof/*-$p.json.gz 2>/dev/null | head -1 | xargs -r -I{} mv {} "$out/"; done
      rm -rf "$out/prof" ;;  # megabytes a trace: one per arm comes back, and the summary
    ray)
      timeout ${RAY_S:-280} python3 scripts/bench_ray.py --model random:sd15 --size 512x512 --steps 20 --gpus 1 \
        --requests ${RAY_N:-20} --concurrency 4 --rounds 3 --json "$out/ray.json" > "$out/ray.txt" 2>&1
      echo "=== ray rc=$?" >> "$out/tables.md"
      pkill -9 -f 'raylet|gcs_server|ray::|diffusiond-ray' 2>/dev/null  # what a timed-out run leaves holding the GPU
      grep -E "p50|req/s|throughput" "$out/ray.txt" >> "$out/tables.md" ;;
  esac
done
