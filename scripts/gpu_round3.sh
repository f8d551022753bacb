#!/usr/bin/env bash
# The H200 figures of issues 27, 29, 30 and 31 that need a GPU (docs/benchmarks.md), as named steps, each
# bounded by its own timeout so one that hangs leaves the others' results. Wheels carried in .whl/.
# Results (JSON and logs) in /tmp/r3-out, packed into $OUT by `pack`. Usage on a device call:
#   ALT_REQUESTS=16 timeout 585 scripts/gpu_round3.sh setup alternate cold trajectory-sd15 pack   (~560 s)
#   timeout 585 scripts/gpu_round3.sh setup stream-test pack      (then, in a call of its own: setup stream pack)
#   timeout 585 scripts/gpu_round3.sh setup template-test cold-template imports pack   (issue 27, first: the template on CUDA)
#   timeout 120 scripts/gpu_round3.sh setup imports pack   (issue 27: where the worker's 13 s of imports go)
#   timeout 585 scripts/gpu_round3.sh setup cold-template pack   (issue 27: --preimport on against off on CUDA; not run yet)
#   timeout 585 scripts/gpu_round3.sh setup hostkeep-test pack   (issue 27: HostCopy.release on CUDA; not run yet)
#   BIG_CONFIGS=resident,stream,fp8-mm,fp8-wo timeout 585 scripts/gpu_round3.sh setup stream wan12 pack   (issue 28:
#     stream and FLUX in fp8 against resident at 24 GiB, then Wan 1.3B 832x480x81 inside 12 GiB)
#   timeout 585 scripts/gpu_round3.sh setup gguf-compiled pack   (issue 28: GGUF Q8_0 against resident, both compiled)
#   timeout 585 scripts/gpu_round3.sh setup lora weights trajectory-flow pack
#   PRESETS="sd3.5-large qwen-image wan2.2-5b flux-kontext" timeout 585 scripts/gpu_round3.sh setup presets pack
#     (issue 30: the presets without a forward time yet; sd3.5-medium, ltx-2b, ltx-2 ran on an H100 on 2026-12-05)
#   timeout 585 scripts/gpu_round3.sh setup attention pack   (issue 31; flash-attn, sageattention wheels in .whl/ if wanted)
#   timeout 585 scripts/gpu_round3.sh setup batch-curve pack   (issue 31: 512² compiled throughput curve, batches in
#     powers of two up to 8, every size warmed by --warmup 512x512:all; then BSZ_MAX=16 BSZ_SWEEP=32,64 in a call of its own)
#   timeout 585 scripts/gpu_round3.sh setup encoders-flux pack   (issue 31: FLUX's cold start with eager text encoders)
#   timeout 585 scripts/gpu_round3.sh setup sdxl pack; ... flux-compiled pack; ... flux-fp8-compiled pack;
#     ... step-cache pack; ... ready-flux pack; ... ready-sd15 pack   (issue 31: one call each)
# Each call's figures are written up in docs/benchmarks.md before the next (a machine can stop answering).
set -uo pipefail
out=/tmp/r3-out
mkdir -p "$out"  # packed into $OUT/r3.tgz by the step `pack` (a device call returns 8 files at most)
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
cache=/tmp/dcache
export DIFFUSIOND_CACHE=$cache
pack() {  # JSON and logs: the arrays of PSNR runs went over what a call returns
  tar czf "${OUT:-.}/r3-$(date +%H%M%S).tgz" --exclude="*.npy" --exclude="*.png" --exclude="*.gguf" -C /tmp r3-out && echo packed; }
