#pragma once
// One silo: holds its data, its model and its inner AdamW state across rounds (and, with a state
// folder, across restarts); for each round it pulls the global model (decoded as the server
// encoded it), trains H local steps, and pushes its pseudo-gradient (the decoded global model
// minus the local weights), compressed with error feedback. With [post] the silo is a LoraSilo
// (fed/post_lora.h) and the exchanged "model" is its LoRA adapters' B; the rest is the same. The
// same Client runs over gRPC (`pollen fed client`) and over the in-process transport (`pollen fed
// simulate`), which passes the same protobuf messages through the same checks.
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "data/loader.h"
#include "dist/communicator.h"
#include "dist/grad_reducer.h"
#include "dist/zero_adamw.h"
#include "fed/client_state.h"
#include "fed/config.h"
#include "fed/coordinator.h"
#include "fed/drift_correction.h"
#include "fed/post_lora.h"
#include "fed/round_trainer.h"
#include "fed/secagg/session.h"
#include "fed/wire.h"
#include "model/llama.h"
#include "optim/adamw.h"
#include "train/trainer.h"
#include "train/trainer_data.h"

namespace pollen::fed {

// How a client reaches the server. Streams come as callbacks so that big models never sit twice
// in memory on the way.
class Transport {
 public:
  virtual ~Transport() = default;
  virtual pb::JoinReply join(const pb::JoinRequest& r) = 0;
  virtual pb::TaskReply task(const pb::TaskRequest& r) = 0;
  // Calls on_message for every message of the model stream, in order.
  virtual void pull(const pb::PullRequest& r,
                    const std::function<void(const pb::TensorStream&)>& on_message) = 0;
  // Sends every message next() yields (false: no more), then returns the server's reply.
  virtual pb::PushReply push(const std::function<bool(pb::TensorStream&)>& next) = 0;
  // One secure-aggregation step; throws with the server's reason when refused.
  virtual pb::SecAggReply secagg(const pb::SecAggRequest& r) = 0;
};

// The server's handling of the two streams, shared by the gRPC service and the in-process
// transport. Each throws pollen::Error on a bad stream.
void serve_pull(Coordinator& c, const pb::PullRequest& r, const std::string& peer_id,
                const std::function<void(const pb::TensorStream&)>& write);
pb::PushReply serve_push(Coordinator& c, const std::string& peer_id,
                         const std::function<bool(pb::TensorStream&)>& read);

// A round no retry can make succeed: this client's update cannot be sent as the federation is
// configured (a secure aggregation ring too small for its tokens). The client stops, naming it,
// rather than train the round again and again.
class RoundCannotSucceed : public Error {
 public:
  using Error::Error;
};

// A call to a server that is connected but did not answer in time (its lock held while it
// aggregates and checkpoints a large model), or that has no room for the call now (its threads,
// or this client's open calls, at their limit): worth waiting for, unlike a server that cannot
// be reached or that refuses.
class ServerBusy : public Error {
 public:
  using Error::Error;
};

// Waits out a busy server, but not forever: a server busy for longer than limit_s in a row (a
// server hung with its connection open) ends the client with an Error saying how long it waited.
class BusyServerWait {
 public:
  // call_timeout_s: how long a call waits before it finds the server busy (the streak begins
  // that long before the first ServerBusy).
  BusyServerWait(std::string client_id, double limit_s, double call_timeout_s)
      : client_id_(std::move(client_id)), limit_s_(limit_s), call_timeout_s_(call_timeout_s) {}
  // After a call that threw ServerBusy: logs that the client asks again (after a second), or
  // throws past limit_s.
  void busy(const ServerBusy& e, const char* then);
  // After a call the server answered.
  void answered() { busy_since_.reset(); }

 private:
  std::string client_id_;
  double limit_s_, call_timeout_s_;
  std::optional<std::chrono::steady_clock::time_point> busy_since_;
};

// Calls the coordinator directly (simulation), through the same functions as the gRPC service.
class LocalTransport : public Transport {
 public:
  explicit LocalTransport(Coordinator& c) : c_(c) {}
  pb::JoinReply join(const pb::JoinRequest& r) override { return c_.join(r, ""); }
  pb::TaskReply task(const pb::TaskRequest& r) override { return c_.task(r, ""); }
  void pull(const pb::PullRequest& r,
            const std::function<void(const pb::TensorStream&)>& on_message) override;
  pb::PushReply push(const std::function<bool(pb::TensorStream&)>& next) override;
  pb::SecAggReply secagg(const pb::SecAggRequest& r) override;

