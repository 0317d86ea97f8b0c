"""HF transformers as the reference for pollen's reward-model export (CPU, float32).

usage: hf_reward_reference.py DIR
  loads DIR (written by pollen) with AutoModelForSequenceClassification and scores the token
  sequences of DIR/sequences.json twice: each alone, and all in one batch right-padded with the
  config's pad_token_id (HF then scores the token before the first pad). Writes
  {"alone": [...], "batched": [...]} to DIR/scores.json.
"""
import json
import sys

import torch
import transformers


def main():
    folder = sys.argv[1]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        folder, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    assert type(model).__name__ == "LlamaForSequenceClassification", type(model).__name__
    sequences = json.load(open(f"{folder}/sequences.json"))
    pad = model.config.pad_token_id
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([s])).logits[0, 0].item() for s in sequences]
        width = max(len(s) for s in sequences)
        padded = torch.tensor([s + [pad] * (width - len(s)) for s in sequences])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
        batched = model(input_ids=padded, attention_mask=mask).logits[:, 0].tolist()
    json.dump({"alone": alone, "batched": batched}, open(f"{folder}/scores.json", "w"))


if __name__ == "__main__":
    main()
