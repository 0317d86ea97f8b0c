#pragma once
// GRPO (group relative policy optimisation, DeepSeekMath): reinforcement learning with verifiable
// rewards. Each step takes `prompts_per_step` prompts, samples `group_size` completions of each
// with the generation engine, scores them with a verifier, normalises the rewards within each
// prompt's group into advantages, and follows the gradient of the clipped policy-ratio loss (plus
// beta times the k3 KL estimate to a reference model); see train/grpo_loss.h for the arithmetic.
//
// Prompts are JSONL: {"prompt": "text", "answer": ...} (the text is the model's input as is) or
// {"messages": [{"role": ..., "content": ...}, ...], "answer": ...} (rendered with the chat
// template and an assistant header; completions stop at the end-of-turn token). The answer is a
// string or a number.
//
// Deterministic: the prompts of batch b and the random stream of each completion are functions
// of (seed, b, slot), so a resumed run samples what the uninterrupted one did.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "train/data_key.h"
#include "train/grpo_loss.h"
#include "train/objective.h"
#include "train/synth_tasks.h"
#include "train/verifiers.h"

namespace pollen::train {

struct GrpoOptions {
  std::filesystem::path data;       // prompts JSONL
  std::filesystem::path eval_data;  // optional: held-out prompts, answered greedily
  int64_t eval_prompts = 0;         // evaluate on the first N held-out prompts (0: all)
  int64_t group_size = 8;           // G completions per prompt
  int64_t prompts_per_step = 4;
  int64_t updates_per_batch =
      1;                    // optimizer steps on each sampled batch (ratio != 1 after the 1st)
  int64_t micro_batch = 8;  // completions per forward/backward
  int64_t max_completion_tokens = 64;
  double temperature = 1.0;
  int64_t top_k = 0;
  double top_p = 1.0;
  std::vector<std::string> stop;  // stop strings (kept in the scored completion)
  ClippedLossOptions loss;
  LossAggregation aggregation = LossAggregation::sequence;
  bool scale_rewards = true;  // divide advantages by the group's std (false: Dr. GRPO)
  std::string reference;      // the KL reference (any --model spec); needed when beta > 0
  // A reward model (an HF sequence-classification directory, as `pollen rm` exports): its score
  // of the prompt and the completion is the reward, plus the verifier's when [grpo.verifier]
  // is given too.
  std::filesystem::path reward_model;
};

// [grpo]: every key read and checked, [grpo.verifier] included (unknown keys refused). Paths are
// relative to base_dir. With a reward model and no [grpo.verifier], `verifier` is left empty.
GrpoOptions read_grpo_options(ConfigTable& section, const std::filesystem::path& base_dir,
                              RewardFunction* verifier);

// One prompt: its text, its tokens (what the model sees before the completion) and its answer.
struct GrpoPrompt {
  std::string text;
  std::vector<uint32_t> tokens;
  std::string answer;
  // A conversation's: what the chat template writes after the assistant's reply (ChatML's
  // "<|im_end|>\n"), which a reward model trained on chat pairs read at the end of every reply.
  std::string turn_end;
};

// A rollout's reward from its prompt and its completion.
using RolloutReward = std::function<double(const GrpoPrompt& prompt, std::string_view completion)>;

// How long a prompt may be: its tokens plus `completion_tokens` (grpo.max_completion_tokens) must
// fit the model's `positions` (0: any length).
struct PromptLimit {
  int64_t positions = 0;
  int64_t completion_tokens = 0;
};

// Reads prompts JSONL; errors name the file, the line and the field. Every answer is checked by
// the verifier (a numeric verifier refuses an answer that is not a number); without a verifier
// (an empty function: rewards from a reward model alone) the answer is optional. A prompt longer
// than `limit` allows is refused.
std::vector<GrpoPrompt> read_grpo_prompts(const std::filesystem::path& path,
                                          const tokenizer::Tokenizer& tokenizer,
                                          const tokenizer::ChatFormat& chat_format,
                                          const RewardFunction& verifier, PromptLimit limit = {});

// One sampled batch: prompts_per_step * group_size completions, group by group.
struct Rollouts {
  int64_t batch = -1;                         // 0-based batch number
  std::vector<int64_t> prompt;                // per completion: index into the prompts
  std::vector<std::vector<uint32_t>> tokens;  // per completion: the scored tokens
  std::vector<double> rewards, advantages;    // per completion
  std::vector<std::vector<double>> old_logp;  // per completion token (updates_per_batch > 1)
  std::vector<std::vector<double>> ref_logp;  // per completion token (beta > 0)
};

class GrpoObjective : public Objective {
 public:
  // `reward` replaces the verifier the section names (a reward model's score, say).
  explicit GrpoObjective(const ObjectiveContext& context, RewardFunction reward = {});
  GrpoObjective(const GrpoOptions& options, std::vector<GrpoPrompt> prompts,
                std::vector<GrpoPrompt> eval_prompts, RewardFunction reward,
                const tokenizer::Tokenizer& tokenizer, std::vector<uint32_t> stop_tokens,
                uint64_t seed);

