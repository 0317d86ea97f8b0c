#include "tokenizer/vocab.h"

#include <xxhash.h>

#include "base/error.h"

namespace pollen::tokenizer {

namespace {
uint64_t hash_bytes(std::string_view bytes) {
  return XXH3_64bits(bytes.data(), bytes.size());
}
}  // namespace

size_t Vocab::slot_of(std::string_view bytes, uint64_t hash) const {
  size_t mask = slot_ids_.size() - 1;
  uint32_t tag = static_cast<uint32_t>(hash >> 32);
  for (size_t i = hash & mask;; i = (i + 1) & mask) {
    uint32_t id = slot_ids_[i];
    if (id == 0 || (slot_tags_[i] == tag && tokens_[id - 1] == bytes)) return i;
  }
}

void Vocab::grow_index() {
  size_t capacity = slot_ids_.empty() ? 1024 : slot_ids_.size() * 2;
  slot_ids_.assign(capacity, 0);
  slot_tags_.assign(capacity, 0);
  for (uint32_t id = 0; id < tokens_.size(); ++id) {
    if (!present_[id]) continue;
    uint64_t h = hash_bytes(tokens_[id]);
    size_t slot = slot_of(tokens_[id], h);
    slot_ids_[slot] = id + 1;
    slot_tags_[slot] = static_cast<uint32_t>(h >> 32);
  }
}

void Vocab::add(uint32_t id, std::string bytes) {
  POLLEN_CHECK(!contains(id), "token id ", id, " appears twice");
  POLLEN_CHECK(id < kMaxTokenId, "token id ", id, " is too large (ids are below ", kMaxTokenId,
               ")");
  if (id >= tokens_.size()) {
    tokens_.resize(id + 1);
    present_.resize(id + 1, 0);
  }
  if ((count_ + 1) * 2 > slot_ids_.size()) grow_index();
  uint64_t h = hash_bytes(bytes);
  size_t slot = slot_of(bytes, h);
  POLLEN_CHECK(slot_ids_[slot] == 0, "token bytes of id ", id, " are the same as those of id ",
               slot_ids_[slot] - 1);
  slot_ids_[slot] = id + 1;
  slot_tags_[slot] = static_cast<uint32_t>(h >> 32);
  tokens_[id] = std::move(bytes);
  present_[id] = 1;
  ++count_;
}

std::optional<uint32_t> Vocab::find(std::string_view bytes) const {
  if (slot_ids_.empty()) return std::nullopt;
  uint32_t id = slot_ids_[slot_of(bytes, hash_bytes(bytes))];
  if (id == 0) return std::nullopt;
  return id - 1;
}

}  // namespace pollen::tokenizer
