#pragma once
// Federated post-training with LoRA adapters as the exchanged state (docs/federated.md,
// 'Federated post-training with LoRA'). Every silo runs a post-training objective (SFT, ...) on
// its own data, starting each round from the round's global adapters, with A drawn from the
// federation's shared seed and frozen (lora.train_a = false); it sends only B's pseudo-gradient
// (the global B minus its local B), and that of the objective's own parameters where it has any
// (a reward model's score head, which is dense and averages as it is). The server averages them
// weighted by tokens and applies its outer optimizer (fed/strategy.h) to what travels. Exact,
// because with A shared and frozen the merged update is linear in B: mean_i(scale B_i A) = scale
// mean_i(B_i) A (model::average_lora_shared_a). The adapters travel through the wire's encoding and
// checks (fed/wire.h), as the model does in pre-training; the base never travels.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dist/communicator.h"
#include "dist/grad_reducer.h"
#include "fed/config.h"
#include "fed/received.h"
#include "fed/round_trainer.h"
#include "fed/wire.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "model/llama.h"
#include "optim/adamw.h"
#include "optim/schedule.h"
#include "train/post_run.h"

namespace pollen::fed {

// The tensors a federation of LoRA silos exchanges: B of every adapter (PEFT names), in
// Lora::named_parameters() order.
ParamSpecs lora_specs(const model::Lora& lora);
Weights lora_weights(const model::Lora& lora);                     // copies, float32
void set_lora_weights(const model::Lora& lora, const Weights& w);  // copies in

// Empty when a silo's adapters agree with the federation's; otherwise one line per difference
// ("lora.rank: server 4, client 8", the two sides named by `names`). Every key counts: rank,
// alpha, rslora and dropout change what B means, the targets which tensors there are, the seed
// and train_a the shared A.
std::string lora_agreement_differences(const model::LoraConfig& server,
                                       const model::LoraConfig& client,
                                       std::pair<const char*, const char*> names = {"server",
                                                                                    "client"});

// The adapters' config as canonical JSON (what Join carries), and back; the parse refuses
// malformed or out-of-range input naming `what`.
std::string lora_config_json(const model::LoraConfig& config);
model::LoraConfig parse_lora_config_json(const std::string& json, const std::string& what);

// What a client's Join says of its post-training silo against the server's terms (their
// lora_json empty: a pre-training server): empty when they agree, else every difference
// ("lora.rank: server 4, client 8; base weights: server 3f2a.., client 91c0..; post.objective:
// server rm, client sft").
std::string post_agreement_differences(const pb::JoinRequest& client, const ServerTerms& terms);

// The objectives that federate with LoRA ("sft", "dpo", "grpo", "rm"); others are refused naming
// `where`. `base`: the run file's model.base, GRPO's KL reference when grpo.beta > 0 and no
// grpo.reference is named (as `pollen grpo` takes it).
train::ObjectiveFactory lora_objective_factory(const std::string& objective,
                                               const std::string& where,
                                               const std::string& base = {});

// The objective's own parameters, which travel beside B, as its objective starts them (drawn
// from the run file's seed): a reward model's score head `score.weight` (1, hidden); none for the
// others.
io::NamedTensors initial_objective_params(const std::string& objective,
                                          const model::LlamaConfig& base, uint64_t seed);

// What a post-training federation exchanges: B of every adapter, then the objective's own
// parameters (`objective`, named tensors). The specs, float32 copies, and the values copied in
// (shapes checked; `what` names the holder in errors).
ParamSpecs post_specs(const model::Lora& lora, const io::NamedTensors& objective);
Weights post_weights(const model::Lora& lora, const io::NamedTensors& objective);
void set_post_weights(const model::Lora& lora, const io::NamedTensors& objective, const Weights& w,
                      const std::string& what);

// What the server of a post-training federation reads of its [post] run file: the base (loaded
// only to fingerprint it), its tokenizer's fingerprint, the adapters' config and the seed that
// draws the objective's own parameters.
struct PostBaseInfo {
  std::string base;  // the run file's model.base (adapter_config.json names it)
  model::LlamaConfig architecture;
  std::string base_sha256, tokenizer_fingerprint;
  model::LoraConfig lora;
  uint64_t seed = 0;         // the run file's run.seed
  optim::Schedule schedule;  // the run file's, over its train.steps
};

// The global state of a post-training federation, as its server holds it: the adapters (A drawn
// from the shared lora.seed, B zero at first) and the objective's own parameters, drawn from the
// run file's seed as a silo's objective draws them (a reward model's score head). What travels is
// every B, then those parameters (specs()).
class PostGlobal {
 public:
  PostGlobal(const model::LlamaConfig& base, const model::LoraConfig& lora,
             const std::string& objective, uint64_t seed);
  const ParamSpecs& specs() const { return specs_; }
  Weights weights() const { return post_weights(lora_, objective_params_); }  // float32 copies
  void set_weights(const Weights& w) {
    set_post_weights(lora_, objective_params_, w, "the server's post-training state");
  }
  const model::Lora& lora() const { return lora_; }
  // The objective's parameters, named; empty for most objectives.
  const io::NamedTensors& objective_params() const { return objective_params_; }
  // The adapters as a PEFT folder in `dir`, and the objective's parameters beside them in
  // dir/objective.safetensors when it has any.
  void save(const std::filesystem::path& dir, const std::string& base_name) const;

