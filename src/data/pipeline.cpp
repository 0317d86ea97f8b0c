#include "data/pipeline.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "base/config.h"
#include "base/error.h"
#include "base/files.h"
#include "base/hash.h"
#include "base/log.h"
#include "base/thread_pool.h"
#include "data/batch_pipeline.h"
#include "data/decontam.h"
#include "data/json_record.h"
#include "data/shards.h"
#include "data/text.h"
#include "tokenizer/hf_format.h"
#include "tokenizer/tokenizer.h"

namespace pollen::data {
namespace fs = std::filesystem;
using nlohmann::json;

// ---- config ------------------------------------------------------------------------------------

namespace {

PipelineConfig read_pipeline_config(ConfigTable& t, const fs::path& path) {
  PipelineConfig c;
  c.source = path.string();
  c.base_dir = path.parent_path().empty() ? fs::path(".") : path.parent_path();
  std::string out = t.require_string("output");
  c.output = (fs::path(out).is_absolute() ? fs::path(out) : c.base_dir / out).lexically_normal();
  c.threads = static_cast<int>(t.get_int_in("threads", 0, 0, kConfigThreadsMax));
  c.fail_on_bad_input = t.get_bool("fail_on_bad_input", false);
  c.batch_bytes = t.get_int("batch_bytes", c.batch_bytes);
  POLLEN_CHECK(c.batch_bytes > 0, t.where("batch_bytes"), ": must be positive");
  c.checkpoint_bytes = t.get_int("checkpoint_bytes", c.checkpoint_bytes);
  POLLEN_CHECK(c.checkpoint_bytes > 0, t.where("checkpoint_bytes"), ": must be positive");
  c.limits.max_line_bytes =
      t.get_int_in("max_line_bytes", c.limits.max_line_bytes, 1, kConfigIntMax);
  c.limits.max_doc_bytes = t.get_int_in("max_doc_bytes", c.limits.max_doc_bytes, 1, kConfigIntMax);
  auto names = t.get_strings("sources");
  POLLEN_CHECK(!names.empty(), t.where("sources"), ": list at least one source");
  auto src_table = t.table("source");
  POLLEN_CHECK(src_table.has_value(), t.where("source"),
               ": expected a [source.<name>] table for "
               "each name in 'sources'");
  for (const auto& n : names) {
    auto st = src_table->table(n);
    POLLEN_CHECK(st.has_value(), t.where("source." + n), ": missing table for source '", n, "'");
    SourceSpec s;
    s.name = n;
    s.paths = st->get_strings("paths");
    POLLEN_CHECK(!s.paths.empty(), st->where("paths"), ": list at least one file or folder");
    s.format = st->get_string("format", s.format);
    POLLEN_CHECK(s.format == "text" || s.format == "delimited" || s.format == "jsonl",
                 st->where("format"), ": expected \"text\", \"delimited\" or \"jsonl\", got \"",
                 s.format, "\"");
    s.delimiter = st->get_string("delimiter", s.delimiter);
    s.text_field = st->get_string("text_field", s.text_field);
    s.id_field = st->get_string("id_field", s.id_field);
    if (st->has("include")) s.include = st->get_strings("include");
    if (st->has("exclude")) s.exclude = st->get_strings("exclude");
    st->finish();
    c.sources.push_back(std::move(s));
  }
  src_table->finish();
  if (auto u = t.table("utf8")) {
    c.utf8 = u->get_string("invalid", c.utf8);
    POLLEN_CHECK(c.utf8 == "repair" || c.utf8 == "drop", u->where("invalid"),
                 ": expected \"repair\" or \"drop\"");
    c.normalize_newlines = u->get_bool("normalize_newlines", c.normalize_newlines);
    u->finish();
  }
  if (auto f = t.table("length")) load_filter(*f, c.length), f->finish();
  if (auto f = t.table("gopher_quality")) load_filter(*f, c.gopher_quality), f->finish();
  if (auto f = t.table("gopher_repetition")) load_filter(*f, c.gopher_repetition), f->finish();
  if (auto f = t.table("c4")) load_filter(*f, c.c4), f->finish();
  if (auto f = t.table("fineweb")) load_filter(*f, c.fineweb), f->finish();
  if (auto f = t.table("exact_dedup")) {
    c.exact_dedup = f->get_bool("enabled", c.exact_dedup);
    f->finish();
  }
  if (auto f = t.table("minhash")) {
    auto& m = c.minhash;
    m.enabled = f->get_bool("enabled", m.enabled);
    m.ngram = static_cast<int>(f->get_int_in("ngram", m.ngram, 1, 1 << 20));
    m.bands = static_cast<int>(f->get_int_in("bands", m.bands, 1, 1 << 20));
    m.rows = static_cast<int>(f->get_int_in("rows", m.rows, 1, 1 << 20));
    m.verify = f->get_bool("verify", m.verify);
    m.threshold = f->get_double("threshold", m.threshold);
    m.seed = static_cast<uint64_t>(
        f->get_int_in("seed", static_cast<int64_t>(m.seed), 0, kConfigIntMax));
    m.max_bucket_compare = f->get_int("max_bucket_compare", m.max_bucket_compare);
    f->finish();
  }
  if (auto f = t.table("pii")) {
    c.pii.enabled = f->get_bool("enabled", c.pii.enabled);
    for (int k = 0; k < kPiiTypes; ++k) {
      auto type = static_cast<PiiType>(k);
      c.pii.types[static_cast<size_t>(k)] = f->get_bool(pii_type_name(type), true);
    }
    f->finish();
  }
  if (auto f = t.table("decontaminate")) {
    c.eval_files = f->get_strings("eval_files");
    c.decontaminate = f->get_bool("enabled", !c.eval_files.empty());
    c.decontaminate_ngram =
        static_cast<int>(f->get_int_in("ngram", c.decontaminate_ngram, 1, 1 << 20));
    c.eval_text_field = f->get_string("text_field", c.eval_text_field);
    POLLEN_CHECK(!c.decontaminate || !c.eval_files.empty(), f->where("eval_files"),
                 ": decontamination needs at least one evaluation file");
    f->finish();
  }
  if (auto f = t.table("split")) {
    c.validation_fraction = f->get_double("validation_fraction", c.validation_fraction);
    POLLEN_CHECK(c.validation_fraction >= 0 && c.validation_fraction <= 1,
                 f->where("validation_fraction"), ": expected a number in [0, 1]");
    c.split_seed = static_cast<uint64_t>(f->get_int_in("seed", 0, 0, kConfigIntMax));
    f->finish();
  }
  if (auto f = t.table("tokenize")) {
    c.tokenize = f->get_bool("enabled", true);
    c.tokenizer = f->get_string("tokenizer", "");
    POLLEN_CHECK(!c.tokenize || !c.tokenizer.empty(), f->where("tokenizer"),
                 ": give a tokenizer.json file (or set enabled = false)");
    c.add_bos = f->get_bool("add_bos", c.add_bos);
    c.add_eos = f->get_bool("add_eos", c.add_eos);
    c.bos_token = f->get_string("bos_token", "");
    c.eos_token = f->get_string("eos_token", "");
    c.shard_tokens = f->get_int("shard_tokens", c.shard_tokens);
    POLLEN_CHECK(c.shard_tokens > 0, f->where("shard_tokens"), ": must be positive");
    c.prefix = f->get_string("prefix", c.prefix);
    f->finish();
  } else {
    c.tokenize = false;
  }
  t.finish();
  return c;
}

}  // namespace

PipelineConfig PipelineConfig::load(const fs::path& path) {
  ConfigTable t = ConfigTable::load(path);
  return read_pipeline_config(t, path);
}

PipelineConfig PipelineConfig::parse(const std::string& text, const fs::path& path) {
  ConfigTable t = ConfigTable::parse(text, path.string());
  return read_pipeline_config(t, path);
}

json PipelineConfig::to_json() const {
  json j;
  j["threads_do_not_change_outputs"] = true;
  j["fail_on_bad_input"] = fail_on_bad_input;
  j["max_line_bytes"] = limits.max_line_bytes;
  j["max_doc_bytes"] = limits.max_doc_bytes;
  json srcs = json::array();
  for (const auto& s : sources)
    srcs.push_back({{"name", s.name},
                    {"paths", s.paths},
                    {"format", s.format},
                    {"delimiter", s.delimiter},
                    {"text_field", s.text_field},
                    {"id_field", s.id_field},
                    {"include", s.include},
                    {"exclude", s.exclude}});
  j["sources"] = srcs;
  j["utf8"] = {{"invalid", utf8}, {"normalize_newlines", normalize_newlines}};
  j["length"] = {{"enabled", length.enabled},
                 {"min_chars", length.min_chars},
                 {"max_chars", length.max_chars},
                 {"min_words", length.min_words},
                 {"max_words", length.max_words}};
  const auto& g = gopher_quality;
  j["gopher_quality"] = {{"enabled", g.enabled},
                         {"min_doc_words", g.min_doc_words},
                         {"max_doc_words", g.max_doc_words},
                         {"min_avg_word_length", g.min_avg_word_length},
                         {"max_avg_word_length", g.max_avg_word_length},
                         {"max_symbol_word_ratio", g.max_symbol_word_ratio},
                         {"max_bullet_lines_ratio", g.max_bullet_lines_ratio},
                         {"max_ellipsis_lines_ratio", g.max_ellipsis_lines_ratio},
                         {"max_non_alpha_words_ratio", g.max_non_alpha_words_ratio},
                         {"min_stop_words", g.min_stop_words}};
  const auto& r = gopher_repetition;
  j["gopher_repetition"] = {{"enabled", r.enabled},
                            {"dup_line_frac", r.dup_line_frac},
                            {"dup_para_frac", r.dup_para_frac},
                            {"dup_line_char_frac", r.dup_line_char_frac},
                            {"dup_para_char_frac", r.dup_para_char_frac},
                            {"top_n_grams", r.top_n_grams},
                            {"dup_n_grams", r.dup_n_grams}};
  j["c4"] = {{"enabled", c4.enabled},
             {"remove_citations", c4.remove_citations},
             {"filter_no_terminal_punct", c4.filter_no_terminal_punct},
             {"min_num_sentences", c4.min_num_sentences},
             {"min_words_per_line", c4.min_words_per_line},
             {"max_word_length", c4.max_word_length},
             {"filter_lorem_ipsum", c4.filter_lorem_ipsum},
             {"filter_javascript", c4.filter_javascript},
             {"filter_curly_bracket", c4.filter_curly_bracket},
             {"filter_policy", c4.filter_policy}};
  j["fineweb"] = {{"enabled", fineweb.enabled},
                  {"line_punct_thr", fineweb.line_punct_thr},
                  {"line_punct_exclude_zero", fineweb.line_punct_exclude_zero},
                  {"short_line_thr", fineweb.short_line_thr},
                  {"short_line_length", fineweb.short_line_length},
                  {"char_duplicates_ratio", fineweb.char_duplicates_ratio},
                  {"new_line_ratio", fineweb.new_line_ratio}};
  j["exact_dedup"] = {{"enabled", exact_dedup}};
  j["minhash"] = {{"enabled", minhash.enabled}, {"ngram", minhash.ngram},
                  {"bands", minhash.bands},     {"rows", minhash.rows},
                  {"verify", minhash.verify},   {"threshold", minhash.threshold},
                  {"seed", minhash.seed},       {"max_bucket_compare", minhash.max_bucket_compare}};
  json p{{"enabled", pii.enabled}};
  for (int k = 0; k < kPiiTypes; ++k)
    p[pii_type_name(static_cast<PiiType>(k))] = pii.types[static_cast<size_t>(k)];
  j["pii"] = p;
  j["decontaminate"] = {{"enabled", decontaminate},
                        {"ngram", decontaminate_ngram},
                        {"eval_files", eval_files},
                        {"text_field", eval_text_field}};
  j["split"] = {{"validation_fraction", validation_fraction}, {"seed", split_seed}};
  j["tokenize"] = {{"enabled", tokenize},          {"tokenizer", tokenizer},
                   {"add_bos", add_bos},           {"add_eos", add_eos},
                   {"bos_token", bos_token},       {"eos_token", eos_token},
                   {"shard_tokens", shard_tokens}, {"prefix", prefix}};
  return j;
}

// ---- counting ----------------------------------------------------------------------------------
namespace {

struct StageCounts {
  std::string name;
  bool enabled = true;
  int64_t docs_in = 0, bytes_in = 0, docs_kept = 0, bytes_kept = 0, docs_modified = 0;
  std::map<std::string, std::pair<int64_t, int64_t>> dropped;
  json extra = json::object();

