#!/usr/bin/env bash
# Data-parallel SFT on CPU (bench/README.md, "Data parallel (CPU, MPI)"): the same SFT run
# (llama-tiny from its seed, the SFT example's arithmetic conversations, 4 x 2 packed rows of 128
# positions a step) as 1 process on 1 and on 2 threads and as 2 ranks of 1 thread under mpirun;
# tokens/s averaged over steps 6 to the end from metrics.jsonl, and the last loss.
# Usage: bench/sft_ranks_bench.sh SFT_JSONL TOKENIZER_JSON [STEPS]
#   (the SFT example's data: configs/post/sft-tiny.toml says how to make both files)
set -euo pipefail
cd "$(dirname "$0")/.."
data=$(realpath "$1")
tokenizer=$(realpath "$2")
steps=${3:-30}
pollen=$(realpath build/pollen)
work=build/bench-sft-ranks
rm -rf "$work"
mkdir -p "$work"
root=()
[ "$(id -u)" -eq 0 ] && root=(--allow-run-as-root)

cat > "$work/run.toml" <<TOML
[run]
seed = 1
threads = 1
[model]
base = "llama-tiny"
tokenizer = "$tokenizer"
chat_template = "chatml"
[train]
steps = $steps
[optimizer]
lr = 3e-3
[metrics]
log_interval = 1000
tensorboard = false
[sft]
data = "$data"
validation_fraction = 0
seq = 128
micro_batch = 4
accumulation = 2
TOML

report() {  # label, ranks, run dir
  python3 - "$1" "$2" "$3" <<'PY'
import json, sys
label, ranks, run = sys.argv[1], int(sys.argv[2]), sys.argv[3]
recs = [json.loads(l) for l in open(run + "/metrics.jsonl") if '"loss"' in l][5:]
tps = sum(r["tokens_per_s"] for r in recs) / len(recs)
print(json.dumps({"run": label, "ranks": ranks, "steps_timed": len(recs),
                  "tokens_per_s": round(tps), "tokens_per_s_per_rank": round(tps / ranks),
                  "last_loss": recs[-1]["loss"]}))
PY
}

cd "$work"
echo "== 1 process, 1 thread"
"$pollen" sft --config run.toml --set run.dir=one-1 2>/dev/null
report "1 process, 1 thread" 1 one-1
echo "== 1 process, 2 threads"
"$pollen" sft --config run.toml --set run.dir=one-2 --set run.threads=2 2>/dev/null
report "1 process, 2 threads" 1 one-2
echo "== 2 ranks, 1 thread each"
mpirun -np 2 --bind-to none --oversubscribe "${root[@]}" \
  "$pollen" sft --config run.toml --set run.dir=two 2>/dev/null
report "2 ranks, 1 thread each" 2 two
