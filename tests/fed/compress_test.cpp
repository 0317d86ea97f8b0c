// Compression: round trips within the stated bound, sizes, hostile payloads, error feedback.
#include <gtest/gtest.h>

#include <cmath>

#include "base/rng.h"
#include "fed/compress.h"

using namespace pollen;
using namespace pollen::fed;

namespace {

std::vector<float> random_values(int64_t n, uint64_t seed, double scale = 1.0) {
  Rng rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<float>(scale * rng.normal());
  return v;
}

CompressOptions opts(Codec c, int64_t block = 64) {
  CompressOptions o;
  o.codec = c;
  o.block = block;
  return o;
}

}  // namespace

TEST(Compress, RoundTripWithinStatedBound) {
  for (Codec c : {Codec::none, Codec::bf16, Codec::int8, Codec::int4}) {
    for (int64_t n : {1, 7, 64, 1000, 4097}) {
      for (int64_t block : {1, 32, 64, 100}) {
        auto x = random_values(n, static_cast<uint64_t>(n * 31 + block), 1e-3);
        if (n > 3) x[3] = 0;  // zeros stay zero
        std::string enc;
        const auto o = opts(c, block);
        encode(x.data(), n, o, enc);
        ASSERT_EQ(enc.size(), encoded_bytes(c, n, block));
        std::vector<float> y(static_cast<size_t>(n));
        decode(reinterpret_cast<const uint8_t*>(enc.data()), enc.size(), n, o, y.data(), "t");
        const auto bound = error_bound(x.data(), n, o);
        for (int64_t i = 0; i < n; ++i) {
          const auto k = static_cast<size_t>(i);
          ASSERT_LE(std::fabs(y[k] - x[k]), bound[k])
              << codec_name(c) << " n=" << n << " block=" << block << " i=" << i;
        }
        if (n > 3) EXPECT_EQ(y[3], 0.0f);
        if (c == Codec::none) EXPECT_EQ(x, y);
      }
    }
  }
}

TEST(Compress, SizesAreWhatTheDocsSay) {
  EXPECT_EQ(encoded_bytes(Codec::none, 1000, 64), 4000u);
  EXPECT_EQ(encoded_bytes(Codec::bf16, 1000, 64), 2000u);
  EXPECT_EQ(encoded_bytes(Codec::int8, 1000, 64), 16 * 4 + 1000u);
  EXPECT_EQ(encoded_bytes(Codec::int4, 1001, 64), 16 * 4 + 501u);
}

TEST(Compress, HostilePayloadsAreRefused) {
  const auto x = random_values(10, 1);
  std::vector<float> y(10);
  for (Codec c : {Codec::none, Codec::bf16, Codec::int8, Codec::int4}) {
    std::string enc;
    encode(x.data(), 10, opts(c, 4), enc);
    auto* p = reinterpret_cast<const uint8_t*>(enc.data());
    EXPECT_THROW(decode(p, enc.size() - 1, 10, opts(c, 4), y.data(), "t"), Error);
    std::string bad = enc;
    if (c == Codec::none) {
      const float nan = NAN;
      std::memcpy(bad.data() + 8, &nan, 4);
    } else if (c == Codec::bf16) {
      bad[2] = '\x80', bad[3] = '\x7f';  // +inf
    } else {
      const float neg = -1.0f;
      std::memcpy(bad.data(), &neg, 4);  // a negative scale
    }
    EXPECT_THROW(decode(reinterpret_cast<const uint8_t*>(bad.data()), bad.size(), 10, opts(c, 4),
                        y.data(), "t"),
                 Error)
        << codec_name(c);
  }
  std::string enc;
  encode(x.data(), 10, opts(Codec::int8, 4), enc);
  enc[3 * 4 + 2] = '\x80';  // -128 after the three scales
  EXPECT_THROW(decode(reinterpret_cast<const uint8_t*>(enc.data()), enc.size(), 10,
                      opts(Codec::int8, 4), y.data(), "t"),
               Error);
  EXPECT_THROW(parse_codec("int2"), Error);
}

TEST(Compress, ErrorFeedbackSumsToTheOriginal) {
  // Over R rounds: sum of decoded updates + the residual left = sum of the true updates.
  for (Codec c : {Codec::bf16, Codec::int8, Codec::int4}) {
    const auto o = opts(c, 16);
    ErrorFeedback ef;
    const int64_t n = 300;
    std::vector<double> sum_true(n, 0), sum_sent(n, 0);
    for (int r = 0; r < 20; ++r) {
      auto x = random_values(n, 100 + static_cast<uint64_t>(r), 1e-2);
      Weights delta{Tensor::from<float>({n}, x)};
      auto payloads = ef.encode(delta, o);
      std::vector<float> y(n);
      decode(reinterpret_cast<const uint8_t*>(payloads[0].data()), payloads[0].size(), n, o,
             y.data(), "t");
      for (int64_t i = 0; i < n; ++i) sum_true[i] += x[i], sum_sent[i] += y[i];
    }
    const float* res = ef.residual()[0].data<float>();
    double worst = 0, worst_without = 0;
    for (int64_t i = 0; i < n; ++i) {
      worst = std::max(worst, std::fabs(sum_sent[i] + res[i] - sum_true[i]));
      worst_without = std::max(worst_without, std::fabs(sum_sent[i] - sum_true[i]));
    }
    EXPECT_LT(worst, 1e-6) << codec_name(c);
    // and what is still owed is no more than one round's compression error
    double amax = 0;
    for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(static_cast<double>(res[i])));
    EXPECT_LT(amax, c == Codec::int4 ? 0.02 : 0.005) << codec_name(c);
    EXPECT_LT(worst_without, 0.03) << codec_name(c);
  }
}
