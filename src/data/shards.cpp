#include "data/shards.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "base/error.h"
#include "base/files.h"
#include "base/hash.h"
#include "base/json_depth.h"

namespace pollen::data {
namespace fs = std::filesystem;

TokenDType token_dtype_for(int64_t vocab_size) {
  return vocab_size <= 65535 ? TokenDType::u16 : TokenDType::u32;
}
const char* token_dtype_name(TokenDType t) {
  return t == TokenDType::u16 ? "u16" : "u32";
}
TokenDType parse_token_dtype(const std::string& name, const std::string& where) {
  if (name == "u16") return TokenDType::u16;
  if (name == "u32") return TokenDType::u32;
  fail(where, ": token_dtype '", name, "' is not \"u16\" or \"u32\"");
}
size_t token_dtype_bytes(TokenDType t) {
  return t == TokenDType::u16 ? 2 : 4;
}

nlohmann::json ShardInfo::to_json() const {
  return {{"split", split},
          {"tokens", tokens},
          {"index", index},
          {"num_tokens", num_tokens},
          {"num_docs", num_docs},
          {"sha256_tokens", sha256_tokens},
          {"sha256_index", sha256_index}};
}

ShardInfo ShardInfo::from_json(const nlohmann::json& j, const std::string& where) {
  ShardInfo s;
  try {
    s.split = j.at("split").get<std::string>();
    s.tokens = j.at("tokens").get<std::string>();
    s.index = j.at("index").get<std::string>();
    s.num_tokens = j.at("num_tokens").get<int64_t>();
    s.num_docs = j.at("num_docs").get<int64_t>();
    s.sha256_tokens = j.at("sha256_tokens").get<std::string>();
    s.sha256_index = j.at("sha256_index").get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    fail(where, ": bad shard entry: ", e.what());
  }
  POLLEN_CHECK(s.tokens.find('/') == std::string::npos && s.index.find('/') == std::string::npos,
               where, ": shard file names must be plain names in the manifest's folder");
  // Bounds that keep the reader's sizes from wrapping: at most 2^50 tokens and documents.
  POLLEN_CHECK(s.num_tokens >= 0 && s.num_tokens <= (int64_t{1} << 50), where, ": shard '",
               s.tokens, "' has num_tokens ", s.num_tokens, ", expected 0 to 2^50");
  POLLEN_CHECK(s.num_docs >= 0 && s.num_docs <= (int64_t{1} << 50), where, ": shard '", s.tokens,
               "' has num_docs ", s.num_docs, ", expected 0 to 2^50");
  return s;
}

// ---- writer ------------------------------------------------------------------------------------

struct ShardWriter::Open {
  ShardInfo info;
  fs::path tokens_tmp;
  std::FILE* file = nullptr;
  Sha256 sha;
  std::vector<uint64_t> starts{0};
};

ShardWriter::ShardWriter(fs::path dir, std::string prefix, std::string split, TokenDType dtype,
                         int64_t max_tokens)
    : dir_(std::move(dir)),
      prefix_(std::move(prefix)),
      split_(std::move(split)),
      dtype_(dtype),
      max_tokens_(max_tokens) {
  POLLEN_CHECK(max_tokens_ > 0, "shard size must be positive");
  fs::create_directories(dir_);
}

ShardWriter::~ShardWriter() {
  if (open_ && open_->file) {
    std::fclose(open_->file);
    std::error_code ec;
    if (!keep_partial_) fs::remove(open_->tokens_tmp, ec);
  }
}

fs::path ShardWriter::open_file() const {
  return open_ ? open_->tokens_tmp : fs::path();
}

bool is_shard_file_of(std::string_view name, std::string_view prefix, bool partial) {
  const auto take = [&](std::string_view part) {
    if (!name.starts_with(part)) return false;
    name.remove_prefix(part.size());
    return true;
  };
  if (partial && !take(".")) return false;
  if (!take(prefix) || !take("-") || !(take("train-") || take("validation-"))) return false;
  const size_t digits = name.find_first_not_of("0123456789");
  if (digits < 5 || digits == std::string_view::npos) return false;
  name.remove_prefix(digits);
  return partial ? name == ".tokens.tmp" : name == ".tokens" || name == ".index";
}

std::string ShardWriter::next_base() const {
  char num[16];
  std::snprintf(num, sizeof num, "%05d", static_cast<int>(done_.size()));
  return prefix_ + "-" + split_ + "-" + num;
}

void ShardWriter::open_next(const char* mode) {
  open_ = std::make_unique<Open>();
  const std::string base = next_base();
  open_->info.split = split_;
  open_->info.tokens = base + ".tokens";
  open_->info.index = base + ".index";
  open_->tokens_tmp = dir_ / ("." + open_->info.tokens + ".tmp");
  open_->file = std::fopen(open_->tokens_tmp.c_str(), mode);
  POLLEN_CHECK(open_->file, "cannot create '", open_->tokens_tmp.string(),
               "': ", std::strerror(errno));
}

void ShardWriter::add_document(std::span<const uint32_t> ids) {
  if (open_ && open_->info.num_tokens > 0 &&
      open_->info.num_tokens + static_cast<int64_t>(ids.size()) > max_tokens_)
    close_current();
  if (!open_) open_next();
  size_t w = token_dtype_bytes(dtype_);
  buffer_.resize(ids.size() * w);
  for (size_t i = 0; i < ids.size(); ++i) {
    uint32_t v = ids[i];
    if (dtype_ == TokenDType::u16) {
      POLLEN_CHECK(v <= 0xffff, "token id ", v, " does not fit a u16 shard");
      buffer_[2 * i] = static_cast<uint8_t>(v);
      buffer_[2 * i + 1] = static_cast<uint8_t>(v >> 8);
    } else {
      for (int b = 0; b < 4; ++b) buffer_[4 * i + b] = static_cast<uint8_t>(v >> (8 * b));
    }
  }
  if (!buffer_.empty()) {
    POLLEN_CHECK(std::fwrite(buffer_.data(), 1, buffer_.size(), open_->file) == buffer_.size(),
                 "cannot write '", open_->tokens_tmp.string(), "': ", std::strerror(errno));
    open_->sha.update(buffer_.data(), buffer_.size());
  }
  open_->info.num_tokens += static_cast<int64_t>(ids.size());
  open_->info.num_docs += 1;
  open_->starts.push_back(static_cast<uint64_t>(open_->info.num_tokens));
}

void ShardWriter::close_current() {
  Open& o = *open_;
  POLLEN_CHECK(std::fflush(o.file) == 0 && ::fsync(fileno(o.file)) == 0, "cannot write '",
               o.tokens_tmp.string(), "': ", std::strerror(errno));
  std::fclose(o.file);
  o.file = nullptr;
  std::string index(o.starts.size() * 8, '\0');
  for (size_t i = 0; i < o.starts.size(); ++i)
    for (int b = 0; b < 8; ++b) index[8 * i + b] = static_cast<char>(o.starts[i] >> (8 * b));
  o.info.sha256_tokens = o.sha.hex_digest();
  o.info.sha256_index = sha256_hex(index);
  // The index is written first and the tokens renamed last: a shard whose tokens file exists
  // under its final name is complete.
  write_file_atomic(dir_ / o.info.index, index);
  fs::rename(o.tokens_tmp, dir_ / o.info.tokens);
  done_.push_back(o.info);
  open_.reset();
}

std::vector<ShardInfo> ShardWriter::finish() {
  if (open_) close_current();
  return done_;
}

nlohmann::json ShardWriter::checkpoint() {
  nlohmann::json done = nlohmann::json::array();
  for (const auto& info : done_) done.push_back(info.to_json());
  nlohmann::json open;  // null: no open shard
  if (open_) {
    POLLEN_CHECK(std::fflush(open_->file) == 0 && ::fsync(fileno(open_->file)) == 0,
                 "cannot write '", open_->tokens_tmp.string(), "': ", std::strerror(errno));
    open = {{"tokens", open_->info.tokens}, {"starts", open_->starts}};
  }
  keep_partial_ = true;
  return {{"done", done}, {"open", open}};
}

void ShardWriter::resume(const nlohmann::json& state) {
  POLLEN_CHECK(!open_ && done_.empty(), "ShardWriter::resume: the writer has already written");
  keep_partial_ = true;
  for (const auto& j : state.at("done")) {
    done_.push_back(ShardInfo::from_json(j, "resume point"));
    POLLEN_CHECK(fs::exists(dir_ / done_.back().tokens) && fs::exists(dir_ / done_.back().index),
                 "shard '", done_.back().tokens, "' of the resume point is missing");
  }
  const nlohmann::json& open = state.at("open");
  if (open.is_null()) return;
  const std::string tokens = next_base() + ".tokens";
  POLLEN_CHECK(open.at("tokens").get<std::string>() == tokens, "resume point: open shard '",
               open.at("tokens").get<std::string>(), "', expected '", tokens, "'");
  // Closed after the resume point was saved (its tokens renamed to their final name, in the same
  // batch): open it again; what it holds past the resume point is cut below.
  const fs::path tmp = dir_ / ("." + tokens + ".tmp");
  if (!fs::exists(tmp) && fs::exists(dir_ / tokens)) fs::rename(dir_ / tokens, tmp);
  open_next("r+b");
  open_->starts = open.at("starts").get<std::vector<uint64_t>>();
  POLLEN_CHECK(!open_->starts.empty() && open_->starts.front() == 0,
               "resume point: bad starts of '", open_->info.tokens, "'");
  open_->info.num_tokens = static_cast<int64_t>(open_->starts.back());
  open_->info.num_docs = static_cast<int64_t>(open_->starts.size()) - 1;
  const auto bytes =
      static_cast<off_t>(open_->info.num_tokens) * static_cast<off_t>(token_dtype_bytes(dtype_));
  struct stat st {};
  POLLEN_CHECK(::fstat(fileno(open_->file), &st) == 0 && st.st_size >= bytes &&
                   ::ftruncate(fileno(open_->file), bytes) == 0,
               "'", open_->tokens_tmp.string(), "' is shorter than its resume point");
  std::vector<char> buf(1 << 20);
  for (size_t got; (got = std::fread(buf.data(), 1, buf.size(), open_->file)) > 0;)
    open_->sha.update(buf.data(), got);
  POLLEN_CHECK(std::ftell(open_->file) == bytes && std::fseek(open_->file, 0, SEEK_END) == 0,
               "cannot read '", open_->tokens_tmp.string(), "'");
}

// ---- manifest ----------------------------------------------------------------------------------

std::string manifest_text(const nlohmann::json& manifest) {
  return manifest.dump(2) + "\n";
}

std::string dataset_version(const fs::path& manifest_path) {
  return sha256_file(manifest_path);
}

Manifest Manifest::load(const fs::path& path) {
  Manifest m;
  m.path = path;
  // `pollen data prepare` removes an earlier manifest when it starts over and writes the new one
  // last: a folder without one is one whose run has not finished.
  POLLEN_CHECK(fs::exists(path), "no manifest '", path.string(),
               "': not a prepared dataset, or its `pollen data prepare` has not finished "
               "(run it again to finish)");
  std::string text = read_file(path);
  check_json_depth(text, cat("manifest '", path.string(), "'"));
  try {
    m.json = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail("manifest '", path.string(), "' is not valid JSON: ", e.what());
  }
  std::string where = cat("manifest '", path.string(), "'");
  POLLEN_CHECK(m.json.is_object() && m.json.value("format", "") == "pollen-shards-v1", where,
               ": expected \"format\": \"pollen-shards-v1\"");
  try {
    m.token_dtype = parse_token_dtype(m.json.at("token_dtype").get<std::string>(), where);
    m.vocab_size = m.json.at("vocab_size").get<int64_t>();
    // 0: prepared without tokenizing (no shards to read).
    POLLEN_CHECK(m.vocab_size >= 0 && (m.token_dtype == TokenDType::u32 || m.vocab_size <= 65536),
                 where, ": vocab_size ", m.vocab_size, " does not fit its token_dtype ",
                 token_dtype_name(m.token_dtype));
    const nlohmann::json& shards = m.json.at("shards");
    POLLEN_CHECK(shards.is_array(), where, ": \"shards\" must be a list, got ", shards.type_name());
    for (size_t i = 0; i < shards.size(); ++i)
      m.shards.push_back(ShardInfo::from_json(shards[i], cat(where, ": shards[", i, "]")));
  } catch (const nlohmann::json::exception& e) {
    fail(where, ": ", e.what());
  }
  return m;
}

std::vector<ShardInfo> Manifest::split(const std::string& name) const {
  std::vector<ShardInfo> out;
  for (const auto& s : shards)
    if (s.split == name) out.push_back(s);
  return out;
}

// ---- reader ------------------------------------------------------------------------------------

struct ShardReader::Impl {
  std::unique_ptr<MappedFile> tokens;
};

ShardReader::ShardReader(const fs::path& dir, const ShardInfo& info, TokenDType dtype,
                         bool verify_sha)
    : impl_(std::make_unique<Impl>()), dtype_(dtype) {
  fs::path tpath = dir / info.tokens, ipath = dir / info.index;
  POLLEN_CHECK(fs::exists(tpath), "shard '", tpath.string(), "' is missing");
  POLLEN_CHECK(fs::exists(ipath), "shard index '", ipath.string(), "' is missing");
  impl_->tokens = std::make_unique<MappedFile>(tpath);
  size_t w = token_dtype_bytes(dtype);
  POLLEN_CHECK(impl_->tokens->size() == static_cast<size_t>(info.num_tokens) * w, "shard '",
               tpath.string(), "' has ", impl_->tokens->size(), " bytes, the manifest says ",
               info.num_tokens, " tokens of ", w, " bytes");
  std::string index = read_file(ipath);
  POLLEN_CHECK(index.size() == static_cast<size_t>(info.num_docs + 1) * 8, "shard index '",
               ipath.string(), "' has ", index.size(), " bytes, expected ",
               (info.num_docs + 1) * 8);
  if (verify_sha) {
    // Hashed a chunk at a time, each chunk's largest id taken while it is in cache: one pass
    // over the shard for both.
    Sha256 sha;
    const auto* bytes = reinterpret_cast<const uint8_t*>(impl_->tokens->data());
    constexpr int64_t kChunkTokens = int64_t{1} << 18;
    uint32_t most = 0;
    for (int64_t i0 = 0; i0 < info.num_tokens; i0 += kChunkTokens) {
      const int64_t i1 = std::min(info.num_tokens, i0 + kChunkTokens);
      sha.update(bytes + i0 * static_cast<int64_t>(w), static_cast<size_t>(i1 - i0) * w);
      for (int64_t i = i0; i < i1; ++i) most = std::max(most, token(i));
    }
    max_token_ = most;
    std::string got = sha.hex_digest();
    POLLEN_CHECK(got == info.sha256_tokens, "shard '", tpath.string(),
                 "' does not match its manifest: SHA-256 ", got, ", expected ", info.sha256_tokens);
    got = sha256_hex(index);
    POLLEN_CHECK(got == info.sha256_index, "shard index '", ipath.string(),
                 "' does not match its manifest: SHA-256 ", got, ", expected ", info.sha256_index);
  }
  starts_.resize(static_cast<size_t>(info.num_docs + 1));
  for (size_t i = 0; i < starts_.size(); ++i) {
    uint64_t v = 0;
    for (int b = 0; b < 8; ++b)
      v |= static_cast<uint64_t>(static_cast<uint8_t>(index[8 * i + b])) << (8 * b);
    starts_[i] = v;
  }
  POLLEN_CHECK(starts_.front() == 0 && starts_.back() == static_cast<uint64_t>(info.num_tokens),
               "shard index '", ipath.string(), "' must start at 0 and end at ", info.num_tokens);
  for (size_t i = 1; i < starts_.size(); ++i)
    POLLEN_CHECK(starts_[i] >= starts_[i - 1], "shard index '", ipath.string(),
                 "' is not sorted at entry ", i);
  num_tokens_ = info.num_tokens;
}

ShardReader::~ShardReader() = default;

uint32_t ShardReader::max_token() const {
  if (max_token_) return *max_token_;
  uint32_t most = 0;
  for (int64_t i = 0; i < num_tokens_; ++i) most = std::max(most, token(i));
  return most;
}

uint32_t ShardReader::token(int64_t i) const {
  const auto* p = reinterpret_cast<const uint8_t*>(impl_->tokens->data());
  if (dtype_ == TokenDType::u16) return p[2 * i] | (static_cast<uint32_t>(p[2 * i + 1]) << 8);
  const uint8_t* q = p + 4 * i;
  return q[0] | (q[1] << 8) | (q[2] << 16) | (static_cast<uint32_t>(q[3]) << 24);
}

}  // namespace pollen::data
