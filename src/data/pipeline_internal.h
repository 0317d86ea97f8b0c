#pragma once
// What the files of `pollen data prepare` share (pipeline.cpp runs it, pipeline_pass1.cpp holds
// pass 1): the counts of a stage, outputs written atomically, progress lines, the records of
// work/pass1.docs and pass 1 itself. For src/data's pipeline files only; pipeline.h is the
// interface.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/hash.h"
#include "base/thread_pool.h"
#include "data/pipeline.h"
#include "data/readers.h"

namespace pollen::data {

// The counts of one stage, as the manifest holds them: documents and bytes in, kept and
// dropped (by reason), and what else the stage reports (`extra`).
struct StageCounts {
  std::string name;
  bool enabled = true;
  int64_t docs_in = 0, bytes_in = 0, docs_kept = 0, bytes_kept = 0, docs_modified = 0;
  std::map<std::string, std::pair<int64_t, int64_t>> dropped;
  nlohmann::json extra = nlohmann::json::object();

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
  nlohmann::json to_json() const {
    nlohmann::json d = nlohmann::json::object();
    for (const auto& [k, v] : dropped) d[k] = {{"docs", v.first}, {"bytes", v.second}};
    nlohmann::json j{{"name", name},           {"enabled", enabled},
                     {"docs_in", docs_in},     {"bytes_in", bytes_in},
                     {"docs_kept", docs_kept}, {"bytes_kept", bytes_kept},
                     {"dropped", d},           {"docs_modified", docs_modified}};
    for (auto it = extra.begin(); it != extra.end(); ++it) j[it.key()] = it.value();
    return j;
  }
  static StageCounts from_json(const nlohmann::json& j) {
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

// A file written under a temporary name and renamed into place by commit(). An abandoned one
// is removed, unless sync() made its bytes part of a resume point: then a later run reopens it
// where that resume point left it.
class AtomicOut {
 public:
  explicit AtomicOut(std::filesystem::path path) : path_(std::move(path)), tmp_(tmp_path(path_)) {
    f_ = std::fopen(tmp_.c_str(), "wb");
    POLLEN_CHECK(f_, "cannot create '", tmp_.string(), "': ", std::strerror(errno));
  }
  // Continues a file that sync() left at `bytes` (later bytes are cut off); its hash is
  // recomputed from what is there. Renamed into place after that resume point (by a run stopped
  // before its manifest), it is taken back.
  AtomicOut(std::filesystem::path path, int64_t bytes)
      : path_(std::move(path)), tmp_(tmp_path(path_)) {
    if (!std::filesystem::exists(tmp_) && std::filesystem::exists(path_))
      std::filesystem::rename(path_, tmp_);
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
      if (!keep_) std::filesystem::remove(tmp_, ec);
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
    POLLEN_CHECK(std::fflush(f_) == 0, "cannot write '", tmp_.string(),
                 "': ", std::strerror(errno));
    POLLEN_CHECK(::fsync(fileno(f_)) == 0, "cannot sync '", tmp_.string(),
                 "': ", std::strerror(errno));
    keep_ = true;
    return bytes_;
  }
  std::string commit() {
    sync();
    std::fclose(f_);
    f_ = nullptr;
    std::filesystem::rename(tmp_, path_);
    return sha_.hex_digest();
  }
  int64_t bytes() const { return bytes_; }

 private:
  static std::filesystem::path tmp_path(const std::filesystem::path& p) {
    return p.parent_path() / ("." + p.filename().string() + ".tmp");
  }
  std::filesystem::path path_, tmp_;
  std::FILE* f_ = nullptr;
  bool keep_ = false;
  Sha256 sha_;
  int64_t bytes_ = 0;
};

// A line of progress on stderr: redrawn in place on a terminal (at most every 200 ms), else a
// new line at most every 2 seconds.
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

// What pass 1 leaves for pass 2 and the manifest.
struct Pass1Result {
  std::vector<StageCounts> stages;  // read, then the kPass1Stages
  nlohmann::json inputs = nlohmann::json::array();
  nlohmann::json problems = nlohmann::json::array();
  int64_t problems_total = 0;
  nlohmann::json files = nlohmann::json::object();
  int64_t docs = 0;  // written to pass1.docs
  std::string sha256_docs, sha256_sigs;
};

// What pass 1's outputs depend on (its basis): the config of pass 1, each input's name, size and
// modification time, and the version of what the stages decide. pass1_key hashes it: the key
// that decides whether pass 1's outputs (or a resume point) can be reused. The basis is saved
// beside the key, so that a rerun that cannot reuse them says why (basis_changes).
nlohmann::json pass1_basis(const PipelineConfig& c, const std::vector<InputFile>& files);
std::string pass1_key(const nlohmann::json& basis);
// What differs between a saved basis and this run's, in words: the config keys, the input files
// changed, added or gone (the first few by name), the rest by what it is.
std::string basis_changes(const nlohmann::json& saved, const nlohmann::json& now);
// Whether the resume point `saved` (read from `path`) is of this run (`key`); when it is not,
// warns that pass `pass` starts over and why (basis_changes against `basis`).
bool resume_point_matches(const nlohmann::json& saved, const std::string& key,
                          const nlohmann::json& basis, const std::filesystem::path& path, int pass);

// Pass 1: reads the inputs, filters them and drops exact duplicates; writes the survivors to
// work/pass1.docs and their MinHash signatures to work/pass1.sig. Continues from
// work/pass1.resume.json when it holds the key of `basis` and its partial outputs are there.
Pass1Result run_pass1(const PipelineConfig& c, const std::vector<InputFile>& files,
                      const std::filesystem::path& work, const nlohmann::json& basis,
                      const PrepareOptions& opt);

// Reads the next record of work/pass1.docs (pipeline_pass1.cpp writes them), advancing `offset`
// past it; false at the end.
bool read_doc_record(std::FILE* in, const std::filesystem::path& path, uint32_t& source,
                     std::string& id, std::string& text, int64_t& offset);

// Runs fn(i) for every i in [0, n) on all threads, in small chunks handed out as threads come
// free (documents differ in size); each i's result goes to its own slot, so the outcome does
// not depend on the scheduling.
inline void for_each_document(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n == 0) return;
  const int chunks = static_cast<int>(std::min<int64_t>(n, int64_t{16} * num_threads()));
  pool().run_chunks(n, chunks, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) fn(i);
  });
}

}  // namespace pollen::data
