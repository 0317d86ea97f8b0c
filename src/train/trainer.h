#pragma once
// The pre-training loop behind `pollen train`: gradient accumulation over micro-batches with the
// loss a mean over every scored token of the global batch, AdamW on a schedule, evaluation,
// checkpoints that resume bitwise, metrics (JSONL + TensorBoard), preemption by SIGINT/SIGTERM
// and a stop after too many non-finite losses in a row. The checkpoint format and its helpers:
// train/trainer_checkpoint.h.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "dist/communicator.h"
#include "dist/grad_reducer.h"
#include "model/llama.h"
#include "train/config.h"
#include "train/run_control.h"
#include "train/trainer_checkpoint.h"

namespace pollen::train {

struct TrainOptions {
  bool resume = false;
  bool handle_signals = true;  // SIGINT/SIGTERM: finish the step, checkpoint, stop
  // Tests: behave as if preempted once this many steps have run in this process (-1: never).
  int64_t stop_after = -1;
  bool quiet = false;  // no progress lines (tests)
  // The job's ranks (data parallel); null: this process alone, as one that has no launcher.
  dist::Communicator* comm = nullptr;
  FaultInjection fault;
};

using TrainResult = RunResult;

TrainResult run_training(const TrainConfig& config, const TrainOptions& options);

// Scored targets (>= 0) in a batch.
int64_t count_scored(const model::Batch& batch);

struct AccumulatedLoss {
  double loss = 0;  // mean over every scored token of all micro-batches
  int64_t scored = 0;
};
// Forward and backward of each micro-batch with the loss summed and its gradient scaled by
// 1 / (scored tokens of all micro-batches): the parameters' gradients become those of the mean
// over the whole global batch, whatever each micro-batch scores.
AccumulatedLoss accumulate_gradients(const model::Llama& model,
                                     const std::vector<model::Batch>& micro_batches);

// The same for one rank of a data-parallel job: scored tokens and the loss are summed over
// ranks (the loss is the global batch's mean), the last micro-batch's backward reduces the
// gradients bucket by bucket as they are finished (earlier ones accumulate locally, with no
// communication), and `reduce_wait_s` gets the seconds spent waiting for reductions.
// `stop` is this rank's stop request in, any rank's out (so that every rank stops together).
AccumulatedLoss accumulate_gradients(const model::Llama& model,
                                     const std::vector<model::Batch>& micro_batches,
                                     dist::Communicator& comm, dist::GradReducer& reducer,
                                     bool& stop, double& reduce_wait_s);

// --resume: rank 0 chooses the checkpoint under `ckpt_root` to resume from and tells the other
// ranks; none when the run has none yet (refused when there are some and none verifies).
std::optional<std::filesystem::path> agree_on_checkpoint(const std::filesystem::path& ckpt_root,
                                                         dist::Communicator& comm);

// Whether weight decay applies to each parameter (named as HF names them), given the no-decay
// groups "norms", "biases" and "embeddings".
std::vector<bool> decay_mask(const std::vector<std::pair<std::string, ag::Var>>& params,
                             const std::vector<std::string>& no_decay);

// This machine's GEMM rate (FLOP/s) in `dtype`, MFU's default peak: f32 on pollen's thread pool,
// or f32 or bf16 on the GPU (cuBLASLt, fp32 accumulation, no TF32).
double measure_peak_flops(Device device = Device::cpu, DType dtype = DType::f32);

}  // namespace pollen::train
