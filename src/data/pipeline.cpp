// `pollen data prepare`, the run: the config's paths checked, pass 1 run (or its saved outputs
// reused), near-duplicates found, pass 2 run from its last resume point and the manifest
// written. pipeline.h describes the stages; pass 1 is in pipeline_pass1.cpp.
#include "data/pipeline.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string_view>
#include <unordered_map>

#include "base/error.h"
#include "base/files.h"
#include "base/folder_lock.h"
#include "base/hash.h"
#include "base/log.h"
#include "base/thread_pool.h"
#include "base/utf8.h"
#include "data/batch_pipeline.h"
#include "data/decontam.h"
#include "data/json_record.h"
#include "data/pipeline_internal.h"
#include "data/shards.h"
#include "tokenizer/hf_format.h"
#include "tokenizer/tokenizer.h"

namespace pollen::data {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

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
  try {
    k.t = std::make_unique<tokenizer::Tokenizer>(tokenizer::load_hf_json(p));
  } catch (const Error& e) {
    fail("config file '", c.source, "': tokenize.tokenizer '", c.tokenizer, "': ", e.what());
  }
  auto pick = [&](bool want, const std::string& name, const std::vector<uint32_t>& from_template,
                  std::initializer_list<const char*> usual,
                  const char* key) -> std::optional<uint32_t> {
    if (!want) return std::nullopt;
    if (!name.empty()) {
      auto id = find_token(*k.t, name);
      POLLEN_CHECK(id.has_value(), "config file '", c.source, "': tokenize.", key,
                   ": the tokenizer '", p.string(), "' has no added token \"", name, "\"");
      return id;
    }
    if (!from_template.empty()) return from_template.front();
    for (const char* u : usual)
      if (auto id = find_token(*k.t, u)) return id;
    fail("config file '", c.source, "': tokenize.", key, ": the tokenizer '", p.string(),
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

// `p` absolute, with links resolved as far as it exists.
fs::path resolved(const fs::path& p) {
  std::error_code ec;
  const fs::path full = fs::weakly_canonical(fs::absolute(p), ec);
  return ec ? fs::absolute(p).lexically_normal() : full;
}

// A path as the config gives it (relative to the config's folder `base`), resolved.
fs::path resolved_in(const fs::path& base, const fs::path& p) {
  return resolved(p.is_absolute() ? p : base / p);
}

// The shard prefixes that runs in this output folder have used (work/shard_prefixes.json), with
// `more` added: a shard of any of them that this run does not keep is stale, whichever prefix
// wrote it.
std::set<std::string> note_shard_prefixes(const fs::path& work, const std::set<std::string>& more) {
  const fs::path path = work / "shard_prefixes.json";
  std::set<std::string> prefixes;
  if (fs::exists(path)) {
    const json saved = json::parse(read_file(path), nullptr, false);
    if (saved.is_array())
      for (const auto& p : saved)
        if (p.is_string()) prefixes.insert(p.get<std::string>());
  }
  const size_t before = prefixes.size();
  prefixes.insert(more.begin(), more.end());
  if (prefixes.size() > before) write_file_atomic(path, json(prefixes).dump() + "\n");
  return prefixes;
}

// Where a tokenized run keeps the hash of the tokenizer copy it wrote into the output folder.
fs::path tokenizer_copy_record(const fs::path& work) {
  return work / "tokenizer_copy.sha256";
}

// What an earlier run's manifest says of the files it wrote, for a folder prepared before the
// records in work/ were kept: the prefixes of its shards (PREFIX-SPLIT-NNNNN.tokens by their
// split), and the hash of its tokenizer copy, taken as it is now when no record holds it.
std::set<std::string> take_earlier_manifest(const fs::path& manifest, const fs::path& work) {
  std::set<std::string> prefixes;
  const json m = json::parse(read_file(manifest), nullptr, false);
  if (!m.is_object()) return prefixes;
  if (m.contains("shards") && m["shards"].is_array())
    for (const auto& shard : m["shards"]) {
      const std::string name = shard.value("tokens", ""), split = shard.value("split", "");
      const size_t at = name.rfind("-" + split + "-");
      if (at == std::string::npos || at == 0) continue;
      const std::string prefix = name.substr(0, at);
      if (is_shard_file_of(name, prefix, false)) prefixes.insert(prefix);
    }
  const fs::path copy = manifest.parent_path() / "tokenizer.json";
  if (m.contains("tokenizer") && m["tokenizer"].is_object() &&
      m["tokenizer"].value("file", "") == "tokenizer.json" && fs::exists(copy) &&
      !fs::exists(tokenizer_copy_record(work)))
    write_file_atomic(tokenizer_copy_record(work), sha256_file(copy) + "\n");
  return prefixes;
}

// An evaluation file's format by its name, as the sources' files are read: "jsonl" for
// NAME.jsonl in any case (compressed too: .jsonl.gz, .JSONL.ZST), else "text".
std::string eval_file_format(const fs::path& p) {
  const std::string ext = lower_extension(p);
  const fs::path unpacked = ext == ".gz" || ext == ".zst" ? p.stem() : p;
  return lower_extension(unpacked) == ".jsonl" ? "jsonl" : "text";
}

// The first file of a finished dataset that is gone or not the size its manifest says, as
// "'NAME' is missing" (empty: none). Sizes only: a rerun of a finished config takes seconds.
std::string damaged_output(const fs::path& dir, const json& m) {
  const auto check = [&](const std::string& name, uint64_t bytes) -> std::string {
    std::error_code ec;
    const uintmax_t got = fs::file_size(dir / name, ec);
    if (ec) return cat("'", name, "' is missing");
    return got == bytes ? "" : cat("'", name, "' has ", got, " bytes, its manifest says ", bytes);
  };
  std::vector<std::pair<std::string, uint64_t>> files;
  for (const auto& f : m.at("curated")) files.emplace_back(f.at("file"), f.at("bytes"));
  files.emplace_back(m.at("near_duplicates").at("file"), m.at("near_duplicates").at("bytes"));
  const uint64_t width = token_dtype_bytes(parse_token_dtype(m.at("token_dtype"), "manifest"));
  for (const auto& shard : m.at("shards")) {
    files.emplace_back(shard.at("tokens"), shard.at("num_tokens").get<uint64_t>() * width);
    files.emplace_back(shard.at("index"), (shard.at("num_docs").get<uint64_t>() + 1) * 8);
  }
  for (const auto& [name, bytes] : files)
    if (std::string why = check(name, bytes); !why.empty()) return why;
  if (m.at("tokenizer").is_object() && !fs::exists(dir / m["tokenizer"].at("file")))
    return cat("'", m["tokenizer"]["file"].get<std::string>(), "' is missing");
  return "";
}

// The files and folders the config names, checked before any work: one that does not exist is
// a typo (or a mount that is not there), reported as the key that holds it.
void check_configured_paths(const PipelineConfig& c) {
  const auto where = [&](const std::string& key) {
    return cat("config file '", c.source, "', key '", key, "'");
  };
  // `file`: a file is expected (not a folder).
  auto check = [&](const std::string& key, const std::string& p, const std::string& expected,
                   bool file) {
    const fs::path path = fs::path(p).is_absolute() ? fs::path(p) : c.base_dir / p;
    const std::string full = path.string() == p ? "" : cat(" ('", path.string(), "')");
    POLLEN_CHECK(fs::exists(path), where(key), ": '", p, "' does not exist", full, "; expected ",
                 expected);
    POLLEN_CHECK(!file || !fs::is_directory(path), where(key), ": '", p, "' is a folder", full,
                 "; expected ", expected);
  };
  for (const auto& s : c.sources)
    for (const auto& p : s.paths)
      check("source." + s.name + ".paths", p, "a file or folder", false);
  if (c.tokenize)
    check("tokenize.tokenizer", c.tokenizer,
          "a tokenizer.json (or --no-tokenize, to stop at the curated JSONL)", true);
  if (c.decontaminate)
    for (const auto& e : c.eval_files) check("decontaminate.eval_files", e, "a file", true);
  POLLEN_CHECK(!fs::exists(c.output) || fs::is_directory(c.output), where("output"), ": '",
               c.output.string(), "' is a file; expected a folder to write the dataset to");
  const fs::path output = resolved(c.output);  // c.output holds the config's folder already
  for (const SourceSpec& s : c.sources)
    for (const std::string& p : s.paths)
      POLLEN_CHECK(resolved_in(c.base_dir, p) != output, where("source." + s.name + ".paths"),
                   ": '", p,
                   "' is the output folder too, so the dataset's own files would be read back as "
                   "input; write the dataset to another folder (one inside it is left out of the "
                   "inputs)");
}

// Whether `path` is `folder` or lies under it (both absolute and normal).
bool is_within(const fs::path& path, const fs::path& folder) {
  return std::mismatch(folder.begin(), folder.end(), path.begin(), path.end()).first ==
         folder.end();
}

// The input files of the config's sources, each under its own name (the prefix of its documents'
// ids, and what the manifest lists), without the dataset's own files where a listed folder
// holds the output folder.
std::vector<InputFile> list_config_inputs(const PipelineConfig& c) {
  std::vector<InputFile> files = list_inputs(c.sources, c.base_dir);
  // f.listed as the config gives it; f.path and c.output hold the config's folder already.
  const auto absolute = [&](const fs::path& listed) { return resolved_in(c.base_dir, listed); };
  const fs::path output = resolved(c.output);
  // A file under the output that was found there by a folder holding the output: the dataset's
  // own. One found by a listed folder inside the output stays an input.
  const auto own = [&](const InputFile& f) {
    const fs::path listed = absolute(f.listed);
    return listed != output && is_within(output, listed) && is_within(resolved(f.path), output);
  };
  const auto outputs = std::erase_if(files, own);
  if (outputs > 0)
    log::warn("data: the output folder '", c.output.string(), "' is inside a source's paths; its ",
              outputs, " files are not read as input");
  std::vector<int> per_source(c.sources.size(), 0);
  for (const InputFile& f : files) ++per_source[static_cast<size_t>(f.source)];
  for (size_t s = 0; s < c.sources.size(); ++s)
    if (per_source[s] == 0)
      log::warn("data: source.", c.sources[s].name,
                ".paths hold no file that its include and exclude patterns take: the source "
                "contributes nothing");
  POLLEN_CHECK(!files.empty(), "config file '", c.source,
               "': no source holds a file its include and exclude patterns take "
               "(source.<name>.paths, .include, .exclude): there is nothing to prepare");
  // Two listed folders of a source may hold files at one relative path (dumps by date, each
  // with part-000.jsonl): those are named by their listed folder too, as the config gives it
  // (relative to the config's folder; an absolute one by its last component).
  std::map<std::string, int> uses;
  for (const InputFile& f : files) ++uses[f.name];
  for (InputFile& f : files) {
    if (uses[f.name] < 2) continue;
    const fs::path listed =
        (f.listed.is_absolute() ? f.listed.filename() : f.listed).lexically_normal();
    const std::string source = c.sources[static_cast<size_t>(f.source)].name;
    const bool listed_folder = fs::is_directory(absolute(f.listed));
    f.name = source + "/" + listed.generic_string() +
             (listed_folder ? "/" + f.name.substr(source.size() + 1) : std::string());
  }
  // Names go into JSON (ids, the manifest): a file name that is not UTF-8 is named with each
  // invalid sequence as U+FFFD, as its text would be; two names made one are refused below.
  for (InputFile& f : files) {
    std::string repaired;
    if (utf8_repair(f.name, repaired) == 0) continue;
    log::warn("data: the name of '", f.path.string(), "' is not UTF-8; its documents are named '",
              repaired, "'");
    f.name = std::move(repaired);
  }
  std::map<std::string, const InputFile*> named;
  for (const InputFile& f : files) {
    const auto [first, fresh] = named.emplace(f.name, &f);
    POLLEN_CHECK(fresh, "source.", c.sources[static_cast<size_t>(f.source)].name, ".paths: '",
                 first->second->path.string(), "' and '", f.path.string(),
                 "' would both be named '", f.name,
                 "' (their documents' ids and the manifest's inputs); list one of them under "
                 "another source");
  }
  return files;
}

}  // namespace

fs::path prepare(const PipelineConfig& c, const PrepareOptions& opt) {
  check_configured_paths(c);
  // One `pollen data prepare` at a time writes a dataset folder: two would overwrite each
  // other's shards and manifest. The lock is in work/, so that the dataset's own files stay
  // byte-identical from run to run.
  const FolderLock lock(c.output, "output", c.output / "work" / ".lock");
  if (c.threads > 0) set_num_threads(c.threads);
  fs::create_directories(c.output / "work");
  const fs::path work = c.output / "work";
  // What a killed run's atomic writes left (.NAME.tmp.PID: a manifest, an index, a resume point)
  // is nobody's now that this run holds the folder: every such file in work/, and in the output
  // folder (which may hold files of others) those of the files pollen writes there.
  const auto atomic_leftover = [](const std::string& name, bool ours) {
    const size_t at = name.find(".tmp.");
    if (!name.starts_with(".") || at == std::string::npos || at + 5 == name.size() ||
        name.find_first_not_of("0123456789", at + 5) != std::string::npos)
      return false;
    const std::string base = name.substr(1, at - 1);
    return ours || base == "manifest.json" || base == "tokenizer.json" ||
           base == "near-duplicates.jsonl" || base.starts_with("curated-") ||
           base.ends_with(".index");
  };
  for (const fs::path& dir : {c.output, work})
    for (const auto& e : fs::directory_iterator(dir))
      if (atomic_leftover(e.path().filename().string(), dir == work)) fs::remove(e.path());
  const fs::path manifest_path = c.output / "manifest.json";
  std::vector<InputFile> files = list_config_inputs(c);
  const json basis1 = pass1_basis(c, files);
  const std::string key1 = pass1_key(basis1);
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
  const json basis_all{
      {"pass1", basis1}, {"config", c.to_json()}, {"contents", sha256_hex(contents)}};
  // A finished run with the same config and inputs: nothing to do.
  if (fs::exists(manifest_path) && fs::exists(work / "done.json")) {
    json done = json::parse(read_file(work / "done.json"), nullptr, false);
    if (!done.is_discarded() && done.value("key", "") == key_all &&
        done.value("manifest_sha256", "") == sha256_file(manifest_path)) {
      const std::string damage = damaged_output(c.output, json::parse(read_file(manifest_path)));
      if (damage.empty()) {
        log::info("data: ", manifest_path.filename().string(),
                  " is complete for this config and these inputs; nothing to do");
        return manifest_path;
      }
      log::warn("data: '", manifest_path.string(), "' is of this config and these inputs, but ",
                damage, ": preparing it again");
    }
    if (!done.is_discarded() && done.value("key", "") != key_all)
      log::info("data: '", manifest_path.string(), "' was prepared from another config or inputs (",
                basis_changes(done.value("basis", json()), basis_all), "); preparing it again");
  }
  // The tokenizer is read before anything is removed or read, so that a wrong one (or a missing
  // BOS or EOS token) is refused before hours of reading, and leaves a finished dataset whole.
  Tok tok;
  TokenDType dtype = TokenDType::u16;
  if (c.tokenize) {
    tok = load_tokenizer(c);
    dtype = token_dtype_for(tok.t->vocab_size());
  }
  // Not the finished run: the manifest of an earlier one goes before any shard is touched, so
  // that an interruption from here on leaves a folder that reads as unfinished rather than an
  // old manifest beside new or missing shards (removed first: without it, no done.json marks
  // the folder finished).
  std::error_code ec;
  if (fs::exists(manifest_path))
    note_shard_prefixes(work, take_earlier_manifest(manifest_path, work));
  fs::remove(manifest_path, ec);
  POLLEN_CHECK(!ec, "cannot remove the earlier manifest '", manifest_path.string(),
               "': ", ec.message());
  fs::remove(work / "done.json", ec);

  // ---- pass 1, or its saved outputs
  Pass1Result p1;
  bool reuse = false;
  if (fs::exists(work / "pass1.json")) {
    json saved = json::parse(read_file(work / "pass1.json"), nullptr, false);
    if (!saved.is_discarded() && saved.value("key", "") != key1)
      log::info("data: pass 1's outputs are of another config or inputs (",
                basis_changes(saved.value("basis", json()), basis1), "); pass 1 runs again");
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
    p1 = run_pass1(c, files, work, basis1, opt);
    json stages = json::array();
    for (const auto& s : p1.stages) stages.push_back(s.to_json());
    json saved{{"key", key1},
               {"basis", basis1},
               {"stages", stages},
               {"inputs", p1.inputs},
               {"problems", p1.problems},
               {"problems_total", p1.problems_total},
               {"docs", p1.docs},
               {"sha256_docs", p1.sha256_docs},
               {"sha256_sigs", p1.sha256_sigs}};
    write_file_atomic(work / "pass1.json", saved.dump(1) + "\n");
  }
  fs::remove(work / "pass1.resume.json", ec);  // pass 1 is done
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
      spec.format = eval_file_format(p);
      spec.text_field = c.eval_text_field;
      InputFile f{0, p, "eval/" + p.filename().string(), false, e};
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
  // Resume from pass 2's last resume point when it belongs to this run's config, inputs and
  // pass 1; else start pass 2 over.
  const fs::path resume_path = work / "pass2.json";
  const std::string key2 = sha256_hex(key_all + p1.sha256_docs);
  json basis2 = basis_all;
  basis2["pass1_docs"] = p1.sha256_docs;
  const std::set<std::string> prefixes = note_shard_prefixes(work, {c.prefix});
  std::unique_ptr<Pass2Outputs> out;
  if (reuse && fs::exists(resume_path)) {
    json saved = json::parse(read_file(resume_path), nullptr, false);
    if (resume_point_matches(saved, key2, basis2, resume_path, 2)) {
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
  // writes them again), and so are its partial shards that this run does not continue, and the
  // shards of earlier runs here under another prefix; the output folder's other files are not
  // this dataset's.
  std::set<std::string> kept_shards;
  std::set<fs::path> open_shards;
  for (int s = 0; s < 2 && c.tokenize; ++s) {
    for (const auto& info : out->writers[s]->shards()) kept_shards.insert(info.tokens);
    open_shards.insert(out->writers[s]->open_file());
  }
  for (const auto& e : fs::directory_iterator(c.output)) {
    const fs::path p = e.path();
    const std::string name = p.filename().string();
    const auto ours = [&](bool partial) {
      return std::any_of(prefixes.begin(), prefixes.end(),
                         [&](const std::string& x) { return is_shard_file_of(name, x, partial); });
    };
    const bool shard =
        ours(false) &&
        !kept_shards.count(fs::path(p).replace_extension(".tokens").filename().string());
    const bool partial = ours(true) && !open_shards.count(p);
    if (shard || partial) fs::remove(p);
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
    // Contamination is looked for in the text as read: redaction would break the n-grams of an
    // evaluation text holding an address or a number. A contaminated document passes the pii
    // stage unchanged, as nothing of it is written.
    if (c.decontaminate && deco.contaminated(d.text)) {
      d.contaminated = true;
      return;
    }
    if (c.pii.enabled) {
      d.pii = redact_pii(d.text, c.pii, tmp);
      if (d.pii.total()) d.text.swap(tmp);
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
    saved["basis"] = basis2;
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
  // Pass 2 done: a run stopped while its files are renamed into place resumes from here (each
  // output renamed already is taken back), with no document to curate again.
  save_resume_point();
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

  if (opt.interrupt_before_manifest) fail("interrupted after pass 2's renames (as asked)");

  // ---- the manifest
  json m;
  m["format"] = "pollen-shards-v1";
  m["token_dtype"] = token_dtype_name(dtype);
  m["vocab_size"] = c.tokenize ? static_cast<int64_t>(tok.t->vocab_size()) : 0;
  // The copy of the tokenizer a tokenized run writes, and the hash of what it wrote
  // (tokenizer_copy_record): an untokenized run removes that copy (it would pass for its
  // tokenizer), and nobody else's file, tokenize.tokenizer's own included.
  const fs::path copy = c.output / "tokenizer.json", copied = tokenizer_copy_record(work);
  const bool named = !c.tokenizer.empty() && fs::equivalent(copy, c.base_dir / c.tokenizer, ec);
  if (c.tokenize) {
    fs::path src =
        fs::path(c.tokenizer).is_absolute() ? fs::path(c.tokenizer) : c.base_dir / c.tokenizer;
    const std::string text = read_file(src);
    if (named) {
      fs::remove(copied, ec);  // the user's file, not a copy
    } else {
      write_file_atomic(copied, sha256_hex(text) + "\n");
      write_file_atomic(copy, text);
    }
    m["tokenizer"] = {{"fingerprint", tok.t->fingerprint()}, {"file", "tokenizer.json"}};
  } else {
    m["tokenizer"] = nullptr;
    if (!named && fs::exists(copy) && fs::exists(copied) &&
        read_file(copied) == sha256_file(copy) + "\n")
      fs::remove(copy);
    fs::remove(copied, ec);
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
  write_file_atomic(
      work / "done.json",
      json{{"key", key_all}, {"basis", basis_all}, {"manifest_sha256", sha256_hex(text)}}.dump() +
          "\n");
  if (opt.progress) std::fprintf(stderr, "%s", dataset_stats(manifest_path).c_str());
  return manifest_path;
}

}  // namespace pollen::data
