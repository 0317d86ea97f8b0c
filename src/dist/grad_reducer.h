#pragma once
// Gradients summed over ranks in buckets while backward still runs.
//
// Parameters are packed into buckets of about `bucket_mb` in reverse model order (the order in
// which backward finishes their gradients: head first, embeddings last). During the observed
// backward (the last micro-batch of a step; the others accumulate locally with no
// communication) the reducer counts the gradient writes each parameter receives; once a
// bucket's parameters have all received their last one it copies them into the bucket's flat
// buffer and starts a non-blocking reduction, in bucket order on every rank. The first step
// learns how many writes each parameter gets and reduces everything after backward.
//
// The buckets live where the parameters do: host memory for MPI, GPU memory for NCCL
// (nccl_communicator.h), which then reduces them on the GPU's stream after the copies into them.
//
//   all_reduce mode:     each rank ends with the sum of every gradient (plain data parallel).
//   reduce_scatter mode: each rank ends with its block of each bucket's sum (ZeRO-1): bucket b
//                        is padded to a multiple of the world size and rank r owns elements
//                        [r * n_b / world, (r + 1) * n_b / world).
#include <cstdint>
#include <functional>
#include <unordered_map>
#include <vector>

#include "autograd/tape.h"
#include "autograd/var.h"
#include "dist/communicator.h"

namespace pollen::dist {

// A parameter's place in a bucket.
struct BucketEntry {
  size_t param;    // index into the reducer's parameters
  int64_t offset;  // first element in the bucket's flat buffer
  int64_t numel;
};

struct Bucket {
  std::vector<BucketEntry> entries;
  int64_t padded = 0;  // elements in the flat buffer: a multiple of the world size
};

// Packs parameters (f32, or bf16 on the GPU) into buckets of at most `bucket_bytes` (a larger
// parameter gets a bucket of its own), last parameter first; each bucket padded to a multiple of
// `world`.
std::vector<Bucket> plan_buckets(const std::vector<ag::Var>& params, int64_t bucket_bytes,
                                 int world);

enum class ReduceMode { all_reduce, reduce_scatter };

class GradReducer final : public ag::BackwardObserver {
 public:
  GradReducer(Communicator& comm, std::vector<ag::Var> params, int64_t bucket_bytes,
              ReduceMode mode);

  // Observe the backward of a step's last micro-batch (ag::ObserveBackward).
  void leaf_written(const ag::VarNode* leaf) override;
  void step_done() override;

  // After that backward: starts the buckets not started yet and waits for all of them.
  // all_reduce: every parameter's gradient becomes the sum over ranks. reduce_scatter:
  // shard_grad(b) holds this rank's block of bucket b's sum. Returns the seconds spent waiting.
  double finish();

  const std::vector<Bucket>& buckets() const { return buckets_; }
  const std::vector<ag::Var>& params() const { return params_; }
  Communicator* communicator() const { return &comm_; }
  int64_t shard_size(size_t bucket) const { return buckets_[bucket].padded / comm_.world(); }
  Tensor& shard_grad(size_t bucket) { return shards_[bucket]; }
  // The bucket's flat buffer (free for reuse once finish() has returned).
  Tensor& flat(size_t bucket) { return flats_[bucket]; }
  // Called with the bucket's index after each bucket's reduction starts (tests inject faults).
  void on_bucket_started(std::function<void(size_t)> hook) { bucket_started_ = std::move(hook); }

 private:
  void start(size_t bucket);
  void copy_out(size_t bucket);

  Communicator& comm_;
  std::vector<ag::Var> params_;
  ReduceMode mode_;
  Device device_ = Device::cpu;  // the parameters', their gradients' and the buckets'
  std::vector<Bucket> buckets_;
  std::vector<Tensor> flats_, shards_;
  std::unordered_map<const ag::VarNode*, size_t> index_;
  std::vector<size_t> bucket_of_;
  std::vector<int64_t> expected_writes_, writes_;  // per parameter; expected -1: not learned
  std::vector<size_t> written_this_step_;
  std::vector<int64_t> waiting_on_;  // per bucket: parameters whose gradient is not final yet
  std::vector<Request> requests_;
  std::vector<bool> started_;
  size_t next_to_start_ = 0;
  bool learned_ = false;
  std::function<void(size_t)> bucket_started_;
};

}  // namespace pollen::dist
