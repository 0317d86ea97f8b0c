#include "ops/rope.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "base/rng.h"

namespace pollen::ops {
namespace {

constexpr double kTheta = 10000.0;

Tensor random_tensor(const Shape& shape, Rng& rng) {
  std::vector<double> values(static_cast<size_t>(shape_numel(shape)));
  for (double& x : values) x = rng.normal();
  return Tensor::from(shape, values);
}

// Position ids of packed documents: they restart at 0 where each document begins.
Tensor packed_positions(int64_t batch, int64_t seq, const std::vector<int64_t>& doc_lengths) {
  std::vector<int32_t> positions;
  for (int64_t b = 0; b < batch; ++b) {
    int64_t t = 0;
    for (size_t doc = 0; t < seq; ++doc) {
      const int64_t length = doc_lengths[(doc + static_cast<size_t>(b)) % doc_lengths.size()];
      for (int64_t p = 0; p < length && t < seq; ++p, ++t)
        positions.push_back(static_cast<int32_t>(p));
    }
  }
  return Tensor::from({batch, seq}, positions);
}

// HF LlamaRotaryEmbedding + apply_rotary_pos_emb, element by element, in f64:
// emb = cat(freqs, freqs), out = x * cos(emb) + rotate_half(x) * sin(emb).
Tensor naive_rope(const Tensor& x, const Tensor& positions, double theta) {
  const int64_t rows = x.size(0) * x.size(1), heads = x.size(2), dim = x.size(3);
  const auto in = x.to_doubles();
  const int32_t* pos = positions.data<int32_t>();
  std::vector<double> out(in.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      const double* src = in.data() + (r * heads + h) * dim;
      double* dst = out.data() + (r * heads + h) * dim;
      for (int64_t i = 0; i < dim; ++i) {
        const int64_t pair = i % (dim / 2);
        const double freq = 1.0 / std::pow(theta, static_cast<double>(2 * pair) / dim);
        const double angle = pos[r] * freq;
        const double rotated = i < dim / 2 ? -src[i + dim / 2] : src[i - dim / 2];
        dst[i] = src[i] * std::cos(angle) + rotated * std::sin(angle);
      }
    }
  }
  return Tensor::from(x.shape(), out);
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  const auto x = a.to_doubles(), y = b.to_doubles();
  double diff = 0;
  for (size_t i = 0; i < x.size(); ++i) diff = std::max(diff, std::abs(x[i] - y[i]));
  return diff;
}

double dot(const Tensor& a, const Tensor& b) {
  const auto x = a.to_doubles(), y = b.to_doubles();
  double sum = 0;
  for (size_t i = 0; i < x.size(); ++i) sum += x[i] * y[i];
  return sum;
}

Tensor rope(const Tensor& x, const Tensor& positions, bool backward = false) {
  Tensor out = Tensor::empty(x.shape(), x.dtype());
  if (backward) {
    rope_backward(x, positions, kTheta, out);
  } else {
    rope_forward(x, positions, kTheta, out);
  }
  return out;
}

TEST(Rope, MatchesTheHfFormulaWithPositionsRestartingPerDocument) {
  Rng rng(1);
  for (int64_t dim : {2, 8, 64, 128}) {
    SCOPED_TRACE(cat("D=", dim));
    const Tensor positions = packed_positions(2, 300, {5, 250, 1, 40});
    const Tensor x = random_tensor({2, 300, 3, dim}, rng);
    const Tensor expected = naive_rope(x, positions, kTheta);
    EXPECT_LT(max_abs_diff(rope(x, positions), expected), 1e-12);
    EXPECT_LT(max_abs_diff(rope(x.to(DType::f32), positions), expected), 1e-5);
  }
}

TEST(Rope, PositionZeroIsTheIdentity) {
  Rng rng(2);
  const Tensor x = random_tensor({1, 4, 2, 16}, rng);
  const Tensor positions = Tensor::from<int32_t>({1, 4}, {0, 0, 0, 0});
  EXPECT_EQ(rope(x, positions).to_doubles(), x.to_doubles());
}

TEST(Rope, WorksInPlace) {
  Rng rng(3);
  const Tensor positions = packed_positions(2, 50, {7, 30});
  const Tensor x = random_tensor({2, 50, 4, 32}, rng).to(DType::f32);
  const Tensor expected = rope(x, positions);
  Tensor in_place = x.clone();
  rope_forward(in_place, positions, kTheta, in_place);
  EXPECT_EQ(in_place.to_doubles(), expected.to_doubles());
}

// <rope(x), y> == <x, rope_backward(y)>: the backward is the transpose of the forward map.
TEST(RopeBackward, IsTheTransposeOfTheForward) {
  Rng rng(4);
  const Tensor positions = packed_positions(3, 64, {10, 33, 3});
  const Tensor x = random_tensor({3, 64, 2, 32}, rng);
  const Tensor y = random_tensor({3, 64, 2, 32}, rng);
  const double forward_side = dot(rope(x, positions), y);
  const double backward_side = dot(x, rope(y, positions, true));
  EXPECT_NEAR(forward_side, backward_side, 1e-12 * std::abs(forward_side));
  EXPECT_LT(max_abs_diff(rope(rope(x, positions), positions, true), x), 1e-12);
}

TEST(RopeBackward, MatchesFiniteDifferences) {
  Rng rng(5);
  const Tensor positions = packed_positions(1, 20, {6, 14});
  Tensor x = random_tensor({1, 20, 2, 8}, rng);
  const Tensor weights = random_tensor(x.shape(), rng);
  const Tensor dx = rope(weights, positions, true);
  const double step = 1e-6;
  double* xs = x.data<double>();
  const auto grad = dx.to_doubles();
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double saved = xs[i];
    xs[i] = saved + step;
    const double up = dot(rope(x, positions), weights);
    xs[i] = saved - step;
    const double down = dot(rope(x, positions), weights);
    xs[i] = saved;
    const double numeric = (up - down) / (2 * step);
    diff += (grad[i] - numeric) * (grad[i] - numeric);
    norm += numeric * numeric;
  }
  EXPECT_LT(std::sqrt(diff / norm), 1e-6);
}

