"""PEFT (PyPI) as the reference for pollen's LoRA adapter folders (CPU, float64).

usage: peft_reference.py DIR
  DIR/base          an HF Llama directory written by pollen (the base model)
  DIR/pollen        a LoRA adapter written by pollen
  DIR/tokens.json   rows of token ids
writes
  DIR/pollen_logits.bin   logits of PeftModel.from_pretrained(base, DIR/pollen)
  DIR/peft              a LoRA adapter made by PEFT on the base (random non-zero B), saved with
                        save_pretrained
  DIR/peft_logits.bin   its logits

.bin files hold float64 values, rows x positions x vocab, little-endian.
"""
import ctypes
import json
import sys

import peft
import torch
import transformers


def write_logits(model, tokens, path):
    with torch.no_grad():
        out = model(input_ids=tokens, use_cache=False).logits.double().contiguous()
    with open(path, "wb") as f:
        f.write(ctypes.string_at(out.data_ptr(), out.numel() * 8))


def base_model(folder):
    model = transformers.LlamaForCausalLM.from_pretrained(f"{folder}/base",
                                                          torch_dtype=torch.float64)
    return model.eval()


def main():
    folder = sys.argv[1]
    tokens = torch.tensor(json.load(open(f"{folder}/tokens.json")), dtype=torch.long)

    adapted = peft.PeftModel.from_pretrained(base_model(folder), f"{folder}/pollen").eval()
    write_logits(adapted, tokens, f"{folder}/pollen_logits.bin")

    torch.manual_seed(0)
    config = peft.LoraConfig(r=3, lora_alpha=5, lora_dropout=0.1, task_type="CAUSAL_LM",
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                             "up_proj", "down_proj"])
    made = peft.get_peft_model(base_model(folder), config)
    with torch.no_grad():
        for name, p in made.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    made.save_pretrained(f"{folder}/peft")
    write_logits(made.eval(), tokens, f"{folder}/peft_logits.bin")


if __name__ == "__main__":
    main()
