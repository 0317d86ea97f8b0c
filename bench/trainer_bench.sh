#!/usr/bin/env bash
# Trainer benchmarks (bench/README.md, "Trainer"):
#  1. `pollen train` throughput on llama-cpu against `pollen bench step` at the same batch, seq
#     and threads (the trainer's overhead: data loading, accumulation, metrics);
#  2. writing a llama-124m checkpoint (weights + AdamW moments, hashed, fsynced) against
#     `dd conv=fsync` of the same size on the same disk, 5 alternated pairs in the same run
#     (bench/checkpoint_bench.sh).
# Usage: bench/trainer_bench.sh MANIFEST [THREADS]   (any manifest with vocab_size <= 8192)
set -euo pipefail
cd "$(dirname "$0")/.."
manifest=$(realpath "$1")
threads=${2:-2}
pollen=build/pollen
work=build/bench-trainer
rm -rf "$work"
mkdir -p "$work"

echo "== bench step: llama-cpu, batch 8, seq 128, $threads threads"
$pollen bench step --model llama-cpu --batch 8 --seq 128 --steps 10 --warmup 2 --threads "$threads"

cat > "$work/run.toml" <<TOML
[run]
dir = "run"
threads = $threads
[model]
preset = "llama-cpu"
[data]
manifests = ["$manifest"]
validation_split = ""
[train]
steps = 12
micro_batch = 8
seq = 128
[optimizer]
lr = 3e-4
[checkpoint]
interval = 0
[metrics]
peak_flops = 1e12
log_interval = 100
TOML
echo "== pollen train: llama-cpu, 12 steps of 8 x 128, $threads threads (steps 3-12 averaged)"
$pollen train --config "$work/run.toml" 2>&1 | grep -E "finished|checkpoint step"
python3 - "$work/run/metrics.jsonl" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
tail = recs[2:]
print(json.dumps({"steps_timed": len(tail),
                  "tokens_per_s": round(sum(r["tokens_per_s"] for r in tail) / len(tail)),
                  "last_loss": tail[-1]["loss"]}))
PY

bench/checkpoint_bench.sh "$work/ckpt-bench" 5 llama-124m
