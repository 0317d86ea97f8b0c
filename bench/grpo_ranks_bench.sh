#!/usr/bin/env bash
# Data-parallel GRPO on CPU (bench/README.md, "Post-training as several ranks"): the GRPO example
# (configs/post/grpo-tiny.toml: 8 prompts x 8 completions a step from the SFT example's model,
# a KL term, no evaluation) as 1 process on 1 and on 2 threads and as 2 ranks of 1 thread under
# mpirun; seconds per step over steps 3 to the end from metrics.jsonl, and the mean reward.
# Usage: bench/grpo_ranks_bench.sh [STEPS]
#   (first the SFT example and the GRPO prompts: configs/post/grpo-tiny.toml says how)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-12}
pollen=$(realpath build/pollen)
config=$(realpath configs/post/grpo-tiny.toml)
work=build/bench-grpo-ranks
rm -rf "$work"
mkdir -p "$work"
work=$(realpath "$work")
root=()
[ "$(id -u)" -eq 0 ] && root=(--allow-run-as-root)
sets=(--set "train.steps=$steps" --set eval.interval=1000000 --set checkpoint.interval=1000000
  --set metrics.tensorboard=false)

report() {  # label, ranks, run dir
  python3 - "$1" "$2" "$3" <<'PY'
import json, sys
label, ranks, run = sys.argv[1], int(sys.argv[2]), sys.argv[3]
recs = [json.loads(l) for l in open(run + "/metrics.jsonl") if '"loss"' in l]
timed = recs[2:]
per_step = (timed[-1]["elapsed_s"] - recs[1]["elapsed_s"]) / len(timed)
print(json.dumps({"run": label, "ranks": ranks, "steps_timed": len(timed),
                  "seconds_per_step": round(per_step, 3),
                  "mean_reward": round(sum(r["grpo/reward"] for r in recs) / len(recs), 4)}))
PY
}

echo "== 1 process, 1 thread"
"$pollen" grpo --config "$config" "${sets[@]}" --set "run.dir=$work/one-1" --set run.threads=1 \
  2>/dev/null
report "1 process, 1 thread" 1 "$work/one-1"
echo "== 1 process, 2 threads"
"$pollen" grpo --config "$config" "${sets[@]}" --set "run.dir=$work/one-2" --set run.threads=2 \
  2>/dev/null
report "1 process, 2 threads" 1 "$work/one-2"
echo "== 2 ranks, 1 thread each"
mpirun -np 2 --bind-to none --oversubscribe "${root[@]}" \
  "$pollen" grpo --config "$config" "${sets[@]}" --set "run.dir=$work/two" --set run.threads=1 \
  2>/dev/null
report "2 ranks, 1 thread each" 2 "$work/two"
