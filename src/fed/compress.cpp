#include "fed/compress.h"

#include "fed/compress_mix.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace pollen::fed {

Codec parse_codec(const std::string& name) {
  if (name == "none") return Codec::none;
  if (name == "bf16") return Codec::bf16;
  if (name == "int8") return Codec::int8;
  if (name == "int4") return Codec::int4;
  if (name == "nf2") return Codec::nf2;
  if (name == "nf3") return Codec::nf3;
  if (name == "mix") return Codec::mix;
  if (name == "sign") return Codec::sign;
  if (name == "topk") return Codec::topk;
  fail("unknown compression '", name,
       "'; expected none, bf16, int8, int4, nf3, nf2, mix, sign or topk");
}

const char* codec_name(Codec c) {
  switch (c) {
    case Codec::none:
      return "none";
    case Codec::bf16:
      return "bf16";
    case Codec::int8:
      return "int8";
    case Codec::int4:
      return "int4";
    case Codec::nf2:
      return "nf2";
    case Codec::nf3:
      return "nf3";
    case Codec::mix:
      return "mix";
    case Codec::sign:
      return "sign";
    case Codec::topk:
      return "topk";
  }
  return "?";
}

ScaleFormat parse_scale_format(const std::string& name) {
  if (name == "float32") return ScaleFormat::f32;
  if (name == "bf16") return ScaleFormat::bf16;
  fail("unknown scale format '", name, "'; expected float32 or bf16");
}

const char* scale_format_name(ScaleFormat f) {
  return f == ScaleFormat::bf16 ? "bf16" : "float32";
}

std::optional<CompressOptions::Problem> CompressOptions::problem() const {
  if (block < 1 || block > (int64_t{1} << 20))
    return Problem{"block", cat("compression block must be in [1, 1048576], got ", block)};
  if (codec != Codec::topk) return std::nullopt;
  if (block > 65536)
    return Problem{"block", cat("compression block must be at most 65536 with topk, got ", block)};
  if (topk < 1 || topk > block)
    return Problem{"topk", cat("compression topk must be in [1, block = ", block, "], got ", topk)};
  return std::nullopt;
}

void CompressOptions::validate() const {
  if (const auto p = problem()) fail(p->what);
}

