// The prepare pipeline end to end: accounting, bad input, determinism and resumption.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/files.h"
#include "base/folder_lock.h"
#include "base/thread_pool.h"
#include "data/loader.h"
#include "data/pipeline.h"
#include "data/readers.h"
#include "data/shards.h"
#include "support/errors.h"
#include "support/process.h"
#include "tokenizer/open.h"
#include "tokenizer/trainer.h"

namespace fs = std::filesystem;
using namespace pollen;
using namespace pollen::data;
using nlohmann::json;

namespace {

std::string paragraph(int seed) {
  static const char* w[] = {"river",    "valley",  "people",   "market",  "bridge",
                            "garden",   "winter",  "summer",   "letter",  "window",
                            "mountain", "harbour", "station",  "library", "teacher",
                            "village",  "orchard", "festival", "kitchen"};
  std::string s;
  uint64_t x = static_cast<uint64_t>(seed) * 2654435761u + 1;
  for (int sent = 0; sent < 8; ++sent) {
    s += "The ";
    for (int k = 0; k < 9; ++k) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      s += w[(x >> 33) % 19];
      s += k == 4 ? " and the " : " ";
    }
    s += "of the town.";
    s += sent % 3 == 2 ? "\n" : " ";
  }
  return s;
}

void write(const fs::path& p, const std::string& s) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << s;
}

struct Corpus {
  fs::path root;
  ~Corpus() { fs::remove_all(root); }
  Corpus() {
    // One folder per process: ctest runs this file's tests in parallel.
    root = fs::temp_directory_path() / ("pollen_data_pipeline_test_" + std::to_string(::getpid()));
    fs::remove_all(root);
    fs::path c = root / "corpus";
    // Plain text documents, one per file, with an exact duplicate and a near-duplicate.
    for (int i = 0; i < 40; ++i)
      write(c / "text" / ("doc" + std::to_string(i) + ".txt"), paragraph(i));
    write(c / "text" / "dup.txt", paragraph(3));
    write(c / "text" / "near.txt", paragraph(5) + " One extra closing sentence here.");
    write(c / "text" / "empty.txt", "");
    write(c / "text" / "bad_utf8.txt", paragraph(77) + " caf\xC3 bad byte");
    write(c / "text" / "pii.txt", paragraph(78) + " Write to someone@example.org today.");
    // Delimited, gzip-compressed.
    std::string fort;
    for (int i = 100; i < 110; ++i) fort += paragraph(i) + "\n%\n";
    gzFile gz = gzopen((c / "fortunes.gz").c_str(), "wb");
    gzwrite(gz, fort.data(), static_cast<unsigned>(fort.size()));
    gzclose(gz);
    // JSONL, zstd-compressed, with bad records.
    std::string jl;
    for (int i = 200; i < 210; ++i) jl += json{{"text", paragraph(i)}, {"n", i}}.dump() + "\n";
    jl += "{not json\n";
    jl += json{{"body", "no text field"}}.dump() + "\n";
    jl += json{{"text", std::string(5000, 'x')}}.dump() + "\n";  // over max_line_bytes
    // Line 14: invalid UTF-8 inside the JSON string (repaired by the utf8 stage, reported).
    std::string bad = json{{"text", paragraph(210) + " bad @ byte"}}.dump();
    bad[bad.find('@')] = '\xff';
    jl += bad + "\n";
    std::string z(ZSTD_compressBound(jl.size()), '\0');
    z.resize(ZSTD_compress(z.data(), z.size(), jl.data(), jl.size(), 3));
    write(c / "records.jsonl.zst", z);
    // An evaluation set that one training document contains.
    write(root / "eval.jsonl", json{{"text", paragraph(9)}}.dump() + "\n");
    // A small tokenizer.
    tokenizer::PieceCounts counts(tokenizer::pattern_regex("gpt2"));
    std::vector<std::string> texts;
    for (int i = 0; i < 50; ++i) texts.push_back(paragraph(i));
    std::vector<std::string_view> views(texts.begin(), texts.end());
    counts.add_documents(views);
    auto tok = tokenizer::train_bpe(counts, {400, {"<|endoftext|>"}, counts.pattern()});
    tokenizer::save_tokenizer(tok, root / "tokenizer.json");
  }
  // `top`: more top-level keys; `extra`: more keys of the [tokenize] table, or more tables.
  fs::path config(const std::string& out, int threads, const std::string& extra = "",
                  const std::string& top = "") const {
    fs::path p = root / (out + ".toml");
    write(p, "output = \"" + out + "\"\nthreads = " + std::to_string(threads) +
                 "\nmax_line_bytes = 1000\nbatch_bytes = 4096\n" + top +
                 "sources = [\"text\", \"fortunes\", \"records\"]\n"
                 "[source.text]\npaths = [\"corpus/text\"]\n"
                 "[source.fortunes]\npaths = [\"corpus/fortunes.gz\"]\nformat = \"delimited\"\n"
                 "[source.records]\npaths = [\"corpus/records.jsonl.zst\"]\nformat = \"jsonl\"\n"
                 "[minhash]\nngram = 5\n"
                 "[decontaminate]\neval_files = [\"eval.jsonl\"]\n"
                 "[split]\nvalidation_fraction = 0.2\n"
                 "[tokenize]\ntokenizer = \"tokenizer.json\"\nshard_tokens = 2000\n" +
                 extra);
    return p;
  }
};

const Corpus& corpus() {
  static Corpus c;
  return c;
}

// Runs prepare in a new output folder.
fs::path run(const std::string& out, int threads, const std::string& stop = "") {
  int before = num_threads();
  auto cfg = PipelineConfig::load(corpus().config(out, threads));
  fs::remove_all(cfg.output);
  auto m = prepare(cfg, {.progress = false, .stop_after = stop});
  set_num_threads(before);
  return cfg.output;
}

// Runs prepare in `out` as it is (a first run or a rerun after an interruption); with
// `interrupt_after` > 0 pass 2 is interrupted after that many batches, with
// `interrupt_pass1_after` > 0 pass 1 after that many resume points. Returns whether it ran to
// the end.
bool rerun(const std::string& out, int threads, int64_t interrupt_after,
           const std::string& top = "", int64_t interrupt_pass1_after = 0) {
  int before = num_threads();
  bool finished = true;
  try {
    prepare(PipelineConfig::load(corpus().config(out, threads, "", top)),
            {.progress = false,
             .interrupt_pass2_after = interrupt_after,
             .interrupt_pass1_after = interrupt_pass1_after});
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("interrupted after"), std::string::npos) << e.what();
    finished = false;
  }
  set_num_threads(before);
  return finished;
}

// Pass 2's saved position: documents of pass 1 done at its last resume point (-1: none).
int64_t resume_point_docs(const std::string& out) {
  fs::path p = corpus().root / out / "work" / "pass2.json";
  return fs::exists(p) ? json::parse(read_file(p))["state"]["docs"].get<int64_t>() : -1;
}

// Pass 1's saved position: the input file its last resume point continues with (-1: none).
int64_t pass1_resume_file(const std::string& out) {
  fs::path p = corpus().root / out / "work" / "pass1.resume.json";
  return fs::exists(p) ? json::parse(read_file(p))["next_file"].get<int64_t>() : -1;
}

std::map<std::string, std::string> outputs(const fs::path& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file()) files[e.path().filename().string()] = read_file(e.path());
  return files;
}

}  // namespace

// An evaluation text holding an IP address is still found in a training document: contamination
// is looked for before PII redaction rewrites the address. A document that is only redacted is
// kept.
TEST(Pipeline, ContaminationIsFoundBeforePiiRedaction) {
  const fs::path dir = corpus().root / "deco_pii";
  const std::string question =
      "How many requests did the server at 10.20.30.40 answer in five milliseconds today?";
  write(dir / "eval.jsonl", json{{"text", question}}.dump() + "\n");
  write(dir / "docs" / "a.txt", "Some forum post. " + question + " Answer: 42.");
  write(dir / "docs" / "b.txt", "Bees visit the spring garden; write to bee@example.org.");
  write(dir / "prepare.toml",
        "output = \"out\"\nthreads = 1\nsources = [\"d\"]\n[source.d]\npaths = [\"docs\"]\n"
        "[gopher_quality]\nenabled = false\n[gopher_repetition]\nenabled = false\n"
        "[decontaminate]\neval_files = [\"eval.jsonl\"]\n");
  prepare(PipelineConfig::load(dir / "prepare.toml"), {.progress = false});
  const json m = json::parse(read_file(dir / "out" / "manifest.json"));
  std::map<std::string, json> stage;
  for (const auto& s : m["stages"]) stage[s["name"]] = s;
  EXPECT_EQ(stage["decontaminate"]["dropped"]["contaminated"]["docs"], 1) << m.dump();
  EXPECT_EQ(stage["pii"]["redactions"]["email"], 1);
  EXPECT_EQ(stage["pii"]["redactions"]["ip"], 0);  // the contaminated document's is not counted
  EXPECT_EQ(stage["decontaminate"]["docs_kept"], 1);
  fs::remove_all(dir);
}