 private:
  model::Lora lora_;
  io::NamedTensors objective_params_;
  ParamSpecs specs_;
};

// A federated reward model exported as `pollen rm` exports one (docs/posttraining.md, [rm]):
// `config`'s base with the global adapters merged, the global score head, the base's tokenizer
// and the [rm] pad token, as an HF sequence-classification folder `dir`.
void export_federated_reward_model(const train::PostConfig& config, const PostGlobal& global,
                                   const std::filesystem::path& dir);
PostBaseInfo read_post_base(const PostSettings& post);

// A client's LoRA silo from its [post]: the run file with <objective>.data set to post.data.
train::PostConfig silo_post_config(const PostSettings& post);
// Warns when the silos' run file's schedule (`run` names the file) ends before the federation's
// local steps do (a schedule that decays: its rate stays at its last value after train.steps).
void warn_if_schedule_ends_early(const optim::Schedule& s, const std::filesystem::path& run,
                                 int64_t federation_steps);

// One silo: the base its run file names (frozen), adapters from the run file's [lora] (which
// must have train_a = false), the objective over the silo's data, and AdamW over B on the run
// file's [optimizer] and [schedule] (counted in local steps across rounds).
// As a RoundTrainer it is what `pollen fed client` trains with [post]: the exchanged tensors are
// B, the aggregation weight the tokens the objective ran through the model, the data version
// the SHA-256 of the objective's section and data file.
class LoraSilo : public RoundTrainer {
 public:
  LoraSilo(std::string id, const train::PostConfig& config,
           const train::ObjectiveFactory& make_objective);
  // A silo of several ranks (fed/silo.h): from now on each rank runs its share of every local
  // step and of evaluation, and the gradients are summed over the ranks in buckets of about
  // `bucket_mb` MiB (train::Objective::split_across).
  void split_across(dist::Communicator& comm, double bucket_mb);
  // POLLEN_FAULT_INJECT (tests): the fault before a local step, counted over rounds, on this
  // silo's rank.
  void set_fault_injection(const train::FaultInjection& fault) { fault_ = fault; }
  // The objective's held-out loss and metrics with the current adapters.
  train::ObjectiveStep evaluate_held_out();

  // B of every adapter, then the objective's own parameters (a reward model's head).
  ParamSpecs exchanged_specs() const override { return post_specs(*lora_, objective_params_); }
  Weights exchanged_weights() const override { return post_weights(*lora_, objective_params_); }
  void set_exchanged_weights(const Weights& w) override {
    set_post_weights(*lora_, objective_params_, w, cat("silo '", id_, "'"));
  }
  Result train(int64_t steps) override;
  double evaluate(int64_t* tokens) override;
  const std::string& manifest_hash() const override { return data_hash_; }

  // The client's state across restarts (fed/client_state.h): B and the AdamW moments into
  // `w`; the local step count and the objective's state (data position) as JSON.
  nlohmann::ordered_json write_state(io::CheckpointWriter& w) const;
  void read_state(const std::filesystem::path& checkpoint, const nlohmann::ordered_json& state);

  const std::string& id() const { return id_; }
  const model::Lora& lora() const { return *lora_; }
  const model::Llama& model() const { return model_; }
  const model::LoraConfig& lora_config() const { return lora_->config(); }
  const std::string& base_name() const { return config_.base; }  // the run file's model.base
  uint64_t seed() const { return config_.seed; }                 // the run file's run.seed
  const train::PostConfig& config() const { return config_; }
  const std::string& base_sha256() const { return base_sha256_; }
  const std::string& tokenizer_fingerprint() const { return tokenizer_fingerprint_; }
  train::Objective& objective() { return *objective_; }
  int64_t steps_taken() const { return step_; }

 private:
  std::string id_;
  train::PostConfig config_;
  model::Llama model_;
  std::string base_sha256_, tokenizer_fingerprint_, data_hash_;
  std::shared_ptr<model::Lora> lora_;
  // The base's tokenizer, which the objective keeps a pointer to (GRPO decodes every
  // completion with it): it lives as long as the silo.
  std::shared_ptr<const tokenizer::Tokenizer> tokenizer_;
  std::unique_ptr<train::Objective> objective_;
  std::vector<std::pair<std::string, ag::Var>> trained_;  // B, then the objective's, named
  io::NamedTensors objective_params_;  // a reward model's head: the values of its Vars
  std::vector<ag::Var> params_;
  std::unique_ptr<optim::AdamW> opt_;
  std::unique_ptr<dist::GradReducer> reducer_;  // several ranks: sums the gradients over them
  dist::Communicator* comm_ = nullptr;          // the silo's ranks; null: this process alone
  train::FaultInjection fault_;
  int64_t step_ = 0;  // local steps over every round

  Result train_steps(int64_t steps);
  double evaluate_share(int64_t* tokens);
};

// The LoRA silo of a client's [post]; with `comm` of several ranks, split across them
// (client.toml's parallel.bucket_mb).
std::unique_ptr<LoraSilo> make_lora_silo(const ClientConfig& config, dist::Communicator* comm);

// `pollen fed post --config FILE`: a post-training federation simulated in one process as `pollen
// fed simulate` runs one (fed/run.h: the server's Coordinator and a Client per silo, every message
// through the in-process transport). The file's [federation] names the silos' post-training run
// file (`run`, its [lora] with train_a = false), the objective, the silos and each one's data
// (set as the run file's <objective>.data), rounds, local_steps, eval_every and `output` (the
// server's folder: adapter/, checkpoints/, metrics.jsonl, the clients' states; for a reward model
// reward_model/); [strategy] and [compression] as the server reads them.
SimConfig load_fed_post_config(const std::filesystem::path& path);

}  // namespace pollen::fed
