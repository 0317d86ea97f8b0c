#pragma once
// One silo: holds its data, its model and its inner AdamW state across rounds (and, with a state
// folder, across restarts); for each round it pulls the global model (decoded as the server
// encoded it), trains H local steps, and pushes its pseudo-gradient (the decoded global model
// minus the local weights), compressed with error feedback. The same Client runs over gRPC
// (`pollen fed client`) and over the in-process transport (`pollen fed simulate`), which passes
// the same protobuf messages through the same checks.
#include <functional>
#include <memory>
#include <string>

#include "data/loader.h"
#include "fed/config.h"
#include "fed/coordinator.h"
#include "fed/secagg/session.h"
#include "fed/wire.h"
#include "model/llama.h"
#include "optim/adamw.h"

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
// of the mean loss over every scored token of its micro-batches, as in `pollen train`).
class LocalTrainer {
 public:
  explicit LocalTrainer(const ClientConfig& config);
  struct Result {
    int64_t tokens = 0;  // scored tokens trained on
    double loss = 0;     // mean over them
    double seconds = 0;
  };
  Result train(int64_t steps);
  // Mean loss of the current weights over eval_batches validation batches (or none when the
  // data has no validation split); *tokens gets how many were scored.
  double evaluate(int64_t* tokens);
  model::Llama& model() { return model_; }
  const std::string& manifest_hash() const { return manifest_hash_; }
  int64_t steps_taken() const { return step_; }
  // The state a client keeps across rounds and restarts (fed/client_state.h).
  optim::AdamW& optimizer() { return opt_; }
  data::Loader& train_loader() { return *train_; }
  void set_steps_taken(int64_t steps) { step_ = steps; }

 private:
  ClientConfig config_;
  model::Llama model_;
  optim::AdamW opt_;
  std::unique_ptr<data::Loader> train_, validation_;
  std::string manifest_hash_;
  int64_t step_ = 0;
};

class Client {
 public:
  // Resumes the state saved under config.state_dir, when there is one.
  Client(ClientConfig config, Transport& transport);
  // Joins; throws with the server's reason when refused.
  void join();
  // One task request and what it asks: returns the task's kind.
  pb::TaskKind poll_once();
  // Polls until the server says the run is over; joins again when a restarted server has
  // forgotten it.
  void run();
  const std::string& id() const { return config_.id; }
  LocalTrainer& trainer() { return trainer_; }
  uint64_t bytes_sent() const { return bytes_sent_; }
  uint64_t bytes_received() const { return bytes_received_; }
  int64_t last_round() const { return last_round_; }  // the last round trained (0: none)

 private:
  void handle(const pb::TaskReply& task);
  void train_round(const pb::TaskReply& task);
  // Secure aggregation (client_secagg.cpp): the key, share and unmask steps, and the masked push
  // that replaces the plain one.
  void secagg_step(const pb::TaskReply& task);
  pb::SecAggReply secagg_call(int64_t round, const std::function<void(pb::SecAggRequest&)>& fill);
  EncodedSet masked_update(int64_t round, const Weights& delta, int64_t tokens);
  void save_state();

  ClientConfig config_;
  Transport& transport_;
  LocalTrainer trainer_;
  ParamSpecs specs_;
  ErrorFeedback feedback_;
  std::unique_ptr<LocalDp> local_dp_;  // [local_dp]: clip and noise before anything leaves
  uint64_t bytes_sent_ = 0, bytes_received_ = 0;
  std::unique_ptr<secagg::ClientSession> secagg_;  // the current round's
  int64_t last_round_ = 0;
};

}  // namespace pollen::fed
