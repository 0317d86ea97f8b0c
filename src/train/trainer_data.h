#pragma once
// The data of a pre-training run: the train loader, whose step is one global batch of
// train.batch_tokens read in micro-steps of micro_batch rows on every rank (the same batch at any
// world size), and the validation batches it evaluates on (the same at every evaluation; none
// when a rank cannot read them), with the mean validation loss over them.
#include <cstdint>
#include <memory>

#include "data/loader.h"
#include "dist/communicator.h"
#include "model/llama.h"
#include "train/config.h"

namespace pollen::train {

struct Validation {
  std::unique_ptr<data::Loader> loader;  // null: no evaluation
  data::LoaderState start;
  // Batches an evaluation scores: eval.batches, or the whole batches the split holds when that is
  // fewer (more would score windows twice, from the loader's next epoch).
  int64_t batches = 0;
};

struct TrainData {
  int64_t accum = 0;  // micro-steps per step
  data::Loader loader;
  Validation validation;
};

// Opens this rank's loaders; with several ranks, a collective (whether every rank has the
// validation data).
TrainData open_train_data(const TrainConfig& cfg, dist::Communicator& comm);

// Mean validation loss over `batches` batches (NaN when none scored a token); with several ranks
// each evaluates every world-th batch and the sums are reduced, so the result is the single
// process's. `scored`, when given, receives the tokens scored.
double validation_loss(const model::Llama& model, Validation& validation, int64_t batches,
                       dist::Communicator* comm, int64_t* scored = nullptr);

}  // namespace pollen::train
