#pragma once
// Direct preference optimisation (Rafailov et al. 2023) and IPO (Azar et al. 2023) as a
// post-training objective. Data: prompt/chosen/rejected JSONL (train/preference_data.h). The
// reference log-probabilities are the starting model's, computed once before the first step and
// kept in the run folder under a name made from the data files' and the model's hashes, so that
// a resumed run (or a new run on the same data and model) reads them instead. Under LoRA the
// reference is the frozen base (the model without its adapters), as the starting model is.
//
// [dpo] keys: data, validation (JSONL files) or validation_fraction, loss ("sigmoid" or "ipo"),
// beta, label_smoothing, batch_pairs (pairs per optimizer step), micro_batch_pairs (pairs per
// forward pass).
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "train/data_key.h"
#include "train/objective.h"
#include "train/preference_data.h"
#include "train/preference_loss.h"

namespace pollen::train {

// The reference log-probabilities of every pair: P chosen then P rejected per data file.
struct ReferenceLogps {
  std::vector<double> train, eval;  // (2N) each: chosen of every pair, then rejected
};

class DpoObjective : public Objective {
 public:
  explicit DpoObjective(ObjectiveContext context);

  std::string name() const override { return "dpo"; }
  ObjectiveStep train_step(const model::Llama& model, int64_t step) override;
  ObjectiveStep evaluate(const model::Llama& model) override;
  // Held-out pairs: a validation fraction holds out at least one; a validation file may be empty.
  std::string no_validation_data() const override {
    return eval_pairs_.empty() ? "dpo.validation holds no pairs" : "";
  }
  // Rank r runs the step's micro-batches (and the held-out ones) r, r + ranks, ...; every rank
  // computes the references, rank 0 alone writes their cache.
  void split_across(dist::Communicator& comm, dist::GradReducer& reducer) override {
    share_ = {&comm, &reducer};
  }
  nlohmann::ordered_json state() const override;
  void restore(const nlohmann::ordered_json& state) override;

  // The pairs' reference log-probabilities, computed (or read from the run folder's cache) with
  // `model` the first time they are needed.
  const ReferenceLogps& references(const model::Llama& model);

 private:
  // Loss over some pairs of `pairs` with references `ref` (2N); backward when recording.
  PreferenceStats run_pairs(const model::Llama& model, const std::vector<PreferencePair>& pairs,
                            const std::vector<double>& ref, const std::vector<size_t>& indices,
                            double scale, bool backward, int64_t* tokens) const;
  std::filesystem::path cache_path(const std::string& file) const;
  void load_cache(const std::filesystem::path& path, const std::string& data_key);

  ObjectiveContext context_;
  PreferenceLossOptions loss_;
  std::filesystem::path data_path_, eval_path_;
  int64_t batch_pairs_ = 8, micro_batch_pairs_ = 4;
  std::vector<PreferencePair> train_pairs_, eval_pairs_;
  std::optional<DataIdentity> identity_;  // the data files, tokenizer and sequence format
  std::string cache_file_;  // the reference cache's name in the run folder, once known
  std::unique_ptr<ReferenceLogps> references_;
  RankShare share_;
};

std::unique_ptr<Objective> make_dpo_objective(ObjectiveContext context);

// The per-sequence log-probabilities of a batch's completions under `model` -> (B).
ag::Var completion_logps(const model::Llama& model, const SequenceBatch& batch);

}  // namespace pollen::train