namespace {

int qmax(Codec c) {
  return c == Codec::int4 ? 7 : 127;
}

int64_t blocks_of(int64_t n, int64_t block) {
  return (n + block - 1) / block;
}

// nf2's and nf3's levels, and the cuts between them (the midpoints), in units of the block's
// sigma: the Lloyd-Max quantizers of a normal distribution with 4 and 8 levels.
constexpr float kNf2Levels[4] = {-1.5104f, -0.4528f, 0.4528f, 1.5104f};
constexpr float kNf2Cut = 0.9816f;
constexpr float kNf3Levels[8] = {-2.1519f, -1.3439f, -0.7560f, -0.2451f,
                                 0.2451f,  0.7560f,  1.3439f,  2.1519f};
constexpr float kNf3Cuts[3] = {0.5005f, 1.0500f, 1.7479f};  // the positive ones; 0 is the fourth

// mean|x| over [lo, hi) times c; throws on a non-finite value (block b).
float mean_magnitude(const float* x, int64_t lo, int64_t hi, double c, int64_t b) {
  double sum = 0;
  for (int64_t i = lo; i < hi; ++i) sum += std::fabs(x[i]);
  POLLEN_CHECK(std::isfinite(sum), "compression: a non-finite value in block ", b);
  return static_cast<float>(sum / static_cast<double>(hi - lo) * c);
}

const double kSigmaPerMeanMagnitude = std::sqrt(std::acos(-1.0) / 2);

uint64_t scale_bytes(const CompressOptions& o) {
  return o.scale == ScaleFormat::bf16 ? 2 : 4;
}

// Largest relative amount a stored scale exceeds the computed one.
float scale_slack(const CompressOptions& o) {
  return 1 + std::ldexp(1.0f, o.scale == ScaleFormat::bf16 ? -7 : -23);
}

// Stores block b's scale s >= 0 in the options' format, rounded up to the next representable
// value at or above s, and returns the stored value, the one values are coded against: no
// value's code then needs clipping, in float32's subnormal range too. Refuses a scale whose
// largest level would overflow, as decoding would.
float store_scale(uint8_t* scales, int64_t b, double s, float largest_level,
                  const CompressOptions& o) {
  float stored = static_cast<float>(s);
  if (static_cast<double>(stored) < s) stored = std::nextafter(stored, INFINITY);
  if (o.scale == ScaleFormat::f32) {
    std::memcpy(scales + 4 * b, &stored, 4);
  } else {
    uint32_t bits;
    std::memcpy(&bits, &stored, 4);
    const auto high = static_cast<uint16_t>((bits + 0xffffu) >> 16);
    stored = bf16{high}.to_float();
    std::memcpy(scales + 2 * b, &high, 2);
  }
  POLLEN_CHECK(std::isfinite(stored * largest_level), "compression: block ", b, "'s scale ", s,
               " is too large for a ", scale_format_name(o.scale), " scale");
  return stored;
}

float load_scale(const uint8_t* scales, int64_t b, const CompressOptions& o) {
  if (o.scale == ScaleFormat::bf16) {
    bf16 h;
    std::memcpy(&h.bits, scales + 2 * b, 2);
    return h.to_float();
  }
  float f;
  std::memcpy(&f, scales + 4 * b, 4);
  return f;
}

// Throws unless every value of x[lo, hi) is finite (block b), before any is chosen or scaled.
void check_finite(const float* x, int64_t lo, int64_t hi, int64_t b) {
  for (int64_t i = lo; i < hi; ++i) {
    POLLEN_CHECK(std::isfinite(x[i]), "compression: value ", i, " (block ", b, ") is not finite");
  }
}

// Block b's scale from a payload: finite, non-negative, and small enough that the codec's largest
// level times it stays finite.
float read_scale(const uint8_t* scales, int64_t b, const CompressOptions& o, float largest_level,
                 const std::string& what) {
  const float scale = load_scale(scales, b, o);
  POLLEN_CHECK(std::isfinite(scale) && scale >= 0 && std::isfinite(scale * largest_level), what,
               ": block ", b, " has scale ", scale,
               "; scales must be finite, non-negative and at most ",
               std::numeric_limits<float>::max() / largest_level);
  return scale;
}

// sign, nf2 and nf3: per block a scale s = mean|x| times a factor, then `bits` bits per value
// choosing one of 2^bits levels, decoded as level * s. The codes form one little-endian bit
// stream: value i takes bits [bits i, bits (i + 1)), low bits first (so with 3 bits a value may
// span two bytes).
struct LevelCodec {
  int bits;
  const float* levels;
  double scale_per_mean_magnitude;
  float inner_error;  // the largest error, in units of s, of a value inside the outermost cuts
  unsigned (*code)(float x, float scale);
};

constexpr float kSignLevels[2] = {1.0f, -1.0f};

LevelCodec level_codec(Codec c) {
  switch (c) {
    case Codec::sign:
      return {1, kSignLevels, 1.0, 0, [](float x, float) -> unsigned { return x < 0 ? 1 : 0; }};
    case Codec::nf3:
      return {3, kNf3Levels, kSigmaPerMeanMagnitude, kNf3Levels[7] - kNf3Cuts[2],
              [](float x, float scale) -> unsigned {
                const float a = std::fabs(x);
                const unsigned up = (a > kNf3Cuts[0] * scale) + (a > kNf3Cuts[1] * scale) +
                                    (a > kNf3Cuts[2] * scale);
                return x < 0 ? 3 - up : 4 + up;
              }};
    default:
      return {2, kNf2Levels, kSigmaPerMeanMagnitude, kNf2Levels[3] - kNf2Cut,
              [](float x, float scale) -> unsigned {
                const float cut = kNf2Cut * scale;
                return x < 0 ? (x < -cut ? 0 : 1) : (x > cut ? 3 : 2);
              }};
  }
}

float largest_level(const LevelCodec& c) {
  float largest = 0;
  for (int l = 0; l < (1 << c.bits); ++l) largest = std::max(largest, std::fabs(c.levels[l]));
  return largest;
}

uint64_t level_code_bytes(int bits, int64_t n) {
  return (static_cast<uint64_t>(n) * static_cast<uint64_t>(bits) + 7) / 8;
}

void encode_levels(const LevelCodec& c, const float* x, int64_t n, const CompressOptions& o,
                   uint8_t* p) {
  const int64_t block = o.block, nb = blocks_of(n, block);
  uint8_t* codes = p + scale_bytes(o) * nb;
  std::memset(codes, 0, static_cast<size_t>(level_code_bytes(c.bits, n)));
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * block, hi = std::min(n, lo + block);
    const float scale = store_scale(p, b, mean_magnitude(x, lo, hi, c.scale_per_mean_magnitude, b),
                                    largest_level(c), o);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t bit = c.bits * i;
      const unsigned v = c.code(x[i], scale) << (bit % 8);
      codes[bit / 8] |= static_cast<uint8_t>(v);
      if (v > 0xffu) codes[bit / 8 + 1] |= static_cast<uint8_t>(v >> 8);
    }
  }
}

