#pragma once
// What a federated client trains each round, behind one interface, so that one Client (and one
// server, the Coordinator) runs both kinds of federation: pre-training's LocalTrainer, whose
// exchanged state is the whole model, and post-training's LoraSilo (fed/post_lora.h), whose
// exchanged state is its LoRA adapters' B. The client pulls the exchanged tensors, sets them,
// trains, and pushes global minus local.
#include <cstdint>
#include <map>
#include <string>

#include "base/error.h"
#include "base/log.h"
#include "dist/communicator.h"
#include "fed/strategy.h"
#include "fed/wire.h"

namespace pollen::fed {

// A failure that every rank of a silo meets at the same point (a step's loss or token count,
// which the ranks agree on): the round fails on every rank and the silo waits for the next one.
class RoundFailure : public Error {
 public:
  using Error::Error;
};

// Runs a round's collective work on one rank of a silo. In a silo of several ranks any error but
// a RoundFailure or a dead peer is this rank's alone (a full disk, a verifier's failure) and
// leaves the others waiting in a collective it will never start: it ends the silo's job (exit
// code 1), as an error on one rank of `pollen train` does. `comm`: null for a silo of one.
template <typename Work>
auto on_every_rank_or_none(dist::Communicator* comm, const std::string& silo, Work&& work) {
  try {
    return work();
  } catch (const dist::PeerFailure&) {
    throw;
  } catch (const RoundFailure&) {
    throw;
  } catch (const Error& e) {
    if (comm != nullptr && comm->world() > 1) {
      log::error("client '", silo, "' rank ", comm->rank(), ": ", e.what(),
                 "; ending the silo's job");
      comm->abort_job(1);
    }
    throw;
  }
}

class RoundTrainer {
 public:
  virtual ~RoundTrainer() = default;
  struct Result {
    int64_t tokens = 0;  // the aggregation weight: tokens trained on this round
    double loss = 0;     // mean over the round
    double seconds = 0;
    // The token ids at the scored positions (inputs) and what they predict (targets), over every
    // rank; each sums to `tokens` (row weighting, fed/strategy.h). Empty where no row of the
    // exchanged tensors belongs to a token (LoRA adapters).
    TokenCounts input_counts, target_counts;
    // The objective's own scalars, each the mean over the round's steps (a post-training
    // objective's: GRPO's "reward", DPO's "rewards/margins", ...); empty in pre-training.
    std::map<std::string, double> metrics;
  };
  // The tensors the federation exchanges, in wire order, and their current local values
  // (float32 copies); set_exchanged_weights copies the round's global values in.
  virtual ParamSpecs exchanged_specs() const = 0;
  virtual Weights exchanged_weights() const = 0;
  virtual void set_exchanged_weights(const Weights& w) = 0;
  // `steps` optimizer steps on the silo's own data.
  virtual Result train(int64_t steps) = 0;
  // The held-out loss of the current weights; *tokens gets how many were scored (0: none held
  // out, and the loss means nothing).
  virtual double evaluate(int64_t* tokens) = 0;
  // The version of the silo's data, recorded in the lineage (at most 128 characters).
  virtual const std::string& manifest_hash() const = 0;
};

}  // namespace pollen::fed
