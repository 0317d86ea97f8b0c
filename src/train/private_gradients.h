#pragma once
// DP-SGD's gradient of one pre-training step (`[privacy]`, optim/dp_sgd.h): the step's Poisson
// sample of the training data's sequences, each sequence's gradient of its mean token loss
// computed on its own and clipped, their noised sum over the expected sample size left in the
// parameters' gradients for the optimizer. Several ranks draw rank 0's sample, each takes every
// world-th sequence of it, rank 0 adds the noise to its share and the shares are summed: the same
// release as one process's, to float rounding.
#include <cstdint>

#include "data/loader.h"
#include "dist/communicator.h"
#include "model/llama.h"
#include "optim/dp_sgd.h"
#include "train/trainer.h"

namespace pollen::train {

struct PrivateGradient {
  AccumulatedLoss loss;      // over the sampled sequences' scored tokens (NaN when none scored)
  int64_t rows = 0;          // sequences sampled
  int64_t clipped = 0;       // of them, those whose gradient norm was above the clip
  double reduce_wait_s = 0;  // several ranks: seconds waiting for the clipped sums' reduction
};

// Step `step` (1-based) of DP-SGD over `loader`'s windows (Loader::windows_total()); with
// `comm` of several ranks, a collective whose result every rank holds.
PrivateGradient private_gradients(const model::Llama& model, const data::Loader& loader,
                                  optim::DpSgd& dp, int64_t step,
                                  dist::Communicator* comm = nullptr);

}  // namespace pollen::train
