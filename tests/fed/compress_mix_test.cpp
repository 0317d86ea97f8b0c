// mix: nf2's bytes, spent on the blocks that moved; its layout and its refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "base/rng.h"
#include "fed/compress.h"

using namespace pollen;
using namespace pollen::fed;

namespace {

CompressOptions opts(Codec c, int64_t block, ScaleFormat scale = ScaleFormat::f32) {
  CompressOptions o;
  o.codec = c;
  o.block = block;
  o.scale = scale;
  return o;
}

std::vector<float> round_trip(const std::vector<float>& x, const CompressOptions& o) {
  std::string enc;
  encode(x.data(), static_cast<int64_t>(x.size()), o, enc);
  EXPECT_EQ(enc.size(), encoded_bytes(o, static_cast<int64_t>(x.size())));
  std::vector<float> y(x.size());
  decode(reinterpret_cast<const uint8_t*>(enc.data()), enc.size(), static_cast<int64_t>(x.size()),
         o, y.data(), "t");
  return y;
}

double squared_error(const std::vector<float>& x, const std::vector<float>& y, size_t lo = 0,
                     size_t hi = SIZE_MAX) {
  double e = 0;
  for (size_t i = lo; i < std::min(hi, x.size()); ++i) e += (double(y[i]) - x[i]) * (y[i] - x[i]);
  return e;
}

// `blocks` blocks of 64: the first `moving` normal with sigma 1 (block b scaled by 1 + b / 8),
// the rest zeros, as the embedding rows of tokens no silo saw this round.
std::vector<float> rows(int64_t blocks, int64_t moving, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> x(static_cast<size_t>(blocks * 64), 0.0f);
  for (int64_t i = 0; i < moving * 64; ++i)
    x[static_cast<size_t>(i)] = static_cast<float>((1 + double(i / 64) / 8) * rng.normal());
  return x;
}

}  // namespace

TEST(CompressMix, MovesNf2sBytesAndThreeBitsABlock) {
  for (ScaleFormat scale : {ScaleFormat::f32, ScaleFormat::bf16}) {
    for (int64_t n : {1, 63, 64, 1000, 4097}) {
      for (int64_t block : {1, 7, 64, 300}) {
        // nf2's bytes for each block alone, and 3 bits a block for its level.
        const int64_t blocks = (n + block - 1) / block;
        uint64_t nf2 = 0;
        for (int64_t b = 0; b < blocks; ++b)
          nf2 += encoded_bytes(opts(Codec::nf2, block, scale), std::min(block, n - b * block));
        EXPECT_EQ(encoded_bytes(opts(Codec::mix, block, scale), n), nf2 + (3 * blocks + 7) / 8);
        if (block % 4 == 0)  // then each block's codes end on a byte: nf2's bytes for the whole
          EXPECT_EQ(nf2, encoded_bytes(opts(Codec::nf2, block, scale), n));
      }
    }
  }
}

TEST(CompressMix, SpendsTheZeroBlocksBitsOnTheOthers) {
  // Half the blocks zero: nf2 spends 2.5 bits a value on them for nothing; mix sends them as
  // 3-bit levels and codes the moving half at about 5 bits a value: int4 (4.5 with its scale)
  // or finer, never worse than int4 alone would, and about ten times closer than nf2.
  const auto x = rows(32, 16, 1);
  const auto mixed = round_trip(x, opts(Codec::mix, 64));
  const auto nf2 = round_trip(x, opts(Codec::nf2, 64));
  const auto int4 = round_trip(x, opts(Codec::int4, 64));
  for (size_t i = 16 * 64; i < x.size(); ++i) ASSERT_EQ(mixed[i], 0.0f) << i;
  EXPECT_LE(squared_error(x, mixed), squared_error(x, int4));
  EXPECT_LT(squared_error(x, mixed) * 8, squared_error(x, nf2));
}

TEST(CompressMix, GivesTheLargerBlocksTheFinerCodes) {
  // No zero blocks, energies rising block by block: with nf2's budget (less the levels' 3 bits
  // a block) the larger blocks take finer codes than the smaller ones, and the total error is
  // below nf2's, which codes every block alike.
  const auto x = rows(32, 32, 2);
  const auto o = opts(Codec::mix, 64);
  std::string enc;
  encode(x.data(), static_cast<int64_t>(x.size()), o, enc);
  std::vector<int> level(32);
  for (size_t b = 0; b < 32; ++b) {
    const size_t bit = 3 * b;
    unsigned v = static_cast<uint8_t>(enc[bit / 8]);
    v |= static_cast<unsigned>(static_cast<uint8_t>(enc[bit / 8 + 1])) << 8;
    level[b] = static_cast<int>((v >> (bit % 8)) & 7u);
  }
  EXPECT_LT(level.front(), level.back());
  int first = 0, last = 0;
  for (size_t b = 0; b < 8; ++b) first += level[b], last += level[24 + b];
  EXPECT_LT(first, last);
  const auto mixed = round_trip(x, o);
  EXPECT_LT(squared_error(x, mixed), squared_error(x, round_trip(x, opts(Codec::nf2, 64))));
}

