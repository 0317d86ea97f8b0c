// Micro-benchmarks of attention and rope (f32) at the model's shapes, one causal document per
// row. GFLOP/s counts the useful work: 4*D flops per visible (query, key) pair forward (q.k and
// p.v) and 10*D backward (scores recomputed, dout.v, and the dq, dk, dv products).
#include <benchmark/benchmark.h>

#include <vector>

#include "base/rng.h"
#include "base/thread_pool.h"
#include "ops/attention.h"
#include "ops/rope.h"

namespace pollen::ops {
namespace {

constexpr int64_t kBatch = 8, kHeads = 6, kKvHeads = 2, kHeadDim = 64;

Tensor random_f32(const Shape& shape, Rng& rng) {
  std::vector<float> values(static_cast<size_t>(shape_numel(shape)));
  for (float& x : values) x = static_cast<float>(rng.normal());
  return Tensor::from(shape, values);
}

// Inputs for sequence length state.range(0), run on state.range(1) threads.
struct Problem {
  explicit Problem(const benchmark::State& state) : Problem(state.range(0)) {
    set_num_threads(static_cast<int>(state.range(1)));
  }
  explicit Problem(int64_t seq)
      : q(random_f32({kBatch, seq, kHeads, kHeadDim}, rng)),
        k(random_f32({kBatch, seq, kKvHeads, kHeadDim}, rng)),
        v(random_f32({kBatch, seq, kKvHeads, kHeadDim}, rng)),
        dout(random_f32(q.shape(), rng)),
        seg_start(Tensor::zeros({kBatch, seq}, DType::i32)),
        out(Tensor::empty(q.shape(), DType::f32)),
        lse(Tensor::empty({kBatch, kHeads, seq}, DType::f32)),
        dq(Tensor::empty(q.shape(), DType::f32)),
        dk(Tensor::empty(k.shape(), DType::f32)),
        dv(Tensor::empty(k.shape(), DType::f32)),
        visible_pairs(static_cast<double>(kBatch * kHeads) * seq * (seq + 1) / 2) {}
  Rng rng{1};
  Tensor q, k, v, dout, seg_start, out, lse, dq, dk, dv;
  double scale = 0.125;
  double visible_pairs;
};

void set_gflops(benchmark::State& state, double flops_per_call) {
  state.counters["GFLOP/s"] = benchmark::Counter(
      flops_per_call * static_cast<double>(state.iterations()) / 1e9, benchmark::Counter::kIsRate);
}

void BM_AttentionForward(benchmark::State& state) {
  Problem p(state);
  for (auto _ : state) attention_forward(p.q, p.k, p.v, p.seg_start, p.scale, p.out, p.lse);
  set_gflops(state, 4.0 * kHeadDim * p.visible_pairs);
}

void BM_AttentionBackward(benchmark::State& state) {
  Problem p(state);
  attention_forward(p.q, p.k, p.v, p.seg_start, p.scale, p.out, p.lse);
  for (auto _ : state) {
    attention_backward(p.q, p.k, p.v, p.seg_start, p.out, p.lse, p.dout, p.scale, p.dq, p.dk, p.dv);
  }
  set_gflops(state, 10.0 * kHeadDim * p.visible_pairs);
}

void BM_RopeForward(benchmark::State& state) {
  Problem p(state);
  std::vector<int32_t> positions(static_cast<size_t>(kBatch * state.range(0)));
  for (size_t i = 0; i < positions.size(); ++i)
    positions[i] = static_cast<int32_t>(i % static_cast<size_t>(state.range(0)));
  const Tensor pos = Tensor::from({kBatch, state.range(0)}, positions);
  for (auto _ : state) rope_forward(p.q, pos, 10000.0, p.out);
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(2 * p.q.nbytes()));
}

// Arguments: T, threads. Rates use wall-clock time.
void shapes(benchmark::internal::Benchmark* b) {
  for (int64_t seq : {256, 1024})
    for (int64_t threads : {1, 2}) b->Args({seq, threads});
  b->ArgNames({"T", "threads"})->UseRealTime();
}

BENCHMARK(BM_AttentionForward)->Apply(shapes)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AttentionBackward)->Apply(shapes)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_RopeForward)->Apply(shapes)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace pollen::ops