 private:
  Coordinator& c_;
};

// The inner loop of a silo: H steps of AdamW on its own data (the gradient of each step is that
// of the mean loss over every scored token of its micro-batches, as in `pollen train`). With a
// communicator of several ranks (a silo run under mpirun, fed/silo.h) each rank reads its part
// of every global micro-batch and the gradients are summed over ranks as `pollen train` sums
// them (ZeRO-1 with parallel.zero = 1): train, evaluate and load_checkpoint are then collectives
// that every rank calls, and every rank ends a step with the same weights.
class LocalTrainer : public RoundTrainer {
 public:
  // comm: the silo's ranks; null: this process alone.
  explicit LocalTrainer(const ClientConfig& config, dist::Communicator* comm = nullptr);
  // The result's tokens: scored tokens trained on (by every rank); its loss the mean over them.
  Result train(int64_t steps) override;
  // Mean loss of the current weights over eval_batches validation batches (or none when the
  // data has no validation split); *tokens gets how many were scored.
  double evaluate(int64_t* tokens) override;
  // The exchanged tensors: the whole model, its f32 weights (with bf16 compute, AdamW's master
  // weights, not the bf16 copies the model computes with).
  ParamSpecs exchanged_specs() const override { return param_specs(model_); }
  Weights exchanged_weights() const override;  // host copies
  void set_exchanged_weights(const Weights& w) override;
  // The f32 weights where they live, in named_parameters() order: the parameters, or with bf16
  // compute the master weights; weights_changed() after writing them rewrites the bf16 copies.
  std::vector<Tensor> weights() const;
  void weights_changed();
  model::Llama& model() { return model_; }
  dist::Communicator& communicator() { return *comm_; }
  // [dp_sgd]: the silo's DP-SGD, its accountant over every local step so far; null without.
  const optim::DpSgd* dp_sgd() const { return dp_ ? &*dp_ : nullptr; }
  const std::string& manifest_hash() const override { return manifest_hash_; }
  int64_t steps_taken() const { return step_; }
  // The state a client keeps across rounds and restarts (fed/client_state.h): the inner
  // AdamW's whole moments (with ZeRO-1 as gathered at the end of the last train(), on rank 0,
  // when the client keeps a state folder), and the loader, whose position every rank shares.
  train::OptimizerMoments optimizer_moments();
  // Weights and inner optimizer state from a checkpoint written with optimizer_moments().
  void load_checkpoint(const std::filesystem::path& dir);
  data::Loader& train_loader() { return *train_; }
  void set_steps_taken(int64_t steps) { step_ = steps; }
  // POLLEN_FAULT_INJECT: this rank dies or hangs before a local step (counted over rounds).
  void set_fault_injection(const train::FaultInjection& f) { fault_ = f; }
  // Subtracted from the weights after every local step of the next train() calls (drift
  // correction, fed/drift_correction.h); empty: nothing.
  void set_step_drift(Weights drift);
  // Whether the next train() calls share their second moments (strategy.second_moments): with
  // ZeRO-1 every rank then adds its blocks' row and column sums into rank 0's factored form
  // after training, so that no rank gathers the whole moments for it.
  void share_second_moments(bool on) { share_moments_ = on; }
  // The inner AdamW's second moments after the last train(), factored (fed/second_moments.h);
  // rank 0 of a silo of several ranks.
  std::vector<float> factored_second_moments();
  // Replaces the inner AdamW's second moments by the federation's; every rank, before the round.
  void set_second_moments(const std::vector<float>& factored);
  // The tensors whose first moments the next train() calls share (strategy.first_moments;
  // none: empty): with ZeRO-1 rank 0 then gathers those tensors' moments alone after training.
  void share_first_moments(ParamSpecs moments) { first_moment_specs_ = std::move(moments); }
  // The inner AdamW's first moments of the `moments` tensors (fed/first_moments.h) after the
  // last train(), as AdamW's estimate m / (1 - beta1^t); rank 0 of a silo of several ranks, of
  // the tensors shared then.
  Weights first_moments(const ParamSpecs& moments) const;
  // Replaces those first moments by the federation's estimate, stored in this AdamW's scale
  // (a client that has not stepped yet keeps its zeros); every rank, before the round.
  void set_first_moments(const ParamSpecs& moments, const Weights& estimate);