  // The KL reference; set from `reference` when the section names one (and beta > 0).
  void set_reference(std::shared_ptr<const model::Llama> reference);

  std::string name() const override { return "grpo"; }
  // The loss is about 0 by construction (advantages have mean 0 within each group); the mean
  // reward says how the run goes.
  std::string headline_metric() const override { return "reward"; }
  ObjectiveStep train_step(const model::Llama& model, int64_t step) override;
  ObjectiveStep evaluate(const model::Llama& model) override;
  // Under several ranks each samples and scores completions k with k mod ranks its rank, and the
  // whole batch is gathered on every rank before the advantages; the micro-batches of the
  // log-probabilities and of the step are then split round robin, as DPO's are.
  void split_across(dist::Communicator& comm, dist::GradReducer& reducer) override {
    share_ = {&comm, &reducer};
  }
  std::string no_validation_data() const override {
    if (!eval_prompts_.empty()) return "";
    return options_.eval_data.empty() ? "grpo.eval_data is not set"
                                      : "grpo.eval_data holds no prompts";
  }
  nlohmann::ordered_json state() const override;
  void restore(const nlohmann::ordered_json& state) override;

  const GrpoOptions& options() const { return options_; }
  // The batch the last train_step trained on (for tests and inspection).
  const Rollouts& rollouts() const { return rollouts_; }

 private:
  std::vector<int64_t> batch_prompts(int64_t batch) const;
  Rollouts sample(const model::Llama& model, int64_t batch) const;
  // The output layer's rows of the ids completions are sampled from (the tokenizer's): the
  // log-probabilities are normalised over the ids that can be drawn, also when the model's
  // vocabulary is padded beyond them.
  ag::Var sampled_head(const model::Llama& model) const;
  // Per-token log-probabilities of each completion under `model` (no gradient).
  std::vector<std::vector<double>> completion_logprobs(const model::Llama& model,
                                                       const Rollouts& rollouts) const;

  GrpoOptions options_;
  std::optional<DataIdentity> identity_;  // the prompt files, tokenizer and template; none:
                                          // prompts given in memory
  std::vector<GrpoPrompt> prompts_, eval_prompts_;
  RolloutReward reward_;
  const tokenizer::Tokenizer* tokenizer_;
  std::vector<uint32_t> stop_tokens_;
  uint64_t seed_;
  // Loads the KL reference from `spec`, pinned.
  void load_reference(const std::string& spec);

  std::shared_ptr<const model::Llama> reference_;
  // The `reference` spec as the run uses it (a run folder pinned to its checkpoint); empty when
  // the reference is not loaded from the section.
  std::string pinned_reference_;
  Rollouts rollouts_;
  RankShare share_;
};

// The reward model's score of the prompt followed by the completion and, for a conversation, the
// end of the assistant's turn (each encoded by `tokenizer`, as `pollen rm score` encodes a
// prompt/response record, chat or text), plus `verifier`'s reward when it is set.
RolloutReward reward_model_reward(const std::filesystem::path& reward_model,
                                  const tokenizer::Tokenizer& tokenizer, RewardFunction verifier);

// The objective of a run file: with beta > 0 and no `reference` key, the KL reference is the
// run's base model (`base`, as the run file names it), also when the run resumes.
std::unique_ptr<Objective> make_grpo_objective(const ObjectiveContext& context,
                                               const std::string& base);

// One line of GRPO prompts JSONL (no newline) from a template task (`pollen grpo synth`):
// {"messages": [{user: prompt}], "answer": ...}, the conversation SFT's data of the same task
// teaches to answer with "#### ANSWER".
std::string grpo_jsonl_line(const SynthExample& example);

}  // namespace pollen::train
