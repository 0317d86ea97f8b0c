#pragma once
// A silo run as several ranks: `mpirun -np N pollen fed client` (or `pollen launch --nproc N --
// fed client ...`, docs/parallel.md). Rank 0 alone runs the Client and speaks to the server; for
// every round it trains it sends the other ranks an order and the global model (a post-training
// silo: the global adapters), and then every rank evaluates and trains the round together
// (LocalTrainer's collectives, or the post-training objective's split: each rank its part of
// every step, gradients summed over ranks). Only rank 0 computes and pushes the pseudo-gradient
// and writes the client's state. The other ranks follow orders until rank 0 says the run is
// over.
#include <cstdint>
#include <string>

#include "dist/communicator.h"
#include "fed/config.h"
#include "fed/strategy.h"
#include "model/llama.h"
#include "train/trainer.h"

namespace pollen::fed {

struct RoundOrder {
  int64_t round = 0;  // 0: the run is over
  int64_t local_steps = 0;
  bool evaluate = false;        // score the global model on the validation split first
  bool second_moments = false;  // the round shares the inner AdamW's second moments
  // The round shares the inner AdamW's first moments of these tensors (fed/first_moments.h):
  // none, output or token_rows.
  std::string first_moments = "none";
};

// Rank 0: sends the order and, for a round, `model`'s weights (the global model), the round's
// step drift (fed/drift_correction.h; empty: none), the federation's factored second moments
// to start from (fed/second_moments.h; empty: none) and its first moments of the order's tensors
// (empty: none) to the others.
void send_order(dist::Communicator& comm, const RoundOrder& order, model::Llama* model,
                const Weights& step_drift = {}, const std::vector<float>& second_moments = {},
                const Weights& first_moments = {});

// A post-training silo ([post]): rank 0 sends the order (no drift, no shared moments) and the
// round's global adapters, `global` (B, then the objective's own parameters), to the others.
void send_post_order(dist::Communicator& comm, const RoundOrder& order, const Weights& global);

// Every rank but 0: resumes the client's state under config.state_dir as rank 0 does, then
// trains the rounds rank 0 orders until it says the run is over, a post-training silo's too.
// While rank 0 talks to the server the others wait for its next order with no watchdog (a round
// may be minutes away); every collective of a round is watched (parallel.timeout_s).
void follow_orders(const ClientConfig& config, dist::Communicator& comm,
                   const train::FaultInjection& fault);

}  // namespace pollen::fed
