// Compression: round trips within the stated bound, sizes, hostile payloads, error feedback.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

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

CompressOptions opts(Codec c, int64_t block = 64, int64_t topk = 0,
                     ScaleFormat scale = ScaleFormat::f32) {
  CompressOptions o;
  o.codec = c;
  o.block = block;
  o.scale = scale;
  if (c == Codec::topk) o.topk = topk > 0 ? topk : std::max<int64_t>(1, block / 4);
  return o;
}

std::vector<float> round_trip(const std::vector<float>& x, const CompressOptions& o) {
  std::string enc;
  encode(x.data(), static_cast<int64_t>(x.size()), o, enc);
  std::vector<float> y(x.size());
  decode(reinterpret_cast<const uint8_t*>(enc.data()), enc.size(), static_cast<int64_t>(x.size()),
         o, y.data(), "t");
  return y;
}

constexpr Codec kAllCodecs[] = {Codec::none, Codec::bf16, Codec::int8, Codec::int4, Codec::nf3,
                                Codec::nf2,  Codec::mix,  Codec::sign, Codec::topk};
constexpr ScaleFormat kScaleFormats[] = {ScaleFormat::f32, ScaleFormat::bf16};

// Every codec with float32 scales, and those with block scales with bf16 scales too.
std::vector<std::pair<Codec, ScaleFormat>> codecs_and_scales() {
  std::vector<std::pair<Codec, ScaleFormat>> out;
  for (Codec c : kAllCodecs) out.emplace_back(c, ScaleFormat::f32);
  for (Codec c :
       {Codec::int8, Codec::int4, Codec::nf3, Codec::nf2, Codec::mix, Codec::sign, Codec::topk})
    out.emplace_back(c, ScaleFormat::bf16);
  return out;
}

// The smallest bfloat16 at or above x > 0.
float bf16_ceil(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if (u & 0xffffu) u = (u | 0xffffu) + 1;
  std::memcpy(&x, &u, 4);
  return x;
}

}  // namespace

TEST(Compress, RoundTripWithinStatedBound) {
  for (ScaleFormat scale : kScaleFormats) {
    for (Codec c : kAllCodecs) {
      for (int64_t n : {1, 7, 64, 1000, 4097}) {
        for (int64_t block : {1, 32, 64, 100, 300}) {  // 300: topk's 2-byte indices
          auto x = random_values(n, static_cast<uint64_t>(n * 31 + block), 1e-3);
          if (n > 3) x[3] = 0;  // zeros stay zero
          std::string enc;
          const auto o = opts(c, block, 0, scale);
          encode(x.data(), n, o, enc);
          ASSERT_EQ(enc.size(), encoded_bytes(o, n));
          // sign, nf2 and nf3 have no zero level, and mix may code a block with them
          const bool zero_stays =
              c != Codec::sign && c != Codec::nf2 && c != Codec::nf3 && c != Codec::mix;
          std::vector<float> y(static_cast<size_t>(n));
          decode(reinterpret_cast<const uint8_t*>(enc.data()), enc.size(), n, o, y.data(), "t");
          const auto bound = error_bound(x.data(), n, o);
          for (int64_t i = 0; i < n; ++i) {
            const auto k = static_cast<size_t>(i);
            ASSERT_LE(std::fabs(y[k] - x[k]), bound[k])
                << codec_name(c) << " n=" << n << " block=" << block << " i=" << i
                << " scale=" << scale_format_name(scale);
          }
          if (n > 3 && zero_stays) EXPECT_EQ(y[3], 0.0f);
          if (c == Codec::none) EXPECT_EQ(x, y);
        }
      }
    }
  }
}

TEST(Compress, TinyValuesStayWithinTheBoundInBothScaleFormats) {
  // Blocks whose scale is below float32's normal range: 1 / s overflows float32, and bfloat16's
  // steps there are 2^-133, far coarser than 2^-7 s.
  for (ScaleFormat scale : kScaleFormats) {
    for (Codec c : {Codec::int8, Codec::int4, Codec::nf3, Codec::nf2, Codec::sign, Codec::topk}) {
      for (double magnitude : {1e-36, 1e-39, 1e-42}) {
        auto x = random_values(64, 7, magnitude);
        x[5] = 0;
        const auto o = opts(c, 16, 4, scale);
        const auto y = round_trip(x, o);
        const auto bound = error_bound(x.data(), 64, o);
        for (size_t i = 0; i < x.size(); ++i) {
          ASSERT_LE(std::fabs(y[i] - x[i]), bound[i])
              << codec_name(c) << " " << scale_format_name(scale) << " " << magnitude << " i=" << i;
        }
        if (c == Codec::int8 || c == Codec::int4 || c == Codec::topk) EXPECT_EQ(y[5], 0.0f);
      }
    }
  }
}

