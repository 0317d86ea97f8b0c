#!/usr/bin/env bash
# Encode throughput of pollen beside tiktoken and other tiktoken-compatible PyPI encoders, on the
# same documents, checking that every encoder gives pollen's ids.
#   bench/tokenizer_bench.sh [ENCODING]     (gpt2, cl100k_base or o200k_base; default o200k_base)
# Text: /usr/share/common-licenses, fortunes and English man pages of the machine, the first
# 20 MB of them, cut into ~8 KB documents. Peers: a venv at build/bench-peers with tiktoken, riptoken and bpe-openai.
set -euo pipefail
cd "$(dirname "$0")/.."
encoding=${1:-o200k_base}
shared=../shared/data/tokenizers
work=build/tokenizer-bench
mkdir -p "$work"
venv=build/bench-peers
if [ ! -x "$venv/bin/python" ]; then
  /usr/bin/python3 -m venv "$venv"
  "$venv/bin/pip" install -q tiktoken==0.12.0 riptoken==0.2.4 bpe-openai==0.1.4 || true
fi

# The text: every readable licence, man page and fortune, as ~8 KB documents of whole lines.
"$venv/bin/python" - "$work/docs.jsonl" <<'PY'
import glob, gzip, json, sys
parts = []
size = 0
for path in sorted(glob.glob("/usr/share/common-licenses/*")) + \
        sorted(glob.glob("/usr/share/games/fortunes/*")) + sorted(glob.glob("/usr/share/man/man[1-8]/*.gz")):
    if size >= 20_000_000:
        break
    try:
        data = gzip.open(path).read() if path.endswith(".gz") else open(path, "rb").read()
        parts.append(data.decode("utf-8"))
        size += len(data)
    except (OSError, UnicodeDecodeError, IsADirectoryError):
        pass
docs, current = [], ""
for line in "".join(parts).splitlines(keepends=True):
    current += line
    if len(current) >= 8192:
        docs.append(current)
        current = ""
docs.append(current)
with open(sys.argv[1], "w", encoding="utf-8") as f:
    for d in docs:
        f.write(json.dumps({"text": d}) + "\n")
print(f"text: {sum(len(d.encode()) for d in docs) / 1e6:.1f} MB in {len(docs)} documents", file=sys.stderr)
PY

tok="--tokenizer $shared/$encoding.tiktoken --pattern $encoding"
build/pollen tokenizer encode $tok --input "$work/docs.jsonl" --jsonl --special text \
  --output "$work/pollen_ids.bin"
build/pollen tokenizer bench $tok --input "$work/docs.jsonl" --jsonl
"$venv/bin/python" bench/tokenizer_peers.py "$shared" "$encoding" "$work/docs.jsonl" \
  "$work/pollen_ids.bin" "$(nproc)"
