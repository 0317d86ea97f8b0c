"""The peer for `pollen serve`: OpenAI's official Python client (PyPI openai) calls every endpoint
it has for completions, chat and models, and each response is validated against the client's own
types where they describe what OpenAI's API sends (pydantic, strict: a missing or mistyped field
fails). Prints one JSON object of what the
client read, which tests/serve/server_test.cpp compares with pollen's own generation.

usage: openai_client.py BASE_URL  (e.g. http://127.0.0.1:8000/v1)
"""

import json
import sys

import openai
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=60)
out = {"client_version": openai.__version__}


def checked(cls, obj):
    """obj (a parsed response or a streamed chunk) validated as cls from its JSON fields."""
    return cls.model_validate(obj.to_dict())


out["models"] = [checked(Model, m).id for m in client.models.list()]

completion = checked(
    Completion,
    client.completions.create(model="tiny", prompt="The cat sat", max_tokens=8, temperature=0),
)
out["completion"] = {
    "text": completion.choices[0].text,
    "finish_reason": completion.choices[0].finish_reason,
    "usage": completion.usage.to_dict(),
}

# Read, not validated: with echo the first token has no logprob, null in OpenAI's own API (and
# vLLM's, which lm-evaluation-harness reads), where the client's types say a number.
scored = client.completions.create(
    model="tiny", prompt="Paris is the capital of France.", max_tokens=0, echo=True, logprobs=2,
    temperature=0,
)
lp = scored.choices[0].logprobs
out["echo"] = {
    "text": scored.choices[0].text,
    "tokens": lp.tokens,
    "token_logprobs": lp.token_logprobs,
    "top_logprobs": lp.top_logprobs,
    "text_offset": lp.text_offset,
}

# Streamed completions are read, not validated: the client types them as whole completions,
# whose finish_reason cannot be null as it is in every chunk but the last.
text, usage = "", None
for chunk in client.completions.create(
    model="tiny", prompt="The cat sat", max_tokens=8, temperature=0, stream=True,
    stream_options={"include_usage": True},
):
    if chunk.choices:
        text += chunk.choices[0].text
    if chunk.usage is not None:
        usage = chunk.usage.to_dict()
out["completion_streamed"] = {"text": text, "usage": usage}

messages = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is two plus two?"},
]
chat = checked(
    ChatCompletion,
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0),
)
out["chat"] = {
    "role": chat.choices[0].message.role,
    "content": chat.choices[0].message.content,
    "finish_reason": chat.choices[0].finish_reason,
    "usage": chat.usage.to_dict(),
}

scored_chat = checked(
    ChatCompletion,
    client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=20, temperature=0, logprobs=True,
        top_logprobs=2,
    ),
)
out["chat_logprobs"] = [
    {"token": t.token, "logprob": t.logprob, "bytes": t.bytes,
     "top": [a.token for a in t.top_logprobs]}
    for t in scored_chat.choices[0].logprobs.content
]

several = checked(
    ChatCompletion,
    client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0.9, seed=3, n=2
    ),
)
out["chat_n"] = [[c.index, c.message.content] for c in several.choices]

content, finish, usage = "", None, None
for chunk in client.chat.completions.create(
    model="tiny", messages=messages, max_tokens=20, temperature=0, stream=True,
    stream_options={"include_usage": True},
):
    chunk = checked(ChatCompletionChunk, chunk)
    for choice in chunk.choices:
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
    if chunk.usage is not None:
        usage = chunk.usage.to_dict()
out["chat_streamed"] = {"content": content, "finish_reason": finish, "usage": usage}

# The helpers that need a whole text: the client's stream manager collects the deltas itself.
with client.chat.completions.stream(
    model="tiny", messages=messages, max_tokens=20, temperature=0
) as stream:
    try:
        final = stream.get_final_completion()
    except openai.LengthFinishReasonError as e:  # a reply cut at max_tokens: read all the same
        final = e.completion
out["chat_stream_manager"] = final.choices[0].message.content

errors = {}
for name, call in {
    "bad_temperature": lambda: client.completions.create(
        model="tiny", prompt="hi", max_tokens=4, temperature=5),
    "unknown_model": lambda: client.completions.create(
        model="gpt-4o", prompt="hi", max_tokens=4),
    "options_without_stream": lambda: client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, stream_options={"include_usage": True}),
}.items():
    try:
        call()
        errors[name] = None
    except openai.APIStatusError as e:
        errors[name] = {
            "class": type(e).__name__,
            "status": e.status_code,
            "param": e.param,
            "code": e.code,
            "type": e.type,
        }
out["errors"] = errors

print(json.dumps(out))
