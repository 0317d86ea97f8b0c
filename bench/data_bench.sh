#!/usr/bin/env bash
# Data pipeline throughput: MB/s end to end for cumulative stage sets, on 1 and 2 threads, on a
# corpus built from Debian package files (bench/data_corpus.py, checked by SHA-256 when
# EXPECT_SHA256 is set), then datatrove (PyPI, installed by bench/setup-datatrove into
# build/bench-peers) on the same input, and its MinHash clusters compared with pollen's.
# Wall time and CPU time (user + sys) of each run are printed: MB/s per core is text bytes over
# CPU seconds, which stays meaningful on a machine shared with other work.
# Usage: bench/data_bench.sh [max_mb] [thread counts...]   (bench/README.md keeps the results)
# DATATROVE=0 skips datatrove (it takes about 100 times longer than pollen).
set -euo pipefail
cd "$(dirname "$0")/.."
MB=${1:-48}
shift || true
THREADS=${*:-1 2}
W=${DATA_BENCH_DIR:-build/bench/data}
mkdir -p "$W"
python3 bench/data_corpus.py "$W/corpus.jsonl" --max-mb "$MB" ${EXPECT_SHA256:+--expect-sha256 "$EXPECT_SHA256"}
POLLEN=${POLLEN:-build/pollen}

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
id_field = "id"
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

timed() {  # label threads config: runs pollen, prints wall and CPU MB/s
  local label=$1 threads=$2 name=$3
  rm -rf "$W/out-$name"
  /usr/bin/time -f "%e %U %S" -o "$W/time-$name" \
    $POLLEN data prepare --config "$W/$name.toml" --quiet >/dev/null
  read -r wall user sys < "$W/time-$name"
  bytes=$(python3 -c "import json;m=json.load(open('$W/out-$name/manifest.json'));print(m['stages'][0]['bytes_in'])")
  python3 -c "w=$wall; c=$user+$sys; b=$bytes/1e6
print('%-30s %7d %8.2f %8.1f %8.2f %12.1f' % ('$label', $threads, w, b/w, c, b/c))"
}

printf "%-30s %7s %8s %8s %8s %12s\n" "stages" "threads" "wall s" "MB/s" "cpu s" "MB/s/core"
for threads in $THREADS; do
  i=0
  for spec in "read:false:false:false:false:false" \
              "+filters:true:false:false:false:false" \
              "+exact_dedup:true:true:false:false:false" \
              "+minhash:true:true:true:false:false" \
              "+pii:true:true:true:true:false" \
              "+tokenize:true:true:true:true:true" \
              "minhash only:false:false:true:false:false"; do
    IFS=: read -r label f e m p t <<<"$spec"
    name="s$i-t$threads"; i=$((i + 1))
    config "$name" "$threads" "$f" "$e" "$m" "$p" "$t"
    timed "$label" "$threads" "$name"
  done
done
first=${THREADS%% *}
near() {  # config label: what MinHash dropped in that run
  python3 -c "import json;s=[x for x in json.load(open('$W/out-$1/manifest.json'))['stages'] if x['name']=='minhash'][0]
print('pollen %s: %d documents in, %d near-duplicates dropped, %d clusters with duplicates' % ('$2', s['docs_in'], s['dropped'].get('near_duplicate', {}).get('docs', 0), s['clusters_with_duplicates']))"
}
near "s3-t$first" "filters + exact dedup + minhash (verify off)"
near "s6-t$first" "minhash only (verify off)"

if [ "${DATATROVE:-1}" = 0 ]; then
  echo "datatrove: skipped (DATATROVE=0)"
elif [ -x build/bench-peers/bin/python ] && build/bench-peers/bin/python -c "import datatrove" 2>/dev/null; then
  build/bench-peers/bin/python bench/data_datatrove.py "$W/corpus.jsonl" "$W/datatrove" \
    "$W/out-s6-t$first/near-duplicates.jsonl" 2>/dev/null |
    grep -E "^(datatrove |datatrove:|pollen:|same-cluster|clusters:|removed documents|  e\.g\.)"
else
  echo "datatrove: not installed (run bench/setup-datatrove)"
fi
