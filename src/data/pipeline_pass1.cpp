// Pass 1 of `pollen data prepare`: the inputs read in batches, filtered on the thread pool and
// exact-deduplicated in input order; the survivors go to work/pass1.docs, their MinHash
// signatures to work/pass1.sig. pass1_basis and its key say when a rerun may reuse those outputs.
// Resume points (work/pass1.resume.json) are saved where an input file ends, so that a rerun after
// an interruption continues with the next file.
#include "data/pipeline_internal.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <unordered_set>

#include "base/error.h"
#include "base/files.h"
#include "base/hash.h"
#include "base/log.h"
#include "data/batch_pipeline.h"
#include "data/minhash.h"
#include "data/text.h"

namespace pollen::data {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Pass 1's filtering stages, in order.
enum Pass1Stage { kUtf8, kLength, kGopherQ, kGopherR, kC4, kFineWeb, kExact, kPass1Stages };
const char* kPass1Names[] = {"utf8", "length",  "gopher_quality", "gopher_repetition",
                             "c4",   "fineweb", "exact_dedup"};

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

// Calls fn with the text of each of the first `docs` records of a pass1.docs file.
void for_each_saved_document(const fs::path& path, int64_t docs,
                             const std::function<void(std::string_view)>& fn) {
  std::FILE* in = std::fopen(path.c_str(), "rb");
  POLLEN_CHECK(in, "cannot open '", path.string(), "': ", std::strerror(errno));
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> closer(in, std::fclose);
  uint32_t source = 0;
  std::string id, text;
  int64_t offset = 0;
  for (int64_t i = 0; i < docs; ++i) {
    POLLEN_CHECK(read_doc_record(in, path, source, id, text, offset), "'", path.string(),
                 "' holds ", i, " documents, not ", docs);
    fn(text);
  }
}

}  // namespace

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

json pass1_basis(const PipelineConfig& c, const std::vector<InputFile>& files) {
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
  // "v": what the stages decide, so that a folder prepared by a pollen whose stages decided
  // otherwise is prepared again (3: FineWeb and Gopher bounds as datatrove 0.10.1's, and
  // decontamination before PII redaction; 4: Gopher repetition drops an empty text; every later
  // key derives from this one).
  return json{{"config", cfg}, {"files", f}, {"v", 4}};
}

