// `pollen data stats` and `pollen data inspect`: a finished dataset read back from its manifest
// and shards, as a summary of its splits and stages or as chosen documents with their tokens.
#include "data/pipeline.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <set>

#include "base/error.h"
#include "data/shards.h"
#include "tokenizer/hf_format.h"
#include "tokenizer/tokenizer.h"

namespace pollen::data {
namespace fs = std::filesystem;

std::string dataset_stats(const fs::path& where) {
  fs::path path = fs::is_directory(where) ? where / "manifest.json" : where;
  Manifest m = Manifest::load(path);
  std::string out = cat("dataset ", path.string(), "\nversion ", dataset_version(path), "\n");
  int64_t tokens[2] = {0, 0}, docs[2] = {0, 0}, nshards[2] = {0, 0};
  for (const auto& s : m.shards) {
    int k = s.split == "train" ? 0 : 1;
    tokens[k] += s.num_tokens;
    docs[k] += s.num_docs;
    nshards[k]++;
  }
  const bool tokenized = m.json.contains("tokenizer") && m.json["tokenizer"].is_object();
  if (tokenized) {
    out += cat("token dtype ", token_dtype_name(m.token_dtype), ", vocab ", m.vocab_size, "\n");
    out += cat("train: ", docs[0], " docs, ", tokens[0], " tokens in ", nshards[0],
               " shards\nvalidation: ", docs[1], " docs, ", tokens[1], " tokens in ", nshards[1],
               " shards\n");
  } else {
    // Prepared without [tokenize]: its documents are in the curated JSONL alone.
    out += "not tokenized (no shards)\n";
    for (const auto& c : m.json.value("curated", nlohmann::json::array()))
      out += cat(c.value("split", "?"), ": ", c.value("docs", int64_t{0}), " docs, ",
                 c.value("bytes", int64_t{0}), " bytes in ", c.value("file", "?"), "\n");
  }
  if (m.json.contains("stages")) {
    char line[256];
    std::snprintf(line, sizeof line, "%-18s %10s %12s %10s %12s  %s\n", "stage", "docs in",
                  "bytes in", "kept", "bytes kept", "dropped");
    out += line;
    for (const auto& s : m.json["stages"]) {
      std::string dropped;
      for (auto it = s["dropped"].begin(); it != s["dropped"].end(); ++it)
        dropped +=
            cat(dropped.empty() ? "" : ", ", it.key(), " ", it.value()["docs"].get<int64_t>());
      if (!s["enabled"].get<bool>()) dropped = "(off)";
      std::snprintf(line, sizeof line, "%-18s %10lld %12lld %10lld %12lld  ",
                    s["name"].get<std::string>().c_str(),
                    static_cast<long long>(s["docs_in"].get<int64_t>()),
                    static_cast<long long>(s["bytes_in"].get<int64_t>()),
                    static_cast<long long>(s["docs_kept"].get<int64_t>()),
                    static_cast<long long>(s["bytes_kept"].get<int64_t>()));
      out += line + dropped + "\n";
      if (s.contains("redactions")) out += cat("  redactions ", s["redactions"].dump(), "\n");
    }
  }
  if (m.json.value("problems_total", 0) > 0)
    out += cat("problems: ", m.json["problems_total"].get<int64_t>(),
               " (listed in the manifest's \"problems\")\n");
  return out;
}

std::string inspect_documents(const fs::path& where, const std::string& split, int64_t first,
                              int64_t count, int64_t max_ids) {
  fs::path path = fs::is_directory(where) ? where / "manifest.json" : where;
  Manifest m = Manifest::load(path);
  std::unique_ptr<tokenizer::Tokenizer> tok;
  if (m.json.contains("tokenizer") && m.json["tokenizer"].is_object() &&
      fs::exists(m.dir() / m.json["tokenizer"]["file"].get<std::string>()))
    tok = std::make_unique<tokenizer::Tokenizer>(
        tokenizer::load_hf_json(m.dir() / m.json["tokenizer"]["file"].get<std::string>()));
  if (m.split(split).empty()) {
    // A split name the manifest does not have (a typo, "test"): name the ones it has.
    std::set<std::string> names;
    for (const auto& s : m.shards) names.insert(s.split);
    std::string list;
    for (const auto& n : names) list += (list.empty() ? "'" : ", '") + n + "'";
    fail("inspect: '", path.string(), "' has no split '", split,
         "'; its splits: ", list.empty() ? "none (no shards)" : list);
  }
  std::string out;
  int64_t base = 0;
  for (const auto& info : m.split(split)) {
    ShardReader r(m.dir(), info, m.token_dtype, false);
    for (int64_t d = 0; d < r.num_docs(); ++d) {
      int64_t g = base + d;
      if (g < first || g >= first + count) continue;
      auto b = static_cast<int64_t>(r.doc_starts()[static_cast<size_t>(d)]);
      auto e = static_cast<int64_t>(r.doc_starts()[static_cast<size_t>(d + 1)]);
      std::vector<uint32_t> ids;
      for (int64_t k = b; k < e; ++k) ids.push_back(r.token(k));
      out += cat("--- ", split, " doc ", g, " (", info.tokens, " tokens [", b, ", ", e, "), ",
                 e - b, " tokens)\nids:");
      for (int64_t k = 0; k < std::min<int64_t>(max_ids, e - b); ++k)
        out += cat(" ", ids[static_cast<size_t>(k)]);
      if (e - b > max_ids) out += " ...";
      out += "\n";
      if (tok) out += cat("text: ", tok->decode(ids), "\n");
    }
    base += r.num_docs();
  }
  POLLEN_CHECK(first < base, "inspect: the '", split, "' split has ", base, " documents");
  return out;
}

}  // namespace pollen::data
