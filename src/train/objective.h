#pragma once
// Post-training objectives (SFT, DPO, reward models, GRPO) share one loop (train/post_run.h):
// AdamW on a schedule over the trainable parameters (the whole model, or only its LoRA adapters,
// plus any parameters the objective adds, such as a reward head), gradient clipping, evaluation,
// checkpoints that resume bitwise, metrics (JSONL + TensorBoard), progress and preemption. An
// objective supplies what differs: its data, its loss and its metrics.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "autograd/var.h"
#include "base/config.h"
#include "base/error.h"
#include "dist/communicator.h"
#include "dist/grad_reducer.h"
#include "model/llama.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace pollen::train {

// What one optimizer step (or one evaluation) of an objective reports.
struct ObjectiveStep {
  double loss = 0;                 // the value whose gradient the step accumulated
  int64_t tokens = 0;              // tokens run through the model (for tokens/s)
  nlohmann::ordered_json metrics;  // the objective's own scalars: {"rewards/chosen": 0.3, ...}
};

class Objective {
 public:
  virtual ~Objective() = default;
  virtual std::string name() const = 0;  // "sft", "dpo", "rm", "grpo": the metrics' prefix

  // Parameters the objective adds to the model's and trains with them (a reward model's score
  // head), with the names they are saved under. Most objectives add none.
  virtual std::vector<std::pair<std::string, ag::Var>> extra_parameters() const { return {}; }

  // Whether the loss goes through the model's output head (the LM head). A reward model's does
  // not: the loop then leaves lm_head.weight (when not tied to the embedding) and a LoRA adapter
  // on lm_head out of the trained parameters, which no gradient reaches, so that neither weight
  // decay nor a data-parallel reduction moves them.
  virtual bool uses_output_head() const { return true; }

  // The metric that the progress line, the evaluation log line and the run's closing summary
  // show instead of the loss, for an objective whose loss says little (GRPO's is about 0 by
  // construction: "reward"); empty: the loss.
  virtual std::string headline_metric() const { return ""; }

  // Forward and backward of optimizer step `step` (1-based): every micro-batch of the step, the
  // gradient of the step's loss accumulated into the trainable parameters' gradients (already
  // zeroed by the loop). Deterministic given the objective's state, so a resumed run repeats it.
  virtual ObjectiveStep train_step(const model::Llama& model, int64_t step) = 0;
  // The loss and metrics on the held-out data, without gradients.
  virtual ObjectiveStep evaluate(const model::Llama& model) = 0;
  // Empty when there is held-out data; otherwise why there is none and which key gives some.
  // The loop then warns once at the start and never evaluates, as pollen train does without
  // validation data, rather than logging a loss of nan at every evaluation.
  virtual std::string no_validation_data() const { return ""; }

  // A run of several ranks (docs/parallel.md) calls this once, before the first step: from then
  // on each rank runs its share of every step's micro-batches (the step's data position still
  // advances over the whole step on every rank), scales its gradients by the whole step's count,
  // observes its last backward with `reducer` (which sums the gradients over the ranks), and
  // reports the whole step's loss and metrics; evaluate() splits the held-out data the same way.
  // The training equals one process's up to the order of float sums. An objective that cannot
  // split its steps keeps this default, which refuses naming it.
  virtual void split_across(dist::Communicator& comm, dist::GradReducer& reducer) {
    (void)reducer;
    fail("pollen ", name(), " runs as one process, not as ", comm.world(),
         " ranks (docs/parallel.md)");
  }

  // Everything a resumed run needs to continue bitwise (data position, RNG counters), stored
  // as JSON in each checkpoint, and restored from it before the first step of the resumed run.
  virtual nlohmann::ordered_json state() const = 0;
  virtual void restore(const nlohmann::ordered_json& state) = 0;
};

// A data-parallel objective's place among the job's ranks (Objective::split_across); alone until
// set. Objectives that split a step's micro-batches round robin take micro-batch i on rank
// i mod ranks.
struct RankShare {
  dist::Communicator* comm = nullptr;
  dist::GradReducer* reducer = nullptr;
  // Whether item `i` of a step (a micro-batch, a sampled completion) is this rank's.
  bool owns(size_t i) const {
    return comm == nullptr ||
           i % static_cast<size_t>(comm->world()) == static_cast<size_t>(comm->rank());
  }
  // Whether this rank runs micro-batch `micro_batch` of the step on `model`; when another rank
  // does, a model with LoRA adapters counts that forward pass as begun, so that dropout draws
  // this rank's masks by their place in the step.
  bool runs(size_t micro_batch, const model::Llama& model) const {
    if (owns(micro_batch)) return true;
    if (model.lora()) model.lora()->skip_dropout_forwards(1);
    return false;
  }
  // Sums `values` over the ranks in place (alone: leaves them). With each value set by the one
  // rank that owns it and 0 on the others, every rank ends with all of them, exactly.
  void sum(std::span<double> values, const std::string& what) const {
    if (comm != nullptr) comm->all_reduce_sum(values, what);
  }
};

// What an objective is built from: its own section of the run file ([sft], [dpo], [rm] or
// [grpo]; every key read from it and unknown keys refused by the objective), and what the loop
// already resolved.
struct ObjectiveContext {
  ConfigTable section;
  std::filesystem::path base_dir;  // relative data paths in the section are relative to this
  const tokenizer::Tokenizer* tokenizer = nullptr;
  tokenizer::ChatFormat chat_format;  // the model's chat template (or the one the run file names)
  uint64_t seed = 0;
  int64_t max_seq = 0;  // longest sequence the model may see (the model's max positions or less)
  model::LlamaConfig model_config;  // the model trained (a reward head's width comes from it)
  std::filesystem::path run_dir;    // where an objective may keep caches; empty: keep none
  std::string base;  // model.base as the run resolved it: a run folder's checkpoint, pinned
  // The model's end-of-sequence ids (io::model_stop_tokens, as generate and chat stop at); empty:
  // the tokenizer's usual end tokens.
  std::vector<uint32_t> end_tokens;
};

}  // namespace pollen::train