  void keep(int64_t in, int64_t out) {
    docs_in++;
    bytes_in += in;
    docs_kept++;
    bytes_kept += out;
  }
  void drop(const std::string& why, int64_t in) {
    docs_in++;
    bytes_in += in;
    auto& d = dropped[why];
    d.first++;
    d.second += in;
  }
  json to_json() const {
    json d = json::object();
    for (const auto& [k, v] : dropped) d[k] = {{"docs", v.first}, {"bytes", v.second}};
    json j{{"name", name},           {"enabled", enabled},
           {"docs_in", docs_in},     {"bytes_in", bytes_in},
           {"docs_kept", docs_kept}, {"bytes_kept", bytes_kept},
           {"dropped", d},           {"docs_modified", docs_modified}};
    for (auto it = extra.begin(); it != extra.end(); ++it) j[it.key()] = it.value();
    return j;
  }
  static StageCounts from_json(const json& j) {
    StageCounts s;
    s.name = j.at("name");
    s.enabled = j.at("enabled");
    s.docs_in = j.at("docs_in");
    s.bytes_in = j.at("bytes_in");
    s.docs_kept = j.at("docs_kept");
    s.bytes_kept = j.at("bytes_kept");
    s.docs_modified = j.at("docs_modified");
    for (auto it = j.at("dropped").begin(); it != j.at("dropped").end(); ++it)
      s.dropped[it.key()] = {it.value().at("docs"), it.value().at("bytes")};
    for (auto it = j.begin(); it != j.end(); ++it)
      if (!std::set<std::string>{"name", "enabled", "docs_in", "bytes_in", "docs_kept",
                                 "bytes_kept", "dropped", "docs_modified"}
               .count(it.key()))
        s.extra[it.key()] = it.value();
    return s;
  }
};

// Pass 1's filtering stages, in order.
enum Pass1Stage { kUtf8, kLength, kGopherQ, kGopherR, kC4, kFineWeb, kExact, kPass1Stages };
const char* kPass1Names[] = {"utf8", "length",  "gopher_quality", "gopher_repetition",
                             "c4",   "fineweb", "exact_dedup"};

// A file written under a temporary name and renamed into place by commit(). An abandoned one
// is removed, unless sync() made its bytes part of a resume point: then a later run reopens it
// where that resume point left it.
class AtomicOut {
 public:
  explicit AtomicOut(fs::path path) : path_(std::move(path)), tmp_(tmp_path(path_)) {
    f_ = std::fopen(tmp_.c_str(), "wb");
    POLLEN_CHECK(f_, "cannot create '", tmp_.string(), "': ", std::strerror(errno));
  }
  // Continues a file that sync() left at `bytes` (later bytes are cut off); its hash is
  // recomputed from what is there.
  AtomicOut(fs::path path, int64_t bytes) : path_(std::move(path)), tmp_(tmp_path(path_)) {
    f_ = std::fopen(tmp_.c_str(), "r+b");
    POLLEN_CHECK(f_, "cannot reopen '", tmp_.string(), "': ", std::strerror(errno));
    keep_ = true;
    struct stat st {};
    POLLEN_CHECK(
        ::fstat(fileno(f_), &st) == 0 && st.st_size >= bytes && ::ftruncate(fileno(f_), bytes) == 0,
        "'", tmp_.string(), "' is shorter than its resume point (", bytes, " bytes)");
    std::vector<char> buf(1 << 20);
    for (size_t got; (got = std::fread(buf.data(), 1, buf.size(), f_)) > 0;)
      sha_.update(buf.data(), got);
    POLLEN_CHECK(std::ftell(f_) == bytes && std::fseek(f_, 0, SEEK_END) == 0, "cannot read '",
                 tmp_.string(), "'");
    bytes_ = bytes;
  }
  ~AtomicOut() {
    if (f_) {
      std::fclose(f_);
      std::error_code ec;
      if (!keep_) fs::remove(tmp_, ec);
    }
  }
  void write(std::string_view s) {
    POLLEN_CHECK(std::fwrite(s.data(), 1, s.size(), f_) == s.size(), "cannot write '",
                 tmp_.string(), "': ", std::strerror(errno));
    sha_.update(s);
    bytes_ += static_cast<int64_t>(s.size());
  }
  // Puts the bytes written so far on disk, for a resume point; returns their count.
  int64_t sync() {
    POLLEN_CHECK(std::fflush(f_) == 0 && ::fsync(fileno(f_)) == 0, "cannot write '", tmp_.string(),
                 "'");
    keep_ = true;
    return bytes_;
  }
  std::string commit() {
    sync();
    std::fclose(f_);
    f_ = nullptr;
    fs::rename(tmp_, path_);
    return sha_.hex_digest();
  }
  int64_t bytes() const { return bytes_; }

