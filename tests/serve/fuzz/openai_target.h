#pragma once
// What the OpenAI-compatible server's fuzz target runs on each input: a request body as the
// server receives it, through what each endpoint does before the engine (parse_body, the
// request's parser, the chat template, tokenizing and the prompt-length checks) and the reply's
// JSON. Each body must be taken or refused with pollen::Error (an ApiError, answered as a 4xx);
// anything else (another exception, a crash, a sanitizer report) is a finding. Shared by the
// libFuzzer target and the deterministic corpus test.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "base/error.h"
#include "serve/openai.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/pattern.h"
#include "tokenizer/trainer.h"

namespace pollen::fuzz {

namespace openai_request {

using json = nlohmann::json;

// A byte-level BPE trained on a few sentences, with <|endoftext|> and ChatML's special tokens.
inline tokenizer::Tokenizer small_tokenizer() {
  const std::string pattern(tokenizer::known_pattern_regex(tokenizer::KnownPattern::kGpt2));
  tokenizer::PieceCounts counts(pattern);
  const std::vector<std::string_view> docs = {"The cat sat on the mat. The dog sat on the log.",
                                              "Question: what is two plus two? Answer: four."};
  counts.add_documents(docs);
  return tokenizer::train_bpe(counts,
                              {300, {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}, pattern});
}

struct Served {
  tokenizer::Tokenizer tok = small_tokenizer();
  serve::ServedModel model{"tiny", 96, {0}};
  serve::Limits limits{4 << 20, 0, 64, 8, 32};
};

inline const Served& served() {
  static const Served s;
  return s;
}

inline std::string reply(const json& j) {  // as the server writes its replies
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

// Each endpoint on the same body; true when one of them took it.
inline bool each_endpoint(const std::string& body) {
  const Served& s = served();
  const json j = serve::parse_body(body);
  bool taken = false;
  const auto endpoint = [&](auto&& run) {
    try {
      run();
      taken = true;
    } catch (const Error&) {
    }
  };
  endpoint([&] {  // /v1/chat/completions
    serve::ChatRequest r = serve::parse_chat_request(j, s.model, s.limits);
    tokenizer::EncodeOptions eo;
    eo.special = tokenizer::SpecialPolicy::allow_all();
    const auto prompt =
        s.tok.encode(tokenizer::render_chat(tokenizer::ChatTemplate::chatml, r.messages, true), eo);
    const int64_t room = s.model.context - static_cast<int64_t>(prompt.size());
    if (!r.budget_given)
      r.sampling.max_tokens = std::min(r.sampling.max_tokens, std::max<int64_t>(room, 0));
    serve::check_prompt_length(prompt.size(), r.sampling.max_tokens, s.model, s.limits, "messages");
  });
  endpoint([&] {  // /v1/completions
    const serve::CompletionRequest r = serve::parse_completion_request(j, s.tok, s.model, s.limits);
    json texts = json::array();
    for (const auto& t : r.prompt_texts) texts.push_back(t);
    reply(texts);
  });
  endpoint([&] {  // /tokenize
    const serve::TokenizeRequest r = serve::parse_tokenize_request(j);
    tokenizer::EncodeOptions eo;
    eo.special = tokenizer::SpecialPolicy::allow_all();
    eo.add_bos_eos = r.add_special_tokens;
    reply({{"tokens", s.tok.encode(r.prompt, eo)}});
  });
  endpoint([&] {  // /detokenize
    reply({{"prompt", s.tok.decode(serve::parse_detokenize_request(j, s.tok))}});
  });
  return taken;
}

}  // namespace openai_request

// True when an endpoint took the body, false when every one refused it.
inline bool handle_untrusted_request(const uint8_t* data, size_t size) {
  try {
    return openai_request::each_endpoint(std::string(reinterpret_cast<const char*>(data), size));
  } catch (const Error&) {
    return false;
  }
}

}  // namespace pollen::fuzz
