// Data parallelism on the GPU (dist/nccl_communicator.h) as far as one GPU can check it: one NCCL
// rank beside the single-process launcher. Each collective on GPU buffers gives what a world of
// one must (the sum of one rank is its own values), and a training step's gradients reduced in
// buckets by NCCL equal the same step's gradients without a reducer, in f32 and in bf16 (widened
// to f32), bit for bit, and ZeRO-1's sharded AdamW steps as plain AdamW does. Several ranks need
// several GPUs.
#include <gtest/gtest.h>

#include "cuda/gpu_compare.h"
#include "dist/grad_reducer.h"
#include "dist/nccl_communicator.h"
#include "dist/zero_adamw.h"
#include "model/llama.h"
#include "optim/adamw.h"
#include "train/trainer.h"

using namespace pollen;

namespace {

Tensor gpu_values(const std::vector<float>& values) {
  return Tensor::from<float>({static_cast<int64_t>(values.size())}, values).to(Device::cuda);
}

std::vector<double> host_values(const Tensor& t) {
  return t.to_doubles();
}

// Two micro-batches of random tokens for `config`.
std::vector<model::Batch> micro_batches(const model::LlamaConfig& config, Rng& rng) {
  std::vector<model::Batch> out;
  for (int m = 0; m < 2; ++m) {
    Tensor tokens = Tensor::empty({2, 64}, DType::i32),
           targets = Tensor::empty({2, 64}, DType::i32);
    for (int64_t i = 0; i < tokens.numel(); ++i) {
      tokens.data<int32_t>()[i] = static_cast<int32_t>(rng.below(config.vocab_size));
      targets.data<int32_t>()[i] = static_cast<int32_t>(rng.below(config.vocab_size));
    }
    out.push_back(model::Batch::contiguous_rows(tokens, targets));
  }
  return out;
}

// Every gradient of `model`'s parameters as f64 values, after one accumulation of `batches`,
// with the reducer given or none.
std::vector<std::vector<double>> gradients(const model::Llama& model,
                                           const std::vector<model::Batch>& batches,
                                           dist::Communicator* comm, dist::GradReducer* reducer) {
  for (auto& p : model.parameters()) p.zero_grad();
  if (reducer) {
    bool stop = false;
    double waited = 0;
    train::accumulate_gradients(model, batches, *comm, *reducer, stop, waited);
  } else {
    train::accumulate_gradients(model, batches);
  }
  std::vector<std::vector<double>> out;
  for (const auto& p : model.parameters()) out.push_back(p.grad().to_doubles());
  return out;
}

}  // namespace

TEST(CudaNccl, CollectivesOfOneRankOnGpuBuffers) {
  POLLEN_REQUIRE_GPU();
  dist::SingleProcess host;
  dist::NcclCommunicator comm(host, 60);
  EXPECT_EQ(comm.world(), 1);
  const std::vector<float> values = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f};
  Tensor data = gpu_values(values);
  comm.wait(comm.start_all_reduce(data.data<float>(), 5, "an all-reduce"));
  EXPECT_EQ(host_values(data), std::vector<double>({1.5, -2.0, 3.25, 0.0, 7.0}));

  Tensor out = gpu_values({0, 0, 0, 0, 0});
  comm.wait(
      comm.start_reduce_scatter(data.data<float>(), out.data<float>(), 5, "a reduce-scatter"));
  EXPECT_EQ(host_values(out), host_values(data));
  Tensor gathered = gpu_values({0, 0, 0, 0, 0});
  comm.wait(comm.start_all_gather(data.data<float>(), gathered.data<float>(), 5, "an all-gather"));
  EXPECT_EQ(host_values(gathered), host_values(data));
  comm.wait(comm.start_broadcast(data.data<float>(), 5, 0, "a broadcast"));
  EXPECT_EQ(host_values(data), std::vector<double>({1.5, -2.0, 3.25, 0.0, 7.0}));

  // Host values go through the launcher's communicator.
  double sum[1] = {4.0};
  comm.all_reduce_sum(sum, "a host sum");
  EXPECT_EQ(sum[0], 4.0);
}