 private:
  static fs::path tmp_path(const fs::path& p) {
    return p.parent_path() / ("." + p.filename().string() + ".tmp");
  }
  fs::path path_, tmp_;
  std::FILE* f_ = nullptr;
  bool keep_ = false;
  Sha256 sha_;
  int64_t bytes_ = 0;
};

class Progress {
 public:
  Progress(bool on, std::string what) : on_(on), what_(std::move(what)) {
    start_ = last_ = std::chrono::steady_clock::now();
    tty_ = ::isatty(2);
  }
  void update(int64_t docs, int64_t bytes, bool force = false) {
    if (!on_) return;
    auto now = std::chrono::steady_clock::now();
    if (!force && now - last_ < std::chrono::milliseconds(tty_ ? 200 : 2000)) return;
    last_ = now;
    double s = std::chrono::duration<double>(now - start_).count();
    double mb = static_cast<double>(bytes) / 1e6;
    std::fprintf(stderr, "%sdata %s: %lld docs, %.1f MB, %.1f MB/s%s", tty_ ? "\r" : "",
                 what_.c_str(), static_cast<long long>(docs), mb, s > 0 ? mb / s : 0.0,
                 tty_ ? "   " : "\n");
    if (force && tty_) std::fprintf(stderr, "\n");
  }
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  bool on_, tty_;
  std::string what_;
  std::chrono::steady_clock::time_point start_, last_;
};

std::string jsonl_line(std::string_view id, std::string_view source, std::string_view text) {
  std::string out;
  out.reserve(text.size() + id.size() + source.size() + 40);
  out += "{\"id\":";
  append_json_string(out, id);
  out += ",\"source\":";
  append_json_string(out, source);
  out += ",\"text\":";
  append_json_string(out, text);
  out += "}\n";
  return out;
}

// The key that decides whether pass 1's outputs can be reused: the config of pass 1 and each
// input's name, size and modification time.
std::string pass1_key(const PipelineConfig& c, const std::vector<InputFile>& files) {
  json cfg = c.to_json();
  for (const char* k : {"pii", "decontaminate", "split", "tokenize"}) cfg.erase(k);
  json f = json::array();
  for (const auto& in : files) {
    struct stat st {};
    bool ok = !in.missing && ::stat(in.path.c_str(), &st) == 0;
    f.push_back({in.name, ok ? static_cast<int64_t>(st.st_size) : -1,
                 ok ? static_cast<int64_t>(st.st_mtim.tv_sec) : 0,
                 ok ? static_cast<int64_t>(st.st_mtim.tv_nsec) : 0});
  }
  return sha256_hex(json{{"config", cfg}, {"files", f}, {"v", 2}}.dump());
}

struct Pass1Result {
  std::vector<StageCounts> stages;  // read, then the kPass1Stages
  json inputs = json::array();
  json problems = json::array();
  int64_t problems_total = 0;
  json files = json::object();
  int64_t docs = 0;  // written to pass1.docs
  std::string sha256_docs, sha256_sigs;
};

// A surviving document in work/pass1.docs: u32 source index, u32 id bytes, u64 text bytes
// (little-endian), then the id and the text. Pass 2 reads it back without parsing.
void write_doc_record(AtomicOut& out, uint32_t source, std::string_view id, std::string_view text) {
  char head[16];
  const auto id_bytes = static_cast<uint32_t>(id.size());
  const auto text_bytes = static_cast<uint64_t>(text.size());
  std::memcpy(head, &source, 4);
  std::memcpy(head + 4, &id_bytes, 4);
  std::memcpy(head + 8, &text_bytes, 8);
  out.write(std::string_view(head, 16));
  out.write(id);
  out.write(text);
}

// Reads the next record of work/pass1.docs, advancing `offset` past it; false at the end.
bool read_doc_record(std::FILE* in, const fs::path& path, uint32_t& source, std::string& id,
                     std::string& text, int64_t& offset) {
  char head[16];
  size_t got = std::fread(head, 1, 16, in);
  if (got == 0) return false;
  uint32_t id_bytes;
  uint64_t text_bytes;
  std::memcpy(&source, head, 4);
  std::memcpy(&id_bytes, head + 4, 4);
  std::memcpy(&text_bytes, head + 8, 8);
  id.resize(id_bytes);
  text.resize(text_bytes);
  POLLEN_CHECK(got == 16 && std::fread(id.data(), 1, id_bytes, in) == id_bytes &&
                   std::fread(text.data(), 1, text_bytes, in) == text_bytes,
               "'", path.string(), "' ends in a partial record");
  offset += static_cast<int64_t>(16 + id_bytes + text_bytes);
  return true;
}

// Runs fn(i) for every i in [0, n) on all threads, in small chunks handed out as threads come
// free (documents differ in size); each i's result goes to its own slot, so the outcome does
// not depend on the scheduling.
void for_each_document(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n == 0) return;
  const int chunks = static_cast<int>(std::min<int64_t>(n, int64_t{16} * num_threads()));
  pool().run_chunks(n, chunks, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) fn(i);
  });
}

