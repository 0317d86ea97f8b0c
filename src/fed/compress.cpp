#include "fed/compress.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace pollen::fed {

Codec parse_codec(const std::string& name) {
  if (name == "none") return Codec::none;
  if (name == "bf16") return Codec::bf16;
  if (name == "int8") return Codec::int8;
  if (name == "int4") return Codec::int4;
  fail("unknown compression '", name, "'; expected none, bf16, int8 or int4");
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
  }
  return "?";
}

void CompressOptions::validate() const {
  POLLEN_CHECK(block >= 1 && block <= (int64_t{1} << 20),
               "compression block must be in [1, 1048576], got ", block);
}

namespace {

int qmax(Codec c) {
  return c == Codec::int8 ? 127 : 7;
}

int64_t blocks_of(int64_t n, int64_t block) {
  return (n + block - 1) / block;
}

float load_f32(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

}  // namespace

uint64_t encoded_bytes(Codec codec, int64_t n, int64_t block) {
  const auto un = static_cast<uint64_t>(n);
  switch (codec) {
    case Codec::none:
      return 4 * un;
    case Codec::bf16:
      return 2 * un;
    case Codec::int8:
      return 4 * static_cast<uint64_t>(blocks_of(n, block)) + un;
    case Codec::int4:
      return 4 * static_cast<uint64_t>(blocks_of(n, block)) + (un + 1) / 2;
  }
  return 0;
}

void encode(const float* x, int64_t n, const CompressOptions& o, std::string& out) {
  o.validate();
  const size_t start = out.size();
  out.resize(start + encoded_bytes(o.codec, n, o.block));
  auto* p = reinterpret_cast<uint8_t*>(out.data() + start);
  switch (o.codec) {
    case Codec::none:
      std::memcpy(p, x, static_cast<size_t>(n) * 4);
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
      uint8_t* values = p + 4 * nb;
      if (o.codec == Codec::int4) std::memset(values, 0, static_cast<size_t>((n + 1) / 2));
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t lo = b * o.block, hi = std::min(n, lo + o.block);
        float amax = 0;
        for (int64_t i = lo; i < hi; ++i) amax = std::max(amax, std::fabs(x[i]));
        POLLEN_CHECK(std::isfinite(amax), "compression: a non-finite value in block ", b);
        const float scale = amax / static_cast<float>(q);
        std::memcpy(p + 4 * b, &scale, 4);
        const float inv = scale > 0 ? 1.0f / scale : 0.0f;
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
  }
}

void decode(const uint8_t* p, uint64_t size, int64_t n, const CompressOptions& o, float* out,
            const std::string& what) {
  o.validate();
  const uint64_t want = encoded_bytes(o.codec, n, o.block);
  POLLEN_CHECK(size == want, what, ": ", size, " bytes, but ", n, " values in ",
               codec_name(o.codec), " take ", want);
  switch (o.codec) {
    case Codec::none:
      std::memcpy(out, p, static_cast<size_t>(n) * 4);
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
      const uint8_t* values = p + 4 * nb;
      for (int64_t b = 0; b < nb; ++b) {
        const float scale = load_f32(p + 4 * b);
        POLLEN_CHECK(std::isfinite(scale) && scale >= 0, what, ": block ", b, " has scale ", scale,
                     "; scales must be finite and non-negative");
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
  }
}

std::vector<float> error_bound(const float* x, int64_t n, const CompressOptions& o) {
  std::vector<float> bound(static_cast<size_t>(n), 0.0f);
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
        const float b =
            amax / static_cast<float>(qmax(o.codec)) * 0.5f * (1 + 1e-5f) + amax * 1e-6f;
        for (int64_t i = lo; i < hi; ++i) bound[static_cast<size_t>(i)] = b;
      }
      break;
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
