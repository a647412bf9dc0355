# Shared by ab_iteration.sh and ab_step.sh (sourced, not run): the A/B loop over two source
# trees. `ab_rounds RUN LOG` runs, ROUNDS times, the base tree (BASE) then this one, each
# installed editable first, and calls `RUN <tree> <src> <model> <round>` for every model in
# MODELS, announcing each run in LOG. Alternating the trees makes machine drift hit both.
ab_rounds() {
  local run=$1 log=$2 here k tree src model
  here=$(pwd)
  for k in $(seq 1 "$ROUNDS"); do
    for tree in base new; do
      src=$here; [ "$tree" = base ] && src=$(cd "$BASE" && pwd)
      (cd "$src" && python3 -m pip install -q --no-build-isolation --no-deps -e . >/dev/null 2>&1)
      for model in $MODELS; do
        echo "== round $k $tree model $model ($src)" | tee -a "$log"
        "$run" "$tree" "$src" "$model" "$k"
      done
    done
  done
  python3 -m pip install -q --no-build-isolation --no-deps -e . >/dev/null 2>&1
}
