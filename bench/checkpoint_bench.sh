#!/usr/bin/env bash
# Checkpoint write speed (bench/README.md, "Trainer"): `pollen bench checkpoint` (weights + AdamW
# moments, SHA-256 of every byte, fsynced, renamed) against `dd if=/dev/zero bs=1M conv=fsync` of
# the same size into the same folder, alternated PAIRS times in one run (who goes first alternates
# too), since a virtual disk's speed drifts between runs. Prints every pair (pollen's JSON line
# with its CPU seconds, dd's line with its CPU time), the median ratio and the load average.
# Usage: bench/checkpoint_bench.sh [DIR] [PAIRS] [MODEL]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build/bench-checkpoint}
pairs=${2:-5}
model=${3:-llama-124m}
pollen=build/pollen
mkdir -p "$dir"
results=$(mktemp)
trap 'rm -f "$results" "$dir/dd.bin"' EXIT

run_pollen() {
  local out
  out=$($pollen bench checkpoint --model "$model" --dir "$dir/ckpt")
  echo "  pollen: $out" >&2
  python3 -c "import json,sys; j=json.loads(sys.argv[1]); print(j['bytes'], j['seconds'])" "$out"
}
run_dd() {  # $1: MiB
  local out line
  out=$(/usr/bin/time -f "cpu %U s user %S s sys" \
    dd if=/dev/zero of="$dir/dd.bin" bs=1M count="$1" conv=fsync 2>&1)
  rm -f "$dir/dd.bin"
  line=$(grep copied <<< "$out")
  echo "  dd:     $line; $(tail -1 <<< "$out")" >&2
  # "1510998016 bytes (1.5 GB, 1.4 GiB) copied, 2.76161 s, 547 MB/s"
  python3 -c "import sys; w=sys.argv[1].split(); print(w[0], w[w.index('s,') - 1])" "$line"
}

echo "== $model checkpoint vs dd conv=fsync, $pairs pairs, into $dir; $(uptime)"
# The size dd writes: one checkpoint's bytes, rounded up to MiB (measured once, not timed).
read -r bytes _ < <(run_pollen 2>/dev/null)
mib=$(( (bytes + 1048575) / 1048576 ))
for i in $(seq 1 "$pairs"); do
  echo "pair $i"
  if (( i % 2 )); then
    read -r pb ps < <(run_pollen)
    read -r db ds < <(run_dd "$mib")
  else
    read -r db ds < <(run_dd "$mib")
    read -r pb ps < <(run_pollen)
  fi
  echo "$pb $ps $db $ds" >> "$results"
done
echo "== done; $(uptime)"
python3 - "$results" <<'PY'
import statistics, sys
rows = [list(map(float, l.split())) for l in open(sys.argv[1])]
ratios = []
for i, (pb, ps, db, ds) in enumerate(rows, 1):
    p, d = pb / ps / 1e6, db / ds / 1e6
    ratios.append(p / d)
    print(f"pair {i}: pollen {p:7.0f} MB/s   dd {d:7.0f} MB/s   ratio {p / d:.2f}")
print(f"median ratio {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f}); "
      f"target >= 0.70")
PY
