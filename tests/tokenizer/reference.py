"""Reference encodings from the peers pollen's tokenizer is compared with (tiktoken and HF
tokenizers). Called by the C++ tests: reference.py REQUEST.json RESULT.json."""
import base64
import json
import sys


def tiktoken_encoding(req):
    import tiktoken

    ranks = {}
    with open(req["rank_file"], "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding(
        name="reference",
        pat_str=req["pat_str"],
        mergeable_ranks=ranks,
        special_tokens=req.get("special_tokens", {}),
    )


def run_tiktoken(req):
    enc = tiktoken_encoding(req)
    allowed = "all" if req.get("allow_special") else set()
    return {"ids": [enc.encode(t, allowed_special=allowed) for t in req["texts"]]}


def run_hf(req):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(req["tokenizer_json"])
    add = bool(req.get("add_special_tokens", False))
    ids = [tok.encode(t, add_special_tokens=add).ids for t in req["texts"]]
    return {"ids": ids, "decoded": [tok.decode(i, skip_special_tokens=False) for i in ids]}


def decode_hf(req):
    """HF's decode of given id sequences (special tokens kept, or skipped with skip_special)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(req["tokenizer_json"])
    skip = req.get("skip_special", False)
    return {"texts": [tok.decode(ids, skip_special_tokens=skip) for ids in req["ids"]]}


def split_hf(req):
    """The pieces HF's Split pre-tokenizer cuts each text into."""
    from tokenizers import Regex, pre_tokenizers

    pieces = []
    for case in req["cases"]:
        pattern = case["pattern"] if case.get("literal") else Regex(case["pattern"])
        split = pre_tokenizers.Split(pattern, behavior=case["behavior"])
        pieces.append([piece for piece, _ in split.pre_tokenize_str(case["text"])])
    return {"pieces": pieces}


def gpt2_json(req):
    """GPT-2's tokenizer.json, built by HF tokenizers from encoder.json and vocab.bpe."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    bpe = models.BPE.from_file(req["vocab"], req["merges"])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(req["output"])
    return {}


def train_hf(req):
    """Trains one of the tokenizer families with HF's own trainer and saves tokenizer.json."""
    from tokenizers import (Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                            processors, trainers)

    kind = req["kind"]
    specials = req.get("special_tokens", [])
    if kind == "sentencepiece":
        tok = Tokenizer(models.BPE(byte_fallback=True, fuse_unk=True, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
        byte_tokens = ["<0x%02X>" % b for b in range(256)]
        trainer = trainers.BpeTrainer(vocab_size=req["vocab_size"],
                                      special_tokens=["<unk>", "<s>", "</s>"] + byte_tokens,
                                      min_frequency=req.get("min_frequency", 2),
                                      show_progress=False)
        tok.post_processor = None
    else:
        tok = Tokenizer(models.BPE(ignore_merges=kind == "llama3"))
        steps = []
        if kind == "qwen2":
            tok.normalizer = normalizers.NFC()
        if kind in ("llama3", "qwen2"):
            steps.append(pre_tokenizers.Split(Regex(req["pattern"]), behavior="isolated"))
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        else:
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
        if req.get("digits"):
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
        tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=req["vocab_size"], special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      min_frequency=req.get("min_frequency", 0),
                                      show_progress=False)
    tok.train(req["files"], trainer)
    if kind == "sentencepiece":
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    elif specials:
        first = specials[0]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{first} $A", pair=f"{first} $A {first} $B",
            special_tokens=[(first, tok.token_to_id(first))])
    tok.save(req["output"])
    merges = json.loads(tok.to_str())["model"]["merges"]
    return {"merges": [m if isinstance(m, str) else " ".join(m) for m in merges]}


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        req = json.load(f)
    handlers = {"tiktoken": run_tiktoken, "hf": run_hf, "hf_decode": decode_hf, "split": split_hf,
                "gpt2_json": gpt2_json, "train_hf": train_hf}
    result = handlers[req["mode"]](req)
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
