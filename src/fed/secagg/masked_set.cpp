#include "fed/secagg/masked_set.h"

#include <cstring>

namespace pollen::fed::secagg {

std::string ring_codec_name(int ring_bits) {
  return cat("ring", ring_bits);
}

ParamSpecs masked_specs(const ParamSpecs& model, bool counts_unclipped) {
  ParamSpecs out = model;
  if (counts_unclipped) out.push_back({kUnclippedCount, {1}});
  return out;
}

EncodedSet masked_set(const ParamSpecs& specs, const std::vector<uint64_t>& words, int ring_bits) {
  const size_t word = static_cast<size_t>(ring_bits) / 8;
  std::vector<std::string> payloads;
  size_t k = 0;
  for (const auto& s : specs) {
    const auto n = static_cast<size_t>(shape_numel(s.shape));
    POLLEN_ASSERT(k + n <= words.size());
    std::string p(n * word, '\0');
    for (size_t j = 0; j < n; ++j) std::memcpy(p.data() + j * word, &words[k + j], word);
    k += n;
    payloads.push_back(std::move(p));
  }
  POLLEN_ASSERT(k == words.size());
  EncodedSet out = encode_payloads(specs, std::move(payloads), CompressOptions{});
  out.header.set_codec(ring_codec_name(ring_bits));
  out.header.set_codec_block(0);
  return out;
}

void validate_masked_header(const pb::TensorSetHeader& h, const ParamSpecs& specs, int ring_bits,
                            const std::string& what) {
  const std::string codec = ring_codec_name(ring_bits);
  POLLEN_CHECK(h.codec() == codec, what, ": codec '", h.codec().substr(0, 16), "', expected '",
               codec, "' (secure aggregation)");
  POLLEN_CHECK(h.codec_block() == 0, what, ": codec block ", h.codec_block(), ", expected 0");
  POLLEN_CHECK(static_cast<size_t>(h.tensors_size()) == specs.size(), what, ": ", h.tensors_size(),
               " tensors, the model has ", specs.size());
  uint64_t total = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto& t = h.tensors(static_cast<int>(i));
    POLLEN_CHECK(t.name() == specs[i].name, what, ": tensor ", i, " is '", t.name().substr(0, 200),
                 "', expected '", specs[i].name, "'");
    const Shape shape(t.shape().begin(), t.shape().end());
    POLLEN_CHECK(shape == specs[i].shape, what, ": tensor '", specs[i].name,
                 "' has another shape than ", shape_str(specs[i].shape));
    const uint64_t want = static_cast<uint64_t>(shape_numel(specs[i].shape)) * (ring_bits / 8);
    POLLEN_CHECK(t.bytes() == want, what, ": tensor '", specs[i].name, "' says ", t.bytes(),
                 " bytes; ", codec, " needs ", want);
    total += want;
  }
  POLLEN_CHECK(h.total_bytes() == total, what, ": total ", h.total_bytes(), " bytes, expected ",
               total);
  POLLEN_CHECK(h.sha256().size() == 64, what, ": the checksum is not a SHA-256 hex digest");
}

}  // namespace pollen::fed::secagg
