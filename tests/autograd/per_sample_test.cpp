// Per-sample clipping in one pass (autograd/per_sample.h): every sample's norm and the scaled
// sum of the samples' gradients against each sample's gradient taken on its own, through every
// op that writes a parameter's gradient (embedding, RMSNorm, linear with and without a bias, the
// cross-entropy's head, the table as the head too); a sample with a non-finite gradient left
// out; a weight used twice otherwise refused.
#include "autograd/per_sample.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "autograd/functions.h"
#include "ops/per_sample.h"
#include "support/gradcheck.h"

namespace pollen {
namespace {

constexpr int64_t kSamples = 3, kV = 11, kC = 6, kF = 10;

struct Net {
  // table (V,C), norm (C), w1 (F,C), b1 (F), w2 (C,F), head (V,C) unless the table is the head
  std::vector<ag::Var> params;
  explicit Net(uint64_t seed, bool tied = false) {
    Rng rng(seed);
    const Shape shapes[] = {{kV, kC}, {kC}, {kF, kC}, {kF}, {kC, kF}, {kV, kC}};
    for (const Shape& s : shapes)
      if (!tied || params.size() < 5)
        params.emplace_back(testing::random_tensor(s, rng, 0.7, DType::f32), true);
  }
  // The summed token loss of ids and targets (N) int32.
  ag::Var loss(const Tensor& ids, const Tensor& targets) const {
    const ag::Var x = ag::embedding(params[0], ids);
    const ag::Var h = ag::rmsnorm(x, params[1], 1e-5);
    const ag::Var y = ag::linear(h, params[2], &params[3]);
    const ag::Var z = ag::linear(y, params[4]);
    return ag::cross_entropy(z, params.size() > 5 ? params[5] : params[0], targets,
                             ag::Reduction::sum);
  }
};

// Each parameter's gradient (float64) of `seed` times the loss of samples' rows [r0, r1).
std::vector<std::vector<double>> gradient_of(const Net& net, const Tensor& ids,
                                             const Tensor& targets, int64_t r0, int64_t r1,
                                             double seed) {
  for (auto p : net.params) p.zero_grad();
  ag::Tape tape;
  ag::Var loss;
  {
    ag::TapeScope scope(tape);
    loss = net.loss(ids.slice(0, r0, r1), targets.slice(0, r0, r1));
  }
  tape.backward(loss, seed);
  std::vector<std::vector<double>> g;
  for (auto p : net.params) {
    g.push_back(p.grad().to_doubles());
    p.zero_grad();
  }
  return g;
}

// Sample s's tokens cycle through three ids from its first, s (2 rows per sample: rows 1 and 2 are
// each read by two samples) or 2s (more rows: each sample reads its first id twice, rows 2 and 4
// are read by two samples each, and id 3 by sample 1 alone). The samples' gradients on a shared
// row must stay apart in the norms and add up in the sum.
void make_batch(int64_t rows, Tensor& ids, Tensor& targets) {
  ids = Tensor::empty({kSamples * rows}, DType::i32);
  targets = Tensor::empty({kSamples * rows}, DType::i32);
  for (int64_t i = 0; i < ids.numel(); ++i) {
    const int64_t first = i / rows * (rows > 2 ? 2 : 1);
    ids.data<int32_t>()[i] = static_cast<int32_t>(first + (i % rows) % 3);
    targets.data<int32_t>()[i] = static_cast<int32_t>((5 * i + 2) % kV);
  }
  targets.data<int32_t>()[1] = -100;  // an unscored token
}

// The one-pass norms and scaled sum against the samples' own gradients, backward seeded with
// `seed` (which every norm and write must carry).
void expect_matches_each_sample(int64_t rows, const Net& net, const Tensor& ids,
                                const Tensor& targets, const std::vector<double>& scale,
                                const std::vector<bool>& finite, double seed = 1.0) {
  std::vector<std::vector<std::vector<double>>> each;
  for (int64_t s = 0; s < kSamples; ++s)
    each.push_back(gradient_of(net, ids, targets, s * rows, (s + 1) * rows, seed));

  ag::PerSampleGradients per_sample(kSamples, rows);
  ag::Tape tape;
  ag::Var loss;
  {
    ag::TapeScope scope(tape);
    loss = net.loss(ids, targets);
  }
  tape.backward(loss, seed);
  for (const auto& p : net.params) EXPECT_FALSE(p.grad().defined()) << "written before write()";
  for (int64_t s = 0; s < kSamples; ++s) {
    const double got = per_sample.norms_sq()[static_cast<size_t>(s)];
    if (!finite[static_cast<size_t>(s)]) {
      EXPECT_FALSE(std::isfinite(got)) << "sample " << s;
      continue;
    }
    double want = 0;
    for (const auto& g : each[static_cast<size_t>(s)])
      for (double v : g) want += v * v;
    EXPECT_NEAR(got, want, 1e-5 * want) << "sample " << s << ", " << rows << " rows";
  }
  per_sample.write(scale);
  for (size_t p = 0; p < net.params.size(); ++p) {
    ASSERT_TRUE(net.params[p].grad().defined()) << "parameter " << p;
    const std::vector<double> got = net.params[p].grad().to_doubles();
    double error = 0, norm = 0;
    for (size_t j = 0; j < got.size(); ++j) {
      double want = 0;
      for (size_t s = 0; s < each.size(); ++s)
        if (scale[s] != 0) want += scale[s] * each[s][p][j];
      ASSERT_TRUE(std::isfinite(got[j])) << "parameter " << p << " element " << j;
      error = std::max(error, std::abs(got[j] - want));
      norm = std::max(norm, std::abs(want));
    }
    EXPECT_LE(error, 1e-5 * norm) << "parameter " << p << ", " << rows << " rows";
  }
}

TEST(PerSampleGradients, NormsAndTheScaledSumEqualEachSamplesOwnGradient) {
  // 2 rows a sample: every norm from Gram matrices; 8 rows: from each sample's gradient itself.
  for (int64_t rows : {2, 8}) {
    Tensor ids, targets;
    make_batch(rows, ids, targets);
    const Net net(5);
    expect_matches_each_sample(rows, net, ids, targets, {0.5, 2.0, 0.25}, {true, true, true});
    expect_matches_each_sample(rows, net, ids, targets, {0.5, 2.0, 0.25}, {true, true, true}, 0.37);
  }
}

TEST(PerSampleGradients, ASampleOfScaleZeroIsLeftOutEvenWhenNotFinite) {
  const int64_t rows = 4;
  Tensor ids, targets;
  make_batch(rows, ids, targets);
  const Net net(6);
  // Sample 1's first id only: its activations, loss and gradient are not finite.
  net.params[0].value().data<float>()[3 * kC] = std::numeric_limits<float>::infinity();
  expect_matches_each_sample(rows, net, ids, targets, {0.5, 0.0, 2.0}, {true, false, true});
}

TEST(PerSampleGradients, TiedEmbeddingsAddTheCrossTermOfTheirTwoUses) {
  // The table is the head too: each sample's norm is |embedding part + head part|, not the sum
  // of the parts' norms. Repeated ids within a sample and across a row's targets.
  for (int64_t rows : {2, 8}) {
    Tensor ids, targets;
    make_batch(rows, ids, targets);
    const Net net(9, true);
    expect_matches_each_sample(rows, net, ids, targets, {0.5, 2.0, 0.25}, {true, true, true});
    expect_matches_each_sample(rows, net, ids, targets, {0.5, 2.0, 0.25}, {true, true, true}, 0.37);
  }
}

TEST(PerSampleGradients, RefusesAWeightUsedTwiceOtherwise) {
  Tensor ids, targets;
  make_batch(2, ids, targets);
  const Net net(7);
  ag::PerSampleGradients per_sample(kSamples, 2);
  ag::Tape tape;
  ag::Var loss;
  {
    ag::TapeScope scope(tape);
    // w2 (C,F) after w1 (F,C) twice over: a square chain that reuses both weights.
    const ag::Var h = ag::embedding(net.params[0], ids);
    const ag::Var y =
        ag::linear(ag::linear(ag::linear(h, net.params[2]), net.params[4]), net.params[2]);
    loss =
        ag::cross_entropy(ag::linear(y, net.params[4]), net.params[5], targets, ag::Reduction::sum);
  }
  try {
    tape.backward(loss);
    FAIL() << "a weight used twice was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("used twice"), std::string::npos) << e.what();
  }
  // A tied table embedded twice: the cross term of two embedding uses is not kept.
  const Net tied(8, true);
  ag::PerSampleGradients again(kSamples, 2);
  ag::Tape tape2;
  ag::TapeScope scope(tape2);
  const ag::Var first = ag::embedding(tied.params[0], ids);
  try {
    (void)ag::embedding(tied.params[0], ids);
    FAIL() << "a table embedded twice was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("used twice"), std::string::npos) << e.what();
  }
}

TEST(PerSampleOps, OuterProductNormEitherWayEqualsTheProductsNorm) {
  Rng rng(3);
  // (t, m, k): the Gram way (t (m + k) < m k) and the direct way.
  for (const auto& [t, m, k] : {std::tuple{3, 9, 7}, std::tuple{9, 3, 4}}) {
    const Tensor a = testing::random_tensor({t, m}, rng, 1.0, DType::f32);
    const Tensor b = testing::random_tensor({t, k}, rng, 1.0, DType::f32);
    double want = 0;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < k; ++j) {
        double v = 0;
        for (int64_t r = 0; r < t; ++r)
          v += static_cast<double>(a.data<float>()[r * m + i]) * b.data<float>()[r * k + j];
        want += v * v;
      }
    }
    EXPECT_NEAR(ops::outer_product_norm_sq(a.data<float>(), m, b.data<float>(), k, t), want,
                1e-5 * want)
        << t << " rows";
  }
}

}  // namespace
}  // namespace pollen
