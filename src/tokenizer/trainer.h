#pragma once
// Training a byte-level BPE tokenizer.
//
// Counting: the input is cut into documents (a line of a text file with its newline, as HF's
// trainer reads files; or the text field of a JSONL record), documents are pre-tokenised on all
// threads into per-thread counts of distinct pieces, and the counts are summed. Memory grows
// with the number of distinct pieces, not with the corpus.
//
// Merging: the most frequent adjacent pair is merged, again and again, until the vocabulary is
// full. Ties between equally frequent pairs go to the pair whose left token, then right token,
// comes first in this order: single bytes in the order of their GPT-2 byte-level characters
// (HF's initial alphabet order), then merged tokens in the order they were made. This is HF
// tokenizers' rule, so both trainers make the same merges. The result does not depend on the
// number of threads.
//
// Ids: 0-255 are the bytes, then the merges in order, then the special tokens.
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace pollen::tokenizer {

struct TrainOptions {
  uint32_t vocab_size = 32000;  // bytes + merges + special tokens
  std::vector<std::string> special_tokens;
  std::string pattern;  // pre-tokenisation regex
};

// Checks the special tokens a training will add before any work: each non-empty, none twice, none
// a single byte (every byte is a token already), and room for them in vocab_size. `where` names
// their setting in errors.
void check_special_tokens(const std::vector<std::string>& special_tokens, uint64_t vocab_size,
                          const std::string& where);

// Counts of distinct pre-tokenised pieces.
class PieceCounts {
 public:
  explicit PieceCounts(std::string pattern);
  // Move-only: a copy would share the count table but not the bytes read.
  PieceCounts(PieceCounts&&) = default;
  PieceCounts& operator=(PieceCounts&&) = default;
  PieceCounts(const PieceCounts&) = delete;
  PieceCounts& operator=(const PieceCounts&) = delete;

  // Adds every document's pieces, on all threads.
  void add_documents(std::span<const std::string_view> documents);
  // Plain text: each line (with its newline) is a document. JSONL: each record's `field`.
  void add_file(const std::filesystem::path& path, bool jsonl, const std::string& field);

  // Adds `n` occurrences of one piece.
  void add_piece(std::string_view piece, uint64_t n);

  // Federated training: a silo writes its counts to a file, the server merges the silos' files
  // and trains on the sum, which equals counting the concatenated texts. Before writing, a silo
  // may perturb its counts: pieces counted fewer than `min_count` times (at least 1) are dropped,
  // then each remaining count gets round(N(0, stddev^2)) added (drawn in piece order from `seed`,
  // which must stay secret: who knows it can subtract the noise) and those left below 1 are
  // dropped too.
  void perturb(double stddev, uint64_t seed, uint64_t min_count = 1);
  // An upper bound on every pair count training on these counts can make (the sum of count x
  // (length - 1)), saturating at UINT64_MAX.
  uint64_t pair_bound() const;
  // The count file (little-endian): "POLLENPC", u32 version 1, u32 pattern length, pattern,
  // u64 bytes read, u64 pieces, then per piece in byte order u32 length, bytes, u64 count;
  // last the SHA-256 of everything before it. Written atomically.
  void save(const std::filesystem::path& path) const;
  // Adds a count file's counts; its pattern must equal this one's. Throws naming the file and
  // what is wrong (bad magic, truncation, checksum, order, pattern).
  void merge_file(const std::filesystem::path& path);
  // The pattern a count file was made with.
  static std::string file_pattern(const std::filesystem::path& path);

  // Pieces sorted by bytes, with their counts.
  std::vector<std::pair<std::string, uint64_t>> sorted() const;
  size_t distinct() const;
  uint64_t bytes_read() const { return bytes_read_; }
  const std::string& pattern() const { return pattern_; }

 private:
  struct Map;
  std::string pattern_;
  PreTokenizer pre_tokenizer_;
  std::shared_ptr<Map> counts_;
  uint64_t bytes_read_ = 0;
};

Tokenizer train_bpe(const PieceCounts& counts, const TrainOptions& options);

}  // namespace pollen::tokenizer
