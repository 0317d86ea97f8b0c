"""An independent float64 implementation of HF LlamaForCausalLM's forward pass in PyTorch, for
checking pollen's logits. It follows transformers' modeling_llama.py: RMSNorm, rotate_half rotary
embeddings, repeat_kv for grouped-query attention, eager softmax attention, SwiGLU MLP.
Packed documents: a 4-D mask lets each token see earlier tokens of its own document only, and
position ids restart per document, as transformers does for packed sequences.

usage: hf_llama_reference.py DIR   (reads DIR/meta.json and DIR/weights.bin, writes DIR/logits.bin)
"""
import ctypes
import json
import sys

import torch  # the only dependency: numpy is not used, so any numpy beside torch is fine


def rms_norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def main(folder):
    meta = json.load(open(f"{folder}/meta.json"))
    cfg = meta["config"]
    raw = bytearray(open(f"{folder}/weights.bin", "rb").read())
    flat = torch.frombuffer(raw, dtype=torch.float64)  # little-endian hosts only
    weights, at = {}, 0
    for name, shape in zip(meta["names"], meta["shapes"]):
        n = 1
        for d in shape:
            n *= d
        weights[name] = flat[at:at + n].reshape(shape).clone()
        at += n
    assert at == flat.numel(), "weights.bin size does not match meta.json"
    tokens = torch.tensor(meta["tokens"], dtype=torch.long)
    positions = torch.tensor(meta["positions"], dtype=torch.long)
    docs = torch.tensor(meta["doc_ids"], dtype=torch.long)
    B, T = tokens.shape
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg["hidden_size"] // H
    eps = cfg["rms_norm_eps"]

    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    freqs = positions[..., None].double() * inv_freq  # (B,T,D/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # (B,1,T,D)

    causal = torch.ones(T, T, dtype=torch.bool).tril()
    same_doc = docs[:, :, None] == docs[:, None, :]
    allowed = (causal[None] & same_doc)[:, None]  # (B,1,T,T)
    mask = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, float("-inf"))

    x = weights["model.embed_tokens.weight"][tokens]
    for i in range(cfg["num_hidden_layers"]):
        p = lambda n: weights.get(f"model.layers.{i}.{n}")
        h = rms_norm(x, p("input_layernorm.weight"), eps)

        def proj(name, heads):
            y = h @ p(f"self_attn.{name}.weight").T
            b = p(f"self_attn.{name}.bias")
            if b is not None:
                y = y + b
            return y.view(B, T, heads, D).transpose(1, 2)

        q, k, v = proj("q_proj", H), proj("k_proj", KV), proj("v_proj", KV)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(H // KV, dim=1)
        v = v.repeat_interleave(H // KV, dim=1)
        scores = q @ k.transpose(-1, -2) / (D ** 0.5) + mask
        attn = torch.softmax(scores, dim=-1) @ v
        x = x + attn.transpose(1, 2).reshape(B, T, H * D) @ p("self_attn.o_proj.weight").T
        h = rms_norm(x, p("post_attention_layernorm.weight"), eps)
        gate = h @ p("mlp.gate_proj.weight").T
        up = h @ p("mlp.up_proj.weight").T
        x = x + (torch.nn.functional.silu(gate) * up) @ p("mlp.down_proj.weight").T
    x = rms_norm(x, weights["model.norm.weight"], eps)
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    logits = (x @ head.T).reshape(B * T, -1).contiguous()
    with open(f"{folder}/logits.bin", "wb") as out:
        out.write(ctypes.string_at(logits.data_ptr(), logits.numel() * 8))


if __name__ == "__main__":
    main(sys.argv[1])
