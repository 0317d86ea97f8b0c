#pragma once
// Wiring shared by the commands that take --model: the model's tokenizer, chat template and stop
// tokens.
#include <algorithm>
#include <filesystem>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/files.h"
#include "base/json_depth.h"
#include "io/model_source.h"
#include "io/peft.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/open.h"

namespace pollen::cli {

inline const char* kModelHelp =
    "Preset, model file (.toml), pollen checkpoint or run folder, or HF directory";

inline const char* kAdapterHelp =
    "LoRA adapter folder in PEFT's format (adapter_config.json, adapter_model.safetensors), "
    "merged into the model";

// The model, with --adapter's LoRA adapters merged in when one is given.
inline model::Llama load_model_with_adapter(const io::ModelSource& src,
                                            const std::string& adapter) {
  model::Llama m = io::load_model(src);
  if (adapter.empty()) return m;
  return model::merge_lora(m, *io::load_peft_adapter(adapter, src.config, DType::f32, true, &m));
}

// --tokenizer when given, else the one that goes with the model.
inline tokenizer::Tokenizer model_tokenizer(const io::ModelSource& src,
                                            const std::string& override_path) {
  std::filesystem::path path = override_path;
  if (path.empty()) {
    POLLEN_CHECK(src.tokenizer.has_value(), "model '", src.spec, "' (",
                 io::model_kind_name(src.kind),
                 ") has no tokenizer that goes with it; pass --tokenizer FILE");
    path = *src.tokenizer;
  }
  // A rank file holds neither its pattern nor its special tokens, which a model's tokenizer needs.
  POLLEN_CHECK(path.extension() == ".json", "tokenizer '", path.string(),
               "': expected a tokenizer.json; a tiktoken rank file holds neither its pattern nor "
               "its special tokens: write it as one with `pollen tokenizer convert --tokenizer ",
               path.string(), " --pattern P [--add-special TOKEN=ID] --output tokenizer.json`");
  return tokenizer::open_tokenizer(path, "");
}

// Refuses a tokenizer whose ids run past the model's vocabulary (another model's), naming it; a
// smaller one is usual (a vocabulary padded beyond its tokenizer's).
// (Read from the model's config: checked before its weights are loaded.)
inline void check_tokenizer_fits(const tokenizer::Tokenizer& tok, const io::ModelSource& src,
                                 const std::string& override_path) {
  const std::string file =
      override_path.empty() ? src.tokenizer.value_or("").string() : override_path;
  POLLEN_CHECK(tok.vocab_size() <= static_cast<uint32_t>(src.config.vocab_size), "tokenizer '",
               file, "' has ", tok.vocab_size(), " ids, more than the model's vocabulary of ",
               src.config.vocab_size, ": it is another model's");
}

// tokenizer::choose_chat_format for a command line: an error without a name given says to pass
// --chat-template.
inline tokenizer::ChatFormat chosen_chat_format(const std::filesystem::path& dir,
                                                const std::string& name) {
  try {
    return tokenizer::choose_chat_format(dir, name);
  } catch (const Error& e) {
    if (!name.empty()) throw;  // the name given is unknown, and the error says which are known
    fail(e.what(), "; pass --chat-template chatml or --chat-template llama3");
  }
}

// The chat template: `explicit_name` ("chatml" or "llama3") when given, else the one a
// post-training checkpoint names, else the one the model's tokenizer_config.json names (beside
// its other HF files, else beside its tokenizer); an error says what to pass when none does.
inline tokenizer::ChatFormat model_chat_format(const io::ModelSource& src,
                                               const std::string& explicit_name) {
  return chosen_chat_format(io::tokenizer_config_dir(src),
                            explicit_name.empty() ? src.chat_template.value_or("") : explicit_name);
}

// The id of the special token that ends a turn in `format`; an error when the tokenizer lacks it.
inline uint32_t end_of_turn_id(const tokenizer::Tokenizer& tok,
                               const tokenizer::ChatFormat& format) {
  return tokenizer::end_of_turn_id(tok, format.kind, "choose another with --chat-template");
}

// End-of-sequence ids (io::model_stop_tokens).
inline std::vector<uint32_t> stop_tokens(const io::ModelSource& src,
                                         const tokenizer::Tokenizer& tok) {
  return io::model_stop_tokens(src, tok);
}

// tokenizer_config.json's `key` (bos_token or eos_token: "<s>" or {"content": "<s>", ...}) as an
// id of the tokenizer's added tokens; none when the model has no such file, key or token.
inline std::optional<uint32_t> configured_token(const io::ModelSource& src,
                                                const tokenizer::Tokenizer& tok, const char* key) {
  for (const auto& f : src.hf_side_files) {
    if (f.filename() != "tokenizer_config.json") continue;
    const auto j = parse_json_object(read_file(f), cat("'", f.string(), "'"));
    if (!j.contains(key)) continue;
    const auto& v = j[key];
    const auto& content = v.is_object() && v.contains("content") ? v["content"] : v;
    if (!content.is_string()) continue;
    for (const auto& t : tok.added_tokens())
      if (t.content == content.get<std::string>()) return t.id;
  }
  return std::nullopt;
}

// The model's BOS and EOS: tokenizer_config.json's bos_token and eos_token, else the BOS that
// generation_config.json (or an HF config.json) names, else the one the post-processor adds,
// and as EOS the end of turn of the chat template a checkpoint was trained with (as
// instruction-tuned models name theirs) when the tokenizer has it, else the first end token
// (the configured one first); `ends`: every id that ends a generation, the EOS first (what export
// writes for HF and llama.cpp, and serve's /tokenizer_info reports).
struct SpecialIds {
  std::optional<uint32_t> bos, eos;
  std::vector<uint32_t> ends;
};
inline SpecialIds special_ids(const io::ModelSource& src, const tokenizer::Tokenizer& tok) {
  SpecialIds ids{
      configured_token(src, tok, "bos_token"), configured_token(src, tok, "eos_token"), {}};
  if (!ids.bos) ids.bos = io::model_bos_id(src);
  if (!ids.bos && !tok.bos_eos().prefix.empty()) ids.bos = tok.bos_eos().prefix.front();
  if (!ids.eos && src.chat_template)  // none when the tokenizer lacks it (another --tokenizer)
    ids.eos = tokenizer::added_token_id(
        tok, tokenizer::end_of_turn(tokenizer::chat_template_named(*src.chat_template)));
  const auto ends = stop_tokens(src, tok);
  if (!ids.eos && !ends.empty()) ids.eos = ends.front();
  if (ids.eos) ids.ends.push_back(*ids.eos);
  for (uint32_t id : ends)
    if (id != ids.eos) ids.ends.push_back(id);
  return ids;
}

// The BOS transformers reports for the model (serve's /tokenizer_info says the same):
// tokenizer_config.json's bos_token when the model has that file, else, for a pollen model, the
// BOS its post-processor adds.
inline std::optional<uint32_t> reported_bos(const io::ModelSource& src,
                                            const tokenizer::Tokenizer& tok) {
  if (auto bos = configured_token(src, tok, "bos_token")) return bos;
  const bool configured =
      std::any_of(src.hf_side_files.begin(), src.hf_side_files.end(),
                  [](const auto& f) { return f.filename() == "tokenizer_config.json"; });
  if (!configured && !tok.bos_eos().prefix.empty()) return tok.bos_eos().prefix.front();
  return std::nullopt;
}

// lm-evaluation-harness's prefix token (what an empty context or a document's first window is
// conditioned on): the tokenizer's bos_token_id, else its eos_token_id, as tokenizer_config.json
// names them; for a model without that file (a pollen model), the BOS the post-processor adds,
// else its EOS as special_ids gives it.
inline std::optional<uint32_t> lm_eval_prefix_token(const io::ModelSource& src,
                                                    const tokenizer::Tokenizer& tok) {
  if (auto bos = reported_bos(src, tok)) return bos;
  return special_ids(src, tok).eos;
}

}  // namespace pollen::cli
