#pragma once
// What the tokenizer-files fuzz target runs on each input: an HF tokenizer.json (an input whose
// first non-blank byte is '{') or a tiktoken rank file (anything else) is loaded, and a loaded
// tokenizer then encodes and decodes a short text. Each input must be loaded or refused with
// pollen::Error; anything else (another exception, a crash, a sanitizer report, a huge
// allocation) is a finding. Shared by the libFuzzer target and the deterministic corpus test.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "base/error.h"
#include "tokenizer/hf_format.h"
#include "tokenizer/pattern.h"
#include "tokenizer/tiktoken_format.h"

namespace pollen::fuzz {

// True when the file loaded, false when it was refused.
inline bool load_untrusted_tokenizer(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const size_t first = text.find_first_not_of(" \t\r\n");
  const bool json = first != std::string_view::npos && text[first] == '{';
  try {
    const tokenizer::Tokenizer tok =
        json ? tokenizer::hf_from_json_text(text, "fuzz input")
             : tokenizer::tiktoken_from_text(
                   text, "fuzz input",
                   std::string(tokenizer::known_pattern_regex(tokenizer::KnownPattern::kGpt2)),
                   {{100257, "<|endoftext|>", true}});
    tokenizer::EncodeOptions eo;
    eo.special = tokenizer::SpecialPolicy::allow_all();
    eo.add_bos_eos = true;
    const auto ids = tok.encode("Hello, world! 123 <|endoftext|> caf\xc3\xa9", eo);
    tok.decode(ids);
    return true;
  } catch (const Error&) {
    return false;
  }
}

}  // namespace pollen::fuzz
