#pragma once
// A tiny language model with a real tokenizer for evaluation and serving tests: a byte-level BPE
// trained on a few sentences (with <|endoftext|> and ChatML's special tokens), and a random
// two-layer Llama over its vocabulary whose weights are large enough that its predictions vary.
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/files.h"
#include "base/rng.h"
#include "io/hf.h"
#include "model/llama.h"
#include "model/lora.h"
#include "support/gradcheck.h"
#include "tokenizer/hf_format.h"
#include "tokenizer/pattern.h"
#include "tokenizer/trainer.h"

namespace pollen::testing {

inline std::filesystem::path unique_temp_dir(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("pollen_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

inline tokenizer::Tokenizer tiny_tokenizer() {
  const std::string pattern(tokenizer::known_pattern_regex(tokenizer::KnownPattern::kGpt2));
  tokenizer::PieceCounts counts(pattern);
  const std::vector<std::string> docs = {
      "The cat sat on the mat. The dog sat on the log.",
      "Question: what is two plus two? Answer: four.",
      "Paris is the capital of France. Rome is the capital of Italy.",
      "Water boils at one hundred degrees. Ice melts in the sun.",
      "Bees make honey from flowers; flowers need bees."};
  std::vector<std::string_view> views(docs.begin(), docs.end());
  counts.add_documents(views);
  return tokenizer::train_bpe(counts,
                              {360, {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}, pattern});
}

inline model::LlamaConfig tiny_config(uint32_t vocab) {
  model::LlamaConfig c;
  c.name = "tiny-served";
  c.vocab_size = vocab;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 256;
  return c;
}

inline model::Llama tiny_model(uint32_t vocab, uint64_t seed = 7) {
  model::Llama m(tiny_config(vocab), seed);
  Rng rng(seed + 1);
  for (auto& [name, v] : m.named_parameters()) {
    float* p = v.value().data<float>();
    for (int64_t i = 0; i < v.value().numel(); ++i)
      p[i] = static_cast<float>((name.ends_with("norm.weight") ? 1.0 : 0.0) + 0.3 * rng.normal());
  }
  return m;
}

// A model that predicts `token` after anything, by far: its attention and MLP weights are zero,
// so its last hidden state is the input's embedding; every embedding and output row is all ones
// but `token`'s, all threes, so `token`'s logit is 3 * hidden_size and every other one
// hidden_size.
inline model::Llama always_predicting(uint32_t token, uint32_t vocab) {
  model::Llama m(tiny_config(vocab), 1);
  const int64_t hidden = m.config().hidden_size;
  for (auto& [name, v] : m.named_parameters()) {
    const bool table = name == "model.embed_tokens.weight" || name == "lm_head.weight";
    float* p = v.value().data<float>();
    for (int64_t i = 0; i < v.value().numel(); ++i)
      p[i] = table || name.ends_with("norm.weight") ? 1.0f : 0.0f;
    if (table)
      for (int64_t j = 0; j < hidden; ++j) p[token * hidden + j] = 3.0f;
  }
  return m;
}

// The model as an HF directory with its tokenizer (and a tokenizer_config.json that HF's
// AutoTokenizer reads).
inline void write_hf_dir(const model::Llama& m, const tokenizer::Tokenizer& tok,
                         const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  const auto staging = dir.parent_path() / (dir.filename().string() + "_files");
  std::filesystem::create_directories(staging);
  tokenizer::save_hf_json(tok, staging / "tokenizer.json");
  write_file_atomic(staging / "tokenizer_config.json",
                    R"({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": null, )"
                    R"("eos_token": "<|endoftext|>", "model_max_length": 256})");
  io::HfExportOptions o;
  o.extra_files = {staging / "tokenizer.json", staging / "tokenizer_config.json"};
  io::export_hf(m, dir, o);
}

// LoRA adapters of rank 2 on `targets` attached to `model`, with a random non-zero B, so that the
// adapted model differs from its base from the start.
inline std::shared_ptr<model::Lora> attach_random_lora(model::Llama& model,
                                                       std::vector<model::LoraTarget> targets,
                                                       uint64_t seed) {
  model::LoraConfig lc;
  lc.rank = 2;
  lc.targets = std::move(targets);
  auto lora = std::make_shared<model::Lora>(model.config(), lc);
  Rng rng(seed);
  for (auto& [name, v] : lora->named_tensors()) {
    if (!name.ends_with("lora_B.weight")) continue;
    ag::Var b = v;
    b.value().copy_(random_tensor(b.value().shape(), rng, 0.5));
  }
  model.attach_lora(lora);
  return lora;
}

}  // namespace pollen::testing
