#!/usr/bin/env bash
# Data-parallel scaling on CPU (bench/README.md, "Data parallel"): the same run (llama-tiny,
# global batch 8 x 128 tokens, 1 thread per rank) as 1 process and as 2 ranks under mpirun,
# with tokens/s per rank and the fraction of step time spent waiting on gradient reductions,
# averaged over steps 3 to the end from metrics.jsonl.
# Usage: bench/dist_bench.sh MANIFEST [STEPS]   (any manifest with vocab_size <= 4096)
set -euo pipefail
cd "$(dirname "$0")/.."
manifest=$(realpath "$1")
steps=${2:-12}
pollen=$(realpath build/pollen)
work=build/bench-dist
rm -rf "$work"
mkdir -p "$work"
root=()
[ "$(id -u)" -eq 0 ] && root=(--allow-run-as-root)

for zero in 0 1; do
  cat > "$work/run-zero$zero.toml" <<TOML
[run]
threads = 1
[model]
preset = "llama-tiny"
[data]
manifests = ["$manifest"]
validation_split = ""
[train]
steps = $steps
micro_batch = 4
seq = 128
batch_tokens = 1024
[checkpoint]
interval = 0
[metrics]
peak_flops = 1e12
log_interval = 1000
[parallel]
zero = $zero
TOML
done

report() {  # label, run dir
  python3 - "$1" "$2" <<'PY'
import json, sys
label, run = sys.argv[1], sys.argv[2]
recs = [json.loads(l) for l in open(run + "/metrics.jsonl") if '"loss"' in l][2:]
tps = sum(r["tokens_per_s"] for r in recs) / len(recs)
ranks = recs[0].get("ranks", 1)
wait = sum(r.get("reduce_wait_frac", 0.0) for r in recs) / len(recs)
print(json.dumps({"run": label, "ranks": ranks, "steps_timed": len(recs),
                  "tokens_per_s": round(tps), "tokens_per_s_per_rank": round(tps / ranks),
                  "reduce_wait_frac": round(wait, 4), "last_loss": recs[-1]["loss"]}))
PY
}

echo "== 1 process"
(cd "$work" && "$pollen" train --config run-zero0.toml --set run.dir=one 2>/dev/null)
report "1 process" "$work/one"
for zero in 0 1; do
  echo "== 2 ranks, parallel.zero = $zero"
  (cd "$work" && mpirun -np 2 --bind-to none --oversubscribe "${root[@]}" \
    "$pollen" train --config "run-zero$zero.toml" --set run.dir="two-zero$zero" 2>/dev/null)
  report "2 ranks, zero $zero" "$work/two-zero$zero"
done
