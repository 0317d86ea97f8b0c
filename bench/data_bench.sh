#!/usr/bin/env bash
# Data pipeline throughput: MB/s end to end for cumulative stage sets, on 1 and 2 threads, on a
# corpus built from Debian package files (bench/data_corpus.py, checked by SHA-256 when
# EXPECT_SHA256 is set), and datatrove (PyPI) on the same input when build/bench-peers has it.
# Usage: bench/data_bench.sh [max_mb]        (results are printed; bench/README.md keeps them)
set -euo pipefail
cd "$(dirname "$0")/.."
MB=${1:-48}
W=build/bench/data
mkdir -p "$W"
python3 bench/data_corpus.py "$W/corpus.jsonl" --max-mb "$MB" ${EXPECT_SHA256:+--expect-sha256 "$EXPECT_SHA256"}
POLLEN=build/pollen

# A tokenizer for the tokenise stage, trained once on the corpus.
[ -f "$W/tokenizer.json" ] || $POLLEN tokenizer train --input "$W/corpus.jsonl" --jsonl \
  --vocab-size 8192 --special '<|endoftext|>' --output "$W/tokenizer.json" >/dev/null

config() {  # name, threads, stage switches
  local name=$1 threads=$2 filters=$3 exact=$4 minhash=$5 pii=$6 tok=$7
  cat > "$W/$name.toml" <<TOML
output = "out-$name"
threads = $threads
sources = ["debian"]
[source.debian]
paths = ["corpus.jsonl"]
format = "jsonl"
[length]
enabled = $filters
[gopher_quality]
enabled = $filters
[gopher_repetition]
enabled = $filters
[c4]
enabled = $filters
[fineweb]
enabled = $filters
[exact_dedup]
enabled = $exact
[minhash]
enabled = $minhash
verify = false
[pii]
enabled = $pii
[tokenize]
enabled = $tok
tokenizer = "tokenizer.json"
TOML
}

printf "%-28s %8s %8s %8s\n" "stages" "threads" "seconds" "MB/s"
for threads in 1 2; do
  i=0
  for spec in "read:false:false:false:false:false" \
              "+filters:true:false:false:false:false" \
              "+exact_dedup:true:true:false:false:false" \
              "+minhash:true:true:true:false:false" \
              "+pii:true:true:true:true:false" \
              "+tokenize:true:true:true:true:true"; do
    IFS=: read -r label f e m p t <<<"$spec"
    name="s$i-t$threads"; i=$((i + 1))
    config "$name" "$threads" "$f" "$e" "$m" "$p" "$t"
    rm -rf "$W/out-$name"
    start=$(date +%s.%N)
    $POLLEN data prepare --config "$W/$name.toml" --quiet >/dev/null
    end=$(date +%s.%N)
    bytes=$(python3 -c "import json;m=json.load(open('$W/out-$name/manifest.json'));print(m['stages'][0]['bytes_in'])")
    python3 -c "s=$end-$start; print('%-28s %8d %8.2f %8.1f' % ('$label', $threads, s, $bytes/1e6/s))"
  done
done
grep -h '"near_duplicate"' -A1 "$W"/out-s3-t1/manifest.json | tr -d ' \n'; echo " (pollen, minhash verify off)"

if [ -x build/bench-peers/bin/python ] && build/bench-peers/bin/python -c "import datatrove" 2>/dev/null; then
  build/bench-peers/bin/python bench/data_datatrove.py "$W/corpus.jsonl" "$W/datatrove"
else
  echo "datatrove: not installed (python3 -m venv build/bench-peers && build/bench-peers/bin/pip install datatrove)"
fi
