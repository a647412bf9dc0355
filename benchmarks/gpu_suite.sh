#!/usr/bin/env bash
# The whole benchmark suite in one device call on a 2-GPU machine: install, then the kernel
# benchmarks (BENCHMARKS.md §A/§C), the optimizer step (§B1, one GPU) and the training
# iteration (§B: FSDP2 on 1 and 2 GPUs, HSDP 2×1), each stage under its own time limit so a slow
# stage cannot take the others' results with it; the headline ratios are printed last.
# Outputs land in $OUT (default ./gpu_out).
#   bash benchmarks/gpu_suite.sh                       # all stages (~15 min on 2× H200)
#   STAGES="fsdp_S step_M" bash benchmarks/gpu_suite.sh
set -o pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT" .gpu_cache
export PYTHONUNBUFFERED=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export DMUON_CACHE_DIR=$PWD/.gpu_cache/dmuon TRITON_CACHE_DIR=$PWD/.gpu_cache/triton
STAGES=${STAGES:-"kernels step_S step_M fsdp_S fsdp_M fsdp1_S hsdp_S"}
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch, triton, dmuon_compile as d; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), torch.cuda.device_count(), 'GPUs'); print(d.get_ns_backend())"
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
for stage in $STAGES; do
  start=$(date +%s)
  case $stage in
    step_M|step_S)
      timeout ${STEP_TIMEOUT:-150} python3 benchmarks/bench_step.py --model ${stage#step_} \
        --configs torch_muon ours_eager ours_compiled --out "$OUT/$stage.md" 2>&1 \
        | grep -v "autotune candidate" | tee "$OUT/$stage.log" | tail -25 ;;
    fsdp_S|fsdp_M)
      timeout ${FSDP_TIMEOUT:-120} torchrun --standalone --nproc_per_node "$ngpu" benchmarks/bench_fsdp.py \
        --model ${stage#fsdp_} --out "$OUT/${stage}_${ngpu}gpu.json" 2>&1 \
        | grep -v "autotune candidate" | tee "$OUT/$stage.log" | tail -25 ;;
    kernels)
      timeout ${KERNEL_TIMEOUT:-420} python3 benchmarks/bench_kernels.py --out "$OUT/kernels.md" 2>&1 \
        | grep -v "autotune candidate" | tee "$OUT/$stage.log" | tail -25 ;;
    fsdp1_S|fsdp1_M)
      timeout ${FSDP_TIMEOUT:-120} torchrun --standalone --nproc_per_node 1 benchmarks/bench_fsdp.py \
        --model ${stage#fsdp1_} --out "$OUT/${stage}_1gpu.json" 2>&1 \
        | grep -v "autotune candidate" | tee "$OUT/$stage.log" | tail -25 ;;
    hsdp_S|hsdp_M)
      timeout ${FSDP_TIMEOUT:-120} torchrun --standalone --nproc_per_node "$ngpu" benchmarks/bench_fsdp.py \
        --model ${stage#hsdp_} --replicate "$ngpu" --out "$OUT/${stage}_${ngpu}gpu.json" 2>&1 \
        | grep -v "autotune candidate" | tee "$OUT/$stage.log" | tail -25 ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "== $stage: rc=$? in $(( $(date +%s) - start )) s"
done
tar czf "$OUT/gpu_cache.tgz" .gpu_cache 2>/dev/null
echo "== headline ratios"
grep -h -E "HEADLINE|target|Muon tax|^\| (adamw|naive_muon|ours_eager|ours_compiled) " "$OUT"/*.log 2>/dev/null