Pass1Result run_pass1(const PipelineConfig& c, const std::vector<InputFile>& files,
                      const fs::path& work, const PrepareOptions& opt) {
  Pass1Result res;
  StageCounts read;
  read.name = "read";
  std::vector<StageCounts> st(kPass1Stages);
  for (int s = 0; s < kPass1Stages; ++s) st[static_cast<size_t>(s)].name = kPass1Names[s];
  st[kLength].enabled = c.length.enabled;
  st[kGopherQ].enabled = c.gopher_quality.enabled;
  st[kGopherR].enabled = c.gopher_repetition.enabled;
  st[kC4].enabled = c.c4.enabled;
  st[kFineWeb].enabled = c.fineweb.enabled;
  st[kExact].enabled = c.exact_dedup;

  AtomicOut docs_out(work / "pass1.docs");
  AtomicOut sig_out(work / "pass1.sig");
  MinHasher hasher(c.minhash);
  const int m = c.minhash.enabled ? c.minhash.signature_size() : 0;  // per document
  // Exact duplicates by all 128 bits of their content hash (h1 alone only places them).
  struct ContentHash {
    size_t operator()(const std::pair<uint64_t, uint64_t>& h) const { return h.first; }
  };
  std::unordered_set<std::pair<uint64_t, uint64_t>, ContentHash> seen;
  int64_t files_read = 0, files_missing = 0, files_empty = 0, files_unreadable = 0;

  // Bad input, in input order: counted, listed (the first 1000) and logged (the first 20).
  auto report = [&](const Problem& p) {
    if (c.fail_on_bad_input)
      fail("bad input in '", p.file, "'", p.line ? cat(", line ", p.line) : "", ": ", p.reason,
           " (", p.detail, ")");
    res.problems_total++;
    if (res.problems_total <= 20)
      log::warn("data: ", p.file, p.line ? cat(":", p.line) : "", ": ", p.reason, ": ", p.detail);
    if (res.problems.size() < 1000)
      res.problems.push_back(
          {{"file", p.file}, {"line", p.line}, {"reason", p.reason}, {"detail", p.detail}});
    if (p.reason == "missing_file")
      files_missing++;
    else if (p.reason == "empty_file")
      files_empty++;
    else if (p.reason == "unreadable_file")
      files_unreadable++;
    else if (p.reason != "invalid_utf8")
      read.drop(p.reason, p.bytes);
  };

  // What the reader put into a batch, in input order: a document (text or delimited), a block
  // of JSONL lines (split into records on the pool), or a problem. Bytes go to the batch's
  // block and ids, so that reading allocates nothing per document.
  struct Entry {
    size_t file = 0;                   // index into `files`
    int64_t line = 1;                  // the document's (the JSONL block's) first line
    size_t begin = 0, size = 0;        // its bytes in the block
    size_t id_begin = 0, id_size = 0;  // a document's id in the batch's ids
    bool jsonl = false;
    int64_t problem = -1;  // index into the batch's problems
  };
  // A document or a problem (then there is no document), as the filters see it. Items are
  // reused from batch to batch, keeping their buffers.
  struct Item {
    size_t file = 0;
    int64_t line = 1;
    size_t begin = 0, size = 0;  // the document or JSONL record as read, in the block
    bool json = false;           // a JSONL record, decoded by the worker into `text`
    std::string id, text;
    std::optional<Problem> problem;
  };
  struct Outcome {
    int stage = kPass1Stages;  // where it was dropped; kPass1Stages = survived the filters
    const char* reason = nullptr;
    int64_t raw_bytes = 0, utf8_bytes = 0, c4_bytes = 0;
    bool repaired = false, c4_changed = false;
    uint64_t h1 = 0, h2 = 0;
    std::optional<Problem> problem;  // an invalid record (dropped at read) or invalid UTF-8
  };
  struct Batch {
    std::vector<Entry> entries;
    std::string block, ids;
    std::vector<Problem> problems;
    std::vector<std::vector<JsonlLine>> lines;  // of each entry (JSONL blocks)
    std::vector<Item> items;                    // the first n are this batch's
    size_t n = 0;
    std::vector<Outcome> outcome;
    std::vector<uint32_t> sigs;  // (n, m) MinHash signatures
    int64_t bytes = 0;           // bytes read

    void clear() {
      entries.clear();
      block.clear();
      ids.clear();
      problems.clear();
      n = 0;
      bytes = 0;
    }
    Item& add(size_t file) {
      if (n == items.size()) items.emplace_back();
      Item& it = items[n++];
      it.file = file;
      it.json = false;
      it.problem.reset();
      return it;
    }
  };
  constexpr int kDroppedAtRead = -1;
  constexpr size_t kKeptBufferBytes = 1 << 20;
  int64_t done_bytes = 0, done_docs = 0;
  Progress progress(opt.progress, "pass 1 (read, filter, dedup)");

  // One document through the filters, on a worker thread.
  auto filter = [&](Item& it, std::string_view raw, Outcome& o, uint32_t* sig) {
    thread_local std::string tmp;
    const InputFile& f = files[it.file];
    const bool was_json = it.json;
    // A buffer that held a large document is let go rather than kept for small ones.
    if (it.text.capacity() > kKeptBufferBytes) std::string().swap(it.text);
    if (was_json) {
      Problem p;
      if (!decode_record(raw, it.line, c.sources[static_cast<size_t>(f.source)], f.name, it.id,
                         it.text, p)) {
        o.stage = kDroppedAtRead;
        o.problem = std::move(p);
        return;
      }
      // The document limit holds for a record's text as for a text or delimited document
      // (max_line_bytes bounds only the line it came in).
      if (static_cast<int64_t>(it.text.size()) > c.limits.max_doc_bytes) {
        o.stage = kDroppedAtRead;
        o.problem = {f.name, it.line, "document_too_large",
                     cat("over max_doc_bytes = ", c.limits.max_doc_bytes),
                     static_cast<int64_t>(raw.size())};
        return;
      }
    } else {
      it.text.assign(raw);
    }
    if (!utf8_valid(it.id)) {  // ids go into JSON outputs
      utf8_repair(it.id, tmp);
      it.id.swap(tmp);
    }
    std::string& text = it.text;
    o.raw_bytes = static_cast<int64_t>(text.size());
    auto dropped = [&](int stage, const char* why) {
      o.stage = stage;
      o.reason = why;
    };
    if (size_t bad = utf8_invalid_at(text); bad != std::string_view::npos) {
      const int64_t line =
          it.line +
          (was_json ? 0
                    : std::count(text.begin(), text.begin() + static_cast<ptrdiff_t>(bad), '\n'));
      o.problem = Problem{f.name, line, "invalid_utf8",
                          cat(c.utf8 == "drop" ? "dropped" : "repaired", ": invalid UTF-8 at byte ",
                              bad + 1, " of the document"),
                          o.raw_bytes};
      if (c.utf8 == "drop") return dropped(kUtf8, "invalid_utf8");
      utf8_repair(text, tmp);
      text.swap(tmp);
      o.repaired = true;
    }
    if (c.normalize_newlines && text.find('\r') != std::string::npos) {
      tmp.clear();
      for (size_t k = 0; k < text.size(); ++k) {
        if (text[k] == '\r') {
          tmp += '\n';
          if (k + 1 < text.size() && text[k + 1] == '\n') ++k;
        } else {
          tmp += text[k];
        }
      }
      text.swap(tmp);
      o.repaired = true;
    }
    o.utf8_bytes = static_cast<int64_t>(text.size());
    const char* why = nullptr;
    if (c.length.enabled && (why = c.length.check(text))) return dropped(kLength, why);
    if (c.gopher_quality.enabled && (why = c.gopher_quality.check(text)))
      return dropped(kGopherQ, why);
    if (c.gopher_repetition.enabled && (why = c.gopher_repetition.check(text)))
      return dropped(kGopherR, why);
    if (c.c4.enabled) {
      int64_t removed = 0;
      if ((why = c.c4.apply(text, tmp, removed))) return dropped(kC4, why);
      o.c4_changed = tmp != text;
      text.swap(tmp);
    }
    o.c4_bytes = static_cast<int64_t>(text.size());
    if (c.fineweb.enabled && (why = c.fineweb.check(text))) return dropped(kFineWeb, why);
    o.h1 = xxh64(text.data(), text.size(), 0);
    o.h2 = xxh64(text.data(), text.size(), 0x9e3779b97f4a7c15ull);
    if (c.minhash.enabled) hasher.signature(text, sig);
  };

  // Every document of a batch through the filters, on all threads: JSONL blocks are split into
  // records first (on all threads), then the items are laid out in input order.
  auto process = [&](Batch& b) {
    const auto entries = static_cast<int64_t>(b.entries.size());
    if (b.lines.size() < b.entries.size()) b.lines.resize(b.entries.size());
    for_each_document(entries, [&](int64_t e) {
      const Entry& en = b.entries[static_cast<size_t>(e)];
      auto& lines = b.lines[static_cast<size_t>(e)];
      lines.clear();
      if (en.jsonl)
        split_jsonl_lines(std::string_view(b.block).substr(en.begin, en.size), en.line,
                          c.limits.max_line_bytes, lines);
    });
    for (int64_t e = 0; e < entries; ++e) {
      const Entry& en = b.entries[static_cast<size_t>(e)];
      if (en.problem >= 0) {
        b.add(en.file).problem = std::move(b.problems[static_cast<size_t>(en.problem)]);
      } else if (!en.jsonl) {
        Item& it = b.add(en.file);
        it.line = en.line;
        it.begin = en.begin;
        it.size = en.size;
        it.id.assign(b.ids, en.id_begin, en.id_size);
      } else {
        for (const JsonlLine& l : b.lines[static_cast<size_t>(e)]) {
          Item& it = b.add(en.file);
          if (l.too_long_bytes) {
            it.problem = line_too_long(files[en.file].name, l.line, l.too_long_bytes,
                                       c.limits.max_line_bytes);
            continue;
          }
          it.line = l.line;
          it.begin = en.begin + l.begin;
          it.size = l.size;
          it.json = true;
        }
      }
    }
    const auto n = static_cast<int64_t>(b.n);
    b.outcome.assign(b.n, Outcome{});
    b.sigs.assign(static_cast<size_t>(n * m), 0);
    for_each_document(n, [&](int64_t i) {
      Item& it = b.items[static_cast<size_t>(i)];
      if (!it.problem)
        filter(it, std::string_view(b.block).substr(it.begin, it.size),
               b.outcome[static_cast<size_t>(i)], b.sigs.data() + i * m);
    });
  };
  // Counts, exact dedup and the outputs, in input order.
  auto merge = [&](Batch& b) {
    const auto n = static_cast<int64_t>(b.n);
    for (int64_t i = 0; i < n; ++i) {
      Outcome& o = b.outcome[static_cast<size_t>(i)];
      Item& it = b.items[static_cast<size_t>(i)];
      if (it.problem) {
        report(*it.problem);
        continue;
      }
      if (o.problem) report(*o.problem);
      if (o.stage == kDroppedAtRead) continue;
      read.keep(o.raw_bytes, o.raw_bytes);
      int64_t bytes = o.raw_bytes;
      bool alive = true;
      for (int s = 0; s < kPass1Stages && alive; ++s) {
        StageCounts& sc = st[static_cast<size_t>(s)];
        if (o.stage == s) {
          sc.drop(o.reason, bytes);
          alive = false;
          break;
        }
        int64_t out = s == kUtf8 ? o.utf8_bytes : s == kC4 ? o.c4_bytes : bytes;
        if (s == kExact && c.exact_dedup) {
          if (!seen.insert({o.h1, o.h2}).second) {
            sc.drop("duplicate", bytes);
            alive = false;
            break;
          }
        }
        sc.keep(bytes, out);
        if ((s == kUtf8 && o.repaired) || (s == kC4 && o.c4_changed)) sc.docs_modified++;
        bytes = out;
      }
      if (!alive) continue;
      write_doc_record(docs_out, static_cast<uint32_t>(files[it.file].source), it.id, it.text);
      if (c.minhash.enabled)
        sig_out.write(
            std::string_view(reinterpret_cast<const char*>(&b.sigs[static_cast<size_t>(i * m)]),
                             static_cast<size_t>(m) * 4));
      res.docs++;
    }
    done_docs += n;
    done_bytes += b.bytes;
    progress.update(done_docs, done_bytes);
  };

  // Reading on this thread, filtering on the pool, merging on a third thread.
  BatchPipeline<Batch> pipe(process, merge);
  // A batch's block holds up to batch_bytes and one JSONL block (or document) more: reserved
  // once, it is neither copied while it grows nor given back to the system between batches.
  const auto block_bytes = static_cast<size_t>(std::min<int64_t>(c.batch_bytes, 1 << 20));
  auto start_batch = [&] {
    Batch& b = pipe.batch();
    b.clear();
    b.block.reserve(static_cast<size_t>(c.batch_bytes) + 2 * block_bytes);
  };
  start_batch();
  auto added = [&](size_t bytes) {
    Batch& b = pipe.batch();
    b.bytes += static_cast<int64_t>(bytes);
    if (b.bytes >= c.batch_bytes) {
      pipe.submit();
      start_batch();
    }
  };
  auto add_problem = [&](size_t fi, Problem&& p) {
    Batch& b = pipe.batch();
    b.entries.push_back({.file = fi, .problem = static_cast<int64_t>(b.problems.size())});
    b.problems.push_back(std::move(p));
  };
  for (size_t fi = 0; fi < files.size(); ++fi) {
    const InputFile& f = files[fi];
    const SourceSpec& spec = c.sources[static_cast<size_t>(f.source)];
    int64_t bytes = 0;
    std::string sha;
    if (spec.format == "jsonl") {
      read_jsonl_blocks(
          f, c.limits, block_bytes,
          [&](std::string_view block, int64_t first_line) {
            Batch& b = pipe.batch();
            b.entries.push_back({.file = fi,
                                 .line = first_line,
                                 .begin = b.block.size(),
                                 .size = block.size(),
                                 .jsonl = true});
            b.block.append(block);
            added(block.size());
          },
          [&](Problem&& p) { add_problem(fi, std::move(p)); }, bytes, sha);
    } else {
      read_input(
          f, spec, c.limits,
          [&](RawDoc& d) {
            Batch& b = pipe.batch();
            b.entries.push_back({.file = fi,
                                 .line = d.line,
                                 .begin = b.block.size(),
                                 .size = d.text.size(),
                                 .id_begin = b.ids.size(),
                                 .id_size = d.id.size()});
            b.block.append(d.text);
            b.ids.append(d.id);
            added(d.text.size());
          },
          [&](Problem&& p) { add_problem(fi, std::move(p)); }, bytes, sha);
    }
    if (!f.missing) {
      files_read++;
      if (!sha.empty()) res.inputs.push_back({{"path", f.name}, {"sha256", sha}, {"bytes", bytes}});
    }
  }
  if (!pipe.batch().entries.empty()) pipe.submit();
  pipe.finish();
  progress.update(done_docs, done_bytes, true);
  read.extra = {{"files", files_read},
                {"files_missing", files_missing},
                {"files_empty", files_empty},
                {"files_unreadable", files_unreadable}};
  res.stages.push_back(read);
  for (auto& s : st) res.stages.push_back(s);
  res.files = read.extra;
  res.sha256_docs = docs_out.commit();
  res.sha256_sigs = sig_out.commit();
  return res;
}

