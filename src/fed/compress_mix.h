#pragma once
// mix: a tensor's bits spent where its values are. Per block of `block` values one of six
// codings, chosen by the encoder:
//
//   level  0 skip (nothing sent; decoded as zeros)   1 sign   2 nf2   3 nf3   4 int4   5 int8
//
// each coded exactly as that codec codes one block (its scale in the options' format, then its
// codes, the last byte's unused bits zero). A payload holds every block's level (3 bits each, one
// little-endian bit stream, low bits first), then the blocks' codings in block order, then zero
// bytes up to its fixed size: the levels' bytes plus the bytes nf2 takes for the same values,
// block and scale format with each block coded alone (2% more than nf2 with blocks of 64; with a
// block not a multiple of 4 each block's codes also end on a byte), so that nf2 on every block
// always fits. The encoder picks the levels that leave the tensor the least squared error within
// that size: for a multiplier lambda each block takes the level minimising error + lambda * bits,
// with lambda the smallest (found by bisection) whose levels fit; the bytes left over then go one
// block at a time to the finer level removing the most error per byte, and if nf2 on every block
// leaves less error, that is sent (a block whose energy is one outlier has no level between skip
// and int4 that any multiplier picks). So a block of zeros (an embedding row no token of the round
// touched) costs 3 bits, and what it saves buys finer codes for the blocks that moved most: reverse
// water-filling over blocks (Cover and Thomas, ch. 10). With error feedback a skipped block's
// values wait in the residual until they are worth sending.
//
// Decoding checks the payload's size, that every level is at most 5, that the codings fit, each
// as its codec's decoder checks it, and that the bytes after them are zero.
#include <cstdint>

#include "fed/compress.h"

namespace pollen::fed {

uint64_t mix_encoded_bytes(const CompressOptions& options, int64_t n);
void mix_encode(const float* x, int64_t n, const CompressOptions& options, uint8_t* out);
void mix_decode(const uint8_t* data, int64_t n, const CompressOptions& options, float* out,
                const std::string& what);
// The largest error of any level, per element: whichever the encoder picks stays within it.
std::vector<float> mix_error_bound(const float* x, int64_t n, const CompressOptions& options);

}  // namespace pollen::fed
