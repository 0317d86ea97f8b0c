#pragma once
// DP-SGD's gradient of one pre-training step (`[privacy]`, optim/dp_sgd.h): the step's Poisson
// sample of the training data's sequences, each sequence's gradient of its mean token loss
// computed on its own and clipped, their noised sum over the expected sample size left in the
// parameters' gradients for the optimizer. Several ranks draw rank 0's sample, each takes every
// world-th sequence of it, rank 0 adds the noise to its share and the data-parallel reducer sums
// the shares (all-reduced, or reduce-scattered for ZeRO-1): the same release as one process's,
// to float rounding.
#include <cstdint>
#include <functional>

#include "data/loader.h"
#include "dist/grad_reducer.h"
#include "model/llama.h"
#include "optim/dp_sgd.h"
#include "train/trainer.h"

namespace pollen::train {

struct PrivateGradient {
  AccumulatedLoss loss;      // over the sampled sequences' scored tokens (NaN when none scored)
  int64_t rows = 0;          // sequences sampled
  int64_t clipped = 0;       // of them, those whose gradient norm was above the clip
  double reduce_wait_s = 0;  // several ranks: seconds waiting for the shares' reduction
};

struct ClippedRows {
  double loss_sum = 0;  // summed over the rows' scored tokens
  int64_t scored = 0;   // scored tokens
};

// How each sequence's gradient is taken and clipped:
// - batched: `chunk_rows` rows at a time through one forward and one backward pass that clip
//   each row's gradient (autograd/per_sample.h); extra FLOPs for the norms, which grow with seq;
// - one_by_one: a forward and a backward per row, whose gradient is then clipped and added; three
//   extra passes over every parameter's gradient per row, and narrow GEMMs;
// - automatic: batched when the estimate says it costs less (batched_clipping_is_cheaper), else
//   one_by_one.
enum class ClipMethod { automatic, batched, one_by_one };

// True when, by FLOPs, a row's batched clipping costs less than one row's pass on its own.
bool batched_clipping_is_cheaper(const model::LlamaConfig& config, int64_t seq);
// The way `automatic` takes for this model and seq.
ClipMethod automatic_clip_method(const model::LlamaConfig& config, int64_t seq);

// Adds the gradient of each row's mean token loss, clipped, to dp's sum (after dp.begin()):
// rows (R, seq), each one sequence; a row that scores no token adds nothing.
ClippedRows add_clipped_rows(const model::Llama& model, const model::Batch& rows, optim::DpSgd& dp,
                             int64_t chunk_rows, ClipMethod method = ClipMethod::automatic);

// Step `step` (1-based) of DP-SGD over `loader`'s windows (Loader::windows_total()); with the
// `reducer` of several ranks a collective, whose release the reducer leaves as it leaves a
// plain step's gradients (every rank's whole, or each rank's block for ZeRO-1). `chunk_rows`: as
// add_clipped_rows's. `before_reduction`, when given, runs once this rank's share (over B) is in
// the gradients and before the ranks' shares are summed: a data-free term each rank adds its
// share of (FedProx's) is summed with them.
PrivateGradient private_gradients(const model::Llama& model, const data::Loader& loader,
                                  optim::DpSgd& dp, int64_t step, int64_t chunk_rows,
                                  dist::GradReducer* reducer = nullptr,
                                  const std::function<void()>& before_reduction = {});

}  // namespace pollen::train
