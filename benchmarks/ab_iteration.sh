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
here=$(pwd)
for k in $(seq 1 "$ROUNDS"); do
  for tree in base new; do
    src=$here; [ "$tree" = base ] && src=$(cd "$BASE" && pwd)
    (cd "$src" && python3 -m pip install -q --no-build-isolation --no-deps -e . >/dev/null 2>&1)
    for model in $MODELS; do
      echo "== round $k $tree model $model ($src)" | tee -a "$OUT/ab.log"
      (cd "$src" && timeout ${AB_TIMEOUT:-240} torchrun --standalone --nproc_per_node 1 benchmarks/bench_fsdp.py \
        --model "$model" --configs "$CONFIGS" --out "$OUT/ab_${tree}_${model}_${k}.json") 2>&1 \
        | grep -v "^W\|Warning\|warn(" | tail -12 | tee -a "$OUT/ab.log"
    done
  done
done
python3 -m pip install -q --no-build-isolation --no-deps -e . >/dev/null 2>&1