TEST(CompressMix, LayoutIsLevelsThenEachBlocksCodingThenZeros) {
  // blocks of 8 with bf16 scales: zeros (level 0), then integers that int4 codes exactly
  // (s = 7 / 7). The levels take one byte (two 3-bit levels), then nf2's bytes for the values,
  // 2 x (2 + 2) = 8: int8 (2 + 8) does not fit, int4 (2 + 4) does, and the last 2 bytes are zero.
  std::vector<float> x(8, 0.0f);
  for (float v : {1, -2, 3, -4, 5, -6, 7, -7}) x.push_back(v);
  const auto o = opts(Codec::mix, 8, ScaleFormat::bf16);
  std::string enc;
  encode(x.data(), 16, o, enc);
  ASSERT_EQ(enc.size(), 9u);
  EXPECT_EQ(static_cast<uint8_t>(enc[0]), 0u | 4u << 3);  // levels 0 (skip) and 4 (int4)
  std::string int4;
  encode(x.data() + 8, 8, opts(Codec::int4, 8, ScaleFormat::bf16), int4);
  ASSERT_EQ(int4.size(), 6u);
  EXPECT_EQ(enc.substr(1, 6), int4);
  EXPECT_EQ(enc.substr(7), std::string(2, '\0'));
  EXPECT_EQ(round_trip(x, o), x);
  std::string bad = enc;
  bad.back() = 1;
  std::vector<float> y(16);
  EXPECT_THROW(
      decode(reinterpret_cast<const uint8_t*>(bad.data()), bad.size(), 16, o, y.data(), "t"),
      Error);
}

TEST(CompressMix, NeverWorseThanNf2) {
  // nf2 on every block always fits, so mix's error is at most nf2's: on normal values of equal
  // spread, and on one block (a norm's weights), where the levels' byte is the only overhead.
  for (int64_t blocks : {1, 4, 32}) {
    Rng rng(static_cast<uint64_t>(blocks));
    std::vector<float> x(static_cast<size_t>(blocks * 64));
    for (auto& v : x) v = static_cast<float>(rng.normal());
    EXPECT_LE(squared_error(x, round_trip(x, opts(Codec::mix, 64))),
              squared_error(x, round_trip(x, opts(Codec::nf2, 64))))
        << blocks;
  }
  // Blocks whose codes do not end on a byte (2 bits a value): nf2 on every block still fits.
  for (int64_t block : {1, 5, 6, 7, 10}) {
    for (int64_t n : {30, 1001}) {
      Rng rng(static_cast<uint64_t>(block * n));
      std::vector<float> x(static_cast<size_t>(n));
      for (auto& v : x) v = static_cast<float>(rng.normal());
      for (ScaleFormat scale : {ScaleFormat::f32, ScaleFormat::bf16})
        EXPECT_LE(squared_error(x, round_trip(x, opts(Codec::mix, block, scale))),
                  squared_error(x, round_trip(x, opts(Codec::nf2, block, scale))))
            << "block " << block << ", n " << n;
    }
  }
  // One block whose energy is mostly one value (a norm weight the download left behind): sign,
  // nf2 and nf3 miss most of the outlier, int4 catches it but does not fit, so no multiplier picks
  // a level between skip and int4; the leftover bytes still buy the best level that fits.
  Rng rng(9);
  std::vector<float> x(64);
  for (auto& v : x) v = static_cast<float>(0.02 * rng.normal());
  x[47] = -0.4f;
  for (ScaleFormat scale : {ScaleFormat::f32, ScaleFormat::bf16}) {
    const double mixed = squared_error(x, round_trip(x, opts(Codec::mix, 64, scale)));
    EXPECT_LE(mixed, squared_error(x, round_trip(x, opts(Codec::nf2, 64, scale))));
    EXPECT_LT(mixed, 0.9 * squared_error(x, std::vector<float>(64, 0.0f)));
  }
}

TEST(CompressMix, HostilePayloadsAreRefused) {
  const auto x = rows(4, 3, 3);
  const auto o = opts(Codec::mix, 64);
  std::string enc;
  encode(x.data(), 256, o, enc);
  std::vector<float> y(256);
  auto refused = [&](const std::string& bad, const char* why) {
    EXPECT_THROW(
        decode(reinterpret_cast<const uint8_t*>(bad.data()), bad.size(), 256, o, y.data(), "t"),
        Error)
        << why;
  };
  refused(enc.substr(0, enc.size() - 1), "short");
  std::string bad = enc;
  bad[0] = static_cast<char>((bad[0] & ~7) | 6);  // level 6
  refused(bad, "level 6");
  bad = enc;
  bad[0] = static_cast<char>(0x6d), bad[1] = static_cast<char>(0x0b);  // four int8 blocks
  refused(bad, "codings past the payload");
  bad = enc;
  bad[1] = static_cast<char>(bad[1] | 0x80);  // after 4 levels (12 bits)
  refused(bad, "unused header bits");
  // the shipped payload decodes
  EXPECT_NO_THROW(
      decode(reinterpret_cast<const uint8_t*>(enc.data()), enc.size(), 256, o, y.data(), "t"));
}