// An evaluation file is JSONL by its name's extension, in any case, as a source's files are; a
// folder's ".jsonl" in its path does not make a text file JSONL.
TEST(Pipeline, AnEvalFilesFormatIsTakenFromItsExtension) {
  const fs::path dir = corpus().root / "eval_format";
  write(dir / "docs" / "a.txt", "Bees visit the spring garden.");
  const std::string two =
      json{{"text", paragraph(3)}}.dump() + "\n" + json{{"text", paragraph(4)}}.dump() + "\n";
  write(dir / "EVAL.JSONL", two);
  write(dir / "sets.jsonl.d" / "eval.txt", two);
  const auto eval_texts = [&](const std::string& file) {
    write(dir / "prepare.toml",
          "output = \"out\"\nthreads = 1\nsources = [\"d\"]\n[source.d]\npaths = [\"docs\"]\n"
          "[tokenize]\nenabled = false\n[decontaminate]\neval_files = [\"" +
              file + "\"]\n");
    prepare(PipelineConfig::load(dir / "prepare.toml"), {.progress = false});
    const json m = json::parse(read_file(dir / "out" / "manifest.json"));
    for (const auto& s : m["stages"])
      if (s["name"] == "decontaminate") return s["eval_texts"].get<int64_t>();
    return int64_t{-1};
  };
  EXPECT_EQ(eval_texts("EVAL.JSONL"), 2);             // two records
  EXPECT_EQ(eval_texts("sets.jsonl.d/eval.txt"), 1);  // one text
  fs::remove_all(dir);
}

// A file whose name is not UTF-8 is read, named with U+FFFD for each invalid sequence (its
// documents' ids and the manifest are JSON); two names made one by that are refused naming both.
TEST(Pipeline, AFileNameThatIsNotUtf8IsRepairedInItsDocumentsIds) {
  const fs::path dir = corpus().root / "names";
  write(dir / "docs" / "bad\xffname.txt", "A document in a file with a broken name.");
  write(dir / "docs" / "good.txt", "A document in a file with a plain name.");
  write(dir / "prepare.toml",
        "output = \"out\"\nthreads = 1\nsources = [\"d\"]\n[source.d]\npaths = [\"docs\"]\n"
        "[gopher_quality]\nenabled = false\n[gopher_repetition]\nenabled = false\n");
  prepare(PipelineConfig::load(dir / "prepare.toml"), {.progress = false});
  const json m = json::parse(read_file(dir / "out" / "manifest.json"));
  std::set<std::string> inputs;
  for (const auto& i : m["inputs"]) inputs.insert(i["path"].get<std::string>());
  EXPECT_EQ(inputs, (std::set<std::string>{"d/bad\uFFFDname.txt", "d/good.txt"})) << m.dump();
  EXPECT_NE(read_file(dir / "out" / "curated-train.jsonl").find("\"d/bad\uFFFDname.txt"),
            std::string::npos);
  write(dir / "docs" / "bad\xfename.txt", "Another broken name, made the same.");
  fs::remove_all(dir / "out");
  const std::string e = pollen::testing::error_of(
      [&] { prepare(PipelineConfig::load(dir / "prepare.toml"), {.progress = false}); });
  EXPECT_NE(e.find("would both be named 'd/bad\uFFFDname.txt'"), std::string::npos) << e;
  fs::remove_all(dir);
}

TEST(Pipeline, EveryDocumentIsAccountedForAndBadInputIsReported) {
  fs::path out = run("out_account", 2);
  json m = json::parse(read_file(out / "manifest.json"));
  int64_t prev_kept = -1;
  for (const auto& s : m["stages"]) {
    int64_t dropped = 0;
    for (const auto& d : s["dropped"]) dropped += d["docs"].get<int64_t>();
    EXPECT_EQ(s["docs_kept"].get<int64_t>() + dropped, s["docs_in"].get<int64_t>()) << s["name"];
    if (prev_kept >= 0 && s["name"] != "read") {
      EXPECT_EQ(s["docs_in"].get<int64_t>(), prev_kept) << s["name"];
    }
    prev_kept = s["docs_kept"].get<int64_t>();
  }
  auto stage = [&](const std::string& n) {
    for (const auto& s : m["stages"])
      if (s["name"] == n) return s;
    return json();
  };
  // 44 text files read as documents (one empty file is a problem, not a doc), 10 fortunes,
  // 11 good records; three bad records.
  EXPECT_EQ(stage("read")["docs_kept"], 44 + 10 + 11);
  EXPECT_EQ(stage("read")["dropped"]["invalid_json"]["docs"], 1);
  EXPECT_EQ(stage("read")["dropped"]["missing_field"]["docs"], 1);
  EXPECT_EQ(stage("read")["dropped"]["line_too_long"]["docs"], 1);
  EXPECT_EQ(stage("read")["files_missing"], 0);
  EXPECT_EQ(stage("read")["files_empty"], 1);
  EXPECT_EQ(stage("utf8")["docs_modified"], 2);
  EXPECT_EQ(stage("exact_dedup")["dropped"]["duplicate"]["docs"], 1);
  EXPECT_EQ(stage("minhash")["dropped"]["near_duplicate"]["docs"], 1);
  // The near-duplicate is listed with the kept document of its cluster.
  EXPECT_EQ(read_file(out / "near-duplicates.jsonl"),
            "{\"id\":\"text/near.txt\",\"duplicate_of\":\"text/doc5.txt\"}\n");
  EXPECT_EQ(m["near_duplicates"]["docs"], 1);
  EXPECT_EQ(stage("pii")["redactions"]["email"], 1);
  EXPECT_EQ(stage("decontaminate")["dropped"]["contaminated"]["docs"], 1);
  // Problems name the file and line: bad records, and invalid UTF-8 (at its line in a text file,
  // at its record in JSONL).
  std::map<std::string, std::vector<std::pair<std::string, int64_t>>> where;
  for (const auto& p : m["problems"]) where[p["reason"]].push_back({p["file"], p["line"]});
  using At = std::vector<std::pair<std::string, int64_t>>;
  EXPECT_EQ(where["invalid_json"], (At{{"records/records.jsonl.zst", 11}}));
  EXPECT_EQ(where["missing_field"], (At{{"records/records.jsonl.zst", 12}}));
  EXPECT_EQ(where["line_too_long"], (At{{"records/records.jsonl.zst", 13}}));
  const std::string p77 = paragraph(77);
  EXPECT_EQ(where["invalid_utf8"],
            (At{{"text/bad_utf8.txt", 1 + std::count(p77.begin(), p77.end(), '\n')},
                {"records/records.jsonl.zst", 14}}));
  EXPECT_EQ(where["empty_file"], (At{{"text/empty.txt", 0}}));
  EXPECT_EQ(m["problems_total"], 6);
  // Shards hold what the split stage kept, and the loader reads them.
  int64_t docs = 0;
  for (const auto& s : m["shards"]) docs += s["num_docs"].get<int64_t>();
  EXPECT_EQ(docs, stage("split")["docs_kept"]);
  Loader l({.manifests = {out / "manifest.json"}, .batch = 2, .seq = 64});
  EXPECT_GT(l.windows_per_epoch(), 10);
  l.next();
  std::string curated = read_file(out / "curated-train.jsonl");
  EXPECT_NE(curated.find("<EMAIL>"), std::string::npos);
  EXPECT_EQ(curated.find("someone@example.org"), std::string::npos);
  // inspect: a split the manifest does not have is named with the ones it has.
  EXPECT_NE(inspect_documents(out, "validation", 0, 1, 8).find("--- validation doc 0"),
            std::string::npos);
  try {
    inspect_documents(out, "test", 0, 1, 8);
    ADD_FAILURE() << "no error for a split the manifest does not have";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("has no split 'test'; its splits: 'train', 'validation'"),
              std::string::npos)
        << e.what();
  }
}

