#pragma once
// A masked update on the wire: the ring words of every parameter, in the model's order, as a
// tensor set with codec "ring32" (4 bytes per value) or "ring64" (8 bytes), little-endian, block
// 0, through the same header, chunks and SHA-256 as every other tensor set (fed/wire.h).
#include <cstdint>
#include <string>
#include <vector>

#include "fed/wire.h"

namespace pollen::fed::secagg {

std::string ring_codec_name(int ring_bits);
// The masked set's tensors: the model's, then with adaptive clipping under distributed DP the
// one-value tensor of the client's centred unclipped indicator (kUnclippedCount).
inline constexpr const char* kUnclippedCount = "dp.unclipped_count";
ParamSpecs masked_specs(const ParamSpecs& model, bool counts_unclipped);
EncodedSet masked_set(const ParamSpecs& specs, const std::vector<uint64_t>& words, int ring_bits);
// Checks names, order, shapes, codec, block and every byte count; throws naming `what`.
void validate_masked_header(const pb::TensorSetHeader& h, const ParamSpecs& specs, int ring_bits,
                            const std::string& what);

}  // namespace pollen::fed::secagg