 private:
  Result train_steps(int64_t steps);
  double evaluate_share(int64_t* tokens);
  void apply_step_drift();
  // One optimizer step at the round's step s (the schedule's lr, train.round_warmup_steps' ramp)
  // on the accumulated gradients, which it zeroes, then the step's drift correction.
  void step_with_lr(const optim::Schedule& sched, int64_t s);
  // [dp_sgd]: opens the silo's DP-SGD with the accountant client.state_dir holds; one local
  // step's private gradient (with FedProx's term when `anchor` is given), accounted on disk.
  void open_dp_sgd();
  train::AccumulatedLoss private_step(const Weights& anchor);
  // ZeRO-1, every rank after the round: rank 0 gathers what it writes or sends (the whole state
  // with a state folder, else the shared first moments) and the factored second moments.
  void gather_after_round();
  std::vector<float> sharded_factored_second_moments();
  double second_moment_bias() const;  // 1 - beta2^t of the inner AdamW
  double first_moment_bias() const;   // 1 - beta1^t of the inner AdamW
  // The index of each moment spec's tensor among the parameters (and AdamW's slots).
  std::vector<size_t> moment_slots(const ParamSpecs& moments) const;

  ClientConfig config_;
  dist::SingleProcess alone_;
  dist::Communicator* comm_;
  Device device_;  // train.device: where the model, its gradients and AdamW's state live
  model::Llama model_;
  std::vector<ag::Var> params_;                 // in named_parameters() order
  std::unique_ptr<dist::GradReducer> reducer_;  // several ranks
  std::unique_ptr<dist::ZeroAdamW> zero_;       // several ranks and parallel.zero = 1
  std::optional<optim::AdamW> opt_;             // otherwise
  // ZeRO-1, rank 0: the moments after the last train() (see gather_after_round) and the
  // factored second moments
  train::OptimizerMoments gathered_;
  std::vector<float> gathered_factored_;
  bool share_moments_ = false;     // strategy.second_moments this round
  ParamSpecs first_moment_specs_;  // strategy.first_moments this round
  int64_t micro_steps_ = 1;        // per step and rank
  std::unique_ptr<data::Loader> train_;
  train::Validation validation_;  // the same batches at every evaluation; none: no loader
  std::string manifest_hash_;
  int64_t step_ = 0;
  std::optional<optim::DpSgd> dp_;  // [dp_sgd]
  train::FaultInjection fault_;
  Weights step_drift_;
};

class Client {
 public:
  // Resumes the state saved under config.state_dir, when there is one. comm: the silo's ranks
  // when it runs as several (this is rank 0, the only one that talks to the server; the others
  // follow it, fed/silo.h); null: this process alone. With config.post a LoRA silo.
  Client(ClientConfig config, Transport& transport, dist::Communicator* comm = nullptr);
  // Joins; throws with the server's reason when refused.
  void join();
  // One task request and what it asks: returns the task's kind.
  pb::TaskKind poll_once();
  // Polls until the server says the run is over; joins again when a restarted server has
  // forgotten it.
  void run();
  const std::string& id() const { return config_.id; }
  // Pre-training's trainer (throws with [post]), the LoRA silo (null without [post]), and
  // whichever this client trains with.
  LocalTrainer& trainer();
  LoraSilo* lora_silo() { return silo_.get(); }
  RoundTrainer& round_trainer() { return *trainer_; }
  uint64_t bytes_sent() const { return bytes_sent_; }
  uint64_t bytes_received() const { return bytes_received_; }
  int64_t last_round() const { return last_round_; }           // the last round trained (0: none)
  const LocalDp* local_dp() const { return local_dp_.get(); }  // null without [local_dp]

