#include "fed/silo.h"

#include <algorithm>

#include "base/log.h"
#include "fed/client.h"
#include "fed/client_state.h"
#include "fed/first_moments.h"
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

// The federation's factored second moments from rank 0 into `moments` (sized on the others).
void broadcast_moments(dist::Communicator& comm, std::vector<float>& moments) {
  comm.wait(comm.start_broadcast(moments.data(), static_cast<int64_t>(moments.size()), 0,
                                 "the shared second moments"));
}

}  // namespace

void send_order(dist::Communicator& comm, const RoundOrder& order, model::Llama* model,
                const Weights& step_drift, const std::vector<float>& second_moments,
                const Weights& first_moments) {
  int64_t words[8] = {order.round,
                      order.local_steps,
                      order.evaluate ? 1 : 0,
                      step_drift.empty() ? 0 : 1,
                      order.second_moments ? 1 : 0,
                      static_cast<int64_t>(second_moments.size()),
                      first_moments_code(order.first_moments),
                      first_moments.empty() ? 0 : 1};
  comm.broadcast(words, 0, "rank 0's order");
  if (order.round == 0) return;
  broadcast_weights(comm, *model);
  Weights drift = step_drift;  // shares the tensors: rank 0 only sends
  if (!drift.empty()) broadcast_tensors(comm, drift, "the step drift");
  std::vector<float> moments = second_moments;
  if (!moments.empty()) broadcast_moments(comm, moments);
  Weights first = first_moments;  // likewise
  if (!first.empty()) broadcast_tensors(comm, first, "the shared first moments");
}

void follow_orders(const ClientConfig& config, dist::Communicator& comm,
                   const train::FaultInjection& fault) {
  LocalTrainer trainer(config, &comm);
  trainer.set_fault_injection(fault);
  const ParamSpecs specs = param_specs(trainer.model());
  ErrorFeedback feedback;  // rank 0's alone; loaded there only
  DriftCorrection drift;   // likewise
  Weights pulled;          // likewise
  if (!config.state_dir.empty()) {
    load_client_state(config.state_dir, config.id, trainer, specs, feedback, drift, &pulled,
                      nullptr);
  }
  for (;;) {
    int64_t words[8] = {0, 0, 0, 0, 0, 0, 0, 0};
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
