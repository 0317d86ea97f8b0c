#pragma once
// A BPE vocabulary: token id <-> token bytes, with a fast lookup from bytes to id.
// Ids may have holes (tiktoken's cl100k_base has some); holes have no bytes.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace pollen::tokenizer {

// Token ids are below this (2^24; the largest vocabularies in use hold a few hundred thousand):
// the vocabulary is a table indexed by id, so a file's larger id would only allocate billions of
// empty entries.
constexpr uint32_t kMaxTokenId = uint32_t{1} << 24;

// Nor may a file name an id far past its number of tokens: vocabularies are dense, with their
// special tokens just past them, and a lone large id would allocate a table of empty entries
// (id 2^24 - 1 in a 14-byte rank file took 512 MiB before the file was refused).
constexpr uint32_t kMaxIdsPastTokens = uint32_t{1} << 16;

// One past the largest id a file of `tokens` tokens may name.
inline uint32_t token_id_limit(uint64_t tokens) {
  return static_cast<uint32_t>(std::min<uint64_t>(kMaxTokenId, tokens + kMaxIdsPastTokens));
}

class Vocab {
 public:
  // Adds a token; throws if the id or the bytes are already present.
  void add(uint32_t id, std::string bytes);

  std::optional<uint32_t> find(std::string_view bytes) const;
  bool contains(uint32_t id) const { return id < present_.size() && present_[id]; }
  std::string_view bytes(uint32_t id) const { return tokens_[id]; }
  // One past the highest id.
  uint32_t id_end() const { return static_cast<uint32_t>(tokens_.size()); }
  size_t size() const { return count_; }

 private:
  void grow_index();
  size_t slot_of(std::string_view bytes, uint64_t hash) const;

  std::vector<std::string> tokens_;
  std::vector<uint8_t> present_;
  size_t count_ = 0;
  // Open addressing: slot holds id + 1 (0 = empty) and 32 bits of the hash.
  std::vector<uint32_t> slot_ids_;
  std::vector<uint32_t> slot_tags_;
};

}  // namespace pollen::tokenizer
