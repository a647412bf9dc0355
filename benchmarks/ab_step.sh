#!/usr/bin/env bash
# A/B of the optimizer step alone (bench_step.py, one GPU) between two source trees in one
# device call: BASE (e.g. the previous commit, unpacked with `git archive`) and this tree.
# Runs alternate (base, new, base, new) so machine drift hits both; each tree is installed
# editable before its run; both share the autotune verdicts (DMUON_CACHE_DIR) and Inductor's
# cache, so only the first run of each tree compiles cold. Results: $OUT/abstep_<tree>_<model>_<k>.md
# and the medians in $OUT/abstep.log. PROFILE_NEW=1 adds a profiled run of this tree per model
# (bench_step.py --profile: GPU time by kernel category, the trace kept gzipped).
#
#   git archive 09e1d98 | (mkdir -p .gpu_bases/b && tar -x -C .gpu_bases/b)   # CPU machine
#   BASE=.gpu_bases/b MODELS="S M" bash benchmarks/ab_step.sh                    # GPU machine
set -uo pipefail
BASE=${BASE:?set BASE to the baseline source tree}
MODELS=${MODELS:-"S M"}
ROUNDS=${ROUNDS:-2}
CONFIGS=${AB_STEP_CONFIGS:-ours_compiled}
OUT=${OUT:-/tmp/abstep}
mkdir -p "$OUT" .gpu_cache
export PYTHONUNBUFFERED=1 DMUON_CACHE_DIR=${DMUON_CACHE_DIR:-$PWD/.gpu_cache/dmuon}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.gpu_cache/triton}
source "$(dirname "$0")/ab_trees.sh"
run_one() {  # tree src model round
  (cd "$2" && timeout ${AB_TIMEOUT:-200} python3 benchmarks/bench_step.py --model "$3" \
    --configs $CONFIGS --no-fresh-cache --out "$OUT/abstep_$1_$3_$4.md") 2>&1 \
    | grep -E "median|Error|error" | tee -a "$OUT/abstep.log"
}
ab_rounds run_one "$OUT/abstep.log"
if [ "${PROFILE_NEW:-0}" = 1 ]; then
  for model in $MODELS; do
    echo "== profile new model $model" | tee -a "$OUT/abstep.log"
    timeout ${AB_TIMEOUT:-200} python3 benchmarks/bench_step.py --model "$model" --configs $CONFIGS \
      --no-fresh-cache --repeats 10 --out "$OUT/profile_${model}.md" --profile "$OUT/prof" 2>&1 \
      | tail -30 | tee -a "$OUT/abstep.log"
  done
fi