TEST(CudaNccl, BucketedGradientsEqualTheUnreducedOnesInF32AndBf16) {
  POLLEN_REQUIRE_GPU();
  const model::LlamaConfig config = model::resolve_config("llama-tiny");
  Rng rng(11);
  const auto batches = micro_batches(config, rng);
  for (DType compute : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(compute));
    model::Llama model(config, 5);
    model.to(Device::cuda);
    optim::AdamW opt(model.parameters(), optim::AdamWOptions{});
    if (compute == DType::bf16) opt.compute_in_bf16();
    const auto alone = gradients(model, batches, nullptr, nullptr);

    dist::SingleProcess host;
    dist::NcclCommunicator comm(host, 60);
    // Small buckets: several reductions start while backward runs.
    dist::GradReducer reducer(comm, model.parameters(), 64 * 1024, dist::ReduceMode::all_reduce);
    ASSERT_GT(reducer.buckets().size(), 2u);
    // Twice: the first step learns each parameter's writes, the second starts buckets early.
    for (int step = 0; step < 2; ++step) {
      const auto reduced = gradients(model, batches, &comm, &reducer);
      ASSERT_EQ(reduced.size(), alone.size());
      for (size_t i = 0; i < alone.size(); ++i)
        EXPECT_EQ(reduced[i], alone[i]) << "parameter " << i;
      for (const auto& p : model.parameters()) {
        EXPECT_EQ(p.grad().device(), Device::cuda);
        EXPECT_EQ(p.grad().dtype(), DType::f32);  // reduced in f32, whatever the weights' dtype
      }
    }
  }
}

namespace {

// ZeRO-1's steps against AdamW's on the same model and data, with the compute dtype given: in
// bf16, both keep f32 master weights (ZeRO-1 for its blocks only) and bf16 parameters.
void expect_zero_steps_as_adamw(DType compute) {
  const model::LlamaConfig config = model::resolve_config("llama-tiny");
  Rng rng(12);
  const auto batches = micro_batches(config, rng);
  optim::AdamWOptions ao;
  ao.lr = 1e-2;
  ao.max_grad_norm = 0;  // no clipping: the norms' summation orders differ
  model::Llama plain(config, 5), sharded(config, 5);
  plain.to(Device::cuda);
  sharded.to(Device::cuda);
  std::vector<bool> decay;
  for (const auto& p : plain.parameters()) decay.push_back(p.value().dim() >= 2);
  optim::AdamW adamw(plain.parameters(), ao, decay);
  dist::SingleProcess host;
  dist::NcclCommunicator comm(host, 60);
  dist::GradReducer reducer(comm, sharded.parameters(), 64 * 1024,
                            dist::ReduceMode::reduce_scatter);
  dist::ZeroAdamW zero(reducer, ao, decay);
  if (compute == DType::bf16) {
    adamw.compute_in_bf16();
    zero.compute_in_bf16();
  }
  for (int step = 0; step < 3; ++step) {
    gradients(plain, batches, nullptr, nullptr);
    const double norm = adamw.step(ao.lr);
    bool stop = false;
    double waited = 0;
    for (auto& p : sharded.parameters()) p.zero_grad();
    train::accumulate_gradients(sharded, batches, comm, reducer, stop, waited);
    EXPECT_NEAR(zero.step(ao.lr), norm, 1e-6 * norm);
  }
  const auto a = plain.parameters(), b = sharded.parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(b[i].value().device(), Device::cuda);
    EXPECT_EQ(b[i].value().to_doubles(), a[i].value().to_doubles()) << "parameter " << i;
  }
  std::vector<Tensor> m1, m2;
  zero.gather_state(m1, m2, true);
  const std::vector<Tensor> weights = zero.gather_weights(true);  // the f32 masters in bf16
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(b[i].value().dtype(), compute);
    EXPECT_EQ(m1[i].to_doubles(), adamw.slots()[i].exp_avg.to_doubles()) << i;
    EXPECT_EQ(m2[i].to_doubles(), adamw.slots()[i].exp_avg_sq.to_doubles()) << i;
    EXPECT_EQ(weights[i].dtype(), DType::f32);
    EXPECT_EQ(weights[i].to_doubles(), adamw.slots()[i].param.to_doubles()) << i;
  }

  // A checkpoint's weights go back into a fresh model's master blocks and parameters.
  model::Llama resumed(config, 6);
  resumed.to(Device::cuda);
  dist::GradReducer reducer2(comm, resumed.parameters(), 64 * 1024,
                             dist::ReduceMode::reduce_scatter);
  dist::ZeroAdamW zero2(reducer2, ao, decay);
  if (compute == DType::bf16) zero2.compute_in_bf16();
  std::vector<Tensor> on_host;
  for (const Tensor& w : weights) on_host.push_back(w.to(Device::cpu));
  zero2.load_weights(on_host);
  const auto r = resumed.parameters();
  const std::vector<Tensor> again = zero2.gather_weights(true);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(r[i].value().to_doubles(), a[i].value().to_doubles()) << i;
    EXPECT_EQ(again[i].to_doubles(), weights[i].to_doubles()) << i;
  }
}

}  // namespace

TEST(CudaNccl, ZeroAdamWOnTheGpuStepsAsAdamW) {
  POLLEN_REQUIRE_GPU();
  expect_zero_steps_as_adamw(DType::f32);
}

TEST(CudaNccl, ZeroAdamWInBf16KeepsShardedMasterWeightsAndStepsAsAdamW) {
  POLLEN_REQUIRE_GPU();
  expect_zero_steps_as_adamw(DType::bf16);
}
