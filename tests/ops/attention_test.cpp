#include "ops/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "base/rng.h"
#include "base/thread_pool.h"

namespace pollen::ops {
namespace {

struct Dims {
  int64_t batch, seq, heads, kv_heads, head_dim;
};

Tensor random_tensor(const Shape& shape, Rng& rng, DType dtype = DType::f64) {
  std::vector<double> values(static_cast<size_t>(shape_numel(shape)));
  for (double& x : values) x = rng.normal();
  return Tensor::from(shape, values).to(dtype);
}

// Packed documents: each row is cut into runs of random length (1 to max_run tokens).
Tensor random_doc_ids(int64_t batch, int64_t seq, int64_t max_run, Rng& rng) {
  std::vector<int32_t> ids(static_cast<size_t>(batch * seq));
  for (int64_t b = 0; b < batch; ++b) {
    int32_t doc = 0;
    int64_t left = 1 + static_cast<int64_t>(rng.below(static_cast<uint64_t>(max_run)));
    for (int64_t t = 0; t < seq; ++t, --left) {
      if (left == 0) {
        ++doc;
        left = 1 + static_cast<int64_t>(rng.below(static_cast<uint64_t>(max_run)));
      }
      ids[static_cast<size_t>(b * seq + t)] = doc;
    }
  }
  return Tensor::from({batch, seq}, ids);
}

struct Inputs {
  Dims dims;
  Tensor q, k, v, seg_start;
  double scale;
};

Inputs random_inputs(const Dims& d, int64_t max_run, uint64_t seed) {
  Rng rng(seed);
  Inputs in{d,
            random_tensor({d.batch, d.seq, d.heads, d.head_dim}, rng),
            random_tensor({d.batch, d.seq, d.kv_heads, d.head_dim}, rng),
            random_tensor({d.batch, d.seq, d.kv_heads, d.head_dim}, rng),
            segment_starts(random_doc_ids(d.batch, d.seq, max_run, rng)),
            1.0 / std::sqrt(static_cast<double>(d.head_dim))};
  return in;
}

struct Outputs {
  Tensor out, lse;
};

Outputs forward(const Inputs& in, DType dtype = DType::f64) {
  const Dims& d = in.dims;
  Outputs o{Tensor::empty({d.batch, d.seq, d.heads, d.head_dim}, dtype),
            Tensor::empty({d.batch, d.heads, d.seq}, dtype)};
  attention_forward(in.q.to(dtype), in.k.to(dtype), in.v.to(dtype), in.seg_start, in.scale, o.out,
                    o.lse);
  return o;
}

struct Grads {
  Tensor dq, dk, dv;
};

Grads backward(const Inputs& in, const Outputs& o, const Tensor& dout, DType dtype = DType::f64) {
  Grads g{Tensor::empty(in.q.shape(), dtype), Tensor::empty(in.k.shape(), dtype),
          Tensor::empty(in.k.shape(), dtype)};
  attention_backward(in.q.to(dtype), in.k.to(dtype), in.v.to(dtype), in.seg_start, o.out, o.lse,
                     dout.to(dtype), in.scale, g.dq, g.dk, g.dv);
  return g;
}

// The definition, in f64: an explicit (T,T) softmax per head over the keys [seg_start[t], t].
Outputs naive_attention(const Inputs& in) {
  const Dims& d = in.dims;
  const int64_t group = d.heads / d.kv_heads;
  const auto q = in.q.to_doubles(), k = in.k.to_doubles(), v = in.v.to_doubles();
  const int32_t* seg = in.seg_start.data<int32_t>();
  Outputs o{Tensor::zeros({d.batch, d.seq, d.heads, d.head_dim}, DType::f64),
            Tensor::zeros({d.batch, d.heads, d.seq}, DType::f64)};
  double* out = o.out.data<double>();
  double* lse = o.lse.data<double>();
  std::vector<double> scores(static_cast<size_t>(d.seq * d.seq));
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t h = 0; h < d.heads; ++h) {
      const int64_t g = h / group;
      auto q_at = [&](int64_t t, int64_t i) {
        return q[((b * d.seq + t) * d.heads + h) * d.head_dim + i];
      };
      auto kv_at = [&](const std::vector<double>& x, int64_t t, int64_t i) {
        return x[((b * d.seq + t) * d.kv_heads + g) * d.head_dim + i];
      };
      for (int64_t t = 0; t < d.seq; ++t) {
        for (int64_t j = 0; j < d.seq; ++j) {
          const bool visible = j >= seg[b * d.seq + t] && j <= t;
          double s = -std::numeric_limits<double>::infinity();
          if (visible) {
            s = 0;
            for (int64_t i = 0; i < d.head_dim; ++i) s += q_at(t, i) * kv_at(k, j, i);
            s *= in.scale;
          }
          scores[static_cast<size_t>(t * d.seq + j)] = s;
        }
        double max = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < d.seq; ++j) max = std::max(max, scores[t * d.seq + j]);
        double sum = 0;
        for (int64_t j = 0; j < d.seq; ++j) sum += std::exp(scores[t * d.seq + j] - max);
        lse[(b * d.heads + h) * d.seq + t] = max + std::log(sum);
        for (int64_t j = 0; j < d.seq; ++j) {
          const double p = std::exp(scores[t * d.seq + j] - max) / sum;
          for (int64_t i = 0; i < d.head_dim; ++i)
            out[((b * d.seq + t) * d.heads + h) * d.head_dim + i] += p * kv_at(v, j, i);
        }
      }
    }
  }
  return o;
}

