"""HF transformers as the reference for pollen's HF directories (CPU, float32).

usage:
  hf_transformers_reference.py make KIND DIR   makes a small random model of KIND (llama3, qwen2,
      smollm2, smollm2-bf16, mistral, llama-dynamic, llama-yarn), saves it to DIR with
      save_pretrained and writes the logits of DIR/tokens.json's rows to DIR/logits.bin
  hf_transformers_reference.py logits DIR      loads DIR (written by pollen) and writes the logits
  hf_transformers_reference.py tokenizer DIR   loads DIR's tokenizer and configs with the Auto
      classes and writes DIR/tokenizer.out.json: the tokenizer's class, the ids of DIR/text.txt,
      and the BOS and EOS ids that the tokenizer, config.json and generation_config.json name
  hf_transformers_reference.py config DIR      loads DIR/config.json with AutoConfig and writes
      DIR/config.out.json: the values its architecture keys take, defaults included

logits.bin holds float64 values, rows x vocab, little-endian; no numpy is used, so any numpy
beside torch is fine.
"""
import ctypes
import json
import sys

import torch
import transformers


def config_for(kind):
    common = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-5)
    if kind == "llama3":
        return transformers.LlamaConfig(
            **common, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    if kind == "llama-dynamic":
        return transformers.LlamaConfig(
            **common, rope_theta=10000.0, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    if kind == "llama-yarn":
        return transformers.LlamaConfig(
            **common, rope_theta=10000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    if kind == "qwen2":
        return transformers.Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=False)
    if kind.startswith("smollm2"):
        return transformers.LlamaConfig(**common, rope_theta=100000.0, tie_word_embeddings=True)
    if kind == "mistral":
        return transformers.MistralConfig(**common, rope_theta=10000.0, sliding_window=5)
    raise SystemExit(f"unknown kind {kind}")


def logits_of(model, folder):
    tokens = torch.tensor(json.load(open(f"{folder}/tokens.json")), dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=tokens, use_cache=False).logits.double().contiguous()
    with open(f"{folder}/logits.bin", "wb") as f:
        f.write(ctypes.string_at(out.data_ptr(), out.numel() * 8))


def main():
    mode = sys.argv[1]
    if mode == "make":
        kind, folder = sys.argv[2], sys.argv[3]
        torch.manual_seed(1234)
        cfg = config_for(kind)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
        with torch.no_grad():  # every parameter random, so that each one matters
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape))
                else:
                    p.copy_(0.1 * torch.randn(p.shape))
        model.eval()
        if kind.endswith("-bf16"):
            model = model.to(torch.bfloat16)
            model.save_pretrained(folder)
            model = model.float()
        else:
            model.save_pretrained(folder)
        logits_of(model, folder)
    elif mode == "logits":
        folder = sys.argv[2]
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, torch_dtype=torch.float32, attn_implementation="eager")
        model.eval()
        logits_of(model, folder)
    elif mode == "tokenizer":
        folder = sys.argv[2]
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        config = transformers.AutoConfig.from_pretrained(folder)
        generation = transformers.GenerationConfig.from_pretrained(folder)
        text = open(f"{folder}/text.txt", encoding="utf-8").read()
        # The usual call: the tokenizer's output straight into generate.
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        inputs = tok(text, return_tensors="pt")
        generated = model.generate(**inputs, max_new_tokens=2, do_sample=False)
        json.dump({"class": type(tok).__name__, "ids": tok.encode(text),
                   "input_names": sorted(inputs.keys()), "generated": generated.shape[1],
                   "bos": tok.bos_token_id, "eos": tok.eos_token_id,
                   "config_eos": config.eos_token_id, "generation_eos": generation.eos_token_id},
                  open(f"{folder}/tokenizer.out.json", "w"))
    elif mode == "config":
        folder = sys.argv[2]
        c = transformers.AutoConfig.from_pretrained(folder)
        keys = ["num_key_value_heads", "max_position_embeddings", "rope_theta", "rms_norm_eps",
                "tie_word_embeddings", "sliding_window"]
        json.dump({k: getattr(c, k, None) for k in keys}, open(f"{folder}/config.out.json", "w"))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