ready() {  # tag model size dtype timeout [mode]: the time to ready of one start (scripts/ready_time.py), logs named apart
  local name=ready-$1-$SECONDS
  step "$name" "$5" python3 scripts/ready_time.py /tmp/r3-$1.sock "$out/$name-serve.log" -- \
    --state-dir /tmp/r3-state-$1 --model "random:$2" --device cuda --dtype "$4" --compile "${6:-default}" --warmup "$3:1"
}
step() {  # name timeout command...: its stdout's last line (the JSON) to $out/NAME.json, stderr to NAME.log
  local name=$1 t=$2; shift 2
  local t0=$SECONDS
  timeout "$t" "$@" > "$out/$name.json" 2> "$out/$name.log"
  echo "== $name rc=$? $((SECONDS - t0))s"; tail -c 1500 "$out/$name.json"; echo; grep -v "^{" "$out/$name.log" | grep -v "should be kept in float32" | tail -12
  # what has run so far, under one name: a call killed at the device budget's end still returns it (2026-12-06's
  # last call returned nothing: killed before its `pack`, its output held behind a pipe into tail)
  tar czf "${OUT:-.}/r3-partial.tgz" --exclude="*.npy" --exclude="*.png" --exclude="*.gguf" -C /tmp r3-out
}
for s in "$@"; do
  case $s in
    setup)
      pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl > "$out/setup.log" 2>&1
      echo "setup: $(ls /tmp/site | grep -c dist-info) packages"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader ;;
    alternate)  # issue 27: two SDXL-size models alternating under a budget for one, against both resident
      step alternate 330 python3 -m diffusiond bench --alternate random:sdxl,save=0 random:sdxl,save=0 \
        --device-memory ${ALT_BUDGET:-12GiB} --size 1024x1024 --steps 20 --format png --requests ${ALT_REQUESTS:-24} --concurrency 4 --rounds 2 --json ;;
    cold)  # issue 27: first image from a cold daemon on an SD 1.5 folder, page cache warm
      step sd15-folder 100 python3 scripts/bench_presets.py --preset random:sd15 --dtype float16 --save 1 --steps 4 \
        --cache $cache
      step cold 150 python3 scripts/bench_cold.py --folder $cache/models/random-sd15-v1 --starts 3 ;;
    cold-template)  # issue 27: workers forked from the pre-imported template (--preimport on) against fresh
      # interpreters (off) on CUDA, the start and a second model loaded on demand (the same folder); not run yet
      [ -d $cache/models/random-sd15-v1 ] || step sd15-folder 100 python3 scripts/bench_presets.py --preset random:sd15 \
        --dtype float16 --save 1 --steps 4 --cache $cache
      for p in off on; do
        step cold-template-$p 200 python3 scripts/bench_cold.py --folder $cache/models/random-sd15-v1 \
          --second $cache/models/random-sd15-v1 --preimport $p --starts 2
      done ;;
    trajectory-sd15)  # issue 29: rollouts with trajectories against without, same sampler
      step trajectory-sd15 150 python3 scripts/bench_ab.py --label "sd15 ddim eta=1 512 20 steps" \
        --serve "--model m=random:sd15,save=0 --device cuda --dtype float16 --max-batch 1" \
        --base '{"size": "512x512", "steps": 20, "scheduler": "ddim", "eta": 1.0}' \
        --b '{"trajectory": {"latents": true, "log_probs": true}}' --requests 16 --concurrency 4 --rounds 4 ;;
    trajectory-flow)
      step trajectory-flow 240 python3 scripts/bench_ab.py --label "sd3.5-medium flow-sde 512 20 steps" \
        --serve "--model m=random:sd3.5-medium,save=0 --device cuda --dtype bfloat16 --max-batch 1" \
        --base '{"size": "512x512", "steps": 20, "scheduler": "flow-sde", "noise_level": 0.7}' \
        --b '{"trajectory": {"latents": true, "log_probs": true}}' --requests 16 --concurrency 4 --rounds 4 ;;
    lora)  # issue 29: update_lora of a rank-64 adapter on the FLUX.1-dev transformer
      step lora 240 python3 scripts/bench_live.py lora --preset flux-dev --component transformer --rank 64 \
        --dtype bfloat16 --rounds 5 ;;
    weights)  # issue 29: update_weights of the SDXL UNet, written into PARTS memfds (each count in turn, one daemon each)
      for n in ${PARTS:-16}; do
        step weights-p$n 200 python3 scripts/bench_live.py weights --preset sdxl --component unet --dtype float16 \
          --rounds 3 --parts $n
      done ;;
    weights-pageable)  # the same from pageable pages (worker/update_copy.py: the bench's switch; staged is the default)
      DIFFUSIOND_UPDATE_COPY=pageable step weights-pageable 200 python3 scripts/bench_live.py weights --preset sdxl \
        --component unet --dtype float16 --rounds 3 ;;
    controlnet)  # issue 30: a ControlNet's cost against the plain job (SD 1.5, ControlNet from its UNet)
      python3 - <<'PY' > "$out/controlnet-build.log" 2>&1
