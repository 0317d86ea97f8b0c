#pragma once
// Compression of what goes over the wire: float32 tensors encoded as
//
//   none   float32, little-endian                          4 bytes per value, exact
//   bf16   bfloat16, round to nearest even                 2 bytes per value, |err| <= 2^-8 |x|
//   int8   per block of `block` values: one float32 scale s = max|x| / 127, then round(x / s)
//          as int8 in [-127, 127]                          |err| <= s / 2 = max|x| / 254
//   int4   as int8 with s = max|x| / 7 and values in [-7, 7], two per byte, low nibble first
//                                                          |err| <= s / 2 = max|x| / 14
//
// (the error bounds hold up to one float32 rounding of x / s and q * s). Layout of int8/int4:
// all blocks' scales first (float32 LE), then the packed values. Decoding checks the payload's
// size, that every scale is finite and non-negative, and that no value is -128 (int8) or -8
// (int4), so a hostile payload cannot smuggle in NaN, infinities or asymmetric codes.
//
// Error feedback (Seide et al. 2014; Karimireddy et al. 2019): the client adds what compression
// lost last round to this round's update before encoding, and keeps what is lost now, so that
// over rounds the decoded updates sum to the true ones.
#include <cstdint>
#include <string>
#include <vector>

#include "fed/strategy.h"

namespace pollen::fed {

enum class Codec : uint8_t { none = 0, bf16 = 1, int8 = 2, int4 = 3 };

Codec parse_codec(const std::string& name);  // throws listing the codecs
const char* codec_name(Codec codec);

struct CompressOptions {
  Codec codec = Codec::none;
  int64_t block = 64;  // values per scale (int8, int4); 1 ... 1 << 20
  void validate() const;
};

// Bytes of an encoded tensor of `numel` values.
uint64_t encoded_bytes(Codec codec, int64_t numel, int64_t block);

// Appends the encoding of x[0, n) to `out`.
void encode(const float* x, int64_t n, const CompressOptions& options, std::string& out);

// Decodes `size` bytes into out[0, n); throws naming `what` when the payload is malformed.
void decode(const uint8_t* data, uint64_t size, int64_t n, const CompressOptions& options,
            float* out, const std::string& what);

// The largest absolute error `encode` then `decode` may make on x[0, n), per element.
std::vector<float> error_bound(const float* x, int64_t n, const CompressOptions& options);

class ErrorFeedback {
 public:
  // Encodes delta + residual tensor by tensor (one payload each), keeping the new residual
  // (what the decoded payload misses). With codec none nothing is kept.
  std::vector<std::string> encode(const Weights& delta, const CompressOptions& options);
  const Weights& residual() const { return residual_; }
  void set_residual(Weights r) { residual_ = std::move(r); }

 private:
  Weights residual_;
};

}  // namespace pollen::fed
