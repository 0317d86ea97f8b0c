#include "fed/silo.h"

#include <algorithm>

#include "base/log.h"
#include "fed/client.h"
#include "fed/client_state.h"
#include "fed/first_moments.h"
#include "fed/post_lora.h"
#include "fed/second_moments.h"

namespace pollen::fed {
namespace {

// The weights of `model` from rank 0 into every rank's model.
void broadcast_weights(dist::Communicator& comm, model::Llama& model) {
  std::vector<dist::Request> requests;
  for (const auto& [name, p] : model.named_parameters()) {
    const Tensor& w = p.value();
    POLLEN_ASSERT(w.dtype() == DType::f32 && w.is_contiguous());
    requests.push_back(comm.start_broadcast(w.data<float>(), w.numel(), 0, "the global model"));
  }
  for (const auto r : requests) comm.wait(r);
}

// Tensors from rank 0 into `tensors` (sized as rank 0's on the others).
void broadcast_tensors(dist::Communicator& comm, Weights& tensors, const char* what) {
  std::vector<dist::Request> requests;
  for (Tensor& t : tensors)
    requests.push_back(comm.start_broadcast(t.data<float>(), t.numel(), 0, what));
  for (const auto r : requests) comm.wait(r);
}

// RoundOrder::first_moments as an order's word: its index among first_moments_names().
int64_t first_moments_code(const std::string& which) {
  const auto& names = first_moments_names();
  const auto it = std::find(names.begin(), names.end(), which);
  POLLEN_CHECK(it != names.end(), "first moments of '", which, "': not one of the names");
  return it - names.begin();
}

// An order's words: round (0: the run is over), local steps, evaluate, a step drift follows,
// second moments shared, the second moments' count that follows, the first moments' code (an
// index into first_moments_names()), first moments follow.
constexpr size_t kOrderWords = 8;

// Rank 0's order to the others; what it says follows it.
void broadcast_order(dist::Communicator& comm, const RoundOrder& order, bool step_drift,
                     int64_t second_moments, bool first_moments) {
  int64_t words[kOrderWords] = {order.round,
                                order.local_steps,
                                order.evaluate ? 1 : 0,
                                step_drift ? 1 : 0,
                                order.second_moments ? 1 : 0,
                                second_moments,
                                first_moments_code(order.first_moments),
                                first_moments ? 1 : 0};
  comm.broadcast(words, 0, "rank 0's order");
}

// A post-training silo's ranks but 0 (follow_orders): the silo from the client's [post], split
// across the ranks; each round the global adapters from rank 0, then evaluation and the local
// steps.
void follow_post_orders(const ClientConfig& config, dist::Communicator& comm,
                        const train::FaultInjection& fault) {
  std::unique_ptr<LoraSilo> silo = make_lora_silo(config, &comm);
  silo->set_fault_injection(fault);
  if (!config.state_dir.empty()) {
    ErrorFeedback feedback;  // rank 0's alone, as the model it pulled last
    Weights pulled;
    load_client_state(config.state_dir, config.id, *silo, silo->exchanged_specs(), feedback,
                      &pulled, nullptr, nullptr);
  }
  for (;;) {
    int64_t words[kOrderWords] = {};
    comm.wait_for_broadcast(words, 0, "rank 0's order");
    if (words[0] == 0) return;
    Weights global = silo->exchanged_weights();  // shaped as rank 0's
    broadcast_tensors(comm, global, "the global adapters");
    silo->set_exchanged_weights(global);
    try {
      if (words[2] != 0) {
        int64_t tokens = 0;
        silo->evaluate(&tokens);
      }
      silo->train(words[1]);
    } catch (const RoundFailure& e) {
      // The same failure as rank 0's (a non-finite loss is the job's): wait for the next order.
      log::warn("fed client '", config.id, "' rank ", comm.rank(), ": round ", words[0],
                " failed: ", e.what());
    }
  }
}

// The federation's factored second moments from rank 0 into `moments` (sized on the others).
void broadcast_moments(dist::Communicator& comm, std::vector<float>& moments) {
  comm.wait(comm.start_broadcast(moments.data(), static_cast<int64_t>(moments.size()), 0,
                                 "the shared second moments"));
}

}  // namespace

void send_order(dist::Communicator& comm, const RoundOrder& order, model::Llama* model,
                const Weights& step_drift, const std::vector<float>& second_moments,
                const Weights& first_moments) {
  broadcast_order(comm, order, !step_drift.empty(), static_cast<int64_t>(second_moments.size()),
                  !first_moments.empty());
  if (order.round == 0) return;
  broadcast_weights(comm, *model);
  Weights drift = step_drift;  // shares the tensors: rank 0 only sends
  if (!drift.empty()) broadcast_tensors(comm, drift, "the step drift");
  std::vector<float> moments = second_moments;
  if (!moments.empty()) broadcast_moments(comm, moments);
  Weights first = first_moments;  // likewise
  if (!first.empty()) broadcast_tensors(comm, first, "the shared first moments");
}

void send_post_order(dist::Communicator& comm, const RoundOrder& order, const Weights& global) {
  POLLEN_CHECK(!order.second_moments && order.first_moments == "none",
               "a post-training silo shares no optimizer moments");
  broadcast_order(comm, order, false, 0, false);
  Weights adapters = global;  // shares the tensors: rank 0 only sends
  if (order.round != 0) broadcast_tensors(comm, adapters, "the global adapters");
}

void follow_orders(const ClientConfig& config, dist::Communicator& comm,
                   const train::FaultInjection& fault) {
  if (config.post.enabled()) {
    follow_post_orders(config, comm, fault);
    return;
  }
  LocalTrainer trainer(config, &comm);
  trainer.set_fault_injection(fault);
  const ParamSpecs specs = param_specs(trainer.model());
  ErrorFeedback feedback;  // rank 0's alone; loaded there only
  DriftCorrection drift;   // likewise
  Weights pulled;          // likewise
  if (!config.state_dir.empty()) {
    load_client_state(config.state_dir, config.id, trainer, specs, feedback, drift, &pulled,
                      nullptr, nullptr);
  }
  for (;;) {
    int64_t words[kOrderWords] = {};
    comm.wait_for_broadcast(words, 0, "rank 0's order");
    if (words[0] == 0) return;
    broadcast_weights(comm, trainer.model());
    Weights step_drift;
    if (words[3] != 0) {
      for (const auto& spec : specs) step_drift.push_back(Tensor::empty(spec.shape, DType::f32));
      broadcast_tensors(comm, step_drift, "the step drift");
    }
    trainer.set_step_drift(std::move(step_drift));
    trainer.share_second_moments(words[4] != 0);
    if (words[5] > 0) {
      std::vector<float> moments(static_cast<size_t>(words[5]));
      broadcast_moments(comm, moments);  // received before any check, as rank 0 sends them
      POLLEN_CHECK(words[5] == factored_size(specs), "fed client '", config.id, "' rank ",
                   comm.rank(), ": rank 0 sent ", words[5], " second-moment values, expected ",
                   factored_size(specs));
      trainer.set_second_moments(moments);
    }
    const auto& names = first_moments_names();
    POLLEN_CHECK(words[6] >= 0 && words[6] < static_cast<int64_t>(names.size()), "fed client '",
                 config.id, "' rank ", comm.rank(), ": rank 0 sent first-moments code ", words[6]);
    const ParamSpecs first_specs = first_moment_specs(specs, names[static_cast<size_t>(words[6])]);
    trainer.share_first_moments(first_specs);
    if (words[7] != 0) {
      Weights first;
      for (const auto& spec : first_specs) first.push_back(Tensor::empty(spec.shape, DType::f32));
      broadcast_tensors(comm, first, "the shared first moments");
      trainer.set_first_moments(first_specs, first);
    }
    try {
      if (words[2] != 0) {
        int64_t tokens = 0;
        trainer.evaluate(&tokens);
      }
      trainer.train(words[1]);
    } catch (const RoundFailure& e) {
      // The same failure as rank 0's (the loss and counts are the job's): wait for the next.
      log::warn("fed client '", config.id, "' rank ", comm.rank(), ": round ", words[0],
                " failed: ", e.what());
    }
  }
}

}  // namespace pollen::fed