// max |a - b| / max |b|.
double relative_error(const Tensor& a, const Tensor& b) {
  const auto x = a.to_doubles(), y = b.to_doubles();
  EXPECT_EQ(x.size(), y.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    diff = std::max(diff, std::abs(x[i] - y[i]));
    scale = std::max(scale, std::abs(y[i]));
  }
  return diff / std::max(scale, 1e-300);
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

TEST(SegmentStarts, StartANewRunWheneverTheDocumentChanges) {
  const Tensor ids = Tensor::from<int32_t>({2, 6}, {0, 0, 1, 1, 1, 2, 7, 3, 3, 7, 7, 7});
  const Tensor starts = segment_starts(ids);
  const std::vector<double> expected{0, 0, 2, 2, 2, 5, 0, 1, 1, 3, 3, 3};
  EXPECT_EQ(starts.to_doubles(), expected);
}

// T=2, D=2, scale 1. Token 0 sees only key 0: out = v0, lse = q0.k0 = 1. Token 1 scores
// q1.k0 = 0 and q1.k1 = ln 3, so weights 1/4 and 3/4: out = (1,2)/4 + 3(3,4)/4, lse = ln 4.
TEST(AttentionForward, HandComputedTinyCase) {
  const double ln3 = std::log(3.0);
  for (DType dtype : {DType::f64, DType::f32}) {
    const Tensor q = Tensor::from<double>({1, 2, 1, 2}, {1, 0, 0, ln3}).to(dtype);
    const Tensor k = Tensor::from<double>({1, 2, 1, 2}, {1, 0, 0, 1}).to(dtype);
    const Tensor v = Tensor::from<double>({1, 2, 1, 2}, {1, 2, 3, 4}).to(dtype);
    const Tensor seg_start = Tensor::from<int32_t>({1, 2}, {0, 0});
    Tensor out = Tensor::empty({1, 2, 1, 2}, dtype), lse = Tensor::empty({1, 1, 2}, dtype);
    attention_forward(q, k, v, seg_start, 1.0, out, lse);
    const double tol = dtype == DType::f64 ? 1e-14 : 1e-6;
    const auto o = out.to_doubles(), l = lse.to_doubles();
    EXPECT_NEAR(o[0], 1.0, tol);
    EXPECT_NEAR(o[1], 2.0, tol);
    EXPECT_NEAR(o[2], 2.5, tol);
    EXPECT_NEAR(o[3], 3.5, tol);
    EXPECT_NEAR(l[0], 1.0, tol);
    EXPECT_NEAR(l[1], std::log(4.0), tol);
  }
}

TEST(AttentionForward, MatchesNaiveReferenceOnPackedDocuments) {
  uint64_t seed = 1;
  for (int64_t seq : {1, 7, 33, 130}) {
    for (int64_t head_dim : {8, 16, 64}) {
      for (int64_t kv_heads : {1, 2, 4}) {
        SCOPED_TRACE(cat("T=", seq, " D=", head_dim, " KVH=", kv_heads));
        const Inputs in = random_inputs({2, seq, 4, kv_heads, head_dim}, 45, ++seed);
        const Outputs expected = naive_attention(in);
        const Outputs got = forward(in);
        EXPECT_LT(relative_error(got.out, expected.out), 1e-12);
        EXPECT_LT(relative_error(got.lse, expected.lse), 1e-12);
        const Outputs single = forward(in, DType::f32);
        EXPECT_LT(relative_error(single.out, expected.out), 1e-5);
        EXPECT_LT(relative_error(single.lse, expected.lse), 1e-5);
      }
    }
  }
}

TEST(AttentionForward, KeysInOtherDocumentsOrInTheFutureDoNotMatter) {
  for (DType dtype : {DType::f64, DType::f32}) {
    Inputs in = random_inputs({1, 130, 4, 2, 16}, 40, 7);
    const int32_t* seg = in.seg_start.data<int32_t>();
    const int64_t changed = 70;  // a key in the middle of some document
    const Outputs before = forward(in, dtype);
    double* k = in.k.data<double>();
    double* v = in.v.data<double>();
    for (int64_t i = 0; i < 2 * 16; ++i) {
      k[changed * 2 * 16 + i] = 1e6;
      v[changed * 2 * 16 + i] = -1e6;
    }
    const Outputs after = forward(in, dtype);
    const auto o0 = before.out.to_doubles(), o1 = after.out.to_doubles();
    for (int64_t t = 0; t < 130; ++t) {
      const bool sees_changed_key = seg[t] <= changed && changed <= t;
      for (int64_t i = 0; i < 4 * 16; ++i) {
        const size_t at = static_cast<size_t>(t * 4 * 16 + i);
        if (sees_changed_key) {
          EXPECT_NE(o0[at], o1[at]) << "t=" << t;
        } else {
          EXPECT_EQ(o0[at], o1[at]) << "t=" << t;
        }
      }
    }
  }
}

// Central differences of loss = sum(out * weights) against the analytic gradients, at `checks`
// elements of each input (all of them when there are fewer).
void check_gradients(const Dims& d, uint64_t seed, int64_t checks) {
  SCOPED_TRACE(cat("T=", d.seq, " H=", d.heads, " KVH=", d.kv_heads, " D=", d.head_dim));
  Inputs in = random_inputs(d, 50, seed);
  Rng rng(seed + 1000);
  const Tensor weights = random_tensor({d.batch, d.seq, d.heads, d.head_dim}, rng);
  const Grads grads = backward(in, forward(in), weights);
  auto loss = [&] {
    const auto o = forward(in).out.to_doubles();
    const auto w = weights.to_doubles();
    double sum = 0;
    for (size_t i = 0; i < o.size(); ++i) sum += o[i] * w[i];
    return sum;
  };
  const double step = 1e-6;
  const std::pair<Tensor*, const Tensor*> pairs[] = {
      {&in.q, &grads.dq}, {&in.k, &grads.dk}, {&in.v, &grads.dv}};
  for (auto [input, grad] : pairs) {
    double* x = input->data<double>();
    const double* g = grad->data<double>();
    double diff = 0, norm = 0;
    for (int64_t c = 0; c < std::min(checks, input->numel()); ++c) {
      const int64_t i =
          checks >= input->numel()
              ? c
              : static_cast<int64_t>(rng.below(static_cast<uint64_t>(input->numel())));
      const double saved = x[i];
      x[i] = saved + step;
      const double up = loss();
      x[i] = saved - step;
      const double down = loss();
      x[i] = saved;
      const double numeric = (up - down) / (2 * step);
      diff += (g[i] - numeric) * (g[i] - numeric);
      norm += numeric * numeric;
    }
    EXPECT_GT(norm, 1e-6);
    EXPECT_LT(std::sqrt(diff / norm), 1e-6);
  }
}

TEST(AttentionBackward, MatchesFiniteDifferences) {
  check_gradients({2, 7, 4, 2, 8}, 11, 1000);
  check_gradients({1, 33, 4, 4, 16}, 12, 300);
  check_gradients({1, 130, 4, 1, 8}, 13, 200);
}

TEST(AttentionBackward, SinglePrecisionMatchesDouble) {
  const Inputs in = random_inputs({2, 130, 4, 2, 64}, 60, 21);
  Rng rng(22);
  const Tensor dout = random_tensor(in.q.shape(), rng);
  const Grads expected = backward(in, forward(in), dout);
  const Grads single = backward(in, forward(in, DType::f32), dout, DType::f32);
  EXPECT_LT(relative_error(single.dq, expected.dq), 1e-5);
  EXPECT_LT(relative_error(single.dk, expected.dk), 1e-5);
  EXPECT_LT(relative_error(single.dv, expected.dv), 1e-5);
}

// Each output element is computed by one task in a fixed order, so the thread count cannot
// change a single bit.
TEST(Attention, BitwiseReproducibleAcrossRunsAndThreadCounts) {
  const Inputs in = random_inputs({2, 200, 6, 2, 64}, 90, 31);
  Rng rng(32);
  const Tensor dout = random_tensor(in.q.shape(), rng, DType::f32);
  auto run = [&] {
    const Outputs o = forward(in, DType::f32);
    const Grads g = backward(in, o, dout, DType::f32);
    return std::vector<Tensor>{o.out, o.lse, g.dq, g.dk, g.dv};
  };
  const int threads = num_threads();
  set_num_threads(1);
  const auto one_thread = run();
  set_num_threads(2);
  const auto two_threads = run(), two_threads_again = run();
  set_num_threads(threads);
  for (size_t i = 0; i < one_thread.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(two_threads[i], two_threads_again[i])) << "tensor " << i;
    EXPECT_TRUE(bitwise_equal(one_thread[i], two_threads[i])) << "tensor " << i;
  }
}

