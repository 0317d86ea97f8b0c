#pragma once
// Token shards and their manifest (docs/data.md has the byte formats).
//
// A shard is two files: `<prefix>-<split>-NNNNN.tokens`, flat little-endian uint16 (uint32 when
// the vocabulary has more than 65535 ids) token ids, and `<prefix>-<split>-NNNNN.index`, uint64
// document start offsets in tokens, num_docs + 1 entries (first 0, last the token count).
// The manifest (manifest.json) lists the shards with their SHA-256; the dataset version is the
// SHA-256 of the manifest's bytes.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace pollen::data {

enum class TokenDType { u16, u32 };
// u16 when every id of a vocabulary of `vocab_size` fits (vocab_size <= 65535), else u32.
TokenDType token_dtype_for(int64_t vocab_size);
const char* token_dtype_name(TokenDType t);
TokenDType parse_token_dtype(const std::string& name, const std::string& where);
size_t token_dtype_bytes(TokenDType t);

struct ShardInfo {
  std::string split;   // "train" or "validation"
  std::string tokens;  // file name, relative to the manifest's folder
  std::string index;
  int64_t num_tokens = 0;
  int64_t num_docs = 0;
  std::string sha256_tokens;
  std::string sha256_index;
  nlohmann::json to_json() const;
  static ShardInfo from_json(const nlohmann::json& j, const std::string& where);
};

// Whether `name` is a shard file that a ShardWriter of `prefix` writes: PREFIX-SPLIT-NNNNN.tokens
// or .index (SPLIT train or validation), or `.PREFIX-SPLIT-NNNNN.tokens.tmp` when `partial`.
bool is_shard_file_of(std::string_view name, std::string_view prefix, bool partial);

// Writes the shards of one split, in document order, rolling over to a new shard when one
// reaches `max_tokens` (a document is never cut across shards). Files are written under a
// temporary name and renamed when complete, so a crash never leaves a shard that looks whole.
class ShardWriter {
 public:
  ShardWriter(std::filesystem::path dir, std::string prefix, std::string split, TokenDType dtype,
              int64_t max_tokens);
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  void add_document(std::span<const uint32_t> ids);
  // Closes the last shard; returns every shard written (none if no document was added).
  std::vector<ShardInfo> finish();
  // The shards completed so far.
  const std::vector<ShardInfo>& shards() const { return done_; }
  // The temporary file of the shard being written ("" when none is open).
  std::filesystem::path open_file() const;

  // A resume point: the completed shards and the open one's document starts, its tokens put on
  // disk first. From then on a writer destroyed unfinished leaves its open shard's temporary
  // file in place for resume().
  nlohmann::json checkpoint();
  // Continues from checkpoint() of a writer made with the same arguments: the open shard's
  // temporary file is cut back to its checkpointed length and its hash recomputed. Throws when
  // a file the resume point needs is missing or too short.
  void resume(const nlohmann::json& state);

 private:
  struct Open;
  std::string next_base() const;  // <prefix>-<split>-<number> of the next shard
  void open_next(const char* mode = "wb");
  void close_current();
  std::filesystem::path dir_;
  std::string prefix_, split_;
  TokenDType dtype_;
  int64_t max_tokens_;
  std::unique_ptr<Open> open_;
  std::vector<ShardInfo> done_;
  std::vector<uint8_t> buffer_;
  bool keep_partial_ = false;
};

// A manifest read back: the parsed JSON plus the fields the loader needs.
struct Manifest {
  std::filesystem::path path;  // of manifest.json
  nlohmann::json json;
  TokenDType token_dtype = TokenDType::u16;
  int64_t vocab_size = 0;
  std::vector<ShardInfo> shards;

  static Manifest load(const std::filesystem::path& path);
  std::filesystem::path dir() const { return path.parent_path(); }
  std::vector<ShardInfo> split(const std::string& name) const;
};

// The bytes every manifest is written as: JSON with sorted keys, two-space indent, final newline.
std::string manifest_text(const nlohmann::json& manifest);
// The dataset version: SHA-256 (hex) of the manifest file's bytes.
std::string dataset_version(const std::filesystem::path& manifest_path);

// A shard's files, mapped and checked against the manifest (size, SHA-256, index shape).
// Errors name the file and what did not match.
class ShardReader {
 public:
  ShardReader(const std::filesystem::path& dir, const ShardInfo& info, TokenDType dtype,
              bool verify_sha = true);
  ~ShardReader();
  int64_t num_tokens() const { return num_tokens_; }
  int64_t num_docs() const { return static_cast<int64_t>(starts_.size()) - 1; }
  uint32_t token(int64_t i) const;
  // num_docs + 1 document starts (the last is num_tokens).
  const std::vector<uint64_t>& doc_starts() const { return starts_; }
  // The largest token id in the shard (0 when empty): taken while verifying, else one pass.
  uint32_t max_token() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int64_t num_tokens_ = 0;
  std::optional<uint32_t> max_token_;  // taken in the verifying pass
  TokenDType dtype_;
  std::vector<uint64_t> starts_;
};

}  // namespace pollen::data