TEST(Compress, SizesAreWhatTheDocsSay) {
  EXPECT_EQ(encoded_bytes(opts(Codec::none), 1000), 4000u);
  EXPECT_EQ(encoded_bytes(opts(Codec::bf16), 1000), 2000u);
  EXPECT_EQ(encoded_bytes(opts(Codec::int8), 1000), 16 * 4 + 1000u);
  EXPECT_EQ(encoded_bytes(opts(Codec::int4), 1001), 16 * 4 + 501u);
  EXPECT_EQ(encoded_bytes(opts(Codec::sign), 1001), 16 * 4 + 126u);
  EXPECT_EQ(encoded_bytes(opts(Codec::nf2), 1001), 16 * 4 + 251u);
  EXPECT_EQ(encoded_bytes(opts(Codec::nf3), 1001), 16 * 4 + 376u);  // 3003 bits
  // 4 blocks (the last of 232 values), 16 kept in each: scale, then 1-byte index and value each
  EXPECT_EQ(encoded_bytes(opts(Codec::topk, 256, 16), 1000), 4 * 4 + 64 * 2u);
  // blocks of 300 take 2-byte indices; the last block (100 values) keeps 16 too
  EXPECT_EQ(encoded_bytes(opts(Codec::topk, 300, 16), 1000), 4 * 4 + 64 * 3u);
  // a last block shorter than topk keeps all of its values
  EXPECT_EQ(encoded_bytes(opts(Codec::topk, 8, 6), 10), 2 * 4 + 8 * 2u);
  // bf16 scales: 2 bytes a block; codecs without scales are unchanged
  const auto bf = ScaleFormat::bf16;
  EXPECT_EQ(encoded_bytes(opts(Codec::none, 64, 0, bf), 1000), 4000u);
  EXPECT_EQ(encoded_bytes(opts(Codec::bf16, 64, 0, bf), 1000), 2000u);
  EXPECT_EQ(encoded_bytes(opts(Codec::int8, 64, 0, bf), 1000), 16 * 2 + 1000u);
  EXPECT_EQ(encoded_bytes(opts(Codec::int4, 64, 0, bf), 1001), 16 * 2 + 501u);
  EXPECT_EQ(encoded_bytes(opts(Codec::sign, 64, 0, bf), 1001), 16 * 2 + 126u);
  EXPECT_EQ(encoded_bytes(opts(Codec::nf2, 64, 0, bf), 1001), 16 * 2 + 251u);
  EXPECT_EQ(encoded_bytes(opts(Codec::topk, 256, 16, bf), 1000), 4 * 2 + 64 * 2u);
}