// transformers' dynamic NTK: the plain rotation up to M positions; past it, the plain rotation
// with theta * (factor * L / M - (factor - 1))^(D / (D - 2)), L the call's largest position + 1.
TEST(Rope, DynamicScalingGrowsThetaPastTheOriginalLength) {
  Rng rng(6);
  RopeScaling s;
  s.kind = RopeScaling::Kind::dynamic;
  s.factor = 2.0;
  s.original_max_position_embeddings = 32;
  const RopeParams params(kTheta, s);
  const int64_t dim = 16;
  for (int64_t length : {20, 32, 45}) {
    SCOPED_TRACE(cat("length ", length));
    const Tensor positions = packed_positions(1, length, {length});
    const Tensor x = random_tensor({1, length, 2, dim}, rng);
    Tensor out = Tensor::empty(x.shape(), x.dtype());
    rope_forward(x, positions, params, out);
    const double grown =
        length <= 32 ? kTheta : kTheta * std::pow(2.0 * length / 32.0 - 1.0, dim / (dim - 2.0));
    EXPECT_LT(max_abs_diff(out, naive_rope(x, positions, grown)), 1e-12);
  }
}

// Yarn scales cos and sin by its attention factor: the backward is still the transpose, and
// every pair's length grows by that factor.
TEST(RopeBackward, IsTheTransposeWithYarnsAttentionFactor) {
  Rng rng(7);
  RopeScaling s;
  s.kind = RopeScaling::Kind::yarn;
  s.factor = 4.0;
  s.original_max_position_embeddings = 64;
  s.attention_factor = 0.1 * std::log(4.0) + 1.0;
  const RopeParams params(kTheta, s);
  const Tensor positions = packed_positions(2, 80, {80});
  const Tensor x = random_tensor({2, 80, 2, 16}, rng), y = random_tensor({2, 80, 2, 16}, rng);
  Tensor fx = Tensor::empty(x.shape(), x.dtype()), by = Tensor::empty(y.shape(), y.dtype());
  rope_forward(x, positions, params, fx);
  rope_backward(y, positions, params, by);
  EXPECT_NEAR(dot(fx, y), dot(x, by), 1e-10 * std::abs(dot(fx, y)));
  EXPECT_NEAR(std::sqrt(dot(fx, fx)), s.attention_factor * std::sqrt(dot(x, x)), 1e-9);
}

TEST(Rope, RejectsBadInputs) {
  auto message = [](auto&& call) {
    try {
      call();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const Tensor odd = Tensor::zeros({1, 2, 1, 3}, DType::f64);
  const Tensor positions = Tensor::from<int32_t>({1, 2}, {0, 1});
  Tensor out = Tensor::empty({1, 2, 1, 3}, DType::f64);
  EXPECT_NE(message([&] { rope_forward(odd, positions, kTheta, out); }).find("must be even"),
            std::string::npos);
  const Tensor x = Tensor::zeros({1, 2, 1, 4}, DType::f64);
  Tensor dx = Tensor::empty({1, 2, 1, 4}, DType::f64);
  const Tensor negative = Tensor::from<int32_t>({1, 2}, {0, -1});
  EXPECT_NE(message([&] { rope_backward(x, negative, kTheta, dx); }).find("positions[0,1] = -1"),
            std::string::npos);
  const Tensor wrong_shape = Tensor::from<int32_t>({2, 1}, {0, 1});
  EXPECT_NE(message([&] {
              rope_forward(x, wrong_shape, kTheta, dx);
            }).find("positions has shape (2, 1), expected (B,T) (1, 2)"),
            std::string::npos);
  // What the GPU's rope leaves to its caller: the same check on its own.
  EXPECT_NE(message([&] { check_rope_positions(negative); }).find("positions[0,1] = -1"),
            std::string::npos);
  const Tensor too_far = Tensor::from<int32_t>({2, 2}, {0, 1, 2, (1 << 22) + 1});
  EXPECT_NE(message([&] { check_rope_positions(too_far); }).find("positions[1,1] = 4194305"),
            std::string::npos);
  EXPECT_NE(message([&] {
              check_rope_positions(Tensor::zeros({4}, DType::i32));
            }).find("positions must be (B,T) int32"),
            std::string::npos);
  EXPECT_NO_THROW(check_rope_positions(Tensor::from<int32_t>({1, 3}, {0, 1, 1 << 22})));
}

}  // namespace
}  // namespace pollen::ops