 private:
  void handle(const pb::TaskReply& task);
  void train_round(const pb::TaskReply& task);
  // The round's model, pulled: a delta against the model held, the chain of deltas when the client
  // missed rounds (one pull each), or the whole model.
  const Weights& pull_model(const pb::TaskReply& task, const CompressOptions& model_codec);
  // The clients' averaged first moments of the `moments` tensors (strategy.first_moments),
  // pulled after the round's model.
  Weights pull_first_moments(const pb::TaskReply& task, const CompressOptions& model_codec,
                             const ParamSpecs& moments);
  // Secure aggregation (client_secagg.cpp): the key, share and unmask steps, and the masked push
  // that replaces the plain one.
  void secagg_step(const pb::TaskReply& task);
  pb::SecAggReply secagg_call(int64_t round, const std::function<void(pb::SecAggRequest&)>& fill);
  EncodedSet masked_update(int64_t round, const Weights& delta, int64_t tokens);
  // Secure aggregation: a masked update whose push was lost (the server still waits for it) is
  // sent again, the same info and bytes; never trained and masked anew, since the same masks on
  // another update would give away the difference of the two.
  void push_masked_again(const pb::TaskReply& task);
  // Streams the update's info, the set's header and its bytes in chunks.
  pb::PushReply push_update(const pb::UpdateInfo& info, const EncodedSet& set);
  // Whether this client holds secure aggregation's secrets of `round` (it advertised keys for
  // it in this process: a restarted client holds none).
  bool holds_secagg_session(int64_t round) const;
  // A secure aggregation task this client cannot take, holding no secrets of its round: it tells
  // the server that it drops out of the phase (training nothing) and waits for the next round.
  void drop_out(const pb::TaskReply& task);
  // Records, in memory and under client.state_dir, that this client reveals its shares of
  // `round` (before they leave: a lost reply may still have delivered them).
  void note_revealed(int64_t round);
  // Distributed DP: a server's repeatable noise stops the client unless
  // client.allow_repeatable_noise takes it.
  void refuse_repeatable_noise(int64_t round, const secagg::DistributedNoise& noise) const;
  // Distributed DP: `delta` clipped to noise.clip (*clipped: whether it was) and scaled by the
  // client's weight.
  Weights clip_and_weigh(int64_t round, const Weights& delta, int64_t tokens,
                         const secagg::DistributedNoise& noise, bool* clipped) const;
  void save_state();
  // [local_dp]'s account in client.state_dir/local_dp.json, written as each update is released
  // and never rolled back (a rewind removes the saved states of the rounds it goes back over,
  // whose accounts hold releases that were made); taken on start when it counts more than the
  // state.
  void record_local_dp() const;
  void take_local_dp_record();
  // A task of a round this client trained already: its update was lost (the server resumed from
  // an earlier checkpoint, or the round is retried); or the task after an attempt that took
  // local steps and failed before its state was saved. With client.state_dir the client goes
  // back to its state before that round, so that no local step counts twice and no data is
  // skipped; otherwise (or in a silo of several ranks) it goes on from where it is, and says so.
  // A round this client revealed secure aggregation shares for (or an earlier one) is not gone
  // back from: the client trains on from where it is, so that it never sends an input again that
  // the server may already have unmasked in a sum.
  void rewind(int64_t round);

  // Whether the silo runs as several ranks (comm_ then holds them).
  bool several_ranks() const { return comm_ != nullptr && comm_->world() > 1; }

  ClientConfig config_;
  Transport& transport_;
  dist::Communicator* comm_;             // the silo's ranks; null: this process alone
  std::unique_ptr<LocalTrainer> local_;  // pre-training
  std::unique_ptr<LoraSilo> silo_;       // post-training ([post])
  RoundTrainer* trainer_ = nullptr;      // the one of them this client has
  ParamSpecs specs_;
  ErrorFeedback feedback_;
  std::unique_ptr<HeldModel> held_;           // the last round's model (fed/model_view.h)
  std::vector<float> pulled_second_moments_;  // the last pull's (strategy.second_moments)
  DriftCorrection drift_;                     // pre-training's train.drift_correction
  std::unique_ptr<LocalDp> local_dp_;         // [local_dp]: clip and noise before anything leaves
  uint64_t bytes_sent_ = 0, bytes_received_ = 0;
  std::unique_ptr<secagg::ClientSession> secagg_;  // the current round's
  // The masked update of secagg_'s round, once built: kept until the client reveals its shares,
  // so that a lost push is sent again as it was (push_masked_again).
  struct MaskedPush {
    pb::UpdateInfo info;
    EncodedSet set;
  };
  std::optional<MaskedPush> masked_push_;
  // The last round whose secure aggregation shares this client revealed (0: none), kept beside
  // its state: a retry of it, or of an earlier round, is trained on from where the client is
  // (rewind), never again from before it.
  int64_t revealed_round_ = 0;
  int64_t last_round_ = 0;
  // A round attempt took local steps that no saved state holds (it failed before the push):
  // the next round attempt rewinds first.
  bool unsaved_steps_ = false;
  // A fresh client's state before round 1 is saved once the server has accepted it: a refused
  // one (another model, id or run) leaves nothing that its corrected config would then find.
  bool initial_state_unsaved_ = false;
  // Takes the accepted run's id into the state folder, refusing one of another run.
  void keep_run_id(const std::string& run_id);
  // The push sent without the server's answer yet (fed/client_state.h): set before the state
  // saved before the push, so that a client killed or disconnected before the answer settles it
  // from the next task's update_round.
  std::optional<UnsettledPush> unsettled_push_;
  void settle_push(const pb::TaskReply& task);
  // The first round this process began to push an update for (0: none yet), and how many.
  int64_t first_pushed_round_ = 0;
  int64_t pushes_ = 0;
  void note_push(int64_t round);
  // At TASK_DONE: a client that pushed updates of which the server aggregated none of the silo's
  // (update_round 0) fails, naming why (they came after their rounds closed, or were refused).
  void check_some_update_counted(const pb::TaskReply& done) const;
};

}  // namespace pollen::fed
