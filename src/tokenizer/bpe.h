#pragma once
// The BPE model: turns one pre-tokenised piece into token ids by merging adjacent symbols.
//
// Two merge rules, because the two ecosystems differ:
//  - kRankedBytes (tiktoken): repeatedly merge the adjacent pair whose concatenated bytes are the
//    lowest-ranked token (rank = id); a piece that is itself a token is that token.
//  - kMergeList (HF tokenizer.json): repeatedly merge the adjacent pair that comes first in the
//    merge list; with ignore_merges, a piece that is itself a token is that token.
// In both, ties between equal ranks go to the leftmost pair.
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "tokenizer/vocab.h"

namespace pollen::tokenizer {

enum class MergeRule { kRankedBytes, kMergeList };

// The initial symbols of a piece: its bytes (byte-level BPE), or its UTF-8 characters
// (SentencePiece-style BPE, with optional <0xNN> byte fallback for characters not in the vocab).
enum class Alphabet { kBytes, kChars };

struct Merge {
  uint32_t left, right;
  bool operator==(const Merge&) const = default;
};

struct BpeOptions {
  MergeRule rule = MergeRule::kRankedBytes;
  Alphabet alphabet = Alphabet::kBytes;
  bool ignore_merges = false;
  bool byte_fallback = false;
  std::optional<uint32_t> unk;
  bool fuse_unk = false;
};

class BpeModel {
 public:
  // kRankedBytes: `merges` is ignored (they follow from the ranks). kMergeList: merge i has
  // rank i, and its result is the token spelled by the two sides' bytes.
  BpeModel(Vocab vocab, std::vector<Merge> merges, BpeOptions options);
  BpeModel(BpeModel&&) noexcept;
  BpeModel& operator=(BpeModel&&) noexcept;
  ~BpeModel();

  // Appends the ids of one piece to `out`.
  void encode(std::string_view piece, std::vector<uint32_t>& out) const;

  const Vocab& vocab() const { return vocab_; }
  const BpeOptions& options() const { return options_; }
  // The merge list. For kRankedBytes it is derived from the ranks: the merge of a token is the
  // last step of BPE on its bytes with the lower ranks only.
  const std::vector<Merge>& merges() const;

 private:
  struct PairTable;
  void symbols_of(std::string_view piece, std::vector<uint32_t>& symbols) const;
  void merge_symbols(std::vector<uint32_t>& symbols, uint32_t rank_limit) const;
  void merge_short(std::vector<uint32_t>& symbols, uint32_t rank_limit) const;
  void merge_long(std::vector<uint32_t>& symbols, uint32_t rank_limit) const;
  void encode_uncached(std::string_view piece, std::vector<uint32_t>& out) const;

  Vocab vocab_;
  BpeOptions options_;
  std::unique_ptr<PairTable> pairs_;
  std::optional<uint32_t> byte_tokens_[256];
  uint64_t serial_;  // identifies this model in the per-thread piece caches
  mutable std::vector<Merge> merges_;
  mutable std::unique_ptr<std::once_flag> merges_once_;
};

}  // namespace pollen::tokenizer