void decode_levels(const LevelCodec& c, const uint8_t* p, int64_t n, const CompressOptions& o,
                   float* out, const std::string& what) {
  const int64_t block = o.block, nb = blocks_of(n, block);
  const uint8_t* codes = p + scale_bytes(o) * nb;
  const uint64_t code_bytes = level_code_bytes(c.bits, n);
  const unsigned mask = (1u << c.bits) - 1;
  const float largest = largest_level(c);
  for (int64_t b = 0; b < nb; ++b) {
    const float scale = read_scale(p, b, o, largest, what);
    const int64_t lo = b * block, hi = std::min(n, lo + block);
    for (int64_t i = lo; i < hi; ++i) {
      const auto byte = static_cast<uint64_t>(c.bits * i / 8);
      unsigned v = codes[byte];
      if (byte + 1 < code_bytes) v |= static_cast<unsigned>(codes[byte + 1]) << 8;
      out[i] = c.levels[(v >> (c.bits * i % 8)) & mask] * scale;
    }
  }
  const auto used = static_cast<unsigned>(c.bits * n % 8);
  if (used) {
    POLLEN_CHECK((codes[code_bytes - 1] >> used) == 0, what, ": the unused last bits are not zero");
  }
}

// Top-k's layout: how many values a block keeps, how wide an index is, and in all.
struct TopkLayout {
  int64_t blocks, kept_per_block, last_kept, index_bytes;
  uint64_t scale_bytes;
  int64_t kept(int64_t b) const { return b + 1 < blocks ? kept_per_block : last_kept; }
  int64_t total_kept() const { return blocks == 0 ? 0 : (blocks - 1) * kept_per_block + last_kept; }
  uint64_t bytes() const {
    return scale_bytes * static_cast<uint64_t>(blocks) +
           static_cast<uint64_t>(total_kept() * (index_bytes + 1));
  }
};

TopkLayout topk_layout(int64_t n, const CompressOptions& o) {
  TopkLayout l;
  l.blocks = blocks_of(n, o.block);
  l.kept_per_block = std::min(o.topk, o.block);
  l.last_kept = l.blocks == 0 ? 0 : std::min(o.topk, n - (l.blocks - 1) * o.block);
  l.index_bytes = o.block <= 256 ? 1 : 2;
  l.scale_bytes = scale_bytes(o);
  return l;
}

// x[lo, hi)'s `k` largest magnitudes, their indices relative to lo in ascending order.
void top_indices(const float* x, int64_t lo, int64_t hi, int64_t k, std::vector<int64_t>& idx) {
  idx.resize(static_cast<size_t>(hi - lo));
  for (int64_t i = lo; i < hi; ++i) idx[static_cast<size_t>(i - lo)] = i - lo;
  const auto larger = [&](int64_t a, int64_t b) {
    const float fa = std::fabs(x[lo + a]), fb = std::fabs(x[lo + b]);
    return fa > fb || (fa == fb && a < b);
  };
  std::nth_element(idx.begin(), idx.begin() + k - 1, idx.end(), larger);
  idx.resize(static_cast<size_t>(k));
  std::sort(idx.begin(), idx.end());
}

