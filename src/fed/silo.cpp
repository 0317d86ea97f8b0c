#include "fed/silo.h"

#include "base/log.h"
#include "fed/client.h"
#include "fed/client_state.h"

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

// The step drift from rank 0 into `drift` (sized as the model's parameters on the other ranks).
void broadcast_drift(dist::Communicator& comm, Weights& drift) {
  std::vector<dist::Request> requests;
  for (Tensor& d : drift) {
    requests.push_back(comm.start_broadcast(d.data<float>(), d.numel(), 0, "the step drift"));
  }
  for (const auto r : requests) comm.wait(r);
}

}  // namespace

void send_order(dist::Communicator& comm, const RoundOrder& order, model::Llama* model,
                const Weights& step_drift) {
  int64_t words[4] = {order.round, order.local_steps, order.evaluate ? 1 : 0,
                      step_drift.empty() ? 0 : 1};
  comm.broadcast(words, 0, "rank 0's order");
  if (order.round == 0) return;
  broadcast_weights(comm, *model);
  Weights drift = step_drift;  // shares the tensors: rank 0 only sends
  if (!drift.empty()) broadcast_drift(comm, drift);
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
    load_client_state(config.state_dir, config.id, trainer, specs, feedback, drift, &pulled);
  }
  for (;;) {
    int64_t words[4] = {0, 0, 0, 0};
    comm.wait_for_broadcast(words, 0, "rank 0's order");
    if (words[0] == 0) return;
    broadcast_weights(comm, trainer.model());
    Weights step_drift;
    if (words[3] != 0) {
      for (const auto& spec : specs) step_drift.push_back(Tensor::empty(spec.shape, DType::f32));
      broadcast_drift(comm, step_drift);
    }
    trainer.set_step_drift(std::move(step_drift));
    try {
      if (words[2] != 0) {
        int64_t tokens = 0;
        trainer.evaluate(&tokens);
      }
      trainer.train(words[1]);
    } catch (const dist::PeerFailure&) {
      throw;
    } catch (const Error& e) {
      // The same failure as rank 0's (the loss and counts are the job's): wait for the next.
      log::warn("fed client '", config.id, "' rank ", comm.rank(), ": round ", words[0],
                " failed: ", e.what());
    }
  }
}

}  // namespace pollen::fed
