#pragma once
// The shape of a Llama-family decoder, with the meaning of HF LlamaConfig's keys.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "ops/rope.h"

namespace pollen {
class ConfigTable;
}

namespace pollen::model {

struct LlamaConfig {
  std::string name = "custom";
  int64_t vocab_size = 4096;
  int64_t hidden_size = 256;
  int64_t intermediate_size = 688;
  int64_t num_hidden_layers = 4;
  int64_t num_attention_heads = 4;
  int64_t num_key_value_heads = 4;
  int64_t head_dim = 0;  // 0: hidden_size / num_attention_heads
  int64_t max_position_embeddings = 2048;
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-5;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // biases on q, k, v projections (Qwen2)
  double initializer_range = 0.02;
  ops::RopeScaling rope_scaling;  // HF rope_scaling; none by default
  int64_t sliding_window = 0;     // Mistral: attend to the last sliding_window tokens; 0: all

  ops::RopeParams rope_params() const { return {rope_theta, rope_scaling}; }

  int64_t resolved_head_dim() const {
    return head_dim > 0 ? head_dim : hidden_size / num_attention_heads;
  }
  void validate() const;  // throws naming the inconsistent keys

  int64_t parameter_count() const;
  int64_t embedding_parameter_count() const;  // the input embedding table
  // PaLM's count: 6 * (non-embedding parameters + the output head) + 12 * layers * hidden * seq.
  double flops_per_token(int64_t seq_len) const;
};

// The architecture keys in which `got` differs from `expected`, one "key: expected X, got Y" each
// (name and initializer_range are not architecture: weights trained under one fit the other).
std::vector<std::string> architecture_differences(const LlamaConfig& expected,
                                                  const LlamaConfig& got);

// Built-in presets: llama-tiny, llama-cpu, llama-124m, llama-1b, smollm2-135m.
std::vector<std::string> preset_names();
LlamaConfig preset(const std::string& name);  // throws listing the presets when unknown

// A pollen model file (TOML): an optional `preset = "..."` then any keys above to override,
// under [model] or at top level; `sliding_window`, and a `rope_scaling` table with `kind`
// (linear, llama3, dynamic, yarn) and the RopeScaling fields by name. Unknown keys and wrong
// types are errors naming file and key.
LlamaConfig load_config(const std::filesystem::path& path);
LlamaConfig read_config(ConfigTable& table);
// A run file's [model] with `file = "..."`: the file holds the whole architecture, so a preset or
// another architecture key beside it is refused, naming it (init_from may stand beside it).
void check_model_file_stands_alone(const ConfigTable& model);

// "none", "linear", "llama3", "dynamic" or "yarn": rope_scaling.kind in a model file.
const char* rope_scaling_kind_name(ops::RopeScaling::Kind kind);

// A preset name or a path to a TOML model file.
LlamaConfig resolve_config(const std::string& preset_or_file);

}  // namespace pollen::model