void encode_topk(const float* x, int64_t n, const CompressOptions& o, uint8_t* p) {
  const TopkLayout l = topk_layout(n, o);
  uint8_t* indices = p + l.scale_bytes * l.blocks;
  uint8_t* values = indices + l.total_kept() * l.index_bytes;
  std::vector<int64_t> idx;
  int64_t at = 0;  // kept values so far
  for (int64_t b = 0; b < l.blocks; ++b) {
    const int64_t lo = b * o.block, hi = std::min(n, lo + o.block);
    check_finite(x, lo, hi, b);
    top_indices(x, lo, hi, l.kept(b), idx);
    float amax = 0;
    for (int64_t i : idx) amax = std::max(amax, std::fabs(x[lo + i]));
    const float scale = store_scale(p, b, amax / 127.0, 127, o);
    // in double: 1 / scale overflows float32 for scales below 2^-128
    const double inv = scale > 0 ? 1.0 / scale : 0.0;
    for (int64_t i : idx) {
      const auto index = static_cast<uint16_t>(i);
      std::memcpy(indices + at * l.index_bytes, &index, static_cast<size_t>(l.index_bytes));
      const int v = std::clamp(static_cast<int>(std::nearbyint(x[lo + i] * inv)), -127, 127);
      values[at++] = static_cast<uint8_t>(static_cast<int8_t>(v));
    }
  }
}

void decode_topk(const uint8_t* p, int64_t n, const CompressOptions& o, float* out,
                 const std::string& what) {
  const TopkLayout l = topk_layout(n, o);
  const uint8_t* indices = p + l.scale_bytes * l.blocks;
  const uint8_t* values = indices + l.total_kept() * l.index_bytes;
  std::fill(out, out + n, 0.0f);
  int64_t at = 0;
  for (int64_t b = 0; b < l.blocks; ++b) {
    const float scale = read_scale(p, b, o, 127, what);
    const int64_t lo = b * o.block, len = std::min(n, lo + o.block) - lo;
    int64_t previous = -1;
    for (int64_t j = 0; j < l.kept(b); ++j, ++at) {
      uint16_t index = 0;
      std::memcpy(&index, indices + at * l.index_bytes, static_cast<size_t>(l.index_bytes));
      POLLEN_CHECK(index > previous && index < len, what, ": block ", b, " index ", j, " is ",
                   index, "; a block's indices ascend strictly and stay below ", len);
      previous = index;
      const int v = static_cast<int8_t>(values[at]);
      POLLEN_CHECK(v != -128, what, ": kept value ", at, " is -128; codes are in [-127, 127]");
      out[lo + index] = static_cast<float>(v) * scale;
    }
  }
}

}  // namespace

uint64_t encoded_bytes(const CompressOptions& o, int64_t n) {
  const auto un = static_cast<uint64_t>(n);
  const uint64_t scales = scale_bytes(o) * static_cast<uint64_t>(blocks_of(n, o.block));
  switch (o.codec) {
    case Codec::none:
      return 4 * un;
    case Codec::bf16:
      return 2 * un;
    case Codec::int8:
      return scales + un;
    case Codec::int4:
      return scales + (un + 1) / 2;
    case Codec::nf3:
      return scales + level_code_bytes(3, n);
    case Codec::mix:
      return mix_encoded_bytes(o, n);
    case Codec::nf2:
      return scales + level_code_bytes(2, n);
    case Codec::sign:
      return scales + level_code_bytes(1, n);
    case Codec::topk:
      return topk_layout(n, o).bytes();
  }
  return 0;
}

