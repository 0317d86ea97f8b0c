#pragma once
// HF model directories in and out: config.json read key by key (every key that changes the
// computation is implemented or refused with an error naming it; keys that do not are ignored by
// an explicit list), weights from model.safetensors or shards listed by
// model.safetensors.index.json (f32, bf16, f16 converted to the compute dtype), and export of a
// pollen model as such a directory.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/llama.h"

namespace pollen::io {

// Keys of config.json that do not change the computation and are skipped.
const std::vector<std::string>& hf_ignored_config_keys();

// An HF config.json (parsed) as a LlamaConfig; `source` names the file in errors.
model::LlamaConfig parse_hf_config(const nlohmann::json& config, const std::string& source);
model::LlamaConfig read_hf_config(const std::filesystem::path& config_json);

// config.json for a pollen model: model_type llama, or qwen2 when it has q/k/v biases, or mistral
// when it has a sliding window. `torch_dtype` names the dtype the weights are stored in.
nlohmann::ordered_json hf_config_json(const model::LlamaConfig& config,
                                      const std::string& torch_dtype = "float32");

// A folder holding config.json and model.safetensors or model.safetensors.index.json.
bool is_hf_dir(const std::filesystem::path& dir);

// Loads an HF directory's weights into a Llama computing in `dtype`.
model::Llama load_hf_model(const std::filesystem::path& dir, DType dtype = DType::f32);

struct HfExportOptions {
  DType dtype = DType::f32;                        // stored dtype: f32, bf16 or f16
  uint64_t max_shard_bytes = 5'000'000'000;        // above this, model-0000i-of-0000n.safetensors
  std::vector<std::filesystem::path> extra_files;  // copied in: tokenizer.json and the like
  std::string tokenizer_json;  // written as tokenizer.json (empty: none, or among extra_files)
  // The tokenizer's special ids, written into config.json, and into a generation_config.json
  // when the extra files hold none (without them transformers' LlamaConfig assumes bos 1, eos 2).
  std::optional<uint32_t> bos_token_id, eos_token_id;
  // generation_config.json's eos_token_id instead, when more than one id ends a generation (the
  // EOS first), as Llama 3's lists its end of turn beside its end of text.
  std::vector<uint32_t> generation_eos_ids;
  // Written as tokenizer_config.json when the extra files hold none (null: not written), so that
  // AutoTokenizer loads tokenizer.json as it is rather than as LlamaTokenizerFast with <s>, </s>.
  nlohmann::json tokenizer_config;
};

// The start of a tokenizer_config.json for a tokenizer.json of pollen's: loaded as it is
// (PreTrainedTokenizerFast), its calls giving input_ids and attention_mask only (no
// token_type_ids, which a Llama's forward and generate refuse), up to `context` tokens.
nlohmann::json hf_tokenizer_config(int64_t context);

struct HfExportResult {
  std::vector<std::filesystem::path> files;  // written, in order
  uint64_t weight_bytes = 0;
};

// Writes config.json, the weights (sharded with an index above max_shard_bytes) and the extra
// files as the folder `dir`: all of them go into a staging folder beside it
// (`.NAME.tmp-export-PID`, removed on failure), which then takes the place of `dir` in one step.
// An existing `dir` must be empty or hold only files an export writes (refused otherwise, naming
// the first other entry); it is replaced whole, so no file of an earlier export is left in it.
HfExportResult export_hf(const model::Llama& model, const std::filesystem::path& dir,
                         const HfExportOptions& options = {});

}  // namespace pollen::io
