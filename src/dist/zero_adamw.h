#pragma once
// ZeRO stage 1: AdamW whose state is sharded across ranks. Each rank keeps exp_avg and
// exp_avg_sq only for its block of every gradient bucket (GradReducer in reduce_scatter mode),
// so optimizer memory falls by the world size. A step: the global gradient norm from every
// rank's block, the update of this rank's block of the parameters, then an all-gather of every
// bucket's parameters. The arithmetic is AdamW's (optim/adamw.h) element by element. The state
// lives where the parameters do (host or GPU memory; f32 weights only), and the checkpoint
// helpers take and give whole moments on either.
#include <cstdint>
#include <vector>

#include "dist/grad_reducer.h"
#include "optim/adamw.h"

namespace pollen::dist {

class ZeroAdamW {
 public:
  // `decay`: whether weight decay applies to each of the reducer's parameters.
  ZeroAdamW(GradReducer& reducer, const optim::AdamWOptions& options,
            const std::vector<bool>& decay);

  // After reducer.finish(): one update; returns the global gradient norm before clipping. A
  // non-finite norm changes nothing (the same on every rank) and is returned.
  double step(double lr);
  // Seconds spent waiting on the parameter all-gather in the last step.
  double last_wait_s() const { return last_wait_s_; }

  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t steps) { step_ = steps; }
  // Bytes of optimizer state this rank holds (its blocks of the moments, and of the master
  // weights in mixed precision).
  int64_t state_bytes() const;

  // Whole per-parameter moments gathered from every rank's blocks (a collective: every rank
  // calls it), into host memory bucket by bucket, in the reducer's parameter order. Only a rank
  // that passes `keep` holds them after; the others' stay undefined, so that no rank but the one
  // that writes or sends them ever holds the whole state.
  void gather_state(std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq, bool keep);
  // The same for the first moments of the parameters `wanted` marks alone (the others stay
  // undefined): a bucket that holds none of them is not gathered.
  std::vector<Tensor> gather_first_moments(const std::vector<bool>& wanted, bool keep);
  // Takes this rank's blocks of whole per-parameter moments (a checkpoint's).
  void load_state(const std::vector<Tensor>& exp_avg, const std::vector<Tensor>& exp_avg_sq);
  // Takes this rank's blocks of the whole first moments given, keeping the others' (an
  // undefined tensor: that parameter's moments stay) and every second moment.
  void load_first_moments(const std::vector<Tensor>& exp_avg);

  // This rank's blocks of the moments, as views into its state (on the parameters' device):
  // each holds elements [in_param, in_param + numel) of parameter `param`, flattened. For work
  // on the moments that needs no whole tensor (factoring them, setting them from factors).
  struct Block {
    size_t param;
    int64_t in_param;
    Tensor exp_avg, exp_avg_sq;  // [numel] each
  };
  std::vector<Block> blocks();

  // Mixed precision, GPU only: from here on the parameters are bf16 copies, which the model
  // computes with, and this rank keeps f32 master weights for its blocks alone, beside its blocks
  // of the moments; every step all-gathers the updated f32 blocks into the bf16 parameters.
  void compute_in_bf16();
  bool computes_in_bf16() const { return !masters_.empty(); }
  // Whole f32 weights (a collective): in mixed precision gathered from every rank's master
  // blocks into host memory, which only a rank that passes `keep` holds after (the others get
  // undefined tensors), else the parameters themselves (which the next step changes). In the
  // reducer's parameter order.
  std::vector<Tensor> gather_weights(bool keep);
  // Takes this rank's blocks of whole f32 weights (a checkpoint's) and sets the parameters.
  void load_weights(const std::vector<Tensor>& weights);

 private:
  // A run of this rank's block that lies in one parameter.
  struct Piece {
    size_t bucket, param;
    int64_t in_param;  // first element within the parameter
    int64_t in_shard;  // first element within this rank's block of the bucket
    int64_t numel;
  };
  // Every rank's block `shard` of bucket b, as whole per-parameter tensors into `whole` (only
  // those `wanted` marks, all when it is empty; none unless `keep`).
  void gather_bucket(size_t b, const Tensor& shard, std::vector<Tensor>& whole,
                     const std::vector<bool>& wanted, bool keep);

  GradReducer& reducer_;
  Communicator& comm_;
  optim::AdamWOptions options_;
  std::vector<Piece> pieces_;
  // One per piece: views of the parameter (or of its master block) and of the block gradient.
  std::vector<ops::AdamWSlot> slots_;
  std::vector<Tensor> exp_avg_, exp_avg_sq_;  // per bucket: this rank's block
  std::vector<Tensor> masters_;               // per bucket, in mixed precision: f32 weights
  Device device_ = Device::cpu;               // the parameters', the state's and the buckets'
  int64_t step_ = 0;
  double last_wait_s_ = 0;
};

}  // namespace pollen::dist
