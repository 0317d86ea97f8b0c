#pragma once
// Compression of what goes over the wire: float32 tensors encoded as
//
//   none   float32, little-endian                          4 bytes per value, exact
//   bf16   bfloat16, round to nearest even                 2 bytes per value, |err| <= 2^-8 |x|
//   int8   per block of `block` values: one float32 scale s = max|x| / 127, then round(x / s)
//          as int8 in [-127, 127]                          |err| <= s / 2 = max|x| / 254
//   int4   as int8 with s = max|x| / 7 and values in [-7, 7], two per byte, low nibble first
//                                                          |err| <= s / 2 = max|x| / 14
//   nf2    per block: one float32 scale s = mean|x| sqrt(pi / 2) (a normal distribution's sigma,
//          from the block's mean magnitude), then 2 bits per value, four per byte, low bits
//          first: the levels of the 2-bit Lloyd-Max quantizer of a normal distribution,
//          {-1.5104, -0.4528, 0.4528, 1.5104} s, cut at 0 and +-0.9816 s (the midpoints)
//                                                |err| <= max(0.5288 s, |x| - 1.5104 s)
//   nf3    as nf2 with 3 bits per value, eight per three bytes (value i at bits 3i to 3i + 2 of
//          the little-endian bit stream): the 3-bit Lloyd-Max levels {+-0.2451, +-0.7560,
//          +-1.3439, +-2.1519} s, cut at 0, +-0.5005, +-1.0500 and +-1.7479 s
//                                                |err| <= max(0.4040 s, |x| - 2.1519 s)
//   sign   per block: one float32 scale s = mean|x| (the scale that makes s sign(x) nearest to x),
//          then one bit per value, 1 for negative, low bit first; decoded as +-s
//                                                          |err| <= |x| + s, 1 bit per value
//   mix    nf2's bytes and 3 bits per block, spent where the values are: per block one of none
//          (skipped, decoded as zeros), sign, nf2, nf3, int4 or int8, chosen to leave the least
//          squared error over the tensor (fed/compress_mix.h)
//                                                          the chosen coding's bound
//   topk   per block: the `topk` values of largest magnitude (ties: the lower index), as int8
//          with s = max|kept| / 127; the others are sent as zero. Per kept value one index
//          within the block (1 byte when block <= 256, else 2) and one int8 byte
//                                                          kept: |err| <= s / 2; others: |x|
//
// (the error bounds hold up to one float32 rounding of x / s and q * s). Layout of int8/int4:
// all blocks' scales first (float32 LE), then the packed values (nf2, nf3 and sign: any unused bits
// of the last byte zero); of topk: the scales, then every
// block's indices (ascending within a block, little-endian), then every block's values. A block
// of fewer than `topk` values (the last) keeps them all. Encoding refuses a non-finite value.
// Decoding checks the payload's size, that every scale is finite, non-negative and small enough
// that its largest level stays finite, that no value is -128 (int8, topk) or -8 (int4), that unused
// bits are zero, and that a block's indices ascend strictly and stay inside it, so a hostile
// payload cannot smuggle in NaN, infinities, asymmetric codes or writes out of place.
//
// Scales are float32 by default; with `scale = bf16` each is stored as a bfloat16 (2 bytes, LE),
// rounded up, never down, and the values are coded against the stored scale s'. Then
// s <= s' <= s (1 + 2^-7) (plus at most 2^-133 below float32's normal range), so each bound
// above loosens by that much on its scale term and the scale's rounding only ever widens the
// levels. That moves 2 bytes less per block (nf2 with blocks of 64: 2.25 bits per value instead
// of 2.5). An encoder refuses a scale whose largest level would not be finite in its format.
//
// nf2 and nf3 are the 2- and 3-bit members of the NormalFloat family of QLoRA (Dettmers et al.
// 2023), with levels that minimise the squared error for normal values (Max 1960). On normal
// values in blocks of 64 (the scale from each block's mean magnitude) they leave 11.6% and 3.4%
// of the squared norm as error; int4 leaves 1.2%. Scaled sign with error feedback is
// EF-SignSGD's compression (Karimireddy et al. 2019), 32x smaller than float32 but for the
// scales. Top-k with error feedback is the sparsification of Deep Gradient Compression (Lin et al.
// 2018) and SparseLoCo (Sarfi et al. 2025): what is not sent this round stays in the residual and
// is sent when it has grown large enough.
//
// Error feedback (Seide et al. 2014; Karimireddy et al. 2019): the client adds what compression
// lost last round to this round's update before encoding, and keeps what is lost now, so that
// over rounds the decoded updates sum to the true ones.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fed/strategy.h"

namespace pollen::fed {

enum class Codec : uint8_t {
  none = 0,
  bf16 = 1,
  int8 = 2,
  int4 = 3,
  topk = 4,
  sign = 5,
  nf2 = 6,
  nf3 = 7,
  mix = 8
};

Codec parse_codec(const std::string& name);  // throws listing the codecs
const char* codec_name(Codec codec);

// How a block's scale is stored.
enum class ScaleFormat : uint8_t { f32 = 0, bf16 = 1 };

ScaleFormat parse_scale_format(const std::string& name);  // "float32" or "bf16"; throws otherwise
const char* scale_format_name(ScaleFormat format);

struct CompressOptions {
  Codec codec = Codec::none;
  int64_t block =
      64;  // values per scale (int8, int4, nf3, nf2, sign, topk); 1 ... 1 << 20 (topk: ... 65536)
  int64_t topk = 0;  // topk: values kept per block, 1 ... block
  ScaleFormat scale =
      ScaleFormat::f32;  // how block scales are stored (int8, int4, nf3, nf2, sign, topk)
  // What is out of range, and its key ("block" or "topk"); none when the options hold.
  struct Problem {
    const char* key;
    std::string what;
  };
  std::optional<Problem> problem() const;
  void validate() const;  // throws problem()'s words
};

// Bytes of an encoded tensor of `numel` values.
uint64_t encoded_bytes(const CompressOptions& options, int64_t numel);

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