TEST(Compress, Bf16ScalesRoundUpAndValuesAreCodedAgainstTheStoredScale) {
  // int8: s = amax / 127 = 1 + 2^-9, which rounded to the nearest bfloat16 would be 1, below s;
  // stored, it is rounded up to 1 + 2^-7, and the values are coded against that.
  const float amax = 127.0f * (1 + std::ldexp(1.0f, -9));
  const std::vector<float> x{amax, -amax / 2, 0.25f, 0};
  const auto o = opts(Codec::int8, 4, 0, ScaleFormat::bf16);
  std::string enc;
  encode(x.data(), 4, o, enc);
  uint16_t stored;
  std::memcpy(&stored, enc.data(), 2);
  EXPECT_EQ(stored, 0x3f81);  // 1 + 2^-7
  const float s = bf16_ceil(amax / 127);
  EXPECT_EQ(s, 1 + std::ldexp(1.0f, -7));
  const auto y = round_trip(x, o);
  EXPECT_EQ(y[0], 126 * s);  // amax / s = 126.26
  EXPECT_EQ(y[1], -63 * s);  // amax / 2s = 63.13
  EXPECT_EQ(y[2], 0.0f);     // 0.25 / s = 0.248
  // nf2 codes against the stored scale: cuts at +-0.9816 s' with s' = bf16_ceil(s)
  const std::vector<float> z{1, -3, 0, 2};
  const auto y2 = round_trip(z, opts(Codec::nf2, 4, 0, ScaleFormat::bf16));
  const float s2 = bf16_ceil(static_cast<float>(1.5 * std::sqrt(std::acos(-1.0) / 2)));
  const std::vector<float> want{0.4528f * s2, -1.5104f * s2, 0.4528f * s2, 1.5104f * s2};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_FLOAT_EQ(y2[i], want[i]) << i;
  // a scale past bfloat16's largest finite value is refused, not sent as infinity
  const float max = std::numeric_limits<float>::max();
  const std::vector<float> huge{max, max, max, max};  // sign's scale: mean|x| = max
  EXPECT_THROW(encode(huge.data(), 4, opts(Codec::sign, 4, 0, ScaleFormat::bf16), enc), Error);
  // int8: max / 127 rounds up to a scale whose code 127 would overflow: refused, not sent
  EXPECT_THROW(encode(huge.data(), 4, opts(Codec::int8, 4, 0, ScaleFormat::bf16), enc), Error);
  EXPECT_THROW(encode(huge.data(), 4, opts(Codec::int8, 4), enc), Error);
  EXPECT_EQ(parse_scale_format("bf16"), ScaleFormat::bf16);
  EXPECT_EQ(parse_scale_format("float32"), ScaleFormat::f32);
  EXPECT_THROW(parse_scale_format("fp8"), Error);
}

TEST(Compress, SignSendsTheBlocksMeanMagnitude) {
  // s = mean |x| per block, then +-s by sign (zero counts as positive)
  const std::vector<float> x{1, -3, 0, 2, -0.5f, 0.25f};
  const auto y = round_trip(x, opts(Codec::sign, 4));
  const std::vector<float> want{1.5f, -1.5f, 1.5f, 1.5f, -0.375f, 0.375f};
  EXPECT_EQ(y, want);
}

TEST(Compress, Nf2CutsAtTheNormalLloydMaxPoints) {
  // s = mean|x| sqrt(pi / 2) = 1.88; cuts at 0 and +-0.9816 s = +-1.845
  const std::vector<float> x{1, -3, 0, 2, -1.8f, 1.9f};
  const auto y = round_trip(x, opts(Codec::nf2, 4));
  const auto s = static_cast<float>(1.5 * std::sqrt(std::acos(-1.0) / 2));
  const auto t = static_cast<float>(1.85 * std::sqrt(std::acos(-1.0) / 2));  // the last block
  const std::vector<float> want{0.4528f * s, -1.5104f * s, 0.4528f * s,
                                1.5104f * s, -0.4528f * t, 0.4528f * t};
  ASSERT_EQ(y.size(), want.size());
  for (size_t i = 0; i < y.size(); ++i) EXPECT_FLOAT_EQ(y[i], want[i]) << i;
}

TEST(Compress, Nf3CutsAtTheNormalLloydMaxPointsAndPacksThreeBitsAValue) {
  // one block of 16: mean|x| = 0.38125, s = mean|x| sqrt(pi / 2) = 0.4778; cuts at 0, +-0.2392,
  // +-0.5017 and +-0.8352, so the first eight values land in each level once, in a shuffled order
  // whose codes straddle byte boundaries, and the zeros in the level just above 0
  std::vector<float> x{1.6f, -0.1f, 0.4f, -1.9f, 0.1f, -0.4f, 0.8f, -0.8f};
  x.resize(16, 0.0f);
  const auto o = opts(Codec::nf3, 16);
  std::string enc;
  encode(x.data(), 16, o, enc);
  ASSERT_EQ(enc.size(), 4u + 6u);
  // value i at bits 3i .. 3i + 2 of the stream, low bits first
  const uint64_t codes[16] = {7, 3, 5, 0, 4, 2, 6, 1, 4, 4, 4, 4, 4, 4, 4, 4};
  uint64_t stream = 0;
  for (int i = 0; i < 16; ++i) stream |= codes[i] << (3 * i);
  for (int byte = 0; byte < 6; ++byte)
    EXPECT_EQ(static_cast<uint8_t>(enc[static_cast<size_t>(4 + byte)]),
              (stream >> (8 * byte)) & 0xffu)
        << byte;
  const auto y = round_trip(x, o);
  const auto s = static_cast<float>(0.38125 * std::sqrt(std::acos(-1.0) / 2));
  const float levels[8] = {-2.1519f, -1.3439f, -0.7560f, -0.2451f,
                           0.2451f,  0.7560f,  1.3439f,  2.1519f};
  for (size_t i = 0; i < y.size(); ++i) EXPECT_FLOAT_EQ(y[i], levels[codes[i]] * s) << i;
}

