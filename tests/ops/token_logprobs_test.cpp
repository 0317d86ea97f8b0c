// Per-token log-probabilities through the LM head: values against a naive float64 log-softmax,
// every block size, and the backward against float64 finite differences.
#include "ops/token_logprobs.h"

#include <gtest/gtest.h>

#include <cmath>

#include "autograd/token_logprobs.h"
#include "support/gradcheck.h"

namespace pollen {
namespace {
using testing::max_gradcheck_error;
using testing::random_tensor;
using testing::weighted_sum;

// log softmax(h w^T / temperature) at each target, term by term in float64.
std::vector<double> naive_logprobs(const Tensor& h, const Tensor& w, const Tensor& targets,
                                   double temperature = 1.0) {
  const int64_t n = h.size(0), c = h.size(1), v = w.size(0);
  std::vector<double> out(static_cast<size_t>(n), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t t = targets.data<int32_t>()[i];
    if (t < 0) continue;
    std::vector<double> logit(static_cast<size_t>(v), 0.0);
    for (int64_t j = 0; j < v; ++j)
      for (int64_t k = 0; k < c; ++k)
        logit[j] += h.data<double>()[i * c + k] * w.data<double>()[j * c + k];
    for (double& l : logit) l /= temperature;
    double sum = 0;
    for (double l : logit) sum += std::exp(l);
    out[i] = logit[t] - std::log(sum);
  }
  return out;
}

TEST(TokenLogprobs, EveryBlockSizeMatchesNaiveLogSoftmax) {
  Rng rng(11);
  const Tensor h = random_tensor({7, 5}, rng), w = random_tensor({13, 5}, rng, 2.0);
  const Tensor targets = Tensor::from<int32_t>({7}, {3, -100, 0, 12, 12, 7, 1});
  const std::vector<double> expected = naive_logprobs(h, w, targets);
  for (int64_t block : {1, 2, 3, 7, 0}) {
    Tensor logp = Tensor::empty({7}, DType::f64), lse = Tensor::empty({7}, DType::f64);
    ops::token_logprobs_forward(h, w, targets, logp, lse, 1.0, block);
    for (int64_t i = 0; i < 7; ++i)
      EXPECT_NEAR(logp.data<double>()[i], expected[i], 1e-12) << "block " << block << " row " << i;
    EXPECT_EQ(logp.data<double>()[1], 0.0);  // unscored row
  }
}

// GRPO scores at its sampling temperature: the logits divided by it, forward and backward.
TEST(TokenLogprobs, TemperatureDividesTheLogits) {
  Rng rng(15);
  const Tensor h = random_tensor({7, 5}, rng), w = random_tensor({13, 5}, rng, 2.0);
  const Tensor targets = Tensor::from<int32_t>({7}, {3, -100, 0, 12, 12, 7, 1});
  for (double temperature : {0.5, 1.7}) {
    const std::vector<double> expected = naive_logprobs(h, w, targets, temperature);
    for (int64_t block : {2, 0}) {
      Tensor logp = Tensor::empty({7}, DType::f64), lse = Tensor::empty({7}, DType::f64);
      ops::token_logprobs_forward(h, w, targets, logp, lse, temperature, block);
      for (int64_t i = 0; i < 7; ++i)
        EXPECT_NEAR(logp.data<double>()[i], expected[i], 1e-12)
            << "temperature " << temperature << " block " << block << " row " << i;
    }
    std::vector<ag::Var> leaves = {ag::Var(h.clone(), true, "h"), ag::Var(w.clone(), true, "w")};
    const Tensor weights = random_tensor({7}, rng);
    const double err = max_gradcheck_error(
        [&](std::vector<ag::Var>& v) {
          return weighted_sum(ag::token_logprobs(v[0], v[1], targets, temperature), weights);
        },
        leaves);
    EXPECT_LT(err, 1e-6) << "temperature " << temperature;
  }
  Tensor logp = Tensor::empty({7}, DType::f64), lse = Tensor::empty({7}, DType::f64);
  EXPECT_THROW(ops::token_logprobs_forward(h, w, targets, logp, lse, 0.0), Error);
}

TEST(TokenLogprobs, SumIsMinusTheSummedCrossEntropy) {
  Rng rng(12);
  const Tensor h = random_tensor({9, 4}, rng, 1.0, DType::f32);
  const Tensor w = random_tensor({6, 4}, rng, 1.0, DType::f32);
  const Tensor targets = Tensor::from<int32_t>({9}, {0, 1, 2, 3, 4, 5, -1, 5, 0});
  const ag::Var logp = ag::token_logprobs(ag::Var(h), ag::Var(w), targets);
  double sum = 0;
  for (int64_t i = 0; i < 9; ++i) sum += logp.value().data<float>()[i];
  const double ce =
      ag::cross_entropy(ag::Var(h), ag::Var(w), targets, ag::Reduction::sum).value().item();
  EXPECT_NEAR(sum, -ce, 1e-4);
}

TEST(TokenLogprobs, GradientMatchesFiniteDifferences) {
  Rng rng(13);
  std::vector<ag::Var> leaves = {ag::Var(random_tensor({6, 7}, rng), true, "h"),
                                 ag::Var(random_tensor({11, 7}, rng), true, "w")};
  const Tensor targets = Tensor::from<int32_t>({6}, {2, -100, 0, 10, 10, 5});
  const Tensor weights = random_tensor({6}, rng);  // every token weighted differently
  const double err = max_gradcheck_error(
      [&](std::vector<ag::Var>& v) {
        return weighted_sum(ag::token_logprobs(v[0], v[1], targets), weights);
      },
      leaves);
  EXPECT_LT(err, 1e-6);
}

TEST(TokenLogprobs, TargetOutsideVocabularyIsAClearError) {
  Rng rng(14);
  const Tensor h = random_tensor({2, 3}, rng), w = random_tensor({4, 3}, rng);
  Tensor logp = Tensor::empty({2}, DType::f64), lse = Tensor::empty({2}, DType::f64);
  try {
    ops::token_logprobs_forward(h, w, Tensor::from<int32_t>({2}, {1, 4}), logp, lse);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("target 4 at row 1"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace pollen
