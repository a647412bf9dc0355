#!/usr/bin/env bash
# One device call: GPU kernel tests, autotune, kernel benchmarks (benchmarks/README.md §A, §C).
# Usage (on the GPU machine, repo root): bash benchmarks/gpu_kernels_check.sh [--quick] [--sections CA]
# Writes logs and the markdown table under $OUT (default ./gpu_out); the Triton and autotune
# caches go to .gpu_cache/ (tarred to $OUT so a later call can carry them back).
set -o pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT" .gpu_cache
export PYTHONUNBUFFERED=1
export DMUON_CACHE_DIR=$PWD/.gpu_cache/dmuon TRITON_CACHE_DIR=$PWD/.gpu_cache/triton
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,utilization.gpu --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 benchmarks/gpu_mirror_check.py 2>&1 | tee "$OUT/mirror_check.log" || exit 1
if [ -z "$SKIP_TESTS" ]; then
  timeout 200 python3 -m pytest tests/kernels -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
timeout ${BENCH_TIMEOUT:-330} python3 benchmarks/bench_kernels.py --out "$OUT/bench_kernels.md" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "autotune candidate started"
rc=$?
tar czf "$OUT/gpu_cache.tgz" .gpu_cache
exit $rc
