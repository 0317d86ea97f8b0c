// Per-sequence log-probabilities: values against log-softmax computed directly in double, and
// the backward pass against float64 finite differences.
#include "autograd/sequence_logprob.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "support/gradcheck.h"

namespace pollen {
namespace {

constexpr int64_t kRows = 3, kT = 4, kC = 5, kV = 7;

// Row 0 scores three positions, row 1 one, row 2 none (its log-probability is 0).
Tensor fixed_targets() {
  return Tensor::from<int32_t>({kRows * kT}, {-100, 2, 6, 0, -100, -100, 3, -1, -1, -1, -1, -1});
}

TEST(SequenceLogprobs, SumsLogSoftmaxOfTheScoredPositionsOfEachRow) {
  Rng rng(11);
  const Tensor h = testing::random_tensor({kRows * kT, kC}, rng);
  const Tensor w = testing::random_tensor({kV, kC}, rng);
  const Tensor targets = fixed_targets();
  const ag::Var out = ag::sequence_logprobs(ag::Var(h), ag::Var(w), targets, kRows);
  ASSERT_EQ(out.shape(), (Shape{kRows}));
  const double* hp = h.data<double>();
  const double* wp = w.data<double>();
  const int32_t* tp = targets.data<int32_t>();
  for (int64_t b = 0; b < kRows; ++b) {
    double expected = 0;
    for (int64_t p = b * kT; p < (b + 1) * kT; ++p) {
      if (tp[p] < 0) continue;
      std::vector<double> logits(kV);
      double mx = -1e300;
      for (int64_t v = 0; v < kV; ++v) {
        for (int64_t c = 0; c < kC; ++c) logits[v] += hp[p * kC + c] * wp[v * kC + c];
        mx = std::max(mx, logits[v]);
      }
      double z = 0;
      for (double l : logits) z += std::exp(l - mx);
      expected += logits[tp[p]] - mx - std::log(z);
    }
    EXPECT_NEAR(out.value().to_doubles()[b], expected, 1e-12) << "row " << b;
  }
  EXPECT_EQ(out.value().to_doubles()[2], 0.0);
}

TEST(SequenceLogprobs, BackwardMatchesFiniteDifferences) {
  Rng rng(12);
  std::vector<ag::Var> leaves = {ag::Var(testing::random_tensor({kRows * kT, kC}, rng), true, "h"),
                                 ag::Var(testing::random_tensor({kV, kC}, rng), true, "w")};
  // Distinct weights per row so that a gradient routed to the wrong row shows.
  const Tensor weights = Tensor::from<double>({kRows}, {0.7, -1.3, 2.1});
  const Tensor targets = fixed_targets();
  const double err = testing::max_gradcheck_error(
      [&](std::vector<ag::Var>& l) {
        return testing::weighted_sum(ag::sequence_logprobs(l[0], l[1], targets, kRows), weights);
      },
      leaves);
  EXPECT_LT(err, 1e-6);
}

TEST(SequenceLogprobs, RefusesPositionsThatDoNotSplitIntoRows) {
  Rng rng(13);
  const ag::Var h(testing::random_tensor({10, kC}, rng));
  const ag::Var w(testing::random_tensor({kV, kC}, rng));
  EXPECT_ANY_THROW(ag::sequence_logprobs(h, w, Tensor::full({10}, 1, DType::i32), 3));
}

}  // namespace
}  // namespace pollen
