#pragma once
// Shared second moments (`strategy.second_moments = "factored"`; docs/federated.md, "Shared
// second moments").
//
// Each client's inner AdamW divides its moves by its own running mean of squared gradients, v.
// With silos whose data differ, each client then normalises its own silo's gradients, where the
// data-parallel baseline normalises the sum of all silos' gradients once, and the average of the
// clients' moves loses what they dispute. Sharing v fixes the scale: the clients send their v
// with their update, the server averages them (weighted by tokens, like the update), and every
// client starts the next round from that average.
//
// What travels is v factored as Adafactor stores it: for each matrix [rows, cols] its row means
// R and column means C (rows + cols values), rebuilt as v[i][j] = R[i] C[j] / mean(R); every
// other tensor (norm weights) whole; on the wire in 8-bit logarithmic codes. The means are
// linear, so the
// average of the clients' factored v is the factored average v. For a model of hidden size d
// the factored form has about 2/d as many values as the model.
#include <cstdint>
#include <string>
#include <vector>

#include "fed/wire.h"
#include "tensor/tensor.h"

namespace pollen::fed {

// How many values the factored form of tensors of these shapes has.
int64_t factored_size(const ParamSpecs& specs);

// v (one tensor per spec, float32) factored: each matrix's row means then column means, every
// other tensor whole, in the specs' order.
std::vector<float> factor_second_moments(const ParamSpecs& specs,
                                         const std::vector<const Tensor*>& v);

// Rebuilds v from its factored form: each matrix as R[i] C[j] / mean(R) (zero where the mean is
// zero), every other tensor as it is.
void expand_second_moments(const ParamSpecs& specs, const std::vector<float>& factored,
                           const std::vector<Tensor*>& v);

// v held in pieces (ZeRO-1 keeps each rank's blocks of it), factored without whole tensors:
// add_factor_sums adds elements [first, first + count) of the k-th tensor's v (flattened) into
// `sums`, laid out as the factored form but holding each matrix's row and column sums;
// factor_means turns the sums of every piece into the factored form. Over whole tensors in
// order this is factor_second_moments, bit for bit.
void add_factor_sums(const ParamSpecs& specs, size_t k, int64_t first, const float* v,
                     int64_t count, std::vector<double>& sums);
std::vector<float> factor_means(const ParamSpecs& specs, const std::vector<double>& sums);
// Elements [first, first + count) of the k-th tensor rebuilt from the factored form into `out`,
// as expand_second_moments rebuilds them.
void expand_second_moments_range(const ParamSpecs& specs, const std::vector<float>& factored,
                                 size_t k, int64_t first, int64_t count, float* out);

// The weighted mean of the clients' factored moments, summed in double in the order given.
std::vector<float> average_second_moments(const std::vector<const std::vector<float>*>& factored,
                                          const std::vector<double>& weights);

// Refuses a factored form of another size than `size`, or with a value that is not finite or
// is negative, naming `what`.
void check_second_moments(const float* values, int64_t count, int64_t size,
                          const std::string& what);

// The factored form on the wire (empty for none), segment by segment: each matrix's row means,
// its column means, each other tensor. A segment is two float32 (little-endian), lo and hi, the
// log2 of its smallest and largest positive value (both 0 when none is positive), then one
// byte a value: 0 for zero, else c in [1, 255] for 2^(lo + (c - 1) (hi - lo) / 254), the
// nearest such level in log2. A value is then kept to within a factor 2^((hi - lo) / 508):
// 2.8% over a segment spanning 2^20. About 1 byte a value where bfloat16 takes 2.
std::string pack_second_moments(const ParamSpecs& specs, const std::vector<float>& factored);
// The values of `bytes` for `specs`; throws naming `what` unless the size is exactly the specs',
// every lo <= hi is finite and hi < 128 (so each value is finite), as check_second_moments.
std::vector<float> unpack_second_moments(const ParamSpecs& specs, const std::string& bytes,
                                         const std::string& what);

}  // namespace pollen::fed
