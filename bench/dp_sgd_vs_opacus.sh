#!/usr/bin/env bash
# DP-SGD step throughput: `pollen bench step --dp-clip` (each way of clipping) beside Opacus on
# PyTorch, and each one's plain step, all in one run.
#
#   bench/setup-opacus && bench/dp_sgd_vs_opacus.sh      (after scripts/build)
#
# Every step clips each of its rows (one sequence each) to norm 1, adds Gaussian noise of
# multiplier 1 and takes an AdamW step, on random tokens. Opacus runs the CPU peer's decoders
# (../shared/peers/pytorch_cpu_peer.py) with per-sample gradients from hooks, and with its fast
# gradient clipping ("ghost"). Each implementation runs ROUNDS times, alternating, and the best
# round is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-3}
PEER=${PEER:-../shared/peers/pytorch_cpu_peer.py}
PY=build/bench-opacus/bin/python
[ -x "$PY" ] || { echo "run bench/setup-opacus first" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

impls=(pollen pollen-dp pollen-dp-batched pollen-dp-one-by-one opacus-hooks opacus-ghost)
specs=("llama-tiny 8 128" "llama-tiny 32 64" "llama-cpu 8 256" "llama-cpu 32 64")

run_one() {  # impl model batch seq
  local step=(build/pollen bench step --model "$2" --batch "$3" --seq "$4" --steps "$STEPS"
              --threads "$THREADS")
  case "$1" in
    pollen) "${step[@]}" ;;
    pollen-dp) "${step[@]}" --dp-clip 1 --dp-noise 1 ;;
    pollen-dp-batched) "${step[@]}" --dp-clip 1 --dp-noise 1 --dp-clipping batched ;;
    pollen-dp-one-by-one) "${step[@]}" --dp-clip 1 --dp-noise 1 --dp-clipping one-by-one ;;
    opacus-*) "$PY" bench/dp_sgd_opacus_peer.py "$PEER" "$2" "${1#opacus-}" "$THREADS" \
                "$STEPS" "$3" "$4" 2>/dev/null ;;
  esac
}

for round in $(seq "$ROUNDS"); do
  for spec in "${specs[@]}"; do
    set -- $spec
    for impl in "${impls[@]}"; do
      run_one "$impl" "$1" "$2" "$3" | tail -n 1 > "$out/$impl-$1-$2-$round.json"
      echo "round $round $impl $spec: $(cut -c1-150 "$out/$impl-$1-$2-$round.json")" >&2
    done
  done
done

python3 - "$out" "${impls[*]}" "${specs[@]}" <<'PY'
import json, sys, glob
out, impls, specs = sys.argv[1], sys.argv[2].split(), sys.argv[3:]
print("| model | batch x seq | " + " | ".join(impls) + " | pollen-dp / best Opacus |")
print("|---|---|" + "---|" * (len(impls) + 1))
for spec in specs:
    model, batch, seq = spec.split()
    best = {}
    for impl in impls:
        runs = [json.load(open(f)) for f in glob.glob(f"{out}/{impl}-{model}-{batch}-*.json")]
        best[impl] = max(r["tokens_per_s"] for r in runs)
    opacus = max(v for k, v in best.items() if k.startswith("opacus"))
    cells = " | ".join(f"{best[i]:.0f}" for i in impls)
    print(f"| {model} | {batch} x {seq} | {cells} | {best['pollen-dp'] / opacus:.2f}x |")
print("tokens/s, best of the rounds; pollen: plain step, then DP-SGD (auto, batched, one by one)")
PY
