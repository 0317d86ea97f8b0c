"""Chat conversations rendered by HF transformers' apply_chat_template with the chat_template of
a tokenizer_config.json. Called by chat_template_test.cpp: chat_reference.py REQUEST RESULT."""
import json
import sys

from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast


def render(case):
    with open(case["config"], encoding="utf-8") as f:
        config = json.load(f)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE()),
        bos_token=config.get("bos_token"),
        eos_token=config.get("eos_token"),
    )
    return tokenizer.apply_chat_template(
        case["messages"],
        chat_template=config["chat_template"],
        tokenize=False,
        add_generation_prompt=case["add_generation_prompt"],
    )


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        request = json.load(f)
    result = {"texts": [render(case) for case in request["cases"]]}
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
