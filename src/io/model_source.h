#pragma once
// The one place that turns what a user typed after --model into a model: a preset name, a
// pollen model file (.toml), a pollen checkpoint folder (step-*/ from `pollen train`, or a run
// folder, whose newest checkpoint that verifies is taken) or an HF directory. A post-training
// checkpoint of a LoRA run (adapter_config.json and adapter_model.safetensors instead of
// model.safetensors) is the base its config.toml names with the adapters merged in.
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "model/llama.h"

namespace pollen::tokenizer {
class Tokenizer;
}

namespace pollen::io {

struct ModelSource {
  enum class Kind { preset, model_file, checkpoint, hf_dir };
  Kind kind = Kind::preset;
  std::string spec;            // as given
  std::filesystem::path path;  // the folder or file read (checkpoint: the step folder)
  model::LlamaConfig config;
  std::optional<std::filesystem::path> tokenizer;    // tokenizer.json that goes with it, if known
  std::vector<std::filesystem::path> hf_side_files;  // tokenizer_config.json etc. (HF dirs)
  std::optional<std::string> chat_template;  // "chatml" or "llama3", when a checkpoint names it
  // A LoRA checkpoint: its adapters (`path`), merged into `base` as the run loaded it (presets
  // and model files initialised from the run's seed, `base_seed`).
  std::shared_ptr<const ModelSource> base;
  uint64_t base_seed = 0;
};

const char* model_kind_name(ModelSource::Kind kind);

// Resolves without loading weights. Errors say what the spec was taken for and what is missing.
ModelSource resolve_model(const std::string& spec);

// The folder that holds (or would hold) the model's tokenizer_config.json, where its chat
// template is looked up: beside its HF files, else beside `tokenizer` (empty: the tokenizer that
// goes with the model), else the folder or file read.
std::filesystem::path tokenizer_config_dir(const ModelSource& source,
                                           const std::filesystem::path& tokenizer = {});

// The chat template that goes with the model, as Jinja text: the one a post-training checkpoint
// was trained with, else its tokenizer_config.json's (looked up as tokenizer_config_dir does);
// nothing when neither names one.
std::optional<std::string> model_chat_template(const ModelSource& source,
                                               const std::filesystem::path& tokenizer = {});

// The ids that end a generation from the model (what generate, chat, serve and GRPO stop at):
// generation_config.json's eos_token_id when the model has one (else config.json's, from which HF
// derives the generation config), and the tokenizer's usual end tokens (<|endoftext|>, </s>,
// <|eot_id|>, <|im_end|>, <|end_of_text|>): the configured ones first, in their order.
std::vector<uint32_t> model_stop_tokens(const ModelSource& source, const tokenizer::Tokenizer& tok);
// The bos_token_id of the same files (generation_config.json, else an HF directory's
// config.json); none when they name none.
std::optional<uint32_t> model_bos_id(const ModelSource& source);

// `spec` as a run keeps using it: a run folder stands for its newest checkpoint, which moves on
// while that run trains, so it becomes that checkpoint's absolute path (`source`: `spec`
// resolved); any other spec is returned as it is.
std::string pinned_model_spec(const std::string& spec, const ModelSource& source);

// Refuses, saying what to pass instead, a checkpoint folder of a federated post-training server:
// its model.safetensors holds the global LoRA adapters' B matrices alone, no model. `what` names
// it as the user gave it ("model 'DIR'", "--checkpoint 'DIR'").
void refuse_adapter_only_checkpoint(const std::filesystem::path& dir, const std::string& what);

// Loads the weights (presets and model files: initialised from `seed`).
model::Llama load_model(const ModelSource& source, DType dtype = DType::f32, uint64_t seed = 0);

// The weights a run starts from (`model.init_from` of `pollen train` and `pollen fed server`):
// `spec` resolved as above (a checkpoint, a run folder or an HF directory; weights only), refused
// naming every key in which its architecture differs from the run's `expected` model. `key`
// names the setting in errors ("model.init_from"); `resolved`, when given, gets what was read.
model::Llama load_initial_weights(const std::string& spec, const model::LlamaConfig& expected,
                                  const std::string& key, ModelSource* resolved = nullptr);

}  // namespace pollen::io
