#!/usr/bin/env bash
# The benchmark suite in one device call: install, then the chosen stages, each under its own
# time limit so a slow stage cannot take the others' results with it; the headline ratios are
# printed last. Every log, table, JSON and profiler trace goes into one archive,
# $OUT/results.tgz (the device tool returns at most 8 files), plus $OUT/gpu_cache.tgz (autotune
# verdicts and Triton binaries, to carry into the next call as .gpu_cache/) and $OUT/verdicts.tgz
# (the autotune verdicts alone, small enough to always come back).
#   STAGES="probe kernels gputests step_M" bash benchmarks/gpu_suite.sh           # 1 GPU
#   STAGES="probe fsdp_S fsdp_M hsdp_S hsdp1x_S" bash benchmarks/gpu_suite.sh     # 2 GPUs
# SUITE_DEADLINE=N starts no stage after N seconds (the archive is written in any case).
# Stages:
#   probe       nvidia-smi topology + NCCL bandwidth (benchmarks/nccl_probe.py, >= 2 GPUs)
#   sweep       sweep_tiles.py --extra: every tile configuration vs cuBLAS on the NS products
#               (SWEEP_CASES: its --cases; SWEEP_ARGS: more options, e.g. "--only _st,_cp")
#   gluon       gluon_probe.py: each Gluon configuration checked (small shapes, then the real
#               products) and timed against the Triton kernels and cuBLAS (GLUON_CASES,
#               GLUON_CONFIGS: its --cases and --configs, today's shortlisted one first;
#               GLUON_ARGS: more options); the shortlist it argues for goes to
#               $WORK/gluon_pick.txt (SHORTLIST_NEW=auto reads it)
#   kernels     bench_kernels.py sections C, A and N (SYRK, NS per matrix, NaN/Inf stress);
#               KERNEL_ARGS=--profile-ns adds each NS shape's top GPU kernels; with the peer's
#               wheels carried (.wheels, benchmarks/README.md) §A times Dao-AILab's NS beside ours
#   gputests    pytest -m "gpu and not tier" (GPUTEST_PATHS, default tests/: kernels, NCCL runtime)
#   tier        the multi-rank CUDA tier on one GPU: 2–8 gloo ranks share cuda:0
#               (pytest -m gpu tests/distributed/test_gpu_tier.py, TIER_TIMEOUT s, default 540;
#               TIER_K is pytest's -k: a device call holds ~10 min, so run the tier in three
#               calls, TIER_K="not compiled", "compiled and not race", "race and compiled");
#               its log and JUnit XML are archived
#   step_S/M/E  bench_step.py (§B1) with a profile of each configuration (STEP_CONFIGS,
#               STEP_TIMEOUT; STEP_ARGS: more options, e.g. "--size-gate 512,8"; STEP_TAG: a
#               suffix of its log, table and profile folder, for a second run in one call); E, the MoE model, leaves torch_muon_compiled out by default: its
#               peer gets every expert as a 2-D matrix, 796 in one Dynamo graph, minutes of
#               compile (CPU: 50 matrices 57 s, 200 matrices 274 s); run it in a call of its own,
#               STAGES=step_E STEP_CONFIGS="torch_muon_compiled ours_compiled" STEP_TIMEOUT=560
#               (bench_step.py writes its table after each configuration: a cut-off run keeps it);
#               E against the peers that take expert stacks whole (microsoft/dion, torchtitan's
#               DistMuon; their wheels carried, benchmarks/README.md §B1): STEP_CONFIGS=
#               "ours_compiled dion_muon titan_distmuon torch_muon" STEP_TIMEOUT=500
#   shortlist_S/M/E  bench_step.py ours_compiled with the autotune's Gluon candidates set to
#               SHORTLIST_BASE, then SHORTLIST_NEW (gluon_probe.py --configs syntax, or auto:
#               what the gluon stage of the same call picked, gluon_probe.py --pick; the new
#               side's plain SYRKs: SHORTLIST_SYRK_NEW, default none), each with its own
#               verdict cache, SHORTLIST_ROUNDS times (default 1), alternating
#   fsdp_S/M    bench_fsdp.py on all GPUs, 1-D mesh, with profiler traces (exposed comm)
#   fsdp1_S/M/E the same on one GPU (FSDP1_PROFILE=1: with profiler traces, as fsdp_S/M;
#               FSDP1_ARGS: more bench_fsdp.py options); E: the MoE model, its experts on
#               torch._grouped_mm where a probe of it passes, else dense (FSDP1_ARGS=
#               "--moe-impl dense" forces those)
#   hsdp_S/M    HSDP ngpu×1 (pure replicate), ours configurations only + AdamW, with the
#               replicate-stage counters (DMUON_RECORD_FORWARD_PROFILE=1) and ours compiled on
#               the 1-D mesh in the same run (HSDP_WITH_1D), for the HSDP/1-D ratio
#   hsdp1x_S/M  HSDP 1×ngpu (replicate size 1)
#   hsdp2_S/M   HSDP 2×(ngpu/2) (>= 4 GPUs: 2×2, 2×4), with the 1-D run of ours in the same process
#   scale_S/M   bench_fsdp.py (adamw, ours_compiled) on SCALING_GPUS (default "1 2 4 8", capped at
#               the GPUs present), then plot_scaling.py: table + scaling_<model>.png
#   cold        cold_compile.py per model (COLD_MODELS, default "S M") with every cache in a new
#               empty directory, then again in a second process on those caches (warm), each
#               model in its own processes, COLD_REPEATS times (default 1); COLD_WARM_ARGS
#               (e.g. "--cprofile 40") go to the warm runs: first compiled step split into
#               SYRK autotune, Triton compiles, Dynamo and Inductor
#   memory      step_memory.py: the step's peak memory and time, with the 4 GiB stack budget and
#               without (MEMORY_MODELS, default "S M G L70"; MEMORY_CONFIGS; MEMORY_TIMEOUT 400)
#   nsgraph     ns_graph_probe.py: eager NS per call vs torch.optim.Muon's, with graph replay
#   parity      the training demo for 20 steps on 1 GPU and on all GPUs, compared step by step
#               (benchmarks/loss_parity.py)
#   two_gpu     the two-GPU issue on GPUs 0 and 1 (refused with fewer than 2): per model
#               (TWO_GPU_MODELS, default "S M") one bench_fsdp.py run with TP 2 (dp 1 × tp 2) and
#               the 1-D configurations over 2 interleaved (--tp 2 --with-1d), profiled; HSDP 2×1
#               against 1-D (TWO_GPU_HSDP_MODELS, default S); the demo's loss parity over 20
#               steps, 1 GPU against 1-D over 2 and against --tp 2. Time limits (s):
#               TWO_GPU_T_S 110, TWO_GPU_T_M 190, TWO_GPU_T_HSDP 80, TWO_GPU_T_PARITY 40 per demo
#               run (sum 500; carry .gpu_cache from an earlier call: a cold compile of M is slow). CPU dry run of the same commands: TWO_GPU_NGPU=2 TWO_GPU_BENCH_EXTRA=
#               "--quick --device cpu" TWO_GPU_DEMO_EXTRA="--device cpu --d-model 64 --layers 2"
set -o pipefail
OUT=${OUT:-$PWD/gpu_out}
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$OUT" "$WORK/prof" .gpu_cache
export PYTHONUNBUFFERED=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export DMUON_CACHE_DIR=$PWD/.gpu_cache/dmuon TRITON_CACHE_DIR=$PWD/.gpu_cache/triton
STAGES=${STAGES:-"probe kernels step_M fsdp_S fsdp_M hsdp_S"}
T=${STAGE_TIMEOUT:-150}
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$WORK/pip.log" 2>&1 || { cat "$WORK/pip.log"; exit 1; }
# Peers carried as files (.wheels/, git-ignored, named in the call's carry; benchmarks/README.md
# "Peers on the device"): wheels, and tar.xz archives of a wheel's unpacked tree where the wheel
# itself is over the call's 64 MiB. Installed into /tmp/peers, never into the image.
if ls .wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peers .wheels/*.whl >"$WORK/peers.log" 2>&1
  for t in .wheels/*.tar.xz; do
    [ -e "$t" ] && python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$t" /tmp/peers
  done
  export PYTHONPATH=/tmp/peers:/tmp/peers/nvidia_cutlass_dsl/python_packages${PYTHONPATH:+:$PYTHONPATH}
  # Which peers import (§A: Dao-AILab's NS; §B1 model E: microsoft/dion, torchtitan's DistMuon).
  for peer in gram_newton_schulz dion torchtitan.distributed.flex_shard.dist_muon; do
    python3 -c "import importlib, sys; sys.path.insert(0, 'benchmarks'); from torchtitan_steps import _torchtitan_on_this_torch as f; f(); importlib.import_module('$peer'); print('peer: $peer imports')" 2>&1 | tail -1
  done
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch, triton, dmuon_compile as d; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), torch.cuda.device_count(), 'GPUs'); print(d.get_ns_backend())"
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
quiet() { grep -v "autotune candidate"; }
suite_start=$(date +%s)
for stage in $STAGES; do
  start=$(date +%s)
  # SUITE_DEADLINE (s): start no stage after it, so the archive is still written inside the
  # device call's limit.
  if [ -n "${SUITE_DEADLINE:-}" ] && [ $(( start - suite_start )) -ge "$SUITE_DEADLINE" ]; then
    echo "== $stage: skipped (SUITE_DEADLINE=${SUITE_DEADLINE}s reached)"; continue
  fi
  model=${stage##*_}
  log="$WORK/$stage.log"
  case $stage in
    probe)
      { nvidia-smi topo -m; [ "$ngpu" -ge 2 ] && timeout 120 torchrun --standalone --nproc_per_node "$ngpu" benchmarks/nccl_probe.py; } 2>&1 | tee "$log" ;;
    sweep)
      timeout ${SWEEP_TIMEOUT:-300} python3 benchmarks/sweep_tiles.py --extra ${SWEEP_CASES:+--cases $SWEEP_CASES} ${SWEEP_ARGS:-} \
        --out "$WORK/sweep.md" 2>&1 | tee "$log" ;;
    gluon)
      timeout ${GLUON_TIMEOUT:-200} python3 benchmarks/gluon_probe.py ${GLUON_CASES:+--cases $GLUON_CASES} \
        ${GLUON_CONFIGS:+--configs "$GLUON_CONFIGS"} --pick "$WORK/gluon_pick.txt" ${GLUON_ARGS:-} 2>&1 \
        | tee "$log" | tail -60 ;;
    kernels)
      timeout ${KERNEL_TIMEOUT:-420} python3 benchmarks/bench_kernels.py --sections ${KERNEL_SECTIONS:-CAN} ${KERNEL_ARGS:-} \
        --out "$WORK/kernels.md" 2>&1 | quiet | tee "$log" | tail -40 ;;
    gputests)
      timeout ${GPUTEST_TIMEOUT:-$T} python3 -u -m pytest ${GPUTEST_PATHS:-tests} -m "gpu and not tier" -v -p no:cacheprovider \
        2>&1 | tee "$log" | grep -v PASSED | tail -25 ;;
    tier)
      timeout ${TIER_TIMEOUT:-540} python3 -u -m pytest tests/distributed/test_gpu_tier.py -m gpu -v \
        -p no:cacheprovider --durations=0 --junitxml="$WORK/tier.xml" ${TIER_K:+-k "$TIER_K"} \
        2>&1 | tee "$log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|s call" | tail -60 ;;
    step_*)
      configs="torch_muon torch_muon_compiled ours_eager_cublas ours_eager ours_compiled"; limit=200
      [ "$model" = E ] && configs="torch_muon ours_eager_cublas ours_eager ours_compiled" && limit=300
      log="$WORK/$stage${STEP_TAG:-}.log"
      timeout ${STEP_TIMEOUT:-$limit} python3 benchmarks/bench_step.py --model "$model" \
        --configs ${STEP_CONFIGS:-$configs} ${STEP_ARGS:-} \
        --out "$WORK/$stage${STEP_TAG:-}.md" --profile "$WORK/prof${STEP_TAG:-}" 2>&1 | quiet | tee "$log" | tail -60 ;;
    shortlist_*)  # the step alone, ours compiled, with two Gluon shortlists (A/B, alternating)
      for round in $(seq ${SHORTLIST_ROUNDS:-1}); do
        for side in base new; do
          spec=$SHORTLIST_BASE; [ $side = new ] && spec=$SHORTLIST_NEW
          if [ "$spec" = auto ]; then  # what this call's gluon stage picked
            spec=$(cat "$WORK/gluon_pick.txt" 2>/dev/null) || { echo "== no gluon pick: run the gluon stage first"; break 2; }
          fi
          syrk_spec=none; [ $side = new ] && syrk_spec=${SHORTLIST_SYRK_NEW:-none}
          echo "== $stage round $round, $side shortlist: $spec; plain SYRKs: $syrk_spec"
          DMUON_CACHE_DIR=$WORK/verdicts_$side timeout ${STEP_TIMEOUT:-200} python3 benchmarks/bench_step.py \
            --model "$model" --configs ours_compiled --no-fresh-cache --gluon-shortlist "$spec" \
            --gluon-syrk-shortlist "$syrk_spec" \
            --out "$WORK/${stage}_${side}_$round.md" 2>&1 | quiet | grep -E "^\| |^Gluon shortlist|Error|autotune verdict"
        done
      done 2>&1 | tee "$log" ;;
    fsdp_*)
      timeout $T torchrun --standalone --nproc_per_node "$ngpu" benchmarks/bench_fsdp.py --model "$model" \
        --configs ${FSDP_CONFIGS:-adamw,naive_muon,ours_eager,ours_compiled} \
        --out "$WORK/${stage}_${ngpu}gpu.json" --profile "$WORK/prof" 2>&1 | quiet | tee "$log" | tail -40 ;;
    fsdp1_*)
      timeout $T torchrun --standalone --nproc_per_node 1 benchmarks/bench_fsdp.py --model "$model" \
        --configs ${FSDP_CONFIGS:-adamw,naive_muon,ours_eager,ours_compiled} \
        --out "$WORK/${stage}_1gpu.json" ${FSDP1_PROFILE:+--profile "$WORK/prof"} ${FSDP1_ARGS:-} 2>&1 | quiet | tee "$log" | tail -25 ;;
    hsdp_*|hsdp2_*)  # replicate over all GPUs (ngpu×1), or over 2 (2×ngpu/2)
      replicas=$ngpu; [ "${stage%%_*}" = hsdp2 ] && replicas=2
      DMUON_RECORD_FORWARD_PROFILE=1 timeout $T torchrun --standalone --nproc_per_node "$ngpu" \
        benchmarks/bench_fsdp.py --model "$model" --replicate "$replicas" --configs ${HSDP_CONFIGS:-adamw,ours_eager,ours_compiled} \
        --with-1d ${HSDP_WITH_1D:-ours_compiled} --out "$WORK/${stage}_${ngpu}gpu.json" \
        --profile "$WORK/prof" 2>&1 | quiet | tee "$log" | tail -40 ;;
    hsdp1x_*)
      timeout $T torchrun --standalone --nproc_per_node "$ngpu" benchmarks/bench_fsdp.py --model "$model" \
        --replicate 1 --hsdp --configs adamw,ours_compiled --out "$WORK/${stage}_${ngpu}gpu.json" \
        2>&1 | quiet | tee "$log" | tail -25 ;;
    scale_*)
      for n in ${SCALING_GPUS:-1 2 4 8}; do
        [ "$n" -le "$ngpu" ] || continue
        timeout $T torchrun --standalone --nproc_per_node "$n" benchmarks/bench_fsdp.py --model "$model" \
          --configs ${SCALE_CONFIGS:-adamw,ours_compiled} --out "$WORK/scale_${model}_${n}gpu.json" 2>&1 \
          | quiet | tee -a "$log" | grep -E "^\| |^balance|^mesh"
      done
      python3 benchmarks/plot_scaling.py "$WORK"/scale_${model}_*gpu.json --out "$WORK/scaling_$model.md" \
        --png "$WORK/scaling_$model.png" 2>&1 | tee -a "$log" ;;
    cold)
      # One process per model and phase (a model's first step must not ride on another's warm
      # torch), COLD_REPEATS times, each repeat with its own empty caches.
      for rep in $(seq ${COLD_REPEATS:-1}); do
        for m in ${COLD_MODELS:-S M}; do
          C=$(mktemp -d)
          for phase in cold warm; do
            extra=""; [ "$phase" = warm ] && extra=${COLD_WARM_ARGS:-}
            DMUON_CACHE_DIR=$C/d TRITON_CACHE_DIR=$C/t TORCHINDUCTOR_CACHE_DIR=$C/i timeout ${COLD_TIMEOUT:-120} \
              python3 benchmarks/cold_compile.py --model "$m" $extra --out "$WORK/${phase}_${m}_$rep.md" \
              2>&1 | quiet > "$WORK/${phase}_${m}_$rep.log"
            echo "== $phase $m repeat $rep (rc=$?)"; grep -E "^\| [SM] |per key" "$WORK/${phase}_${m}_$rep.md"
          done
        done
      done 2>&1 | tee "$log" ;;
    memory)
      timeout ${MEMORY_TIMEOUT:-400} python3 benchmarks/step_memory.py --model ${MEMORY_MODELS:-S M G L70} \
        ${MEMORY_CONFIGS:+--configs $MEMORY_CONFIGS} --out "$WORK/memory.md" 2>&1 | quiet | tee "$log" | tail -30 ;;
    nsgraph)
      timeout $T python3 benchmarks/ns_graph_probe.py 2>&1 | quiet | tee "$log" ;;
    parity)
      timeout $T python3 -m dmuon_compile.train --device cuda --steps 20 --log-every 1 --eval-every 20 \
        --no-progress --out-dir "$WORK/parity_1gpu" > "$log" 2>&1
      timeout $T torchrun --standalone --nproc_per_node "$ngpu" -m dmuon_compile.train --device cuda --steps 20 \
        --log-every 1 --eval-every 20 --no-progress --out-dir "$WORK/parity_${ngpu}gpu" >> "$log" 2>&1
      python3 benchmarks/loss_parity.py "$WORK/parity_1gpu/log.csv" "$WORK/parity_${ngpu}gpu/log.csv" \
        --rtol ${PARITY_RTOL:-2e-2} 2>&1 | tee -a "$log" | tail -8 ;;
    two_gpu)
      if [ "${TWO_GPU_NGPU:-$ngpu}" -lt 2 ]; then
        echo "two_gpu: needs 2 GPUs, this machine has $ngpu: run it on a 2-GPU machine" | tee "$log"
        (exit 2)
      else
        : >"$log"
        for m in ${TWO_GPU_MODELS:-S M}; do  # TP 2 and 1-D over 2: one process pair, interleaved
          t=TWO_GPU_T_$m; t=${!t:-$([ "$m" = M ] && echo 190 || echo 110)}
          echo "== two_gpu: model $m, tp 2 + 1-D (limit $t s)" | tee -a "$log"
          DMUON_RECORD_FORWARD_PROFILE=1 timeout "$t" torchrun --standalone --nproc_per_node 2 \
            benchmarks/bench_fsdp.py --model "$m" --tp 2 --configs ${TWO_GPU_CONFIGS:-adamw,ours_eager,ours_compiled} \
            --with-1d ${TWO_GPU_CONFIGS:-adamw,ours_eager,ours_compiled} --out "$WORK/two_gpu_tp2_$m.json" \
            --profile "$WORK/prof" ${TWO_GPU_BENCH_EXTRA:-} 2>&1 | quiet | tee -a "$log" \
            | grep -E "^mesh|^\| |^  |^TP|^balance|^FAILED|^skipped|exposed|hidden"
          echo "== two_gpu: model $m, tp 2 + 1-D: rc=${PIPESTATUS[0]}" | tee -a "$log"
        done
        for m in ${TWO_GPU_HSDP_MODELS:-S}; do  # HSDP 2×1 against the 1-D run, same process pair
          echo "== two_gpu: model $m, HSDP 2x1 + 1-D (limit ${TWO_GPU_T_HSDP:-80} s)" | tee -a "$log"
          DMUON_RECORD_FORWARD_PROFILE=1 timeout ${TWO_GPU_T_HSDP:-80} torchrun --standalone --nproc_per_node 2 \
            benchmarks/bench_fsdp.py --model "$m" --replicate 2 --configs adamw,ours_eager,ours_compiled \
            --with-1d ours_compiled --out "$WORK/two_gpu_hsdp2x1_$m.json" --profile "$WORK/prof" \
            ${TWO_GPU_BENCH_EXTRA:-} 2>&1 | quiet | tee -a "$log" \
            | grep -E "^mesh|^\| |^  |^HSDP|^FAILED|replicate broadcast|broadcasts issued"
          echo "== two_gpu: model $m, HSDP 2x1: rc=${PIPESTATUS[0]}" | tee -a "$log"
        done
        P=${TWO_GPU_T_PARITY:-40}
        demo="-m dmuon_compile.train --device cuda --steps 20 --log-every 1 --eval-every 20 --no-progress ${TWO_GPU_DEMO_EXTRA:-}"
        timeout "$P" python3 $demo --out-dir "$WORK/two_gpu_parity_1gpu" >>"$log" 2>&1
        echo "== two_gpu: demo on 1 GPU: rc=$?" | tee -a "$log"
        for run in 1d tp2; do
          flag=; [ $run = tp2 ] && flag="--tp 2"
          timeout "$P" torchrun --standalone --nproc_per_node 2 $demo $flag --out-dir "$WORK/two_gpu_parity_$run" >>"$log" 2>&1
          echo "== two_gpu: demo on 2 GPUs ($run): rc=$?" | tee -a "$log"
        done
        for run in 1d tp2; do
          echo "== two_gpu: loss parity, 2 GPUs ($run) against 1 GPU" | tee -a "$log"
          python3 benchmarks/loss_parity.py "$WORK/two_gpu_parity_1gpu/log.csv" "$WORK/two_gpu_parity_$run/log.csv" \
            --rtol ${PARITY_RTOL:-2e-2} 2>&1 | tee -a "$log" | tail -1
        done
      fi ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "== $stage: rc=$? in $(( $(date +%s) - start )) s"
done
tar czf "$OUT/verdicts.tgz" .gpu_cache/dmuon 2>/dev/null  # small: carry back as .gpu_cache/dmuon
tar czf "$OUT/gpu_cache.tgz" .gpu_cache 2>/dev/null  # with Triton's binaries: often over the 16 MiB limit
tar czf "$OUT/results.tgz" -C "$WORK" . 2>/dev/null
ls -la "$OUT"
echo "== headline ratios"
grep -h -E "HEADLINE|target|Muon tax|exposed|hidden|PARITY|^balance|^\| (adamw|naive_muon|ours_eager|ours_eager_sync|ours_compiled) " "$WORK"/*.log 2>/dev/null