struct Tok {
  std::unique_ptr<tokenizer::Tokenizer> t;
  std::optional<uint32_t> bos, eos;
};

std::optional<uint32_t> find_token(const tokenizer::Tokenizer& t, const std::string& name) {
  for (const auto& a : t.added_tokens())
    if (a.content == name) return a.id;
  return std::nullopt;
}

Tok load_tokenizer(const PipelineConfig& c) {
  Tok k;
  fs::path p =
      fs::path(c.tokenizer).is_absolute() ? fs::path(c.tokenizer) : c.base_dir / c.tokenizer;
  k.t = std::make_unique<tokenizer::Tokenizer>(tokenizer::load_hf_json(p));
  auto pick = [&](bool want, const std::string& name, const std::vector<uint32_t>& from_template,
                  std::initializer_list<const char*> usual,
                  const char* key) -> std::optional<uint32_t> {
    if (!want) return std::nullopt;
    if (!name.empty()) {
      auto id = find_token(*k.t, name);
      POLLEN_CHECK(id.has_value(), "tokenize.", key, ": the tokenizer '", p.string(),
                   "' has no added token \"", name, "\"");
      return id;
    }
    if (!from_template.empty()) return from_template.front();
    for (const char* u : usual)
      if (auto id = find_token(*k.t, u)) return id;
    fail("tokenize.", key, ": the tokenizer '", p.string(),
         "' has no template token or usual special token; name one with tokenize.", key);
  };
  k.bos = pick(c.add_bos, c.bos_token, k.t->bos_eos().prefix,
               {"<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>"}, "bos_token");
  k.eos = pick(c.add_eos, c.eos_token, k.t->bos_eos().suffix,
               {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"}, "eos_token");
  return k;
}

// Pass 2's counts and its position in pass1.docs: with the outputs' lengths, a resume point.
struct Pass2State {
  StageCounts near, pii, deco, split, tok;
  PiiCounts pii_total;
  int64_t split_docs[2] = {0, 0}, split_bytes[2] = {0, 0}, split_tokens[2] = {0, 0};
  int64_t near_docs = 0;
  int64_t docs = 0, offset = 0;  // documents and bytes of pass1.docs done
  int64_t text_bytes = 0;        // their text

  json to_json() const {
    json stages = json::array();
    for (const StageCounts* s : {&near, &pii, &deco, &split, &tok}) stages.push_back(s->to_json());
    auto two = [](const int64_t(&v)[2]) { return json::array({v[0], v[1]}); };
    return {{"stages", stages},
            {"pii_total", pii_total.n},
            {"split_docs", two(split_docs)},
            {"split_bytes", two(split_bytes)},
            {"split_tokens", two(split_tokens)},
            {"near_docs", near_docs},
            {"docs", docs},
            {"offset", offset},
            {"text_bytes", text_bytes}};
  }
  void restore(const json& j) {
    const json& st = j.at("stages");
    int k = 0;
    for (StageCounts* s : {&near, &pii, &deco, &split, &tok})
      *s = StageCounts::from_json(st.at(k++));
    pii_total.n = j.at("pii_total");
    for (int s = 0; s < 2; ++s) {
      split_docs[s] = j.at("split_docs").at(s);
      split_bytes[s] = j.at("split_bytes").at(s);
      split_tokens[s] = j.at("split_tokens").at(s);
    }
    near_docs = j.at("near_docs");
    docs = j.at("docs");
    offset = j.at("offset");
    text_bytes = j.at("text_bytes");
  }
};

// Pass 2's output files: curated JSONL per split, near-duplicates and the shards of each split;
// new, or continued from a resume point (`saved`, holding what checkpoint() returned).
struct Pass2Outputs {
  std::unique_ptr<AtomicOut> curated[2], near;
  std::unique_ptr<ShardWriter> writers[2];

  Pass2Outputs(const PipelineConfig& c, TokenDType dtype, const json* saved) {
    auto open = [&](const char* name) {
      const fs::path p = c.output / name;
      return saved ? std::make_unique<AtomicOut>(p, saved->at("outputs").at(name).get<int64_t>())
                   : std::make_unique<AtomicOut>(p);
    };
    curated[0] = open("curated-train.jsonl");
    curated[1] = open("curated-validation.jsonl");
    near = open("near-duplicates.jsonl");
    for (int s = 0; s < 2 && c.tokenize; ++s) {
      writers[s] = std::make_unique<ShardWriter>(
          c.output, c.prefix, s == 0 ? "train" : "validation", dtype, c.shard_tokens);
      if (saved) writers[s]->resume(saved->at("shards").at(s));
    }
  }
  int64_t shards_done() const {
    int64_t n = 0;
    for (const auto& w : writers)
      if (w) n += static_cast<int64_t>(w->shards().size());
    return n;
  }
  // Puts every byte written so far on disk; returns the lengths and shard states to resume from.
  json checkpoint() {
    json shards = json::array();
    for (auto& w : writers) shards.push_back(w ? w->checkpoint() : json());
    return {{"outputs",
             {{"curated-train.jsonl", curated[0]->sync()},
              {"curated-validation.jsonl", curated[1]->sync()},
              {"near-duplicates.jsonl", near->sync()}}},
            {"shards", shards}};
  }
};

}  // namespace

// ---- the run -----------------------------------------------------------------------------------

namespace {

// The files and folders the config names, checked before any work: one that does not exist is
// a typo (or a mount that is not there), reported as the key that holds it.
void check_configured_paths(const PipelineConfig& c) {
  auto check = [&](const std::string& key, const std::string& p, const std::string& expected) {
    const fs::path path = fs::path(p).is_absolute() ? fs::path(p) : c.base_dir / p;
    POLLEN_CHECK(fs::exists(path), "config file '", c.source, "', key '", key, "': '", p,
                 "' does not exist", path.string() == p ? "" : cat(" ('", path.string(), "')"),
                 "; expected ", expected);
  };
  for (const auto& s : c.sources)
    for (const auto& p : s.paths) check("source." + s.name + ".paths", p, "a file or folder");
  if (c.tokenize)
    check("tokenize.tokenizer", c.tokenizer,
          "a tokenizer.json (or --no-tokenize, to stop at the curated JSONL)");
  if (c.decontaminate)
    for (const auto& e : c.eval_files) check("decontaminate.eval_files", e, "a file");
}

}  // namespace

fs::path prepare(const PipelineConfig& c, const PrepareOptions& opt) {
  check_configured_paths(c);
  if (c.threads > 0) set_num_threads(c.threads);
  fs::create_directories(c.output / "work");
  const fs::path work = c.output / "work";
  const fs::path manifest_path = c.output / "manifest.json";
  std::vector<InputFile> files = list_inputs(c.sources, c.base_dir);
  const std::string key1 = pass1_key(c, files);
  // The config names the tokenizer and the eval files; their contents count too, so that an
  // edited one makes a finished (or half-done) pass 2 start over.
  std::string contents = c.tokenize ? sha256_file(c.base_dir / c.tokenizer) : std::string();
  if (c.decontaminate) {
    for (const auto& e : c.eval_files) {
      const fs::path p = c.base_dir / e;
      POLLEN_CHECK(fs::exists(p), "decontaminate.eval_files: '", e, "' does not exist");
      contents += sha256_file(p);
    }
  }
  const std::string key_all = sha256_hex(key1 + c.to_json().dump() + contents);
  // A finished run with the same config and inputs: nothing to do.
  if (fs::exists(manifest_path) && fs::exists(work / "done.json")) {
    json done = json::parse(read_file(work / "done.json"), nullptr, false);
    if (!done.is_discarded() && done.value("key", "") == key_all &&
        done.value("manifest_sha256", "") == sha256_file(manifest_path)) {
      log::info("data: ", manifest_path.filename().string(),
                " is complete for this config and "
                "these inputs; nothing to do");
      return manifest_path;
    }
  }
  std::error_code ec;
  fs::remove(work / "done.json", ec);

  // ---- pass 1, or its saved outputs
  Pass1Result p1;
  bool reuse = false;
  if (fs::exists(work / "pass1.json")) {
    json saved = json::parse(read_file(work / "pass1.json"), nullptr, false);
    if (!saved.is_discarded() && saved.value("key", "") == key1 &&
        fs::exists(work / "pass1.docs") && fs::exists(work / "pass1.sig") &&
        saved.value("sha256_docs", "") == sha256_file(work / "pass1.docs") &&
        saved.value("sha256_sigs", "") == sha256_file(work / "pass1.sig")) {
      for (const auto& s : saved.at("stages")) p1.stages.push_back(StageCounts::from_json(s));
      p1.inputs = saved.at("inputs");
      p1.problems = saved.at("problems");
      p1.problems_total = saved.at("problems_total");
      p1.docs = saved.at("docs");
      p1.sha256_docs = saved.at("sha256_docs");
      reuse = true;
      log::info("data: pass 1 outputs match this config and these inputs; reusing them");
    }
  }
  if (!reuse) {
    fs::remove(work / "pass1.json", ec);
    p1 = run_pass1(c, files, work, opt);
    json stages = json::array();
    for (const auto& s : p1.stages) stages.push_back(s.to_json());
    json saved{{"key", key1},
               {"stages", stages},
               {"inputs", p1.inputs},
               {"problems", p1.problems},
               {"problems_total", p1.problems_total},
               {"docs", p1.docs},
               {"sha256_docs", p1.sha256_docs},
               {"sha256_sigs", p1.sha256_sigs}};
    write_file_atomic(work / "pass1.json", saved.dump(1) + "\n");
  }
  if (opt.stop_after == "pass1") return {};

  // ---- near-duplicates
  StageCounts near;
  near.name = "minhash";
  near.enabled = c.minhash.enabled;
  std::vector<int64_t> cluster;
  // The id of each cluster's kept document (filled in pass 2), for near-duplicates.jsonl.
  std::unordered_map<int64_t, std::string> kept_of_cluster;
  if (c.minhash.enabled) {
    const int m = c.minhash.signature_size();
    std::string raw = read_file(work / "pass1.sig");
    POLLEN_CHECK(static_cast<int64_t>(raw.size()) == p1.docs * m * 4, "'",
                 (work / "pass1.sig").string(), "' does not hold ", p1.docs, " signatures");
    std::vector<uint32_t> sigs(static_cast<size_t>(p1.docs * m));
    std::memcpy(sigs.data(), raw.data(), raw.size());
    raw = std::string();
    NearDupResult r = find_near_duplicates(sigs, p1.docs, c.minhash);
    cluster = std::move(r.cluster);
    near.extra = {{"candidate_pairs", r.candidate_pairs},
                  {"verified_pairs", r.verified_pairs},
                  {"clusters_with_duplicates", 0}};
    for (int64_t i = 0; i < p1.docs; ++i)
      if (cluster[static_cast<size_t>(i)] != i) kept_of_cluster[cluster[static_cast<size_t>(i)]];
    near.extra["clusters_with_duplicates"] = static_cast<int64_t>(kept_of_cluster.size());
  }

  // ---- pass 2
  Pass2State p2;
  p2.near = near;
  p2.pii.name = "pii";
  p2.pii.enabled = c.pii.enabled;
  p2.deco.name = "decontaminate";
  p2.deco.enabled = c.decontaminate;
  p2.split.name = "split";
  p2.tok.name = "tokenize";
  p2.tok.enabled = c.tokenize;
  Decontaminator deco(c.decontaminate_ngram);
  if (c.decontaminate) {
    for (const auto& e : c.eval_files) {
      fs::path p = fs::path(e).is_absolute() ? fs::path(e) : c.base_dir / e;
      POLLEN_CHECK(fs::exists(p), "decontaminate.eval_files: '", e, "' does not exist");
      SourceSpec spec;
      spec.name = "eval";
      spec.format = p.string().find(".jsonl") != std::string::npos ? "jsonl" : "text";
      spec.text_field = c.eval_text_field;
      InputFile f{0, p, "eval/" + p.filename().string(), false};
      int64_t bytes;
      std::string sha;
      read_input(
          f, spec, c.limits,
          [&](RawDoc& d) {
            Problem pr;
            std::string text;
            if (d.json && !decode_record(d.text, d.line, spec, f.name, d.id, text, pr))
              fail("decontaminate.eval_files: '", e, "' line ", pr.line, ": ", pr.reason, " (",
                   pr.detail, ")");
            deco.add_eval_text(d.json ? text : d.text);
          },
          [&](Problem&& pr) {
            fail("decontaminate.eval_files: '", e, "'", pr.line ? cat(" line ", pr.line) : "", ": ",
                 pr.reason, " (", pr.detail, ")");
          },
          bytes, sha);
    }
    p2.deco.extra = {{"eval_texts", deco.eval_texts()},
                     {"eval_texts_shorter_than_ngram", deco.short_texts()},
                     {"eval_ngrams", deco.ngrams()}};
  }
  Tok tok;
  TokenDType dtype = TokenDType::u16;
  if (c.tokenize) {
    tok = load_tokenizer(c);
    dtype = token_dtype_for(tok.t->vocab_size());
  }

  // Resume from pass 2's last resume point when it belongs to this run's config, inputs and
  // pass 1; else start pass 2 over.
  const fs::path resume_path = work / "pass2.json";
  const std::string key2 = sha256_hex(key_all + p1.sha256_docs);
  std::unique_ptr<Pass2Outputs> out;
  if (reuse && fs::exists(resume_path)) {
    json saved = json::parse(read_file(resume_path), nullptr, false);
    if (!saved.is_discarded() && saved.value("key", "") == key2) {
      try {
        out = std::make_unique<Pass2Outputs>(c, dtype, &saved);
        Pass2State restored = p2;
        restored.restore(saved.at("state"));
        p2 = restored;
        for (const auto& [g, id] :
             saved.at("kept").get<std::vector<std::pair<int64_t, std::string>>>())
          kept_of_cluster.at(g) = id;
        log::info("data: resuming pass 2 after ", p2.docs, " of ", p1.docs, " documents");
      } catch (const std::exception& e) {
        log::warn("data: cannot resume pass 2 (", e.what(), "); starting it over");
        out.reset();
        for (auto& [g, id] : kept_of_cluster) id.clear();
      }
    }
  }
  if (!out) {
    fs::remove(resume_path, ec);
    out = std::make_unique<Pass2Outputs>(c, dtype, nullptr);
  }
  // Shard files of an interrupted run that the resume point does not list are removed (this run
  // writes them again).
  std::set<std::string> kept_shards;
  for (int s = 0; s < 2 && c.tokenize; ++s)
    for (const auto& info : out->writers[s]->shards()) kept_shards.insert(info.tokens);
  for (const auto& e : fs::directory_iterator(c.output)) {
    const fs::path p = e.path();
    if ((p.extension() == ".tokens" || p.extension() == ".index") &&
        !kept_shards.count(fs::path(p).replace_extension(".tokens").filename().string()))
      fs::remove(p);
  }

  struct D {
    uint32_t source = 0;
    std::string id, text;
    bool near_dup = false, contaminated = false;
    PiiCounts pii;
    int split = 0;
    std::vector<uint32_t> ids;
    int64_t bytes_in = 0;
    std::string line;  // the curated JSONL record
    // Empties the document for reuse, keeping its buffers.
    void reset() {
      near_dup = contaminated = false;
      pii = {};
      split = 0;
      ids.clear();
      line.clear();
    }
  };
  struct Batch {
    std::vector<D> docs;  // the first n are this batch's
    int64_t n = 0;
    int64_t first = 0;       // index in pass1.docs of docs[0]
    int64_t end_offset = 0;  // byte offset in pass1.docs after the batch
  };
  Progress progress(opt.progress, "pass 2 (near-dedup, pii, decontaminate, tokenize)");
  // One document through pass 2's stages, on a worker thread.
  auto curate = [&](D& d, int64_t g) {
    thread_local std::string tmp;
    d.bytes_in = static_cast<int64_t>(d.text.size());
    if (c.minhash.enabled && cluster[static_cast<size_t>(g)] != g) {
      d.near_dup = true;
      return;
    }
    if (c.pii.enabled) {
      d.pii = redact_pii(d.text, c.pii, tmp);
      if (d.pii.total()) d.text.swap(tmp);
    }
    if (c.decontaminate && deco.contaminated(d.text)) {
      d.contaminated = true;
      return;
    }
    uint64_t h = xxh64(d.text.data(), d.text.size(), c.split_seed);
    double u = static_cast<double>(h >> 11) * 0x1.0p-53;
    d.split = u < c.validation_fraction ? 1 : 0;
    d.line = jsonl_line(d.id, c.sources[d.source].name, d.text);
    if (c.tokenize) {
      if (tok.bos) d.ids.push_back(*tok.bos);
      tok.t->encode(d.text, {.special = tokenizer::SpecialPolicy::as_text()}, d.ids);
      if (tok.eos) d.ids.push_back(*tok.eos);
    }
  };
  auto process = [&](Batch& b) {
    for_each_document(b.n, [&](int64_t i) { curate(b.docs[static_cast<size_t>(i)], b.first + i); });
  };
  // A resume point after the first batch that completes a shard, and after every
  // checkpoint_bytes of text.
  int64_t shards_at_resume_point = out->shards_done(), bytes_at_resume_point = p2.text_bytes;
  int64_t batches_merged = 0;
  auto save_resume_point = [&] {
    json kept = json::array();
    for (const auto& [g, id] : kept_of_cluster)
      if (!id.empty()) kept.push_back(json::array({g, id}));
    json saved = out->checkpoint();
    saved["key"] = key2;
    saved["state"] = p2.to_json();
    saved["kept"] = kept;
    write_file_atomic(resume_path, saved.dump() + "\n");
    shards_at_resume_point = out->shards_done();
    bytes_at_resume_point = p2.text_bytes;
  };
  // Counts and outputs, in document order.
  auto merge = [&](Batch& b) {
    for (int64_t i = 0; i < b.n; ++i) {
      D& d = b.docs[static_cast<size_t>(i)];
      const int64_t bytes = d.bytes_in, g = b.first + i;
      p2.text_bytes += bytes;
      if (d.near_dup) {
        p2.near.drop("near_duplicate", bytes);
        std::string rec = "{\"id\":";
        append_json_string(rec, d.id);
        rec += ",\"duplicate_of\":";
        append_json_string(rec, kept_of_cluster.at(cluster[static_cast<size_t>(g)]));
        rec += "}\n";
        out->near->write(rec);
        p2.near_docs++;
        continue;
      }
      p2.near.keep(bytes, bytes);
      if (auto it = kept_of_cluster.find(g); it != kept_of_cluster.end()) it->second = d.id;
      int64_t after = static_cast<int64_t>(d.text.size());
      p2.pii.keep(bytes, after);
      if (d.pii.total()) p2.pii.docs_modified++;
      for (int k = 0; k < kPiiTypes; ++k)
        p2.pii_total.n[static_cast<size_t>(k)] += d.pii.n[static_cast<size_t>(k)];
      if (d.contaminated) {
        p2.deco.drop("contaminated", after);
        continue;
      }
      p2.deco.keep(after, after);
      p2.split.keep(after, after);
      p2.split_docs[d.split]++;
      p2.split_bytes[d.split] += after;
      out->curated[d.split]->write(d.line);
      if (c.tokenize) {
        p2.tok.keep(after, after);
        out->writers[d.split]->add_document(d.ids);
        p2.split_tokens[d.split] += static_cast<int64_t>(d.ids.size());
      }
    }
    p2.docs = b.first + b.n;
    p2.offset = b.end_offset;
    progress.update(p2.docs, p2.text_bytes);
    if (out->shards_done() > shards_at_resume_point ||
        p2.text_bytes - bytes_at_resume_point >= c.checkpoint_bytes)
      save_resume_point();
    if (++batches_merged == opt.interrupt_pass2_after)
      fail("interrupted after ", batches_merged, " batches of pass 2 (as asked)");
  };
  {
    const fs::path docs_path = work / "pass1.docs";
    std::FILE* in = std::fopen(docs_path.c_str(), "rb");
    POLLEN_CHECK(in, "cannot open '", docs_path.string(), "'");
    std::unique_ptr<std::FILE, int (*)(std::FILE*)> closer(in, std::fclose);
    std::vector<char> inbuf(1 << 20);
    std::setvbuf(in, inbuf.data(), _IOFBF, inbuf.size());
    POLLEN_CHECK(std::fseek(in, static_cast<long>(p2.offset), SEEK_SET) == 0, "cannot seek in '",
                 docs_path.string(), "'");
    int64_t index = p2.docs, offset = p2.offset, bytes = 0;
    // Reading on this thread, curating on the pool, merging on a third thread.
    BatchPipeline<Batch> pipe(process, merge);
    pipe.batch().n = 0;
    pipe.batch().first = index;
    while (true) {
      Batch& b = pipe.batch();
      if (static_cast<size_t>(b.n) == b.docs.size()) b.docs.emplace_back();
      D& d = b.docs[static_cast<size_t>(b.n)];
      d.reset();
      if (!read_doc_record(in, docs_path, d.source, d.id, d.text, offset)) break;
      POLLEN_CHECK(d.source < c.sources.size(), "'", docs_path.string(), "' names source ",
                   d.source, " of ", c.sources.size());
      bytes += static_cast<int64_t>(d.text.size());
      ++index;
      if (++b.n, bytes >= c.batch_bytes) {
        b.end_offset = offset;
        pipe.submit();
        pipe.batch().n = bytes = 0;
        pipe.batch().first = index;
      }
    }
    if (pipe.batch().n > 0) {
      pipe.batch().end_offset = offset;
      pipe.submit();
    }
    pipe.finish();
    progress.update(p2.docs, p2.text_bytes, true);
    POLLEN_CHECK(index == p1.docs && p2.docs == p1.docs, "'", docs_path.string(), "' holds ", index,
                 " documents, pass 1 wrote ", p1.docs);
  }
  json pii_counts = json::object();
  for (int k = 0; k < kPiiTypes; ++k)
    pii_counts[pii_type_name(static_cast<PiiType>(k))] = p2.pii_total.n[static_cast<size_t>(k)];
  p2.pii.extra = {{"redactions", pii_counts}};
  p2.split.extra = {{"train", {{"docs", p2.split_docs[0]}, {"bytes", p2.split_bytes[0]}}},
                    {"validation", {{"docs", p2.split_docs[1]}, {"bytes", p2.split_bytes[1]}}}};
  p2.tok.extra = {{"train_tokens", p2.split_tokens[0]}, {"validation_tokens", p2.split_tokens[1]}};

  const int64_t near_bytes = out->near->bytes();
  const std::string near_sha = out->near->commit();
  std::string curated_sha[2];
  int64_t curated_bytes[2];
  for (int s = 0; s < 2; ++s) {
    curated_bytes[s] = out->curated[s]->bytes();
    curated_sha[s] = out->curated[s]->commit();
  }
  json shards = json::array();
  if (c.tokenize)
    for (int s = 0; s < 2; ++s)
      for (const auto& info : out->writers[s]->finish()) shards.push_back(info.to_json());

  // ---- the manifest
  json m;
  m["format"] = "pollen-shards-v1";
  m["token_dtype"] = token_dtype_name(dtype);
  m["vocab_size"] = c.tokenize ? static_cast<int64_t>(tok.t->vocab_size()) : 0;
  if (c.tokenize) {
    fs::path src =
        fs::path(c.tokenizer).is_absolute() ? fs::path(c.tokenizer) : c.base_dir / c.tokenizer;
    write_file_atomic(c.output / "tokenizer.json", read_file(src));
    m["tokenizer"] = {{"fingerprint", tok.t->fingerprint()}, {"file", "tokenizer.json"}};
  } else {
    m["tokenizer"] = nullptr;
  }
  m["bos_id"] = tok.bos ? json(*tok.bos) : json(nullptr);
  m["eos_id"] = tok.eos ? json(*tok.eos) : json(nullptr);
  m["add_bos"] = c.tokenize && c.add_bos;
  m["add_eos"] = c.tokenize && c.add_eos;
  m["inputs"] = p1.inputs;
  m["config"] = c.to_json();
  json stages = json::array();
  for (const auto& s : p1.stages) stages.push_back(s.to_json());
  for (const StageCounts* s : {&p2.near, &p2.pii, &p2.deco, &p2.split, &p2.tok})
    stages.push_back(s->to_json());
  m["stages"] = stages;
  m["problems"] = p1.problems;
  m["problems_total"] = p1.problems_total;
  m["curated"] = json::array();
  for (int s = 0; s < 2; ++s)
    m["curated"].push_back({{"split", s == 0 ? "train" : "validation"},
                            {"file", s == 0 ? "curated-train.jsonl" : "curated-validation.jsonl"},
                            {"docs", p2.split_docs[s]},
                            {"bytes", curated_bytes[s]},
                            {"sha256", curated_sha[s]}});
  m["near_duplicates"] = {{"file", "near-duplicates.jsonl"},
                          {"docs", p2.near_docs},
                          {"bytes", near_bytes},
                          {"sha256", near_sha}};
  m["shards"] = shards;
  std::string text = manifest_text(m);
  write_file_atomic(manifest_path, text);
  fs::remove(resume_path, ec);
  write_file_atomic(work / "done.json",
                    json{{"key", key_all}, {"manifest_sha256", sha256_hex(text)}}.dump() + "\n");
  if (opt.progress) std::fprintf(stderr, "%s", dataset_stats(manifest_path).c_str());
  return manifest_path;
}

// ---- stats and inspect -------------------------------------------------------------------------

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
  out += cat("token dtype ", token_dtype_name(m.token_dtype), ", vocab ", m.vocab_size, "\n");
  out += cat("train: ", docs[0], " docs, ", tokens[0], " tokens in ", nshards[0],
             " shards\nvalidation: ", docs[1], " docs, ", tokens[1], " tokens in ", nshards[1],
             " shards\n");
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