void encode(const float* x, int64_t n, const CompressOptions& o, std::string& out) {
  o.validate();
  const size_t start = out.size();
  out.resize(start + encoded_bytes(o, n));
  auto* p = reinterpret_cast<uint8_t*>(out.data() + start);
  switch (o.codec) {
    case Codec::none:
      if (n > 0)
        std::memcpy(p, x, static_cast<size_t>(n) * 4);  // an empty tensor's data may be null
      return;
    case Codec::bf16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t b = bf16::from_float(x[i]).bits;
        std::memcpy(p + 2 * i, &b, 2);
      }
      return;
    case Codec::int8:
    case Codec::int4: {
      const int q = qmax(o.codec);
      const int64_t nb = blocks_of(n, o.block);
      uint8_t* values = p + scale_bytes(o) * nb;
      if (o.codec == Codec::int4) std::memset(values, 0, static_cast<size_t>((n + 1) / 2));
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t lo = b * o.block, hi = std::min(n, lo + o.block);
        check_finite(x, lo, hi, b);
        float amax = 0;
        for (int64_t i = lo; i < hi; ++i) amax = std::max(amax, std::fabs(x[i]));
        const float scale =
            store_scale(p, b, amax / static_cast<double>(q), static_cast<float>(q), o);
        const double inv = scale > 0 ? 1.0 / scale : 0.0;  // see encode_topk
        for (int64_t i = lo; i < hi; ++i) {
          int v = static_cast<int>(std::nearbyint(x[i] * inv));
          v = std::clamp(v, -q, q);
          if (o.codec == Codec::int8) {
            values[i] = static_cast<uint8_t>(static_cast<int8_t>(v));
          } else {
            values[i / 2] |= static_cast<uint8_t>((v & 0xf) << (4 * (i & 1)));
          }
        }
      }
      return;
    }
    case Codec::sign:
    case Codec::nf2:
    case Codec::nf3:
      encode_levels(level_codec(o.codec), x, n, o, p);
      return;
    case Codec::mix:
      mix_encode(x, n, o, p);
      return;
    case Codec::topk:
      encode_topk(x, n, o, p);
      return;
  }
}

void decode(const uint8_t* p, uint64_t size, int64_t n, const CompressOptions& o, float* out,
            const std::string& what) {
  o.validate();
  const uint64_t want = encoded_bytes(o, n);
  POLLEN_CHECK(size == want, what, ": ", size, " bytes, but ", n, " values in ",
               codec_name(o.codec), " take ", want);
  switch (o.codec) {
    case Codec::none:
      if (n > 0) std::memcpy(out, p, static_cast<size_t>(n) * 4);  // an empty tensor's may be null
      for (int64_t i = 0; i < n; ++i) {
        POLLEN_CHECK(std::isfinite(out[i]), what, ": value ", i, " is not finite");
      }
      return;
    case Codec::bf16:
      for (int64_t i = 0; i < n; ++i) {
        bf16 b;
        std::memcpy(&b.bits, p + 2 * i, 2);
        out[i] = b.to_float();
        POLLEN_CHECK(std::isfinite(out[i]), what, ": value ", i, " is not finite");
      }
      return;
    case Codec::int8:
    case Codec::int4: {
      const int64_t nb = blocks_of(n, o.block);
      const uint8_t* values = p + scale_bytes(o) * nb;
      for (int64_t b = 0; b < nb; ++b) {
        const float scale = read_scale(p, b, o, static_cast<float>(qmax(o.codec)), what);
        const int64_t lo = b * o.block, hi = std::min(n, lo + o.block);
        for (int64_t i = lo; i < hi; ++i) {
          int v;
          if (o.codec == Codec::int8) {
            v = static_cast<int8_t>(values[i]);
            POLLEN_CHECK(v != -128, what, ": value ", i, " is -128; int8 codes are in [-127, 127]");
          } else {
            v = (values[i / 2] >> (4 * (i & 1))) & 0xf;
            if (v >= 8) v -= 16;
            POLLEN_CHECK(v != -8, what, ": value ", i, " is -8; int4 codes are in [-7, 7]");
          }
          out[i] = static_cast<float>(v) * scale;
        }
      }
      if (o.codec == Codec::int4 && (n & 1)) {
        POLLEN_CHECK((values[n / 2] >> 4) == 0, what, ": the unused last nibble is not zero");
      }
      return;
    }
    case Codec::sign:
    case Codec::nf2:
    case Codec::nf3:
      decode_levels(level_codec(o.codec), p, n, o, out, what);
      return;
    case Codec::mix:
      mix_decode(p, n, o, out, what);
      return;
    case Codec::topk:
      decode_topk(p, n, o, out, what);
      return;
  }
}