Pass1Result run_pass1(const PipelineConfig& c, const std::vector<InputFile>& files,
                      const fs::path& work, const json& basis, const PrepareOptions& opt) {
  const std::string key = pass1_key(basis);
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

  MinHasher hasher(c.minhash);
  const int m = c.minhash.enabled ? c.minhash.signature_size() : 0;  // per document
  // Exact duplicates by all 128 bits of their content hash (h1 alone only places them).
  struct ContentHash {
    size_t operator()(const std::pair<uint64_t, uint64_t>& h) const { return h.first; }
  };
  std::unordered_set<std::pair<uint64_t, uint64_t>, ContentHash> seen;
  int64_t files_read = 0, files_missing = 0, files_empty = 0, files_unreadable = 0;
  int64_t done_bytes = 0, done_docs = 0;

  // ---- the outputs: new, or continued from the last resume point of an interrupted run
  const fs::path resume_path = work / "pass1.resume.json";
  std::unique_ptr<AtomicOut> docs_out, sig_out;
  size_t first_file = 0;
  const StageCounts fresh_read = read;
  const std::vector<StageCounts> fresh_stages = st;
  if (fs::exists(resume_path)) {
    const json saved = json::parse(read_file(resume_path), nullptr, false);
    if (resume_point_matches(saved, key, basis, resume_path, 1)) {
      try {
        docs_out =
            std::make_unique<AtomicOut>(work / "pass1.docs", saved.at("docs_bytes").get<int64_t>());
        sig_out =
            std::make_unique<AtomicOut>(work / "pass1.sig", saved.at("sigs_bytes").get<int64_t>());
        res.docs = saved.at("docs");
        // Every document in pass1.docs passed exact dedup: their hashes are the seen set.
        if (c.exact_dedup)
          for_each_saved_document(work / ".pass1.docs.tmp", res.docs, [&](std::string_view text) {
            seen.insert({xxh64(text.data(), text.size(), 0),
                         xxh64(text.data(), text.size(), 0x9e3779b97f4a7c15ull)});
          });
        read = StageCounts::from_json(saved.at("read"));
        for (size_t s = 0; s < st.size(); ++s)
          st[s] = StageCounts::from_json(saved.at("stages").at(s));
        res.inputs = saved.at("inputs");
        res.problems = saved.at("problems");
        res.problems_total = saved.at("problems_total");
        files_read = saved.at("files_read");
        files_missing = saved.at("files_missing");
        files_empty = saved.at("files_empty");
        files_unreadable = saved.at("files_unreadable");
        done_docs = saved.at("done_docs");
        done_bytes = saved.at("done_bytes");
        first_file = saved.at("next_file");
        POLLEN_CHECK(first_file <= files.size(), "it is past the last input file");
        log::info("data: resuming pass 1 after ", first_file, " of ", files.size(), " input files");
      } catch (const std::exception& e) {
        log::warn("data: cannot resume pass 1 (", e.what(), "); starting it over");
        docs_out.reset();
        sig_out.reset();
        seen.clear();
        read = fresh_read;
        st = fresh_stages;
        res = Pass1Result{};
        files_read = files_missing = files_empty = files_unreadable = done_docs = done_bytes = 0;
        first_file = 0;
      }
    }
  }
  if (!docs_out) {
    std::error_code ec;
    fs::remove(resume_path, ec);
    docs_out = std::make_unique<AtomicOut>(work / "pass1.docs");
    sig_out = std::make_unique<AtomicOut>(work / "pass1.sig");
  }

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
    // When the batch ends with the end of an input file and a resume point is due: the index of
    // the next file, and what the reader knew then (`inputs`, `files_read`).
    int64_t resume_at_file = -1, files_read = 0;
    json inputs;

    void clear() {
      entries.clear();
      block.clear();
      ids.clear();
      problems.clear();
      n = 0;
      bytes = 0;
      resume_at_file = -1;
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
  // The outputs on disk, then what it takes to continue after them; on the merge thread, after
  // the batch that ends file b.resume_at_file - 1.
  int64_t resume_points = 0;
  auto save_resume_point = [&](const Batch& b) {
    json stages = json::array();
    for (const auto& s : st) stages.push_back(s.to_json());
    const json saved{{"key", key},
                     {"basis", basis},
                     {"next_file", b.resume_at_file},
                     {"docs_bytes", docs_out->sync()},
                     {"sigs_bytes", sig_out->sync()},
                     {"docs", res.docs},
                     {"read", read.to_json()},
                     {"stages", stages},
                     {"inputs", b.inputs},
                     {"problems", res.problems},
                     {"problems_total", res.problems_total},
                     {"files_read", b.files_read},
                     {"files_missing", files_missing},
                     {"files_empty", files_empty},
                     {"files_unreadable", files_unreadable},
                     {"done_docs", done_docs},
                     {"done_bytes", done_bytes}};
    write_file_atomic(resume_path, saved.dump() + "\n");
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
      write_doc_record(*docs_out, static_cast<uint32_t>(files[it.file].source), it.id, it.text);
      if (c.minhash.enabled)
        sig_out->write(
            std::string_view(reinterpret_cast<const char*>(&b.sigs[static_cast<size_t>(i * m)]),
                             static_cast<size_t>(m) * 4));
      res.docs++;
    }
    done_docs += n;
    done_bytes += b.bytes;
    progress.update(done_docs, done_bytes);
    if (b.resume_at_file >= 0) {
      save_resume_point(b);
      if (++resume_points == opt.interrupt_pass1_after)
        fail("interrupted after ", resume_points, " resume points of pass 1 (as asked)");
    }
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
  int64_t bytes_since_resume_point = 0;
  auto added = [&](size_t bytes) {
    Batch& b = pipe.batch();
    b.bytes += static_cast<int64_t>(bytes);
    bytes_since_resume_point += static_cast<int64_t>(bytes);
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
  for (size_t fi = first_file; fi < files.size(); ++fi) {
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
    // A resume point after every checkpoint_bytes of text, where a file ends (and not after
    // the last: pass 1's outputs are committed then).
    if (bytes_since_resume_point >= c.checkpoint_bytes && fi + 1 < files.size()) {
      Batch& b = pipe.batch();
      b.resume_at_file = static_cast<int64_t>(fi + 1);
      b.files_read = files_read;
      b.inputs = res.inputs;
      pipe.submit();
      start_batch();
      bytes_since_resume_point = 0;
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
  res.sha256_docs = docs_out->commit();
  res.sha256_sigs = sig_out->commit();
  return res;
}

}  // namespace pollen::data