TEST(Compress, TopkKeepsTheLargestMagnitudesOfEachBlock) {
  const std::vector<float> x{0.1f, -5, 3, 0.2f, 4, -0.3f, 0, 1, 1, -1, 1, 0.5f};
  const auto y = round_trip(x, opts(Codec::topk, 4, 2));
  const float s0 = 5.0f / 127, s1 = 4.0f / 127, s2 = 1.0f / 127;
  const std::vector<float> want{0,        -127 * s0, 76 * s0, 0,        // -5 and 3 (3 / s0 = 76.2)
                                127 * s1, 0,         0,       32 * s1,  // 4 and 1 (1 / s1 = 31.75)
                                127 * s2, -127 * s2, 0,       0};  // ties go to the lower index
  ASSERT_EQ(y.size(), want.size());
  for (size_t i = 0; i < y.size(); ++i) EXPECT_FLOAT_EQ(y[i], want[i]) << i;
}

TEST(Compress, HostilePayloadsAreRefused) {
  const auto x = random_values(10, 1);
  std::vector<float> y(10);
  for (Codec c : kAllCodecs) {
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
  // sign: the bits past the last value must be zero
  enc.clear();
  encode(x.data(), 10, opts(Codec::sign, 4), enc);
  enc.back() = static_cast<char>(enc.back() | 0x80);
  EXPECT_THROW(decode(reinterpret_cast<const uint8_t*>(enc.data()), enc.size(), 10,
                      opts(Codec::sign, 4), y.data(), "t"),
               Error);
  // nf2 likewise (10 values: 2 of 4 in the last byte)
  enc.clear();
  encode(x.data(), 10, opts(Codec::nf2, 4), enc);
  enc.back() = static_cast<char>(enc.back() | 0x40);
  EXPECT_THROW(decode(reinterpret_cast<const uint8_t*>(enc.data()), enc.size(), 10,
                      opts(Codec::nf2, 4), y.data(), "t"),
               Error);
  // nf3 likewise (10 values: 30 bits, 2 unused in the last byte)
  enc.clear();
  encode(x.data(), 10, opts(Codec::nf3, 4), enc);
  ASSERT_EQ(enc.size(), 3 * 4 + 4u);
  enc.back() = static_cast<char>(enc.back() | 0x40);
  EXPECT_THROW(decode(reinterpret_cast<const uint8_t*>(enc.data()), enc.size(), 10,
                      opts(Codec::nf3, 4), y.data(), "t"),
               Error);
  // topk: a block's indices must ascend strictly and stay inside the block (blocks 4, 4, 2)
  const auto topk = opts(Codec::topk, 4, 2);
  enc.clear();
  encode(x.data(), 10, topk, enc);
  const size_t indices = 3 * 4;
  auto refused = [&](size_t at, char value) {
    std::string bad = enc;
    bad[at] = value;
    EXPECT_THROW(
        decode(reinterpret_cast<const uint8_t*>(bad.data()), bad.size(), 10, topk, y.data(), "t"),
        Error)
        << "index byte " << at << " = " << int(value);
  };
  refused(indices + 1, enc[indices]);  // a repeated index
  refused(indices, 4);                 // past the first block
  refused(indices + 5, 2);             // past the short last block
  std::string bad = enc;
  std::swap(bad[indices], bad[indices + 1]);  // descending
  EXPECT_THROW(
      decode(reinterpret_cast<const uint8_t*>(bad.data()), bad.size(), 10, topk, y.data(), "t"),
      Error);
  bad = enc;
  bad[indices + 6] = '\x80';  // the first kept value: -128
  EXPECT_THROW(
      decode(reinterpret_cast<const uint8_t*>(bad.data()), bad.size(), 10, topk, y.data(), "t"),
      Error);
  // bf16 scales: infinite, NaN or negative ones are refused
  for (Codec c : {Codec::int8, Codec::nf2, Codec::sign, Codec::topk}) {
    const auto o = opts(c, 4, 2, ScaleFormat::bf16);
    for (uint16_t scale : {0x7f80, 0x7fc0, 0xbf80}) {
      bad.clear();
      encode(x.data(), 10, o, bad);
      std::memcpy(bad.data() + 2, &scale, 2);  // the second block's
      EXPECT_THROW(
          decode(reinterpret_cast<const uint8_t*>(bad.data()), bad.size(), 10, o, y.data(), "t"),
          Error)
          << codec_name(c) << " " << scale;
    }
  }
  // a scale so large that its largest level overflows to infinity
  for (Codec c : {Codec::int8, Codec::nf2, Codec::topk}) {
    bad.clear();
    encode(x.data(), 10, opts(c, 4, 2), bad);
    const float huge = std::numeric_limits<float>::max();
    std::memcpy(bad.data(), &huge, 4);
    EXPECT_THROW(decode(reinterpret_cast<const uint8_t*>(bad.data()), bad.size(), 10, opts(c, 4, 2),
                        y.data(), "t"),
                 Error)
        << codec_name(c);
  }
  EXPECT_THROW(opts(Codec::topk, 4, 5).validate(), Error);        // more than the block
  EXPECT_THROW(opts(Codec::topk, 1 << 17, 5).validate(), Error);  // indices are 16-bit
}

TEST(Compress, MutatedPayloadsDecodeToFiniteValuesOrAreRefused) {
  // Valid payloads with random bytes overwritten: the decoder either refuses them or returns
  // finite values only, for every codec, whatever the bytes say.
  Rng rng(11);
  const int64_t n = 37;  // blocks of 8 with a short last one; topk keeps 3 of each
  const auto x = random_values(n, 12);
  std::vector<float> y(static_cast<size_t>(n));
  for (const auto& [c, scale] : codecs_and_scales()) {
    const auto o = opts(c, 8, 3, scale);
    std::string enc;
    encode(x.data(), n, o, enc);
    int refused = 0;
    for (int trial = 0; trial < 2000; ++trial) {
      std::string bad = enc;
      for (int k = 0; k < 1 + trial % 4; ++k)
        bad[rng.next_u64() % bad.size()] = static_cast<char>(rng.next_u64() & 0xff);
      try {
        decode(reinterpret_cast<const uint8_t*>(bad.data()), bad.size(), n, o, y.data(), "t");
      } catch (const Error&) {
        ++refused;
        continue;
      }
      for (float v : y) ASSERT_TRUE(std::isfinite(v)) << codec_name(c) << " trial " << trial;
    }
    if (c == Codec::none || c == Codec::bf16) continue;  // most of their bytes are free
    EXPECT_GT(refused, 0) << codec_name(c);
  }
}

TEST(Compress, NonFiniteValuesAreRefusedBeforeEncoding) {
  for (Codec c : {Codec::int8, Codec::int4, Codec::nf2, Codec::sign, Codec::topk}) {
    for (float bad : {std::nanf(""), std::numeric_limits<float>::infinity()}) {
      auto x = random_values(10, 3);
      x[6] = bad;  // refused before top-k chooses, whatever its magnitude
      std::string enc;
      EXPECT_THROW(encode(x.data(), 10, opts(c, 4, 2), enc), Error) << codec_name(c) << " " << bad;
    }
  }
}

TEST(Compress, ErrorFeedbackSumsToTheOriginal) {
  // Over R rounds: sum of decoded updates + the residual left = sum of the true updates.
  for (const auto& [c, scale] : codecs_and_scales()) {
    if (c == Codec::none) continue;  // nothing lost, nothing kept
    const auto o = opts(c, 16, 0, scale);
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
    if (c == Codec::topk) continue;  // what is unsent waits until it is among the largest
    // and what is still owed is no more than one round's compression error
    double amax = 0;
    for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(static_cast<double>(res[i])));
    const bool coarse = c == Codec::sign || c == Codec::nf2 || c == Codec::mix;
    const bool medium = c == Codec::int4 || c == Codec::nf3;
    EXPECT_LT(amax, coarse ? 0.05 : medium ? 0.02 : 0.005) << codec_name(c);
    EXPECT_LT(worst_without, coarse ? 0.05 : 0.03) << codec_name(c);
  }
}
