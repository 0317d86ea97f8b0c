#pragma once
// Federated post-training with LoRA adapters as the exchanged state (docs/federated.md,
// 'Federated post-training with LoRA'). Every silo runs a post-training objective (SFT, ...) on
// its own data, starting each round from the round's global adapters, with A drawn from the
// federation's shared seed and frozen (lora.train_a = false); it sends only B's pseudo-gradient
// (the global B minus its local B). The server averages them weighted by tokens and applies its
// outer optimizer (fed/strategy.h) to B alone. Exact, because with A shared and frozen the merged
// update is linear in B: mean_i(scale B_i A) = scale mean_i(B_i) A (model::average_lora_shared_a).
// The adapters travel through the wire's encoding and checks (fed/wire.h), as the model does in
// pre-training; the base never travels.
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fed/compress.h"
#include "fed/strategy.h"
#include "fed/wire.h"
#include "model/llama.h"
#include "optim/adamw.h"
#include "train/post_run.h"

namespace pollen::fed {

// The tensors a federation of LoRA silos exchanges: B of every adapter (PEFT names), in
// Lora::named_parameters() order.
ParamSpecs lora_specs(const model::Lora& lora);
Weights lora_weights(const model::Lora& lora);                     // copies, float32
void set_lora_weights(const model::Lora& lora, const Weights& w);  // copies in

// Empty when a silo's adapters agree with the federation's; otherwise one line per difference
// ("lora.rank: server 4, client 8"). Every key counts: rank, alpha, rslora and dropout change
// what B means, the targets which tensors there are, the seed and train_a the shared A.
std::string lora_agreement_differences(const model::LoraConfig& server,
                                       const model::LoraConfig& client);

// One silo: the base its run file names (frozen), adapters from the run file's [lora] (which
// must have train_a = false), the objective over the silo's data, and AdamW over B on the run
// file's [optimizer] and [schedule] (counted in local steps across rounds).
class LoraSilo {
 public:
  LoraSilo(std::string id, const train::PostConfig& config,
           const train::ObjectiveFactory& make_objective);
  struct Result {
    int64_t tokens = 0;
    double loss = 0;  // mean of the steps' losses
    Weights delta;    // global minus local B
  };
  // `steps` optimizer steps of the objective from the global B.
  Result train_round(const Weights& global, int64_t steps);
  // The objective's held-out loss with the current adapters.
  double evaluate();

  const std::string& id() const { return id_; }
  const model::Lora& lora() const { return *lora_; }
  const model::Llama& model() const { return model_; }
  const model::LoraConfig& lora_config() const { return lora_->config(); }
  const std::string& base_name() const { return config_.base; }  // the run file's model.base

 private:
  std::string id_;
  train::PostConfig config_;
  model::Llama model_;
  std::shared_ptr<model::Lora> lora_;
  std::unique_ptr<train::Objective> objective_;
  std::vector<ag::Var> params_;
  std::unique_ptr<optim::AdamW> opt_;
  int64_t step_ = 0;  // local steps over every round
};

struct LoraFedOptions {
  int64_t rounds = 1;
  int64_t local_steps = 10;     // H: optimizer steps per silo and round
  StrategyOptions strategy;     // fedavg with lr 1 (the token-weighted mean of the local B) default
  CompressOptions compression;  // what silos send
};

struct LoraRoundSummary {
  int64_t round = 0;
  int64_t tokens = 0;
  double train_loss = 0;                        // token-weighted over silos
  uint64_t bytes_sent = 0, bytes_received = 0;  // the round's adapters out, updates in
  std::map<std::string, double> client_train_loss;
  std::map<std::string, int64_t> client_tokens;  // each silo's aggregation weight
};

// The server's side: the global adapters (A from the shared seed, B zero) on a base
// architecture, and the outer optimizer over B.
class LoraFederation {
 public:
  LoraFederation(const model::LlamaConfig& base, const model::LoraConfig& lora,
                 LoraFedOptions options);
  // Refuses a silo whose base architecture or adapters differ, naming every difference.
  void admit(const LoraSilo& silo) const;
  // One round: each silo (in the given order; the mean is summed in id order) pulls the encoded
  // global B, trains, pushes its encoded delta; the strategy aggregates.
  LoraRoundSummary run_round(int64_t round, const std::vector<LoraSilo*>& silos);

  const model::Lora& global() const { return global_; }
  const ParamSpecs& specs() const { return specs_; }

 private:
  model::LlamaConfig base_;
  model::Lora global_;
  LoraFedOptions options_;
  ParamSpecs specs_;
  std::unique_ptr<Strategy> strategy_;
};

// `pollen fed post --config FILE`: a simulated federation of LoRA silos in one process. The file's
// [federation] names the silos' post-training run file (`run`, its [lora] with train_a = false),
// the objective, the silos and each one's data (set as <objective>.data of the run file), rounds,
// local_steps and `output` (the final adapters as a PEFT folder, metrics.jsonl beside it);
// [strategy] and [compression] as in docs/federated.md.
struct LoraFedConfig {
  std::filesystem::path run_file;
  std::string objective = "sft";
  std::vector<std::string> silos;
  std::vector<std::string> data;  // one per silo
  std::filesystem::path output;
  LoraFedOptions options;
};
LoraFedConfig load_lora_fed_config(const std::filesystem::path& path);

struct LoraFedResult {
  std::vector<LoraRoundSummary> rounds;
  std::vector<double> eval_loss;  // each silo's held-out loss with the final global adapters
};
LoraFedResult run_lora_federation(const LoraFedConfig& config,
                                  const train::ObjectiveFactory& make_objective);

}  // namespace pollen::fed