// A path the config names that does not exist is a typo: an error naming the config file, the
// key and the path, before any work (no output folder), not a warning and 0 documents.
TEST(Pipeline, AConfiguredPathThatDoesNotExistIsAnErrorBeforeAnyWork) {
  const fs::path cfg_path = corpus().config("out_typo", 1);
  const std::string text = read_file(cfg_path);
  auto error = [&](const std::string& from, const std::string& to) {
    std::string t = text;
    t.replace(t.find(from), from.size(), to);
    const PipelineConfig c = PipelineConfig::parse(t, cfg_path);
    try {
      prepare(c, {.progress = false});
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  std::string e = error("\"corpus/text\"", "\"corpus/txet\"");
  EXPECT_NE(e.find("config file '" + cfg_path.string() +
                   "', key 'source.text.paths': 'corpus/txet' does not exist"),
            std::string::npos)
      << e;
  e = error("\"tokenizer.json\"", "\"nope.json\"");
  EXPECT_NE(e.find("key 'tokenize.tokenizer': 'nope.json' does not exist"), std::string::npos) << e;
  EXPECT_NE(e.find("--no-tokenize"), std::string::npos) << e;
  e = error("\"eval.jsonl\"", "\"eval.jsnol\"");
  EXPECT_NE(e.find("key 'decontaminate.eval_files': 'eval.jsnol' does not exist"),
            std::string::npos)
      << e;
  e = error("\"tokenizer.json\"", "\"corpus\"");
  EXPECT_NE(e.find("key 'tokenize.tokenizer': 'corpus' is a folder"), std::string::npos) << e;
  e = error("output = \"out_typo\"", "output = \"tokenizer.json\"");
  EXPECT_NE(e.find("key 'output': '" + (corpus().root / "tokenizer.json").string() +
                   "' is a file; expected a folder"),
            std::string::npos)
      << e;
  e = error("output = \"out_typo\"", "output = \"corpus/text\"");
  EXPECT_NE(e.find("key 'source.text.paths': 'corpus/text' is the output folder too"),
            std::string::npos)
      << e;
  EXPECT_NE(pollen::testing::error_of([&] {
              std::string t = text;
              const std::string from = "output = \"out_typo\"";
              t.replace(t.find(from), from.size(), "output = \"\"");
              PipelineConfig::parse(t, cfg_path);
            }).find("key 'output': expected a folder to write the dataset to"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(corpus().root / "corpus" / "text" / "work"));
  // The shards' prefix is a name in the output folder, not a path out of it.
  const auto prefix_error = [&](const std::string& prefix) {
    return pollen::testing::error_of(
        [&] { PipelineConfig::parse(text + "prefix = \"" + prefix + "\"\n", cfg_path); });
  };
  for (const std::string bad : {"../escaped/x", "a/b", "", ".hidden"})
    EXPECT_NE(prefix_error(bad).find("key 'tokenize.prefix': '" + bad +
                                     "' must be a file name part of 1 to 128 characters"),
              std::string::npos)
        << prefix_error(bad);
  EXPECT_FALSE(fs::exists(corpus().root / "out_typo"));
}

// A file that is no tokenizer, or a tokenizer without the BOS token asked for, is refused before
// pass 1 reads anything (or a finished dataset's manifest is removed), naming the file and key.
TEST(Pipeline, AWrongTokenizerIsRefusedBeforePassOne) {
  const fs::path cfg_path = corpus().config("out_tokenizer", 1);
  const std::string text = read_file(cfg_path);
  const auto error = [&](const std::string& from, const std::string& to) {
    std::string t = text;
    t.replace(t.find(from), from.size(), to);
    return pollen::testing::error_of(
        [&] { prepare(PipelineConfig::parse(t, cfg_path), {.progress = false}); });
  };
  const fs::path pass1 = corpus().root / "out_tokenizer" / "work" / "pass1.docs";
  std::string e = error("\"tokenizer.json\"", "\"eval.jsonl\"");
  EXPECT_NE(e.find("tokenize.tokenizer 'eval.jsonl': "), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(pass1));
  e = error("shard_tokens = 2000\n",
            "shard_tokens = 2000\nadd_bos = true\nbos_token = \"<nope>\"\n");
  EXPECT_NE(e.find("tokenize.bos_token: the tokenizer"), std::string::npos) << e;
  EXPECT_NE(e.find("config file '" + cfg_path.string() + "'"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(pass1));
  // A finished dataset keeps its manifest when such a mistake is refused.
  const fs::path manifest = prepare(PipelineConfig::parse(text, cfg_path), {.progress = false});
  const std::string finished = read_file(manifest);
  e = error("shard_tokens = 2000\n",
            "shard_tokens = 2000\nadd_bos = true\nbos_token = \"<nope>\"\n");
  EXPECT_NE(e.find("tokenize.bos_token"), std::string::npos) << e;
  ASSERT_TRUE(fs::exists(manifest)) << "a refused config removed the finished manifest";
  EXPECT_EQ(read_file(manifest), finished);
  EXPECT_TRUE(fs::exists(corpus().root / "out_tokenizer" / "work" / "done.json"));
  fs::remove_all(corpus().root / "out_tokenizer");
}

// Two `pollen data prepare` on one output folder would overwrite each other's shards: the second
// is refused while the first holds the folder.
TEST(Pipeline, ASecondPrepareOfTheSameFolderIsRefused) {
  const fs::path cfg_path = corpus().config("out_locked", 1);
  const PipelineConfig c = PipelineConfig::load(cfg_path);
  {
    const FolderLock held(c.output, "output", c.output / "work" / ".lock");
    try {
      prepare(c, {.progress = false});
      ADD_FAILURE() << "a second prepare ran beside the first";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("is in use by another process"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_NO_THROW(prepare(c, {.progress = false}));
}

// A file listed and then removed before it is read (another process cleaning up) is reported
// as missing, naming it, and reading goes on; it does not end the run.
TEST(Pipeline, AFileThatVanishesAfterListingIsReportedAndReadingGoesOn) {
  const fs::path dir = corpus().root / "vanishing";
  write(dir / "text" / "a.txt", paragraph(1));
  write(dir / "text" / "b.txt", paragraph(2));
  write(dir / "records" / "gone.jsonl", "{\"text\": \"hello\"}\n");
  const std::vector<SourceSpec> sources = {
      {.name = "text", .paths = {"text"}},
      {.name = "records", .paths = {"records"}, .format = "jsonl"}};
  const std::vector<InputFile> files = list_inputs(sources, dir);
  ASSERT_EQ(files.size(), 3u);
  fs::remove(dir / "text" / "a.txt");
  fs::remove(dir / "records" / "gone.jsonl");
  std::vector<Problem> problems;
  int docs = 0;
  int64_t bytes = 0;
  std::string sha;
  const auto on_problem = [&](Problem&& p) { problems.push_back(std::move(p)); };
  for (const InputFile& f : files) {
    if (sources[static_cast<size_t>(f.source)].format == "jsonl")
      read_jsonl_blocks(
          f, {}, 1 << 16, [&](std::string_view, int64_t) { ++docs; }, on_problem, bytes, sha);
    else
      read_input(
          f, sources[static_cast<size_t>(f.source)], {}, [&](RawDoc&) { ++docs; }, on_problem,
          bytes, sha);
  }
  EXPECT_EQ(docs, 1);  // b.txt
  ASSERT_EQ(problems.size(), 2u);
  EXPECT_EQ(problems[0].file, "text/a.txt");
  EXPECT_EQ(problems[1].file, "records/gone.jsonl");
  for (const Problem& p : problems) EXPECT_EQ(p.reason, "missing_file") << p.file;
}

// Linked folders inside a listed folder are read (dumps kept on another disk), each real folder
// once: a link back up, or to a folder read already, adds nothing, and real folders keep their own
// names whatever the links' names sort as.
TEST(Pipeline, LinkedSubfoldersAreFollowedOnceWithoutLooping) {
  const fs::path dir = corpus().root / "linked";
  fs::remove_all(dir);
  write(dir / "in" / "real" / "a.txt", paragraph(1));
  write(dir / "elsewhere" / "b.txt", paragraph(2));
  write(dir / "elsewhere" / "deep" / "c.txt", paragraph(3));
  fs::create_directory_symlink(dir / "elsewhere", dir / "in" / "z-disk");
  fs::create_directory_symlink(dir / "elsewhere" / "deep", dir / "in" / "b-deep");
  fs::create_directory_symlink(dir / "in", dir / "in" / "real" / "loop");
  fs::create_directory_symlink(dir / "in" / "real", dir / "in" / "a-again");
  std::vector<std::string> names;
  for (const InputFile& f : list_inputs({{.name = "s", .paths = {"in"}}}, dir))
    names.push_back(f.name);
  // b-deep is reached before z-disk's deep; real/ keeps its name though a-again sorts first.
  EXPECT_EQ(names, (std::vector<std::string>{"s/b-deep/c.txt", "s/real/a.txt", "s/z-disk/b.txt"}));
}

// A compressed file whose damage shows only near its end (a flipped byte, which gzip's CRC
// catches; a truncated stream) is reported unreadable and contributes no documents, although
// megabytes of it decompress before the damage: nothing of it is handed on, the run's counts
// and `inputs` agree, and the good file beside it is read as usual.
TEST(Pipeline, ACorruptOrTruncatedCompressedFileContributesNoDocuments) {
  const fs::path dir = corpus().root / "damaged";
  // About 3 MiB of records of hex digits: over 1 MiB even compressed, so several blocks.
  std::string jl;
  uint64_t x = 7;
  for (int i = 0; i < 6000; ++i) {
    std::string text;
    for (int w = 0; w < 30; ++w) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      char word[20];
      std::snprintf(word, sizeof word, "%016llx ", static_cast<unsigned long long>(x >> 1));
      text += word;
    }
    jl += json{{"text", text}}.dump() + "\n";
  }
  fs::create_directories(dir / "in");
  gzFile gz = gzopen((dir / "full.gz").c_str(), "wb");
  gzwrite(gz, jl.data(), static_cast<unsigned>(jl.size()));
  gzclose(gz);
  std::string z = read_file(dir / "full.gz");
  ASSERT_GT(z.size(), size_t{1} << 20);
  std::string flipped = z;
  flipped[flipped.size() - 20] ^= 0x5a;
  write(dir / "in" / "flipped.jsonl.gz", flipped);
  write(dir / "in" / "truncated.jsonl.gz", z.substr(0, z.size() * 3 / 4));
  std::string zs(ZSTD_compressBound(jl.size()), '\0');
  zs.resize(ZSTD_compress(zs.data(), zs.size(), jl.data(), jl.size(), 1));
  write(dir / "in" / "truncated.jsonl.zst", zs.substr(0, zs.size() * 3 / 4));
  write(dir / "in" / "good.jsonl",
        json{{"text", paragraph(1)}}.dump() + "\n" + json{{"text", paragraph(2)}}.dump() + "\n");

  // The readers hand on nothing of a damaged file, as JSONL blocks or as delimited documents.
  const std::vector<SourceSpec> sources = {
      {.name = "s", .paths = {"in"}, .format = "jsonl"},
      {.name = "d", .paths = {"in/flipped.jsonl.gz"}, .format = "delimited"}};
  for (const InputFile& f : list_inputs(sources, dir)) {
    if (f.name == "s/good.jsonl") continue;
    std::vector<Problem> problems;
    int handed_on = 0;
    int64_t bytes = 0;
    std::string sha;
    const auto on_problem = [&](Problem&& p) { problems.push_back(std::move(p)); };
    if (f.source == 0)
      read_jsonl_blocks(
          f, {}, 1 << 20, [&](std::string_view, int64_t) { ++handed_on; }, on_problem, bytes, sha);
    else
      read_input(
          f, sources[1], {}, [&](RawDoc&) { ++handed_on; }, on_problem, bytes, sha);
    EXPECT_EQ(handed_on, 0) << f.name;
    ASSERT_EQ(problems.size(), 1u) << f.name;
    EXPECT_EQ(problems[0].reason, "unreadable_file") << f.name;
    EXPECT_EQ(problems[0].file, f.name);
  }

  // End to end: only the good file's two documents, three unreadable files, one input.
  write(dir / "cfg.toml",
        "output = \"out\"\nsources = [\"s\"]\n[source.s]\npaths = [\"in\"]\n"
        "format = \"jsonl\"\n[split]\nvalidation_fraction = 0\n[tokenize]\nenabled = false\n");
  const int before = num_threads();
  prepare(PipelineConfig::load(dir / "cfg.toml"), {.progress = false});
  set_num_threads(before);
  const json m = json::parse(read_file(dir / "out" / "manifest.json"));
  const json& read = m["stages"][0];
  EXPECT_EQ(read["docs_in"], 2);
  EXPECT_EQ(read["files"], 4);
  EXPECT_EQ(read["files_unreadable"], 3);
  ASSERT_EQ(m["inputs"].size(), 1u);
  EXPECT_EQ(m["inputs"][0]["path"], "s/good.jsonl");
  std::set<std::string> unreadable;
  for (const auto& p : m["problems"])
    if (p["reason"] == "unreadable_file") unreadable.insert(p["file"].get<std::string>());
  EXPECT_EQ(unreadable, (std::set<std::string>{"s/flipped.jsonl.gz", "s/truncated.jsonl.gz",
                                               "s/truncated.jsonl.zst"}));
  const std::string curated = read_file(dir / "out" / "curated-train.jsonl");
  EXPECT_EQ(std::count(curated.begin(), curated.end(), '\n'), 2);
}

// A dataset folder inside a source's folder is not read as input: the second prepare reads what
// the first read, and finds its work done. An upper-case .GZ is decompressed as .gz is.
TEST(Pipeline, AnOutputInsideASourceFolderIsNotReadAsInput) {
  const fs::path dir = corpus().root / "inside";
  std::string jl;
  for (int i = 300; i < 306; ++i) jl += json{{"text", paragraph(i)}}.dump() + "\n";
  fs::create_directories(dir / "in");
  gzFile gz = gzopen((dir / "in" / "UPPER.JSONL.GZ").c_str(), "wb");
  gzwrite(gz, jl.data(), static_cast<unsigned>(jl.size()));
  gzclose(gz);
  write(dir / "cfg.toml",
        "output = \"in/out\"\nsources = [\"s\"]\n[source.s]\npaths = [\"in\"]\n"
        "format = \"jsonl\"\n[split]\nvalidation_fraction = 0\n[tokenize]\nenabled = false\n");
  const int before = num_threads();
  prepare(PipelineConfig::load(dir / "cfg.toml"), {.progress = false});
  const std::string first = read_file(dir / "in" / "out" / "manifest.json");
  prepare(PipelineConfig::load(dir / "cfg.toml"), {.progress = false});
  set_num_threads(before);
  EXPECT_EQ(read_file(dir / "in" / "out" / "manifest.json"), first);
  const json m = json::parse(first);
  ASSERT_EQ(m["inputs"].size(), 1u) << m["inputs"].dump();
  EXPECT_EQ(m["inputs"][0]["path"], "s/UPPER.JSONL.GZ");
  EXPECT_EQ(m["stages"][0]["docs_in"], 6);
  fs::remove_all(dir);
}

// Two listed folders of a source that hold one relative path name those files by their folder
// too (the others keep their names); a folder listed twice, or a source, is refused. A source
// folder inside the output folder is read.
TEST(Pipeline, InputsNamedAlikeAreToldApartAndAFolderListedTwiceIsRefused) {
  const fs::path dir = corpus().root / "alike";
  write(dir / "d1" / "x.jsonl", json{{"text", paragraph(400)}}.dump() + "\n");
  write(dir / "d2" / "x.jsonl", json{{"text", paragraph(401)}}.dump() + "\n");
  write(dir / "d2" / "y.jsonl", json{{"text", paragraph(402)}}.dump() + "\n");
  const auto config = [&](const std::string& output, const std::string& paths,
                          const std::string& sources = "[\"s\"]") {
    return PipelineConfig::parse("output = \"" + output + "\"\nsources = " + sources +
                                     "\n[source.s]\npaths = " + paths +
                                     "\nformat = \"jsonl\"\n[split]\nvalidation_fraction = 0\n"
                                     "[tokenize]\nenabled = false\n",
                                 dir / "cfg.toml");
  };
  const int before = num_threads();
  prepare(config("out", "[\"d1\", \"d2\"]"), {.progress = false});
  const json manifest = json::parse(read_file(dir / "out" / "manifest.json"));
  std::vector<std::string> inputs;
  for (const auto& in : manifest["inputs"]) inputs.push_back(in["path"].get<std::string>());
  EXPECT_EQ(inputs, (std::vector<std::string>{"s/d1/x.jsonl", "s/d2/x.jsonl", "s/y.jsonl"}));

  const std::string e = pollen::testing::error_of(
      [&] { prepare(config("out2", "[\"d1\", \"d1\"]"), {.progress = false}); });
  EXPECT_NE(e.find("source.s.paths: '" + (dir / "d1" / "x.jsonl").string() + "' and '" +
                   (dir / "d1" / "x.jsonl").string() + "' would both be named 's/d1/x.jsonl'"),
            std::string::npos)
      << e;
  const std::string twice =
      pollen::testing::error_of([&] { config("out3", "[\"d1\"]", "[\"s\", \"s\"]"); });
  EXPECT_NE(twice.find("'s' is listed twice"), std::string::npos) << twice;

  // Sources that yield no file at all: nothing to prepare, refused before anything is written.
  fs::create_directories(dir / "empty");
  const std::string none = pollen::testing::error_of(
      [&] { prepare(config("out4", "[\"empty\"]"), {.progress = false}); });
  EXPECT_NE(none.find("no source holds a file"), std::string::npos) << none;
  EXPECT_FALSE(fs::exists(dir / "out4" / "manifest.json"));

  // The dataset folder holding its source folder: the source is read all the same.
  prepare(config(".", "[\"d2\"]"), {.progress = false});
  set_num_threads(before);
  EXPECT_EQ(json::parse(read_file(dir / "manifest.json"))["inputs"].size(), 2u);
  fs::remove_all(dir);
}

// A MinHash signature of more than 2^20 hashes, or a threshold that is no similarity, is
// refused naming the key.
TEST(Pipeline, MinhashSignatureSizeAndThresholdAreChecked) {
  const auto error = [](const std::string& minhash) {
    return pollen::testing::error_of([&] {
      PipelineConfig::parse(
          "output = \"out\"\nsources = [\"s\"]\n[source.s]\npaths = "
          "[\"in\"]\n[minhash]\n" +
              minhash,
          "/tmp/cfg.toml");
    });
  };
  EXPECT_NE(error("bands = 65536\nrows = 65537\n").find("minhash.bands' * rows (65536 * 65537)"),
            std::string::npos)
      << error("bands = 65536\nrows = 65537\n");
  EXPECT_NE(error("threshold = 1.5\n").find("expected a Jaccard similarity in (0, 1], got 1.5"),
            std::string::npos)
      << error("threshold = 1.5\n");
  EXPECT_NE(error("threshold = 0\n").find("threshold"), std::string::npos);
  EXPECT_EQ(error("bands = 1024\nrows = 1024\nthreshold = 1\n"), "");
}

// max_doc_bytes holds for a JSONL record's text as for a text file or a delimited document
// (max_line_bytes bounds only the line): each longer record is dropped at read, at its line.
TEST(Pipeline, TheDocumentLimitHoldsForRecordsToo) {
  std::vector<size_t> sizes;  // records 1 to 10 hold paragraph(200) to paragraph(209)
  for (int i = 200; i < 210; ++i) sizes.push_back(paragraph(i).size());
  std::vector<size_t> sorted = sizes;
  std::sort(sorted.begin(), sorted.end());
  const size_t limit = sorted[5];  // some records over it, some not
  std::set<int64_t> expected;
  for (size_t i = 0; i < sizes.size(); ++i)
    if (sizes[i] > limit) expected.insert(static_cast<int64_t>(i) + 1);
  if (paragraph(210).size() + 11 > limit) expected.insert(14);  // the record of invalid UTF-8
  ASSERT_FALSE(expected.empty());
  const int before = num_threads();
  auto cfg = PipelineConfig::load(
      corpus().config("out_doc_limit", 2, "", "max_doc_bytes = " + std::to_string(limit) + "\n"));
  fs::remove_all(cfg.output);
  prepare(cfg, {.progress = false});
  set_num_threads(before);
  const json m = json::parse(read_file(cfg.output / "manifest.json"));
  std::set<int64_t> dropped;
  for (const auto& p : m["problems"])
    if (p["reason"] == "document_too_large" && p["file"] == "records/records.jsonl.zst")
      dropped.insert(p["line"].get<int64_t>());
  EXPECT_EQ(dropped, expected);
}

// The eval files' contents key a finished run, as the tokenizer's do: after an eval file is
// edited in place, a rerun decontaminates again and ends where a fresh run ends.
TEST(Pipeline, AnEditedEvalFileIsNotAFinishedRun) {
  const fs::path eval = corpus().root / "eval.jsonl";
  struct Restore {  // the corpus is shared with the tests after this one, if this one fails
    fs::path file;
    std::string text;
    ~Restore() { write(file, text); }
  } restore{eval, read_file(eval)};
  const auto before = outputs(run("out_eval_a", 2));
  write(eval, json{{"text", paragraph(12)}}.dump() + "\n");
  ASSERT_TRUE(rerun("out_eval_a", 2, 0));
  const auto edited = outputs(corpus().root / "out_eval_a");
  const auto fresh = outputs(run("out_eval_b", 2));
  EXPECT_NE(edited, before);  // the comparison can tell
  EXPECT_EQ(edited, fresh);
}

TEST(Pipeline, ByteIdenticalAcrossThreadsFoldersAndResumption) {
  auto one = outputs(run("out_t1", 1));
  ASSERT_TRUE(one.count("manifest.json"));
  EXPECT_GT(one.size(), 6u);
  // Shards, curated JSONL and manifest (with its report) are the same on 2 and 4 threads.
  EXPECT_EQ(outputs(run("out_t2", 2)), one);
  EXPECT_EQ(outputs(run("out_t4", 4)), one);
  // Interrupted after pass 1, then resumed.
  run("out_resume", 2, "pass1");
  EXPECT_FALSE(fs::exists(corpus().root / "out_resume" / "manifest.json"));
  auto cfg = PipelineConfig::load(corpus().config("out_resume", 1));
  prepare(cfg, {.progress = false});
  set_num_threads(2);
  EXPECT_EQ(outputs(corpus().root / "out_resume"), one);
  // Running again changes nothing.
  prepare(cfg, {.progress = false});
  EXPECT_EQ(outputs(corpus().root / "out_resume"), one);
}

TEST(Pipeline, PassOneResumesAfterItsLastFileByteIdentical) {
  const auto one = outputs(run("out_p1_whole", 1));
  const std::string every_file = "checkpoint_bytes = 1\n";
  // Interrupted after each resume point in turn (one after every file that holds text), then
  // resumed on another thread count: what was kept, dropped, reported and deduplicated before
  // the interruption is all there (the duplicate of doc3.txt comes files later).
  int interrupted = 0;
  int64_t last_file = 0;
  for (int64_t k = 1;; ++k) {
    const std::string out = "out_p1_at_" + std::to_string(k);
    fs::remove_all(corpus().root / out);
    if (rerun(out, 1 + static_cast<int>(k % 2), 0, every_file, k)) break;
    ++interrupted;
    const int64_t next = pass1_resume_file(out);
    EXPECT_GT(next, last_file) << "interrupted after resume point " << k;
    last_file = next;
    ::testing::internal::CaptureStderr();
    ASSERT_TRUE(rerun(out, 2 - static_cast<int>(k % 2), 0, every_file));
    const std::string log = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(log.find("resuming pass 1 after " + std::to_string(next) + " of"), std::string::npos)
        << log;
    EXPECT_EQ(log.find("cannot resume"), std::string::npos) << log;
    EXPECT_EQ(outputs(corpus().root / out), one) << "interrupted after resume point " << k;
    EXPECT_EQ(pass1_resume_file(out), -1);  // removed once pass 1 is done
    fs::remove_all(corpus().root / out);
  }
  EXPECT_GE(interrupted, 40);

  // Interrupted twice: the second run goes on from the first one's resume point.
  fs::remove_all(corpus().root / "out_p1_twice");
  ASSERT_FALSE(rerun("out_p1_twice", 2, 0, every_file, 5));
  const int64_t first = pass1_resume_file("out_p1_twice");
  ASSERT_FALSE(rerun("out_p1_twice", 1, 0, every_file, 5));
  EXPECT_GT(pass1_resume_file("out_p1_twice"), first);
  ASSERT_TRUE(rerun("out_p1_twice", 2, 0, every_file));
  EXPECT_EQ(outputs(corpus().root / "out_p1_twice"), one);

  // A resume point whose partial output is gone: pass 1 starts over, with the same result.
  fs::remove_all(corpus().root / "out_p1_lost");
  ASSERT_FALSE(rerun("out_p1_lost", 2, 0, every_file, 10));
  ASSERT_TRUE(fs::remove(corpus().root / "out_p1_lost" / "work" / ".pass1.docs.tmp"));
  ::testing::internal::CaptureStderr();
  ASSERT_TRUE(rerun("out_p1_lost", 2, 0, every_file));
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("cannot resume pass 1"), std::string::npos) << log;
  EXPECT_NE(log.find("starting it over"), std::string::npos) << log;
  EXPECT_EQ(outputs(corpus().root / "out_p1_lost"), one);

  // A config changed after the interruption: its resume point is not used.
  fs::remove_all(corpus().root / "out_p1_edit");
  ASSERT_FALSE(rerun("out_p1_edit", 2, 0, every_file, 3));
  ::testing::internal::CaptureStderr();
  ASSERT_TRUE(rerun("out_p1_edit", 2, 0, every_file + "max_doc_bytes = 3000\n"));
  EXPECT_EQ(::testing::internal::GetCapturedStderr().find("resuming pass 1"), std::string::npos);
}

// A finished dataset whose files were since removed or cut short is prepared again, not taken as
// done.
TEST(Pipeline, AFinishedDatasetMissingAFileIsPreparedAgain) {
  const fs::path out = run("out_damaged", 2);
  const auto whole = outputs(out);
  fs::resize_file(out / "data-train-00000.tokens", 100);
  ::testing::internal::CaptureStderr();
  ASSERT_TRUE(rerun("out_damaged", 2, 0));
  std::string said = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(said.find("but 'data-train-00000.tokens' has 100 bytes, its manifest says"),
            std::string::npos)
      << said;
  EXPECT_EQ(outputs(out), whole);
  fs::remove(out / "curated-validation.jsonl");
  ::testing::internal::CaptureStderr();
  ASSERT_TRUE(rerun("out_damaged", 2, 0));
  said = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(said.find("but 'curated-validation.jsonl' is missing: preparing it again"),
            std::string::npos)
      << said;
  EXPECT_EQ(outputs(out), whole);
  ::testing::internal::CaptureStderr();
  ASSERT_TRUE(rerun("out_damaged", 2, 0));
  said = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(said.find("nothing to do"), std::string::npos) << said;
  fs::remove_all(out);
}

// Prepared again without tokenizing: the earlier run's tokenizer copy goes, and the stats count
// the curated documents (there are no shards to count).
TEST(Pipeline, AnUntokenizedDatasetShowsItsCuratedDocuments) {
  const fs::path out = run("out_untokenized", 2);
  ASSERT_TRUE(fs::exists(out / "tokenizer.json"));
  const int before = num_threads();
  const auto untokenized = [&] {
    prepare(PipelineConfig::load(corpus().config("out_untokenized", 2, "enabled = false\n")),
            {.progress = false});
    set_num_threads(before);
  };
  untokenized();
  EXPECT_FALSE(fs::exists(out / "tokenizer.json"));
  // The same in a folder an older pollen prepared (its copy known from its manifest alone).
  run("out_untokenized", 2);
  ASSERT_TRUE(fs::remove(out / "work" / "tokenizer_copy.sha256"));
  untokenized();
  EXPECT_FALSE(fs::exists(out / "tokenizer.json"));
  const json m = json::parse(read_file(out / "manifest.json"));
  const std::string stats = dataset_stats(out);
  EXPECT_NE(stats.find("not tokenized (no shards)"), std::string::npos) << stats;
  EXPECT_NE(stats.find(cat("train: ", m["curated"][0]["docs"].get<int64_t>(), " docs, ")),
            std::string::npos)
      << stats;
  EXPECT_GT(m["curated"][0]["docs"].get<int64_t>(), 0);
  // A tokenizer.json pollen did not copy there is someone else's: kept.
  write(out / "tokenizer.json", "{\"mine\": true}");
  fs::remove(out / "work" / "done.json");  // prepared again
  untokenized();
  EXPECT_EQ(read_file(out / "tokenizer.json"), "{\"mine\": true}");
  // Nor the very tokenizer the config names, kept in the output folder.
  fs::copy_file(corpus().root / "tokenizer.json", out / "tokenizer.json",
                fs::copy_options::overwrite_existing);
  std::string text = read_file(corpus().config("out_untokenized", 2));
  const std::string named = "tokenizer = \"tokenizer.json\"";
  text.replace(text.find(named), named.size(), "tokenizer = \"out_untokenized/tokenizer.json\"");
  for (const std::string more : {"", "enabled = false\n"}) {
    write(corpus().root / "own.toml", text + more);
    prepare(PipelineConfig::load(corpus().root / "own.toml"), {.progress = false});
    set_num_threads(before);
    EXPECT_EQ(read_file(out / "tokenizer.json"), read_file(corpus().root / "tokenizer.json"))
        << more;
  }
  fs::remove_all(out);
}

// The output folder may hold files of others, shards of another prefix or none; only a stale
// shard of this run's own prefix is removed.
TEST(Pipeline, FilesOfOthersInTheOutputFolderAreKept) {
  const fs::path out = corpus().root / "out_shared";
  fs::remove_all(out);
  const std::map<std::string, std::string> others = {{"search.index", "notes"},
                                                     {"web-train-00000.tokens", "x"},
                                                     {"data-train-1.tokens", "y"},
                                                     {".web-train-00000.tokens.tmp", "z"}};
  for (const auto& [name, text] : others) write(out / name, text);
  write(out / "data-validation-00007.tokens", "a stale shard of this prefix");
  ASSERT_TRUE(rerun("out_shared", 2, 0));
  for (const auto& [name, text] : others) EXPECT_EQ(read_file(out / name), text) << name;
  EXPECT_FALSE(fs::exists(out / "data-validation-00007.tokens"));
  EXPECT_TRUE(fs::exists(out / "data-train-00000.tokens"));
  // Prepared again under another prefix: the shards of the first are this dataset's, stale, also
  // in a folder an older pollen prepared (no record of its prefixes but its manifest).
  fs::remove(out / "work" / "shard_prefixes.json");
  const int before = num_threads();
  prepare(PipelineConfig::load(corpus().config("out_shared", 2, "prefix = \"tiny\"\n")),
          {.progress = false});
  set_num_threads(before);
  EXPECT_FALSE(fs::exists(out / "data-train-00000.tokens"));
  EXPECT_TRUE(fs::exists(out / "tiny-train-00000.tokens"));
  for (const auto& [name, text] : others) EXPECT_EQ(read_file(out / name), text) << name;
  // Without the earlier manifest (a run killed after removing it): the record of prefixes says.
  fs::remove(out / "manifest.json");
  ASSERT_TRUE(rerun("out_shared", 2, 0));
  EXPECT_FALSE(fs::exists(out / "tiny-train-00000.tokens"));
  EXPECT_TRUE(fs::exists(out / "data-train-00000.tokens"));
  // A prefix holding a split's name is read from the manifest whole ("web-validation-x", not
  // "web", whose shards are another's).
  prepare(PipelineConfig::load(corpus().config("out_shared", 2, "prefix = \"web-validation-x\"\n")),
          {.progress = false});
  set_num_threads(before);
  fs::remove(out / "work" / "shard_prefixes.json");
  ASSERT_TRUE(rerun("out_shared", 2, 0));
  EXPECT_FALSE(fs::exists(out / "web-validation-x-train-00000.tokens"));
  for (const auto& [name, text] : others) EXPECT_EQ(read_file(out / name), text) << name;
  fs::remove_all(out);
}

TEST(Pipeline, PassTwoResumesFromItsLastResumePointByteIdentical) {
  auto one = outputs(run("out_whole", 1));
  int64_t pass1_docs = json::parse(
      read_file(corpus().root / "out_whole" /
                "manifest.json"))["stages"][8]["docs_in"];  // minhash, the first stage of pass 2
  // A resume point after every batch: an interrupted run continues from its last one.
  const std::string every_batch = "checkpoint_bytes = 1\n";
  fs::remove_all(corpus().root / "out_steps");
  ASSERT_FALSE(rerun("out_steps", 2, 3, every_batch));
  const int64_t after3 = resume_point_docs("out_steps");
  EXPECT_GT(after3, 0);
  EXPECT_LT(after3, pass1_docs);
  ASSERT_FALSE(rerun("out_steps", 1, 1, every_batch));
  EXPECT_GT(resume_point_docs("out_steps"), after3);  // went on from there, not from the start
  ASSERT_TRUE(rerun("out_steps", 4, 0, every_batch));
  EXPECT_EQ(outputs(corpus().root / "out_steps"), one);
  EXPECT_EQ(resume_point_docs("out_steps"), -1);  // removed once finished

  // Resume points only where shards complete (the default): interrupted at every batch in
  // turn, the bytes written after the last resume point are cut off and redone.
  int interrupted = 0, resumed = 0;
  for (int64_t k = 1;; ++k) {
    const std::string out = "out_at_" + std::to_string(k);
    fs::remove_all(corpus().root / out);
    if (rerun(out, 1 + static_cast<int>(k % 2), k)) break;
    ++interrupted;
    EXPECT_FALSE(fs::exists(corpus().root / out / "manifest.json"));
    const bool saved = resume_point_docs(out) > 0;
    resumed += saved;
    ::testing::internal::CaptureStderr();
    ASSERT_TRUE(rerun(out, 2 - static_cast<int>(k % 2), 0));
    const std::string log = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(log.find("resuming pass 2") != std::string::npos, saved) << log;
    EXPECT_EQ(log.find("cannot resume"), std::string::npos) << log;
    EXPECT_EQ(outputs(corpus().root / out), one) << "interrupted after batch " << k;
    fs::remove_all(corpus().root / out);
  }
  EXPECT_GE(interrupted, 5);
  EXPECT_GE(resumed, 3);
  EXPECT_LT(resumed, interrupted);  // some interruptions came before the first resume point

  // Stopped while its outputs are renamed into place: resumed after the last document, the
  // renamed files taken back, nothing curated again.
  fs::remove_all(corpus().root / "out_renamed");
  int before = num_threads();
  EXPECT_NE(pollen::testing::error_of([&] {
              prepare(PipelineConfig::load(corpus().config("out_renamed", 2)),
                      {.progress = false, .interrupt_before_manifest = true});
            }).find("interrupted after pass 2's renames"),
            std::string::npos);
  set_num_threads(before);
  EXPECT_EQ(resume_point_docs("out_renamed"), pass1_docs);
  EXPECT_TRUE(fs::exists(corpus().root / "out_renamed" / "curated-train.jsonl"));
  EXPECT_FALSE(fs::exists(corpus().root / "out_renamed" / "manifest.json"));
  ::testing::internal::CaptureStderr();
  ASSERT_TRUE(rerun("out_renamed", 1, 0));
  const std::string renamed_log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(renamed_log.find(cat("resuming pass 2 after ", pass1_docs, " of ", pass1_docs)),
            std::string::npos)
      << renamed_log;
  EXPECT_EQ(outputs(corpus().root / "out_renamed"), one);
  fs::remove_all(corpus().root / "out_renamed");

  // A resume point whose partial files are gone: pass 2 starts over, with the same result.
  fs::remove_all(corpus().root / "out_lost");
  ASSERT_FALSE(rerun("out_lost", 2, 4, every_batch));
  ASSERT_TRUE(fs::remove(corpus().root / "out_lost" / ".curated-train.jsonl.tmp"));
  ::testing::internal::CaptureStderr();
  ASSERT_TRUE(rerun("out_lost", 2, 0, every_batch));
  EXPECT_NE(::testing::internal::GetCapturedStderr().find("starting it over"), std::string::npos);
  EXPECT_EQ(outputs(corpus().root / "out_lost"), one);
}

// A rerun with a changed config, interrupted in pass 2, leaves no manifest of the earlier run
// beside shards it does not describe: stats and inspect say the run has not finished.
TEST(Pipeline, AnInterruptedRerunWithAChangedConfigLeavesNoStaleManifest) {
  const fs::path out = run("out_stale", 2);
  ASSERT_TRUE(fs::exists(out / "manifest.json"));
  ::testing::internal::CaptureStderr();
  ASSERT_FALSE(rerun("out_stale", 2, 1, "max_doc_bytes = 3000\n"));
  const std::string said = ::testing::internal::GetCapturedStderr();
  EXPECT_FALSE(fs::exists(out / "manifest.json"));
  // Why the finished dataset and pass 1's outputs are not reused: the key that changed.
  EXPECT_NE(said.find("was prepared from another config or inputs (config keys max_doc_bytes)"),
            std::string::npos)
      << said;
  EXPECT_NE(said.find("pass 1's outputs are of another config or inputs (config keys "
                      "max_doc_bytes); pass 1 runs again"),
            std::string::npos)
      << said;
  for (int k = 0; k < 2; ++k) {
    try {
      if (k == 0)
        dataset_stats(out);
      else
        inspect_documents(out, "train", 0, 1, 8);
      ADD_FAILURE() << "no error for an unfinished folder";
    } catch (const Error& e) {
      EXPECT_NE(
          std::string(e.what()).find("no manifest '" + (out / "manifest.json").string() + "'"),
          std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("has not finished"), std::string::npos) << e.what();
    }
  }
  // Finishing the changed run writes its manifest again, and leaves none of what a killed run
  // could: a partial shard this run does not continue, the temporary file of an atomic write
  // (an index, the manifest, the tokenizer, a resume point).
  write(out / ".data-train-00057.tokens.tmp", std::string(100, 'x'));
  write(out / ".tiny-train-00000.index.tmp.4321", "x");
  write(out / ".manifest.json.tmp.4321", "x");
  write(out / ".tokenizer.json.tmp.4321", "x");
  write(out / "work" / ".pass2.json.tmp.4321", "x");
  write(out / ".report.tmp.4321", "x");  // another tool's: the output folder is not only pollen's
  ASSERT_TRUE(rerun("out_stale", 2, 0, "max_doc_bytes = 3000\n"));
  EXPECT_TRUE(fs::exists(out / "manifest.json"));
  ASSERT_TRUE(fs::remove(out / ".report.tmp.4321")) << "another tool's file was removed";
  for (const auto& e : fs::directory_iterator(out))
    EXPECT_FALSE(e.path().filename().string().starts_with(".")) << e.path();
  for (const auto& e : fs::directory_iterator(out / "work"))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
}

namespace {

// `pollen data prepare --config config` in a child process, its stderr in `log`.
pid_t spawn_prepare(const fs::path& config, const fs::path& log) {
  const pid_t pid = fork();
  if (pid == 0) {
    freopen(log.c_str(), "w", stderr);
    freopen("/dev/null", "w", stdout);
    execl(POLLEN_BINARY, POLLEN_BINARY, "data", "prepare", "--config", config.c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

int exit_code(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Runs `pollen data prepare` on `config` again and again, SIGKILLing each process as soon as
// `saved_position` (of its resume point on disk; -1 for none) goes beyond the last one, until a
// run ends on its own or three were killed; then runs it to the end. Returns the kills.
int kill_at_resume_points(const fs::path& config, const fs::path& logs,
                          const std::function<int64_t()>& saved_position) {
  int kills = 0;
  for (int round = 0; round < 3; ++round) {
    const int64_t before = saved_position();
    const pid_t pid = spawn_prepare(config, logs / ("killed-" + std::to_string(round) + ".log"));
    bool killed = false;
    while (!killed && waitpid(pid, nullptr, WNOHANG) == 0) {
      if (saved_position() > before) {
        ::kill(pid, SIGKILL);
        killed = true;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (!killed) break;
    waitpid(pid, nullptr, 0);
    ++kills;
  }
  EXPECT_EQ(exit_code(spawn_prepare(config, logs / "resumed.log")), 0);
  return kills;
}

// The saved position in a resume point file (-1 when there is none, or it is being replaced).
int64_t saved_position(const fs::path& resume_point, const json::json_pointer& where) {
  std::error_code ec;
  if (!fs::exists(resume_point, ec)) return -1;
  json j = json::parse(read_file(resume_point), nullptr, false);
  return j.is_discarded() || !j.contains(where) ? -1 : j[where].get<int64_t>();
}

// A config of one JSONL source, `files` files of 1500 / files documents each.
fs::path killed_corpus_config(const fs::path& root, const std::string& out, int files) {
  for (int f = 0; f < files; ++f) {
    std::string jl;
    for (int i = f * 1500 / files; i < (f + 1) * 1500 / files; ++i)
      jl += json{{"text", paragraph(1000 + i % 1400)}}.dump() + "\n";  // a few duplicates
    write(root / "docs" / cat("part-", 100 + f, ".jsonl"), jl);
  }
  fs::path p = root / (out + ".toml");
  write(p, "output = \"" + out +
               "\"\nthreads = 2\nbatch_bytes = 4096\ncheckpoint_bytes = 1\nsources = [\"d\"]\n"
               "[source.d]\npaths = [\"docs\"]\nformat = \"jsonl\"\n"
               "[tokenize]\ntokenizer = \"" +
               (corpus().root / "tokenizer.json").string() + "\"\nshard_tokens = 20000\n");
  return p;
}

}  // namespace

TEST(Pipeline, PrepareKilledInPassTwoResumesByteIdentical) {
  // `pollen data prepare` processes, SIGKILLed right after pass 2 saves a resume point (one a
  // batch here), then rerun to the end; against an uninterrupted process.
  const fs::path root = corpus().root / "killed";
  ASSERT_EQ(exit_code(spawn_prepare(killed_corpus_config(root, "whole", 1), root / "whole.log")),
            0);
  const int kills = kill_at_resume_points(killed_corpus_config(root, "killed", 1), root, [&] {
    return saved_position(root / "killed" / "work" / "pass2.json", "/state/docs"_json_pointer);
  });
  EXPECT_GE(kills, 2);
  EXPECT_NE(read_file(root / "resumed.log").find("resuming pass 2 after"), std::string::npos);
  EXPECT_EQ(outputs(root / "killed"), outputs(root / "whole"));
}

TEST(Pipeline, PrepareKilledInPassOneResumesByteIdentical) {
  // The same, SIGKILLed right after pass 1 saves a resume point (one after each of 60 files).
  const fs::path root = corpus().root / "killed1";
  ASSERT_EQ(exit_code(spawn_prepare(killed_corpus_config(root, "whole", 60), root / "whole.log")),
            0);
  const int kills = kill_at_resume_points(killed_corpus_config(root, "killed", 60), root, [&] {
    return saved_position(root / "killed" / "work" / "pass1.resume.json",
                          "/next_file"_json_pointer);
  });
  EXPECT_GE(kills, 2);
  EXPECT_NE(read_file(root / "resumed.log").find("resuming pass 1 after"), std::string::npos);
  EXPECT_EQ(outputs(root / "killed"), outputs(root / "whole"));
}

TEST(Pipeline, OneLargeFileKeepsItsOrderAndOutputsOnOneTwoAndFourThreads) {
  // One plain JSONL file and one delimited file, each over many batches, with bad lines among
  // the records: every thread count keeps every document in file order, with its line.
  fs::path root =
      fs::temp_directory_path() / ("pollen_data_one_file_" + std::to_string(::getpid()));
  fs::remove_all(root);
  std::string jl, fort, expected_ids;
  int64_t line = 0;
  for (int i = 0; i < 400; ++i) {
    jl += json{{"text", paragraph(1000 + i)}}.dump() + (i % 7 == 3 ? "\r\n" : "\n");
    expected_ids += "records/big.jsonl:" + std::to_string(++line) + "\n";
    if (i % 50 == 10) {
      jl += "{not json\n";
      ++line;
    }
    if (i % 60 == 20) {
      jl += "  \n";  // a blank line: no record
      ++line;
    }
  }
  for (int i = 0; i < 200; ++i) {
    fort += paragraph(2000 + i) + "\n%\n";
    expected_ids += "fortunes/big.txt#" + std::to_string(i + 1) + "\n";
  }
  write(root / "big.jsonl", jl);
  write(root / "big.txt", fort);
  auto prepare_on = [&](int threads) {
    const std::string out = "out" + std::to_string(threads);
    write(root / (out + ".toml"),
          "output = \"" + out + "\"\nthreads = " + std::to_string(threads) +
              "\nbatch_bytes = 4096\nsources = [\"records\", \"fortunes\"]\n"
              "[source.records]\npaths = [\"big.jsonl\"]\nformat = \"jsonl\"\n"
              "[source.fortunes]\npaths = [\"big.txt\"]\nformat = \"delimited\"\n"
              "[gopher_quality]\nenabled = false\n[gopher_repetition]\nenabled = false\n"
              "[minhash]\nenabled = false\n[split]\nvalidation_fraction = 0\n");
    int before = num_threads();
    prepare(PipelineConfig::load(root / (out + ".toml")), {.progress = false});
    set_num_threads(before);
    return outputs(root / out);
  };
  auto one = prepare_on(1);
  const std::string& curated = one["curated-train.jsonl"];
  std::string ids;
  for (size_t at = 0; (at = curated.find("{\"id\":\"", at)) != std::string::npos;) {
    at += 7;
    ids += curated.substr(at, curated.find('"', at) - at) + "\n";
  }
  EXPECT_EQ(ids, expected_ids);
  json m = json::parse(one["manifest.json"]);
  EXPECT_EQ(m["stages"][0]["dropped"]["invalid_json"]["docs"], 8);
  EXPECT_EQ(m["problems"][0]["line"], 12);  // after 11 records
  EXPECT_EQ(prepare_on(2), one);
  EXPECT_EQ(prepare_on(4), one);
  fs::remove_all(root);
}

TEST(Pipeline, AHundredMegabyteLineIsReportedWithoutHoldingIt) {
  fs::path root =
      fs::temp_directory_path() / ("pollen_data_long_line_" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root);
  {
    std::ofstream f(root / "big.jsonl", std::ios::binary);
    f << json{{"text", paragraph(1)}}.dump() << "\n{\"text\": \"";
    std::string chunk(1 << 20, 'a');
    for (int i = 0; i < 100; ++i) f << chunk;
    f << "\"}\n" << json{{"text", paragraph(2)}}.dump() << "\n";
  }
  write(root / "big.toml",
        "output = \"out\"\nthreads = 1\nmax_line_bytes = 8388608\nsources = [\"big\"]\n"
        "[source.big]\npaths = [\"big.jsonl\"]\nformat = \"jsonl\"\n[minhash]\nenabled = false\n");
  struct rusage before {};
  ::getrusage(RUSAGE_SELF, &before);
  fs::path manifest = prepare(PipelineConfig::load(root / "big.toml"), {.progress = false});
  struct rusage after {};
  ::getrusage(RUSAGE_SELF, &after);
  json m = json::parse(read_file(manifest));
  fs::remove_all(root);
  const json& read = m["stages"][0];
  EXPECT_EQ(read["docs_kept"], 2);
  EXPECT_EQ(read["dropped"]["line_too_long"]["docs"], 1);
  EXPECT_EQ(read["dropped"]["line_too_long"]["bytes"], (100 << 20) + 13);
  ASSERT_EQ(m["problems"].size(), 1u);
  EXPECT_EQ(m["problems"][0]["file"], "big/big.jsonl");
  EXPECT_EQ(m["problems"][0]["line"], 2);
  // Memory: at most max_line_bytes of the line is ever held (peak RSS in kB).
  EXPECT_LT(after.ru_maxrss - before.ru_maxrss, 40 << 10);
}

TEST(Pipeline, FailOnBadInputAbortsWithFileAndLine) {
  // On 2 threads the error is raised by the merge thread while this one reads.
  for (int threads : {1, 2}) {
    auto cfg = PipelineConfig::load(corpus().config("out_fail", threads, ""));
    cfg.fail_on_bad_input = true;
    cfg.sources.erase(cfg.sources.begin(), cfg.sources.begin() + 2);  // records only
    int before = num_threads();
    try {
      prepare(cfg, {.progress = false});
      ADD_FAILURE() << "expected an error";
    } catch (const Error& e) {
      std::string what = e.what();
      EXPECT_NE(what.find("records/records.jsonl.zst"), std::string::npos) << what;
      EXPECT_NE(what.find("line 11"), std::string::npos) << what;
    }
    set_num_threads(before);
  }
}

TEST(Pipeline, UnknownConfigKeyIsAnError) {
  fs::path p = corpus().config("out_bad", 1, "unknown_key = 3\n");
  try {
    PipelineConfig::load(p);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown_key"), std::string::npos) << e.what();
  }
}

// The same checks with the config named by a relative path with a folder in it, as the docs'
// commands name theirs: the output is resolved once, not joined with the config's folder twice.
TEST(Pipeline, AnOutputThatIsASourceIsFoundFromARelativeConfigToo) {
  const fs::path dir = corpus().root / "relative";
  write(dir / "src" / "a.jsonl", json{{"text", paragraph(5)}}.dump() + "\n");
  const auto prepare_in = [&](const std::string& output) {
    write(dir / "cfg" / "d.toml", "output = \"" + output +
                                      "\"\nsources = [\"a\"]\n[source.a]\npaths = [\"../src\"]\n"
                                      "format = \"jsonl\"\n[split]\nvalidation_fraction = 0\n");
    int status = 0;
    const std::string out = pollen::testing::run_capture(
        cat("cd ", dir.string(), " && ", POLLEN_BINARY,
            " data prepare --config cfg/d.toml --no-tokenize --quiet 2>&1"),
        &status);
    return std::pair{status, out};
  };
  const auto [status, out] = prepare_in("../src");
  EXPECT_NE(status, 0);
  EXPECT_NE(out.find("key 'source.a.paths': '../src' is the output folder too"), std::string::npos)
      << out;
  // An output inside a source folder: its files are not read back as inputs.
  for (int run = 0; run < 2; ++run) ASSERT_EQ(prepare_in("../src/out").first, 0);
  const json m = json::parse(read_file(dir / "src" / "out" / "manifest.json"));
  ASSERT_EQ(m["inputs"].size(), 1u) << m["inputs"];
  EXPECT_EQ(m["inputs"][0]["path"], "a/a.jsonl");
  fs::remove_all(dir);
}

// Values no document could pass, a delimiter no line can equal, and a source name that would
// put a '/' into its documents' ids are refused naming the key.
TEST(Pipeline, ConfigValuesThatMakeNoSenseAreRefused) {
  const std::string base =
      "output = \"o\"\nsources = [\"s\"]\n[source.s]\npaths = [\"in\"]\nformat = \"delimited\"\n";
  const auto error = [&](const std::string& text) {
    return pollen::testing::error_of(
        [&] { PipelineConfig::parse(text, corpus().root / "bad.toml"); });
  };
  std::string e = error(base + "[length]\nmin_chars = -1\n");
  EXPECT_NE(e.find("key 'length.min_chars': expected 0 or more, got -1"), std::string::npos) << e;
  e = error(base + "[length]\nmin_chars = 100\nmax_chars = 10\n");
  EXPECT_NE(e.find("key 'length.max_chars': 10 is less than min_chars (100)"), std::string::npos)
      << e;
  e = error(base + "[gopher_quality]\nmin_doc_words = 90\nmax_doc_words = 50\n");
  EXPECT_NE(e.find("key 'gopher_quality.max_doc_words'"), std::string::npos) << e;
  // A maximum of 0 is no bound.
  EXPECT_NO_THROW(PipelineConfig::parse(base + "[length]\nmin_words = 5\nmax_words = 0\n",
                                        corpus().root / "bad.toml"));
  e = error(base + "delimiter = \"a\\nb\"\n");
  EXPECT_NE(e.find("key 'source.s.delimiter': a delimiter is compared with whole lines"),
            std::string::npos)
      << e;
  for (const std::string name : {"", "a/b", ".."}) {
    std::string text = base;
    text.replace(text.find("[\"s\"]"), 5, "[\"" + name + "\"]");
    text.replace(text.find("[source.s]"), 10, "[source.\"" + name + "\"]");
    e = error(text);
    EXPECT_NE(e.find("key 'sources': '" + name + "' cannot name a source"), std::string::npos)
        << name << ": " << e;
  }
}
