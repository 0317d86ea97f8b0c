#pragma once
// A reward model: the decoder's final hidden state at each sequence's last token, times a scalar
// head `score` (1,C) without bias (as HF's LlamaForSequenceClassification with num_labels 1),
// trained on preference pairs with the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected).
// It exports as an HF sequence-classification directory that transformers loads and scores
// identically (the last token is the one before the first pad_token_id, so the pad token must
// never appear in a scored sequence).
//
// [rm] keys: data, validation (prompt/chosen/rejected JSONL) or validation_fraction, batch_pairs,
// micro_batch_pairs, pad_token (the padding token written to the export; default "<|endoftext|>").
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "train/data_key.h"
#include "train/objective.h"
#include "train/preference_data.h"
#include "train/preference_loss.h"

namespace pollen::train {

class RewardObjective : public Objective {
 public:
  explicit RewardObjective(ObjectiveContext context);

  std::string name() const override { return "rm"; }
  bool uses_output_head() const override { return false; }  // the score head scores
  std::vector<std::pair<std::string, ag::Var>> extra_parameters() const override {
    return {{"score.weight", score_}};
  }
  ObjectiveStep train_step(const model::Llama& model, int64_t step) override;
  ObjectiveStep evaluate(const model::Llama& model) override;
  // Held-out pairs: a validation fraction holds out at least one; a validation file may be empty.
  std::string no_validation_data() const override {
    return eval_pairs_.empty() ? "rm.validation holds no pairs" : "";
  }
  // Rank r runs the step's micro-batches (and the held-out ones) r, r + ranks, ...
  void split_across(dist::Communicator& comm, dist::GradReducer& reducer) override {
    share_ = {&comm, &reducer};
  }
  // The steps' pairs follow from the seed and the step; only the data they are drawn from is kept,
  // so that a resumed run refuses other data.
  nlohmann::ordered_json state() const override { return identity_->state(); }
  void restore(const nlohmann::ordered_json& state) override;

  const ag::Var& score_head() const { return score_; }
  uint32_t pad_token_id() const { return pad_token_id_; }

 private:
  PreferenceStats run_pairs(const model::Llama& model, const std::vector<PreferencePair>& pairs,
                            const std::vector<size_t>& indices, double scale, bool backward,
                            int64_t* tokens) const;

  ObjectiveContext context_;
  ag::Var score_;  // (1,C)
  uint32_t pad_token_id_ = 0;
  int64_t batch_pairs_ = 8, micro_batch_pairs_ = 4;
  std::vector<PreferencePair> train_pairs_, eval_pairs_;
  std::optional<DataIdentity> identity_;  // the data files, tokenizer and template
  RankShare share_;
};

std::unique_ptr<Objective> make_reward_objective(ObjectiveContext context);

// The id of the [rm] section's pad_token (default "<|endoftext|>") in the tokenizer.
uint32_t rm_pad_token_id(ConfigTable& section, const tokenizer::Tokenizer& tokenizer);

// The score head (1,C) a reward model starts from, as HF initialises it: normal(0,
// initializer_range), drawn from the run's seed.
Tensor initial_score_head(const model::LlamaConfig& config, uint64_t seed);

// The id of `token` in the tokenizer's added tokens; an error names `where` otherwise.
uint32_t pad_token_named(const tokenizer::Tokenizer& tokenizer, const std::string& token,
                         const std::string& where);

// Each row's reward: score (1,C) times the final hidden state at the row's last token -> (B).
ag::Var sequence_rewards(const model::Llama& model, const ag::Var& score,
                         const SequenceBatch& batch);

// A reward model loaded from an HF sequence-classification directory.
struct RewardModel {
  std::unique_ptr<model::Llama> decoder;
  ag::Var score;  // (1,C)
  uint32_t pad_token_id = 0;
};
RewardModel load_reward_model(const std::filesystem::path& dir);

// Writes config.json (LlamaForSequenceClassification, num_labels 1, pad_token_id),
// model.safetensors (the decoder's model.* tensors and score.weight) and `extra_files`
// (tokenizer files) into `dir`.
void export_reward_model(const model::Llama& decoder, const ag::Var& score, uint32_t pad_token_id,
                         const std::filesystem::path& dir,
                         const std::vector<std::filesystem::path>& extra_files = {});
// The same with the tokenizer: `tokenizer_json` copied beside, and tokenizer_config.json naming
// the pad token.
void export_reward_model_with_tokenizer(const model::Llama& decoder, const ag::Var& score,
                                        uint32_t pad_token_id,
                                        const std::filesystem::path& tokenizer_json,
                                        const std::filesystem::path& dir);

// The reward model of a post-training checkpoint (its model, objective.safetensors' score.weight
// and tokenizer.json) exported with export_reward_model, with a tokenizer_config.json naming the
// pad token.
void export_reward_checkpoint(const std::filesystem::path& checkpoint, uint32_t pad_token_id,
                              const std::filesystem::path& dir);

// Rewards of sequences, `micro_batch` rows per forward pass, without gradients.
std::vector<double> score_sequences(const model::Llama& decoder, const ag::Var& score,
                                    const std::vector<ScoredSequence>& sequences,
                                    int64_t micro_batch);

// Scores a prompt/response JSONL file: each record is written to `out` (one per line, in order)
// with a "score" field added.
struct ScoreCounts {
  int64_t records = 0;
  int64_t shortened = 0;  // longer than format.max_seq: scored on the prompt's last tokens
};
ScoreCounts score_jsonl(const RewardModel& rm, const SequenceFormat& format,
                        const std::filesystem::path& in, const std::filesystem::path& out,
                        int64_t micro_batch);

}  // namespace pollen::train
