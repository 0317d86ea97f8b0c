#!/usr/bin/env bash
# Training-step throughput: `pollen bench step` beside the PyTorch CPU peer, all in one run.
#
#   bench/step_vs_pytorch.sh            (after scripts/build)
#
# Peers: Debian's python3-torch (1.13, over OpenBLAS, OPENBLAS_NUM_THREADS=1) and, when
# bench/setup-pypi-torch has made build/bench-torch, the current torch from PyPI. Each model is
# run ROUNDS times, alternating the implementations, and the best round of each is kept (the
# least disturbed by anything else on the machine). Peak RSS comes from getrusage in every case.
# The GEMM ceiling is measured in the same run with `pollen bench gemm`. BASELINE=path/to/pollen
# adds another pollen binary (a build of an earlier commit) as one more implementation, so that a
# change is measured against what it changed in the same run.
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-10}
PEER=${PEER:-../shared/peers/pytorch_cpu_peer.py}
POLLEN=build/pollen
BASELINE=${BASELINE:-}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

impls=(pollen debian-torch)
[ -x build/bench-torch/bin/python ] && impls+=(pypi-torch)
[ -n "$BASELINE" ] && impls+=(pollen-baseline)

run_one() {  # impl model batch seq
  case "$1" in
    pollen) "$POLLEN" bench step --model "$2" --batch "$3" --seq "$4" --steps "$STEPS" --threads "$THREADS" ;;
    pollen-baseline) "$BASELINE" bench step --model "$2" --batch "$3" --seq "$4" --steps "$STEPS" --threads "$THREADS" ;;
    debian-torch) OPENBLAS_NUM_THREADS=1 /usr/bin/python3 "$PEER" "$2" "$THREADS" "$STEPS" ;;
    pypi-torch) build/bench-torch/bin/python "$PEER" "$2" "$THREADS" "$STEPS" ;;
  esac
}

"$POLLEN" bench gemm --threads "$THREADS" --size 2048 > "$out/gemm.json"
for round in $(seq "$ROUNDS"); do
  for spec in "llama-tiny 8 128" "llama-cpu 8 256"; do
    set -- $spec
    for impl in "${impls[@]}"; do
      run_one "$impl" "$1" "$2" "$3" | tail -n 1 > "$out/$impl-$1-$round.json"
      echo "round $round $impl $1: $(cat "$out/$impl-$1-$round.json")" >&2
    done
  done
done

python3 - "$out" "$ROUNDS" "${impls[@]}" <<'PY'
import json, sys, glob
out, rounds, impls = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
gemm = json.load(open(f"{out}/gemm.json"))
print(f"GEMM ceiling (pollen bench gemm, {gemm['threads']} threads): {gemm['gflops']} GFLOP/s")
print(f"| model | impl | tokens/s | step ms | peak RSS MB | pollen speed-up | GFLOP/s | of ceiling |")
print("|---|---|---|---|---|---|---|---|")
for model in ("llama-tiny", "llama-cpu"):
    best = {}
    for impl in impls:
        runs = [json.load(open(f)) for f in glob.glob(f"{out}/{impl}-{model}-*.json")]
        best[impl] = max(runs, key=lambda r: r["tokens_per_s"])
    fpt = best["pollen"]["flops_per_token"]
    for impl in impls:
        r = best[impl]
        rss = r.get("peak_rss_mb", r.get("peak_rss_MB"))
        gf = r["tokens_per_s"] * fpt / 1e9
        ratio = best["pollen"]["tokens_per_s"] / r["tokens_per_s"]
        name = r.get("impl", impl)
        print(f"| {model} | {name} | {r['tokens_per_s']:.0f} | {r['step_ms']} | {rss:.0f} | "
              f"{ratio:.2f}x | {gf:.1f} | {100 * gf / gemm['gflops']:.0f}% |")
PY
