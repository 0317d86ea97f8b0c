#pragma once
// A tokenizer: normaliser, pre-tokenizer, BPE model, added (special) tokens, the BOS/EOS
// template, and how ids turn back into bytes. Loaded from tiktoken rank files or HF
// tokenizer.json (see tiktoken_format.h, hf_format.h) or trained (trainer.h).
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/bpe.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/pretokenizer.h"

namespace pollen::tokenizer {

// A token matched in the raw text before anything else: special tokens such as <|endoftext|>,
// and HF's non-special added tokens.
struct AddedToken {
  uint32_t id;
  std::string content;
  bool special = true;
  bool operator==(const AddedToken&) const = default;
};

// What encode does with special tokens found in the text, as tiktoken's allowed_special and
// disallowed_special do. Added tokens that are not special are always matched.
struct SpecialPolicy {
  enum class Others { kRefuse, kText, kAllow };
  Others others = Others::kRefuse;  // what to do with special tokens not in `allowed`
  std::vector<std::string> allowed;

  static SpecialPolicy refuse_all() { return {}; }
  static SpecialPolicy allow_all() { return {Others::kAllow, {}}; }
  static SpecialPolicy as_text() { return {Others::kText, {}}; }
};

struct EncodeOptions {
  SpecialPolicy special = SpecialPolicy::refuse_all();
  bool add_bos_eos = false;  // apply the post-processor template (HF's add_special_tokens)
};

// How ids become bytes again. Byte-level tokens hold raw bytes; SentencePiece-style tokens
// hold text in which `space_marker` (usually "▁") stands for a space, <0xNN> tokens are bytes
// when `byte_fallback`, and `strip_leading_spaces` spaces are removed from the start. With
// `drop_markers_in_first_token` (HF's Metaspace decoder when its scheme prepends a marker), the
// markers of the first token are dropped instead of turned into spaces.
struct DecoderSpec {
  std::string space_marker;
  bool byte_fallback = false;
  int strip_leading_spaces = 0;
  bool drop_markers_in_first_token = false;
  bool operator==(const DecoderSpec&) const = default;
};

// The post-processor template for one sequence: ids around the encoded text.
struct BosEosTemplate {
  std::vector<uint32_t> prefix, suffix;
  bool operator==(const BosEosTemplate&) const = default;
};

class Tokenizer {
 public:
  Tokenizer(BpeModel model, Normalizer normalizer, PreTokenizer pre_tokenizer,
            std::vector<AddedToken> added, BosEosTemplate bos_eos, DecoderSpec decoder);

  std::vector<uint32_t> encode(std::string_view text, const EncodeOptions& options = {}) const;
  void encode(std::string_view text, const EncodeOptions& options,
              std::vector<uint32_t>& out) const;
  // Encodes every text on all threads; the result is the same as encoding them one by one.
  std::vector<std::vector<uint32_t>> encode_batch(std::span<const std::string_view> texts,
                                                  const EncodeOptions& options = {}) const;
  std::string decode(std::span<const uint32_t> ids) const;
  // The text `ids` add where they follow other ids (generated tokens after their prompt, one
  // token of many): no marker dropped from the first and no space stripped, which belong to the
  // start of the whole text, so that decode(a) + decode_continuation(b) == decode(a + b) when a
  // decodes to text that does not begin with spaces only.
  std::string decode_continuation(std::span<const uint32_t> ids) const;
  // The text generated tokens add to their prompt's, as vLLM and transformers' text-generation
  // pipeline give it (skip_special_tokens): decode_continuation without the special added
  // tokens, whose markup ("<|im_start|>") is no text a reader should see.
  std::string generated_text(std::span<const uint32_t> ids) const;

  // One past the highest id of any token.
  uint32_t vocab_size() const;
  std::string_view token_bytes(uint32_t id) const;

  const BpeModel& model() const { return model_; }
  const Normalizer& normalizer() const { return normalizer_; }
  const PreTokenizer& pre_tokenizer() const { return pre_tokenizer_; }
  const std::vector<AddedToken>& added_tokens() const { return added_; }
  const BosEosTemplate& bos_eos() const { return bos_eos_; }
  const DecoderSpec& decoder() const { return decoder_; }

  // The pattern of the pre-tokenizer's first split, if it has one (for `info`).
  std::string pattern() const;
  // SHA-256 over what decides behaviour: vocabulary, merges, normaliser, pre-tokenizer, added
  // tokens, template and decoder. The same in either file format.
  std::string fingerprint() const;

 private:
  void encode_ordinary(std::string_view text, bool at_start, std::vector<uint32_t>& out) const;
  const AddedToken* added_at(std::string_view text, size_t at) const;
  const AddedToken* added_with_id(uint32_t id) const;
  // As HF does, added tokens go through the decoder too.
  void decode_token(std::string_view bytes, bool first, std::string& out) const;

  BpeModel model_;
  Normalizer normalizer_;
  PreTokenizer pre_tokenizer_;
  std::vector<AddedToken> added_;  // longest first, so the longest match wins
  bool added_first_byte_[256] = {};
  BosEosTemplate bos_eos_;
  DecoderSpec decoder_;
};

}  // namespace pollen::tokenizer
