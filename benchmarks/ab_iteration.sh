#!/usr/bin/env bash
# A/B of the one-process training iteration (bench_fsdp.py, one GPU) between two source trees in
# one device call: BASE (e.g. the previous commit, unpacked with `git archive`) and this tree.
# Runs alternate (base, new, base, new) so machine drift hits both; each tree is installed
# editable before its run. Results: $OUT/ab_<tree>_<model>_<k>.json and $OUT/ab.log.
#
#   git archive 9d1568e | (mkdir -p .base && tar -x -C .base)   # on the CPU machine
#   BASE=.base MODELS="S M" bash benchmarks/ab_iteration.sh          # on the GPU machine
set -uo pipefail
BASE=${BASE:?set BASE to the baseline source tree}
MODELS=${MODELS:-"S M"}
ROUNDS=${ROUNDS:-2}
CONFIGS=${AB_CONFIGS:-adamw,ours_eager,ours_compiled}
OUT=${OUT:-/tmp/ab}
mkdir -p "$OUT"
source "$(dirname "$0")/ab_trees.sh"
run_one() {  # tree src model round
  (cd "$2" && timeout ${AB_TIMEOUT:-240} torchrun --standalone --nproc_per_node 1 benchmarks/bench_fsdp.py \
    --model "$3" --configs "$CONFIGS" --out "$OUT/ab_$1_$3_$4.json") 2>&1 \
    | grep -v "^W\|Warning\|warn(" | tail -12 | tee -a "$OUT/ab.log"
}
ab_rounds run_one "$OUT/ab.log"
