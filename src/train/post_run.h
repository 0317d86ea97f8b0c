#pragma once
// The post-training loop behind `pollen sft` (and `dpo`, `rm`, `grpo`): one loop for every
// objective (train/objective.h). It owns the model (the base the run file names), AdamW on a
// schedule over the trainable parameters, clipping, evaluation, checkpoints that resume bitwise
// (pre-training's layout: model.safetensors with HF names, optimizer.safetensors, state.json with
// the objective's state, config.toml, tokenizer.json, SHA-256 manifest; with [lora] the adapters
// in PEFT's format, adapter_config.json and adapter_model.safetensors, instead of the model),
// metrics (JSONL + TensorBoard, the objective's under "<name>/<metric>"), progress, SIGINT/SIGTERM
// and a stop after too many non-finite losses in a row. docs/posttraining.md.
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "io/model_source.h"
#include "train/objective.h"
#include "train/post_config.h"
#include "train/trainer.h"

namespace pollen::train {

struct PostOptions {
  bool resume = false;
  bool handle_signals = true;  // SIGINT/SIGTERM: finish the step, checkpoint, stop
  // Tests: behave as if preempted once this many steps have run in this process (-1: never).
  int64_t stop_after = -1;
  bool quiet = false;  // no progress lines (tests)
  // The job's ranks (data parallel, docs/parallel.md); null: this process alone. Rank 0 writes
  // the run's files; every rank holds the same weights.
  dist::Communicator* comm = nullptr;
  FaultInjection fault;  // POLLEN_FAULT_INJECT (tests of a job of several ranks)
};

struct PostResult : RunResult {             // exit codes as pre-training's
  nlohmann::ordered_json last_val_metrics;  // the objective's at the last evaluation
};

// Builds the objective from its section and what the loop resolved; called once per run.
using ObjectiveFactory = std::function<std::unique_ptr<Objective>(const ObjectiveContext&)>;

// A rank that dies or hangs ends the run with RunStatus::rank_failed, naming it.
PostResult run_post_training(const PostConfig& config, const PostOptions& options,
                             const ObjectiveFactory& make_objective);

// The base a run file names, resolved: the model source (not loaded), its tokenizer
// (model.tokenizer or the one that goes with the base) and chat format (model.chat_template, else
// the base's).
struct PostBase {
  io::ModelSource source;
  std::filesystem::path tokenizer_path;
  std::shared_ptr<const tokenizer::Tokenizer> tokenizer;
  tokenizer::ChatFormat chat_format;
};
PostBase resolve_post_base(const PostConfig& config);

// The model's parameters the optimizer updates, with the names they are saved under: all of
// them, or with [lora] only the adapters', which this attaches to `model` (fresh: A drawn from
// lora.config.seed, B zero); `lora` is then the attached adapters (the loop sets their dropout
// step and saves them), else null.
struct TrainedParameters {
  std::vector<std::pair<std::string, ag::Var>> named;
  std::shared_ptr<model::Lora> lora;
};
TrainedParameters trained_model_parameters(model::Llama& model, const LoraSettings& lora);

// The text files of a LoRA checkpoint besides its tensors: adapter_config.json in PEFT's format,
// naming `base` (the run's model.base) as base_model_name_or_path.
std::string lora_checkpoint_config(const model::Lora& lora, const std::string& base);

}  // namespace pollen::train