TEST(Attention, RejectsBadInputsNamingTheTensor) {
  const Inputs in = random_inputs({1, 5, 4, 2, 8}, 3, 41);
  Tensor out = Tensor::empty({1, 5, 4, 8}, DType::f64);
  Tensor lse = Tensor::empty({1, 5, 4}, DType::f64);  // should be (B,H,T) = (1, 4, 5)
  auto message = [](auto&& call) {
    try {
      call();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] {
              attention_forward(in.q, in.k, in.v, in.seg_start, 1.0, out, lse);
            }).find("lse has shape (1, 5, 4), expected (B,H,T) (1, 4, 5)"),
            std::string::npos);
  Tensor good_lse = Tensor::empty({1, 4, 5}, DType::f64);
  const Tensor k3 = Tensor::zeros({1, 5, 3, 8}, DType::f64);
  EXPECT_NE(message([&] {
              attention_forward(in.q, k3, k3, in.seg_start, 1.0, out, good_lse);
            }).find("multiple of KVH = 3"),
            std::string::npos);
  EXPECT_NE(message([&] {
              attention_forward(in.q, in.k.to(DType::f32), in.v, in.seg_start, 1.0, out, good_lse);
            }).find("k has dtype f32, expected f64"),
            std::string::npos);
  const Tensor strided_v = in.v.transpose(1, 2).contiguous().transpose(1, 2);
  EXPECT_NE(message([&] {
              attention_forward(in.q, in.k, strided_v, in.seg_start, 1.0, out, good_lse);
            }).find("v must be contiguous"),
            std::string::npos);
  const Tensor bad_seg = Tensor::from<int32_t>({1, 5}, {0, 0, 3, 3, 3});
  EXPECT_NE(message([&] {
              attention_forward(in.q, in.k, in.v, bad_seg, 1.0, out, good_lse);
            }).find("seg_start[0,2] = 3"),
            std::string::npos);
}

}  // namespace
}  // namespace pollen::ops