import numpy as np, torch
from PIL import Image
from diffusers import ControlNetModel
from diffusiond.pipelines.presets import build_part, get_preset
unet = build_part(get_preset("sd15").parts["unet"], "cuda", torch.float16)
ControlNetModel.from_unet(unet).save_pretrained("/tmp/cn-sd15")
img = np.zeros((512, 512, 3), np.uint8); img[128:384, 128:384] = 255
Image.fromarray(img).save("/tmp/control.png")
print("ok")
PY
      tail -1 "$out/controlnet-build.log"
      step controlnet 240 python3 scripts/bench_ab.py --label "sd15 + controlnet 512 20 steps" \
        --serve "--model m=random:sd15,save=0 --device cuda --dtype float16 --max-batch 1 --controlnet cn=/tmp/cn-sd15" \
        --base '{"size": "512x512", "steps": 20}' \
        --b '{"control": [{"name": "cn", "image": "/tmp/control.png", "scale": 1.0}]}' \
        --requests 24 --concurrency 4 --rounds 4 ;;
    hires)  # issue 30: a hires pass (2x, bicubic, then img2img at strength 0.5, 10 steps) against the plain job
      step hires 200 python3 scripts/bench_ab.py --label "sd15 512 20 steps + hires 2x 0.5 10 steps" \
        --serve "--model m=random:sd15,save=0 --device cuda --dtype float16 --max-batch 1" \
        --base '{"size": "512x512", "steps": 20}' \
        --b '{"hires": {"scale": 2, "strength": 0.5, "steps": 10}}' --requests 16 --concurrency 4 --rounds 4 ;;
    presets)  # issue 30: the new presets' forward times (random weights, as built, 6 steps after a 2-step warm-up)
      for p in ${PRESETS:-sd3.5-medium sd3.5-large qwen-image ltx-2b ltx-2 wan2.2-5b}; do
        extra=""; [ $p = wan2.2-5b ] && extra="--frames 41"
        step preset-$p 150 python3 scripts/bench_presets.py --preset random:$p --save 0 --steps 6 $extra \
          --json "$out/preset-$p.result.json"
      done ;;
    stream)  # issue 28: offload=stream (resident blocks + a ring of streamed ones) at 24 GiB against resident FLUX.1-dev
      # one process per configuration (bench_bigger.py's driver): resident first (the reference), then stream with
      # resident_blocks planned as the daemon plans it, or STREAM_RESIDENT=N blocks resident when set
      # BIG_CONFIGS adds bench_bigger's others to the same run (fp8-mm, fp8-wo: FLUX in fp8 without offload)
      step stream 560 python3 scripts/bench_bigger.py --out $out/stream --configs ${BIG_CONFIGS:-resident,stream} \
        --budget-gib ${STREAM_BUDGET:-24} --images 2 --timeout 200 --deadline 540 \
        ${STREAM_RESIDENT:+--resident-blocks $STREAM_RESIDENT} ;;
    wan12)  # issue 28: random:wan-1.3b, 832x480, 81 frames, inside a 12 GiB budget (enforced): its UMT5 encoder in
      # fp8 storage, or diffusers' whole-component offload; one warm-up video, one timed, WAN_STEPS steps
      step wan12 300 python3 scripts/bench_bigger.py --out $out/wan12 --preset wan-1.3b --size 832x480 --frames 81 \
        --steps ${WAN_STEPS:-10} --configs te-fp8,model --budget-gib 12 --images 1 --timeout 200 --deadline 290 ;;
    gguf-compiled)  # issue 28: GGUF Q8_0 missed 0.8x eager (0.72x: a dequantization per layer per forward in
      # torch ops); compiled (serve --compile default, regional), inductor fuses it: Q8 against resident, both compiled
      step gguf-compiled 560 python3 scripts/bench_bigger.py --out $out/gguf-compiled --configs resident,q8 \
        --compile default --images 2 --timeout 260 --deadline 540 ;;
    imports)  # issue 27's cold start: the worker's imports on this host, timed (3 runs) and -X importtime (with and
      # without torchao on the path: diffusers imports it when installed), the profiles packed for reading here
      T='import time; t=time.perf_counter(); import diffusiond.worker.process; t1=time.perf_counter(); from diffusers.utils import logging; t2=time.perf_counter(); import diffusers.models.modeling_utils, transformers.modeling_utils; t3=time.perf_counter(); from diffusers import StableDiffusionPipeline; t4=time.perf_counter(); import sys; print("torchao" in sys.modules, "triton" in sys.modules, f"worker {t1-t:.2f} utils {t2-t1:.2f} models {t3-t2:.2f} sdpipe {t4-t3:.2f}")'
      for i in 1 2 3; do python3 -c "$T" 2>/dev/null; done | tee "$out/imports.txt"
      python3 -X importtime -c "$T" 2> "$out/importtime-with-torchao.txt" > /dev/null
      mv /tmp/site/torchao /tmp/torchao.off && { python3 -c "$T" 2>/dev/null | tee -a "$out/imports.txt";
        python3 -X importtime -c "$T" 2> "$out/importtime-without-torchao.txt" > /dev/null; mv /tmp/torchao.off /tmp/site/torchao; } ;;
    stream-test)  # issue 28: offload=stream byte-equal to resident on CUDA (tiny-flux; seconds)
      step stream-test 240 python3 -m pytest -q -x tests/test_gpu_residency.py -k "stream" -p no:cacheprovider ;;
    template-test)  # issue 27: a worker forked from the template uses CUDA and makes a fresh worker's pictures
      # (--preimport auto forks CUDA workers once this passes)
      step template-test 240 python3 -m pytest -q -x tests/test_gpu_template.py -p no:cacheprovider ;;
    updates-test)  # issue 29: a whole component's update and a LoRA's values staged through the pinned buffers land
      step updates-test 120 python3 -m pytest -q -x tests/test_gpu_updates.py -p no:cacheprovider ;;
    memfd-writes)  # issue 29: whether more parts than 8 (ipc.updates.MAX_PARTS) would speed the client's pack
      step memfd-writes 120 python3 scripts/bench_memfd_writes.py --gib 4 --threads ${MEMFD_THREADS:-16} --rounds 2 ;;
    hostkeep-test)  # issue 27: a woken model's kept host copy freed (unpinned) and made again by the next sleep
      step hostkeep-test 240 python3 -m pytest -q -x tests/test_gpu_residency.py -k "released" -p no:cacheprovider ;;
    attention)  # issue 31: FLUX.1-dev 1024² 28 steps on each attention backend that runs here, against the default;
      # one process (the model built once), backends in rotated turns; those that cannot run are listed with why
      step attention 480 python3 -m diffusiond.bench.attention --model random:flux-dev,save=0 --size 1024x1024 \
        --steps 28 --rounds ${ATTN_ROUNDS:-2} \
        --backends ${ATTN_BACKENDS:-native,_native_flash,_native_cudnn,_native_efficient,flash,_flash_3,xformers,sage} ;;
    batch-curve)  # issue 31: SD 1.5 size 512², 4 steps, reduce-overhead: images/s over clients (target >= 50);
      # bench --compile serves --warmup 512x512:all, so every batch size that forms (powers of two up to BSZ_MAX) is
      # compiled cold before ready, about 100 s each: 5 shapes at 16 do not fit one call with the runs. Run it twice,
      # each call on its own: BSZ_MAX=8 (4 shapes, the default), then BSZ_MAX=16 BSZ_SWEEP=32,64. Each run's row is
      # on bench's stderr as it ends ("bench: row {...}" in batch-curve.log), so a timeout still leaves figures
      # BSZ_OPTS=",channels_last=1": spec options added to the model (the curve with and without, on one machine)
      step batch-curve${BSZ_OPTS:-} 570 python3 -m diffusiond bench --model random:sd15,save=0${BSZ_OPTS:-} --dtype float16 --size 512x512 \
        --steps 4 --format png --batch ${BSZ_MAX:-8} --requests ${BSZ_REQUESTS:-96} --concurrency ${BSZ_MAX:-8} \
        --sweep ${BSZ_SWEEP:-4,32} --compile reduce-overhead --modes async --rounds 1 --no-flops --json ;;
    fp8-rows)  # issues 28 and 31: fp8=rowwise (diffusiond's own fp8 matmuls) against resident, FLUX.1-dev 1024² 28 steps,
      # eager within 24 GiB (T5 in fp8 storage), then both compiled (FP8_ROWS_COMPILE=0 skips that half), fp8 within
      # 24 GiB again (T5 in fp8 storage left eager: compile_rules.left_eager)
      step fp8-rows 300 python3 scripts/bench_bigger.py --out $out/fp8-rows --configs resident,fp8-rows --images 2 \
        --timeout 200 --deadline 290
      [ "${FP8_ROWS_COMPILE:-1}" = 1 ] && step fp8-rows-compiled 420 python3 scripts/bench_bigger.py \
        --out $out/fp8-rows-compiled --configs resident,${FP8_ROWS_CONFIG:-fp8-rows} --compile default --images 2 \
        --timeout 300 --deadline 410 ;;
    fp8-rows-graphs)  # issue 31: fp8-rows' compiled half with CUDA graphs (reduce-overhead) against resident the same
      # way, against the 1.9x target (the eager limit: fp8-rows' first half, in the same call)
      # (FP8_ROWS_CONFIG=fp8-rows-full: T5 as built, no budget; issue 31's targets set none)
      step fp8-rows-graphs 450 python3 scripts/bench_bigger.py --out $out/fp8-rows-graphs \
        --configs resident,${FP8_ROWS_CONFIG:-fp8-rows} \
        --compile reduce-overhead --images 2 --timeout 320 --deadline 440 ;;
    vs-eager)  # issue 31's fp8 target and issue 28's auto in one call, each against the eager limit (resident bf16
      # eager, run first into the same out dir, which bench_bigger's driver compares every later configuration with)
      bash "$0" limit-eager fp8-graphs auto-24 ;;
    limit-eager)
      step limit-eager 200 python3 scripts/bench_bigger.py --out $out/vs-eager --configs resident --images 2 \
        --timeout 190 --deadline 195 ;;
    fp8-graphs)  # fp8 compiled with CUDA graphs (no budget, T5 as built; then inside 24 GiB) against limit-eager
      step fp8-graphs 330 python3 scripts/bench_bigger.py --out $out/vs-eager \
        --configs ${FP8_ROWS_CONFIG:-fp8-rows-full,fp8-rows} --compile reduce-overhead --images 2 --timeout 165 \
        --deadline 325 ;;
    auto-24)  # offload=auto inside 24 GiB (stream, for FLUX.1) against limit-eager
      step auto-24 200 python3 scripts/bench_bigger.py --out $out/vs-eager --configs auto --images 2 --timeout 190 \
        --deadline 195 ;;
    fp8-rows-expandable)  # issue 28: fp8-rows' eager half again with the allocator's expandable segments (at 24 GiB
      # fp8-rows reserved 23.8 GiB, 1.3 GiB over what it held: whether the cap's cache flushes cost the 0.88x)
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True step fp8-rows-expandable 300 python3 scripts/bench_bigger.py \
        --out $out/fp8-rows-expandable --configs resident,fp8-rows --images 2 --timeout 200 --deadline 290 ;;
    batch8-layout)  # issue 31: the compiled forward alone (bench's limit-compiled), batch 8 at 512², 4 steps, SD 1.5
      # size, NCHW against channels_last=1 (one process each, one shape compiled each: cheaper than two curves)
      for o in "" ",channels_last=1"; do
        step batch8-layout$o 280 python3 -m diffusiond bench --model random:sd15,save=0$o --dtype float16 \
          --size 512x512 --steps 4 --batch 8 --requests 48 --modes limit,limit-compiled --compile reduce-overhead \
          --rounds 2 --no-flops --json
      done ;;
    batch16)  # issue 31: the compiled forward alone at batch 16 (512², 4 steps, SD 1.5 size, channels_last=1), the
      # eager limit beside it; INDUCTOR_ENV="VAR=1 ..." runs it again with those inductor settings (one process each)
      for e in "" ${INDUCTOR_ENV:-}; do
        timeout 280 env ${e:+"$e"} python3 -m diffusiond bench --model random:sd15,save=0,channels_last=1 --dtype float16 --size 512x512 \
          --steps 4 --batch 16 --requests 96 --modes limit,limit-compiled --compile reduce-overhead --rounds 2 \
          --no-flops --json > "$out/batch16${e:+-$e}.json" 2> "$out/batch16${e:+-$e}.log"
        echo "== batch16 $e rc=$?"; grep '"throughput"' "$out/batch16${e:+-$e}.json" | head -2
      done ;;
    floor)  # issue 31: each target's model against its kernels' floor (scripts/kernel_floor.py: the heavy calls alone,
      # summed) and its eager forward in the same process: FLUX.1-dev exact, SD 1.5 size at batch 16, SDXL
      # (FLOOR_COMPILE=MODE times the compiled forward too, at the cost of its compile)
      bash "$0" floor-flux floor-sd15 floor-sdxl ;;
    floor-flux)
      step floor-flux 200 python3 scripts/kernel_floor.py --model random:flux-dev,save=0 --dtype bfloat16 \
        --size 1024 --steps 28 ${FLOOR_COMPILE:+--compile $FLOOR_COMPILE} ;;
    floor-sd15)
      step floor-sd15 200 python3 scripts/kernel_floor.py --model random:sd15,save=0,channels_last=1 --dtype float16 \
        --size 512 --steps 4 --batch ${FLOOR_BATCH:-16} ${FLOOR_COMPILE:+--compile $FLOOR_COMPILE} ;;
    floor-sdxl)
      step floor-sdxl 120 python3 scripts/kernel_floor.py --model random:sdxl,save=0 --dtype float16 --size 1024 \
        --steps 30 ;;
    fp8-linear)  # issue 28: ways to run FLUX's linear layers from fp8 weights against bf16, one process (the
      # transformer's forward at 1024²: diffusers' casting, one cast, rowwise fp8 matmuls eager and quantizer compiled)
      step fp8-linear 300 python3 scripts/bench_fp8_linear.py --rounds 3 --forwards 4 ;;
    batch-profile)  # issue 31: where a batch of 8 at 512², 4 steps goes on the GPU (eager: kernels by family, the
      # top 25; a compiled forward fuses the rest, not the convolutions and products), two forwards traced
      DIFFUSIOND_TORCH_PROFILE=/tmp/r3-prof:3:2 step batch-profile 200 python3 -m diffusiond bench \
        --model random:sd15,save=0 --dtype float16 --size 512x512 --steps 4 --format png --batch 8 --requests 48 \
        --concurrency 16 --modes async --rounds 1 --no-flops --json
      python3 scripts/profile_summary.py /tmp/r3-prof --kernels 25 > "$out/batch-profile.txt" 2>&1; tail -40 "$out/batch-profile.txt" ;;
    sdxl)  # issue 31: SDXL 1024² 30 steps exact, compiled (UNet whole, default mode) against eager, in one process
      # (bench's limit and limit-compiled: the forward-only ceiling, absolute seconds per image in the JSON)
      step sdxl 570 python3 -m diffusiond bench --model random:sdxl,save=0 --dtype float16 --size 1024x1024 \
        --steps 30 --batch 1 --requests 3 --modes limit,limit-compiled --compile ${SDXL_COMPILE:-default} \
        --rounds 1 --no-flops --json ;;
    flux-compiled)  # issue 31: FLUX.1-dev 1024² 28 steps exact: compiled (regional) with the best attention backend
      # of the `attention` step (FLUX_ATTN) and fused QKV, against eager on that backend (limit: QKV unfused, as
      # fuse_qkv applies only to a compiled model); FLUX_COMPILE=reduce-overhead for CUDA graphs
      step flux-compiled 570 python3 -m diffusiond bench \
        --model random:flux-dev,save=0,fuse_qkv=1${FLUX_ATTN:+,attention=$FLUX_ATTN} --dtype bfloat16 \
        --size 1024x1024 --steps 28 --batch 1 --requests 3 --modes limit,limit-compiled \
        --compile ${FLUX_COMPILE:-default} --rounds 1 --no-flops --json ;;
    flux-fp8-compiled)  # issue 31: FLUX in fp8 (torchao, weights and activations) compiled, against resident
      # compiled, image and latent PSNR (bench_bigger); T5 stays bf16: fp8-storage is refused with --compile
      # (2026-12-06: fp8's compile and warm-up ran past a 260 s bound; resident took 75 s in all, so fp8 gets the rest)
      # (2026-12-06, third session: past 460 s again on an H200, dynamo in the VAE decoder when killed; the recompiles
      # and graph breaks are logged now, to tell a recompile per block from one slow compile)
      TORCH_LOGS=recompiles,graph_breaks step flux-fp8-compiled 580 python3 scripts/bench_bigger.py --out $out/flux-fp8-compiled \
        --configs resident,fp8-mm-full --compile default --images 2 --timeout 460 --deadline 570 ;;
    step-cache)  # issue 31: TaylorSeer lite and full (eager: refused with --compile) against resident (CACHES= adds
      # cache-fbc, which never skipped a step on the random weights, 2026-12-06),
      # FLUX.1-dev 1024² 28 steps, time per image and PSNR of images and latents
      step step-cache 560 python3 scripts/bench_bigger.py --out $out/step-cache \
        --configs resident,${CACHES:-cache-taylorseer-lite,cache-taylorseer} --images 2 --timeout 200 --deadline 540 ;;
    ready-flux)  # issue 31 compile time: FLUX.1-dev cold start to ready, regional compile, one 1024² shape (target
      # <= 60 s; building the random weights can take minutes). The compile cache is in --state-dir
      rm -rf /tmp/r3-state-flux
      ready flux flux-dev,save=0 1024x1024 bfloat16 530 ;;
    encoders-flux)  # issue 31 compile time: FLUX.1-dev cold start with its text encoders eager (compile_encoders=0)
      # against compiled (the default), fresh state dirs; then the compiled forward (limit-compiled) of each, 3 images
      rm -rf /tmp/r3-state-fluxenc0 /tmp/r3-state-fluxenc1
      ready fluxenc0 flux-dev,save=0,compile_encoders=0 1024x1024 bfloat16 200
      ready fluxenc1 flux-dev,save=0 1024x1024 bfloat16 200
      for opt in ,compile_encoders=0 ""; do
        step "encoders-flux-bench${opt#,}" 150 python3 -m diffusiond bench --model random:flux-dev,save=0$opt \
          --dtype bfloat16 --size 1024x1024 --steps 28 --batch 1 --requests 3 --modes limit-compiled --compile default \
          --rounds 1 --no-flops --json
      done ;;
    ready-sd15)  # issue 31: SD 1.5, --compile reduce-overhead --warmup 512x512:1, started twice on one state dir: the
      # second is the warm restart (target <= 15 s). A user's restart loads a folder, so the first start builds the
      # random weights and saves them (save=1, into $cache/models/random-sd15-v1) with a cold compile cache, and the
      # second loads that folder with the cache warm. The first's figures are packed before the second starts
      # (320 + 190 s of bounds; the JSON of each has the worker's phases and the compile cache's hits and misses)
      rm -rf /tmp/r3-state-sd15 $cache/models/random-sd15-v1
      ready sd15 sd15,save=1 512x512 float16 320 reduce-overhead
      pack
      ready sd15 sd15,save=1 512x512 float16 190 reduce-overhead ;;
    pack) pack ;;
    *) echo "unknown step $s" ;;
  esac
done
