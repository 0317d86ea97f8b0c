"""Peer side of bench/tokenizer_bench.sh: encode the same documents with tiktoken and other
tiktoken-compatible PyPI encoders, check their ids against pollen's, print MB/s as JSON lines.
Usage: tokenizer_peers.py ENCODINGS_DIR ENCODING DOCS.jsonl POLLEN_IDS.bin THREADS"""
import base64
import json
import sys
import time

from array import array


def ranks_of(path):
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def peers(enc_dir, name):
    spec = json.load(open(f"{enc_dir}/encodings.json"))[name]
    ranks = ranks_of(f"{enc_dir}/{name}.tiktoken")
    args = dict(name=name, pat_str=spec["pat_str"], mergeable_ranks=ranks,
                special_tokens=spec["special_tokens"])
    try:
        import tiktoken
        yield "tiktoken", tiktoken.Encoding(**args)
    except Exception as e:  # noqa: BLE001 - a peer that cannot load is reported, not fatal
        print(json.dumps({"encoder": "tiktoken", "skipped": str(e)}))
    try:
        import riptoken
        yield "riptoken", riptoken.CoreBPE(ranks, spec["special_tokens"], spec["pat_str"])
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"encoder": "riptoken", "skipped": str(e)}))
    try:
        import bpe_openai
        yield "bpe-openai", bpe_openai.get_encoding(name)
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"encoder": "bpe-openai", "skipped": str(e)}))


def main():
    enc_dir, name, docs_path, pollen_ids, threads = sys.argv[1:6]
    docs = [json.loads(line)["text"] for line in open(docs_path, encoding="utf-8")]
    size = sum(len(d.encode("utf-8")) for d in docs)
    expected = array("I")
    with open(pollen_ids, "rb") as f:
        expected.frombytes(f.read())
    expected = expected.tolist()
    for label, enc in peers(enc_dir, name):
        for n in sorted({1, int(threads)}):
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                if n == 1:
                    ids = [enc.encode_ordinary(d) for d in docs]
                elif label == "riptoken":
                    ids = enc.encode_ordinary_batch(docs)
                else:
                    ids = enc.encode_ordinary_batch(docs, num_threads=n)
                best = min(best, time.perf_counter() - start)
            flat = [i for d in ids for i in d]
            print(json.dumps({"encoder": label, "threads": n, "mb_per_s": round(size / best / 1e6, 2),
                              "same_ids_as_pollen": flat == expected}))


if __name__ == "__main__":
    main()