std::vector<float> error_bound(const float* x, int64_t n, const CompressOptions& o) {
  std::vector<float> bound(static_cast<size_t>(n), 0.0f);
  // The stored scale s' is at most s * slack, and, below float32's normal range, one step above
  // s (bfloat16's steps there are 2^-133, float32's 2^-149): each bound's scale term grows by
  // that, and a decoded level times s' rounds to float32's steps there.
  const float slack = scale_slack(o);
  const float tiny = std::ldexp(1.0f, o.scale == ScaleFormat::bf16 ? -132 : -147);
  switch (o.codec) {
    case Codec::none:
      break;
    case Codec::bf16:
      for (int64_t i = 0; i < n; ++i)
        bound[static_cast<size_t>(i)] = std::ldexp(std::fabs(x[i]), -8);
      break;
    case Codec::int8:
    case Codec::int4:
      for (int64_t lo = 0; lo < n; lo += o.block) {
        const int64_t hi = std::min(n, lo + o.block);
        float amax = 0;
        for (int64_t i = lo; i < hi; ++i) amax = std::max(amax, std::fabs(x[i]));
        // half a step, plus the float32 roundings of x / s and q * s
        const float b = amax / static_cast<float>(qmax(o.codec)) * slack * 0.5f * (1 + 1e-5f) +
                        amax * 1e-6f + tiny;
        for (int64_t i = lo; i < hi; ++i) bound[static_cast<size_t>(i)] = b;
      }
      break;
    case Codec::sign:
    case Codec::nf2:
    case Codec::nf3:
      for (int64_t lo = 0, b = 0; lo < n; lo += o.block, ++b) {
        const int64_t hi = std::min(n, lo + o.block);
        const bool sign = o.codec == Codec::sign;
        const LevelCodec c = level_codec(o.codec);
        const float s = mean_magnitude(x, lo, hi, c.scale_per_mean_magnitude, b);
        for (int64_t i = lo; i < hi; ++i) {
          const float a = std::fabs(x[i]);
          const float e =
              sign ? a + s * slack : std::max(c.inner_error * s * slack, a - largest_level(c) * s);
          bound[static_cast<size_t>(i)] = e * (1 + 1e-5f) + s * 1e-6f + 2 * tiny;
        }
      }
      break;
    case Codec::mix:
      return mix_error_bound(x, n, o);
    case Codec::topk: {
      std::vector<int64_t> idx;
      for (int64_t lo = 0; lo < n; lo += o.block) {
        const int64_t hi = std::min(n, lo + o.block);
        top_indices(x, lo, hi, std::min(o.topk, hi - lo), idx);
        float amax = 0;
        for (int64_t i : idx) amax = std::max(amax, std::fabs(x[lo + i]));
        for (int64_t i = lo; i < hi; ++i) bound[static_cast<size_t>(i)] = std::fabs(x[i]);
        const float b = amax / 127.0f * slack * 0.5f * (1 + 1e-5f) + amax * 1e-6f + tiny;
        for (int64_t i : idx) bound[static_cast<size_t>(lo + i)] = b;
      }
      break;
    }
  }
  return bound;
}

std::vector<std::string> ErrorFeedback::encode(const Weights& delta, const CompressOptions& o) {
  std::vector<std::string> out(delta.size());
  if (o.codec == Codec::none) {
    residual_.clear();
    for (size_t t = 0; t < delta.size(); ++t) {
      fed::encode(delta[t].data<float>(), delta[t].numel(), o, out[t]);
    }
    return out;
  }
  if (residual_.size() != delta.size()) {
    residual_.clear();
    for (const Tensor& d : delta) residual_.push_back(Tensor::zeros(d.shape(), DType::f32));
  }
  std::vector<float> corrected, decoded;
  for (size_t t = 0; t < delta.size(); ++t) {
    const int64_t n = delta[t].numel();
    POLLEN_CHECK(residual_[t].shape() == delta[t].shape(), "error feedback: tensor ", t,
                 " changed shape");
    const float* d = delta[t].data<float>();
    float* r = residual_[t].data<float>();
    corrected.resize(static_cast<size_t>(n));
    decoded.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) corrected[static_cast<size_t>(i)] = d[i] + r[i];
    fed::encode(corrected.data(), n, o, out[t]);
    decode(reinterpret_cast<const uint8_t*>(out[t].data()), out[t].size(), n, o, decoded.data(),
           "error feedback");
    for (int64_t i = 0; i < n; ++i) {
      r[i] = corrected[static_cast<size_t>(i)] - decoded[static_cast<size_t>(i)];
    }
  }
  return out;
}

}  // namespace pollen::fed
