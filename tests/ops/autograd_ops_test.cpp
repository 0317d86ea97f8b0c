// Every differentiable op's backward against float64 central finite differences, on random
// inputs with odd sizes.
#include <gtest/gtest.h>

#include <cmath>

#include "autograd/functions.h"
#include "ops/attention.h"
#include "support/gradcheck.h"

namespace pollen {
namespace {
using testing::max_gradcheck_error;
using testing::random_tensor;
using testing::weighted_sum;

TEST(OpGradients, Linear) {
  Rng rng(1);
  for (auto [n, k, m] : {std::tuple{1, 1, 1}, {3, 5, 7}, {9, 4, 2}}) {
    std::vector<ag::Var> leaves = {ag::Var(random_tensor({n, k}, rng), true, "x"),
                                   ag::Var(random_tensor({m, k}, rng), true, "w"),
                                   ag::Var(random_tensor({m}, rng), true, "b")};
    Tensor wts = random_tensor({n, m}, rng);
    max_gradcheck_error(
        [&](std::vector<ag::Var>& v) { return weighted_sum(ag::linear(v[0], v[1], &v[2]), wts); },
        leaves);
  }
}

TEST(OpGradients, Embedding) {
  Rng rng(2);
  std::vector<ag::Var> leaves = {ag::Var(random_tensor({11, 5}, rng), true, "table")};
  Tensor ids = Tensor::from<int32_t>({7}, {3, 0, 10, 3, 3, 7, 0});  // repeats accumulate
  Tensor wts = random_tensor({7, 5}, rng);
  max_gradcheck_error(
      [&](std::vector<ag::Var>& v) { return weighted_sum(ag::embedding(v[0], ids), wts); }, leaves);
}

TEST(OpGradients, RMSNorm) {
  Rng rng(3);
  for (auto [n, c] : {std::pair{1, 1}, {4, 7}, {13, 64}}) {
    std::vector<ag::Var> leaves = {ag::Var(random_tensor({n, c}, rng), true, "x"),
                                   ag::Var(random_tensor({c}, rng), true, "w")};
    Tensor wts = random_tensor({n, c}, rng);
    max_gradcheck_error(
        [&](std::vector<ag::Var>& v) { return weighted_sum(ag::rmsnorm(v[0], v[1], 1e-5), wts); },
        leaves);
  }
}

TEST(OpGradients, SwiGLUAndAdd) {
  Rng rng(4);
  std::vector<ag::Var> leaves = {ag::Var(random_tensor({5, 9}, rng, 2.0), true, "gate"),
                                 ag::Var(random_tensor({5, 9}, rng), true, "up")};
  Tensor wts = random_tensor({5, 9}, rng);
  max_gradcheck_error(
      [&](std::vector<ag::Var>& v) {
        // add(x, f(x)) with a shared input: both paths must reach `up`.
        return weighted_sum(ag::add(v[1], ag::swiglu(v[0], v[1])), wts);
      },
      leaves);
}

TEST(OpGradients, CrossEntropyMeanIgnoresNegativeTargets) {
  Rng rng(5);
  Tensor targets = Tensor::from<int32_t>({6}, {2, -100, 0, 12, 12, 5});
  {
    std::vector<ag::Var> leaves = {ag::Var(random_tensor({6, 7}, rng), true, "h"),
                                   ag::Var(random_tensor({13, 7}, rng), true, "w")};
    max_gradcheck_error(
        [&](std::vector<ag::Var>& v) {
          return ag::cross_entropy(v[0], v[1], targets, ag::Reduction::mean);
        },
        leaves);
  }
}

// An output layer's first rows (a vocabulary padded beyond the ids scored): the gradient reaches
// those rows, and the rows past them (used by nothing) get zeros.
TEST(OpGradients, LeadingRowsOfAnOutputLayer) {
  Rng rng(6);
  Tensor targets = Tensor::from<int32_t>({6}, {2, 8, 0, 5, 5, 1});
  std::vector<ag::Var> leaves = {ag::Var(random_tensor({6, 7}, rng), true, "h"),
                                 ag::Var(random_tensor({13, 7}, rng), true, "w")};
  max_gradcheck_error(
      [&](std::vector<ag::Var>& v) {
        return ag::cross_entropy(v[0], ag::leading_rows(v[1], 9), targets, ag::Reduction::mean);
      },
      leaves);
  const std::vector<double> dw = leaves[1].grad().to_doubles();
  for (size_t i = 9 * 7; i < dw.size(); ++i) EXPECT_EQ(dw[i], 0.0) << i;
  double first = 0;
  for (size_t i = 0; i < 9 * 7; ++i) first += std::fabs(dw[i]);
  EXPECT_GT(first, 0.0);
}

TEST(OpGradients, AttentionWithRopeGroupedHeadsAndDocuments) {
  Rng rng(6);
  const int64_t b = 2, t = 7, h = 4, kvh = 2, d = 6;
  Tensor doc = Tensor::from<int32_t>({b, t}, {0, 0, 0, 1, 1, 2, 2, 5, 5, 5, 5, 5, 5, 5});
  Tensor pos = Tensor::from<int32_t>({b, t}, {0, 1, 2, 0, 1, 0, 1, 0, 1, 2, 3, 4, 5, 6});
  Tensor seg = ops::segment_starts(doc);
  std::vector<ag::Var> leaves = {ag::Var(random_tensor({b, t, h, d}, rng), true, "q"),
                                 ag::Var(random_tensor({b, t, kvh, d}, rng), true, "k"),
                                 ag::Var(random_tensor({b, t, kvh, d}, rng), true, "v")};
  Tensor wts = random_tensor({b, t, h, d}, rng);
  max_gradcheck_error(
      [&](std::vector<ag::Var>& v) {
        ag::Var q = ag::rope(v[0], pos, 500000.0), k = ag::rope(v[1], pos, 500000.0);
        return weighted_sum(ag::attention(q, k, v[2], seg, 0.37), wts);
      },
      leaves);
}

}  // namespace
}  // namespace pollen
