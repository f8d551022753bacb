#!/usr/bin/env bash
# The benchmark workloads (docs/benchmarks.md) on a GPU machine, one `diffusiond bench` run each; tables and JSON go to
# ${OUT:-bench-out}. Usage: scripts/gpu_bench.sh WORKLOAD...   (see the case list below)
# BENCH_EXTRA adds flags to every run, e.g. BENCH_EXTRA=--trace for the where-the-time-goes table.
# Every workload runs 3 rounds (bench's default) but the video one, 2: a round there takes 1.5 min.
set -uo pipefail
out=${OUT:-bench-out}
mkdir -p "$out"
run() {
  local name=$1; shift
  echo "=== $name: diffusiond bench $*" | tee -a "$out/tables.md"
  python3 -m diffusiond bench "$@" ${BENCH_EXTRA:-} --json > "$out/$name.json" 2> "$out/$name.log"
  local rc=$?
  if [ $rc -ne 0 ]; then echo "FAILED ($rc)"; tail -20 "$out/$name.log"; return; fi
  python3 - "$out/$name.json" <<'PY' | tee -a "$out/tables.md"
import json, sys
from diffusiond.bench import alternate, report
r = json.load(open(sys.argv[1]))
print((alternate.table if "alternate" in r else report.table)(r))
print()
PY
}
for w in "$@"; do
  case $w in
    sd15-512) run sd15-512 --model random:sd15 --size 512x512 --steps 4 --format png --requests 64 ;;
    sd15-1024) run sd15-1024 --model random:sd15 --size 1024x1024 --steps 20 --format png --requests 12 --concurrency 3 ;;
    sd15-512-b8) run sd15-512-b8 --model random:sd15 --size 512x512 --steps 4 --batch 8 --format png --requests 96 ;;
    synthetic-300mb) run synthetic-300mb --model synthetic:compute_ms=500,task=video --size 1024x1024 \
        --frames 100 --steps 10 --format npy --requests 16 ;;
    video-mp4) run video-mp4 --model random:wan-1.3b,save=0 --size 832x480 --frames 33 --steps 10 --format mp4 \
        --requests 4 --concurrency 2 --modes limit,async,sync --rounds 2 ;;
    sdxl-alternate) run sdxl-alternate --alternate random:sdxl random:sdxl --device-memory 12GiB \
        --size 1024x1024 --steps 20 --format png --requests 24 --concurrency 4 --rounds 2 ;;
    *) echo "unknown workload $w" ;;
  esac
done
