// HF export into a folder that already holds something: an earlier export is replaced whole (no
// shard, tokenizer or generation_config.json of it left behind), an export that fails leaves
// the earlier one as it was, and a folder holding anything an export does not write is refused
// and left alone.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "base/files.h"
#include "base/hash.h"
#include "io/hf.h"
#include "support/errors.h"
#include "support/file_size_limit.h"

namespace fs = std::filesystem;
using namespace pollen;

namespace {

fs::path temp_dir(const std::string& name) {
  fs::path d =
      fs::temp_directory_path() / ("pollen_hf_export_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

model::LlamaConfig config(int64_t intermediate_size) {
  return io::parse_hf_config({{"model_type", "llama"},
                              {"vocab_size", 61},
                              {"hidden_size", 32},
                              {"intermediate_size", intermediate_size},
                              {"num_hidden_layers", 2},
                              {"num_attention_heads", 4},
                              {"num_key_value_heads", 2},
                              {"max_position_embeddings", 64}},
                             "config");
}

// Every file of `dir` by name, with the SHA-256 of its bytes.
std::map<std::string, std::string> contents(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    out[e.path().filename().string()] = sha256_file(e.path());
  return out;
}

void expect_same_weights(const model::Llama& a, const model::Llama& b) {
  const auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    ASSERT_EQ(pa[i].second.value().nbytes(), pb[i].second.value().nbytes()) << pa[i].first;
    EXPECT_EQ(std::memcmp(pa[i].second.value().raw(), pb[i].second.value().raw(),
                          pa[i].second.value().nbytes()),
              0)
        << pa[i].first;
  }
}

// Names beside `dir` left by an export into it (its staging folder).
std::vector<std::string> staging_left(const fs::path& dir) {
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir.parent_path()))
    if (e.path().filename().string().starts_with(".tmp-export-" + dir.filename().string() + "."))
      left.push_back(e.path().filename().string());
  return left;
}

// An export with the tokenizer files a model with a tokenizer gets, in 4 shards or more.
io::HfExportOptions sharded_with_tokenizer(const fs::path& tokenizer) {
  io::HfExportOptions o;
  o.max_shard_bytes = 20000;
  o.bos_token_id = 1;
  o.eos_token_id = 2;
  o.tokenizer_config = io::hf_tokenizer_config(64);
  o.extra_files = {tokenizer};
  return o;
}

TEST(HfExport, AnExportOverAnEarlierOneLeavesExactlyItsOwnFiles) {
  const fs::path root = temp_dir("over"), dir = root / "out";
  write_file_atomic(root / "tokenizer.json", "{}");
  const model::Llama first(config(48), 7);
  io::export_hf(first, dir, sharded_with_tokenizer(root / "tokenizer.json"));
  EXPECT_GE(pollen::testing::file_names(dir).size(), 8u);  // 4+ shards, index, 4 side files
  // Another model, in 2 shards, without a tokenizer; the folder named with a trailing '/'.
  const model::Llama second(config(96), 8);
  io::HfExportOptions o;
  o.max_shard_bytes = 70000;
  io::export_hf(second, dir.string() + "/", o);
  EXPECT_EQ(pollen::testing::file_names(dir),
            (std::vector<std::string>{"config.json", "model-00001-of-00002.safetensors",
                                      "model-00002-of-00002.safetensors",
                                      "model.safetensors.index.json"}));
  expect_same_weights(io::load_hf_model(dir), second);
  // And back to one file.
  io::export_hf(first, dir, {});
  EXPECT_EQ(pollen::testing::file_names(dir),
            (std::vector<std::string>{"config.json", "model.safetensors"}));
  expect_same_weights(io::load_hf_model(dir), first);
  EXPECT_TRUE(staging_left(dir).empty());
  fs::remove_all(root);
}

// An export that fails after some of its files are written (here: a tokenizer file that cannot
// be read, after the weights) leaves the earlier export byte for byte, and no staging folder.
TEST(HfExport, AFailedExportLeavesTheEarlierOneWhole) {
  const fs::path root = temp_dir("failed"), dir = root / "out";
  write_file_atomic(root / "tokenizer.json", "{}");
  const model::Llama first(config(48), 7);
  io::export_hf(first, dir, sharded_with_tokenizer(root / "tokenizer.json"));
  const auto before = contents(dir);
  const std::string e = pollen::testing::error_of([&] {
    io::export_hf(model::Llama(config(48), 8), dir, sharded_with_tokenizer(root / "missing.json"));
  });
  EXPECT_NE(e.find("missing.json"), std::string::npos) << e;
  EXPECT_EQ(contents(dir), before);
  expect_same_weights(io::load_hf_model(dir), first);
  EXPECT_TRUE(staging_left(dir).empty());
  // A full disk part way through the weights, over a single-file export.
  io::export_hf(first, dir, {});
  const auto single = contents(dir);
  {
    pollen::testing::FileSizeLimit full_disk(10000);
    EXPECT_NE(pollen::testing::error_of([&] {
                io::export_hf(model::Llama(config(48), 8), dir,
                              sharded_with_tokenizer(root / "tokenizer.json"));
              }).find("cannot write"),
              std::string::npos);
  }
  EXPECT_EQ(contents(dir), single);
  EXPECT_TRUE(staging_left(dir).empty());
  fs::remove_all(root);
}

// What an export killed midway left beside the output (its staging folder, or the old export
// moved aside) is removed by the next export; a running export's staging folder is not, nor
// another output's. An export killed between the two renames of a swap left no output, the
// earlier export moved aside: it is put back, and stays when the next export fails.
TEST(HfExport, WhatAKilledExportLeftIsRemovedByTheNext) {
  const fs::path root = temp_dir("killed"), dir = root / "out";
  const pid_t gone = fork();
  if (gone == 0) _exit(0);
  ASSERT_GT(gone, 0);
  ASSERT_EQ(waitpid(gone, nullptr, 0), gone);
  const std::string dead = std::to_string(gone);
  const pid_t running = getppid();  // the process that runs the tests: alive, and not this one
  const std::vector<std::string> killed = {".tmp-export-out." + dead, ".old-out." + dead};
  const std::vector<std::string> kept = {".tmp-export-out." + std::to_string(running),
                                         ".tmp-export-out.v2." + dead, ".tmp-export-out.12." + dead,
                                         ".tmp-export-out2." + dead};
  for (const auto& names : {killed, kept})
    for (const auto& name : names) {
      fs::create_directories(root / name);
      write_file_atomic(root / name / "model.safetensors", "partial");
    }
  io::export_hf(model::Llama(config(48), 7), dir, {});
  for (const auto& name : killed) EXPECT_FALSE(fs::exists(root / name)) << name;
  for (const auto& name : kept) EXPECT_TRUE(fs::exists(root / name)) << name;

  const fs::path lost = root / "lost", aside = root / (".old-lost." + dead);
  const model::Llama earlier(config(48), 8);
  io::export_hf(earlier, lost, {});
  fs::rename(lost, aside);
  const std::string e = pollen::testing::error_of([&] {
    io::export_hf(model::Llama(config(48), 9), lost, sharded_with_tokenizer(root / "missing.json"));
  });
  EXPECT_NE(e.find("missing.json"), std::string::npos) << e;
  expect_same_weights(io::load_hf_model(lost), earlier);
  EXPECT_FALSE(fs::exists(aside));
  fs::remove_all(root);
}

// A folder holding anything an export does not write (a git clone, a home folder) is refused,
// naming the folder and the entry, and nothing in it changes.
TEST(HfExport, AFolderHoldingOtherFilesIsRefusedAndLeftAlone) {
  const fs::path root = temp_dir("foreign"), dir = root / "out";
  io::export_hf(model::Llama(config(48), 7), dir, {});
  const auto before = contents(dir);
  for (const std::string other : {"notes.txt", ".git", "model.safetensors.bak"}) {
    if (other == ".git")
      fs::create_directory(dir / other);
    else
      write_file_atomic(dir / other, "mine");
    const std::string e =
        pollen::testing::error_of([&] { io::export_hf(model::Llama(config(96), 8), dir, {}); });
    EXPECT_NE(e.find("'" + dir.string() + "' holds '" + other + "'"), std::string::npos) << e;
    EXPECT_NE(e.find("give a new or empty folder, or one an earlier export wrote"),
              std::string::npos)
        << e;
    fs::remove_all(dir / other);
    EXPECT_EQ(contents(dir), before);
  }
  // A folder entry under a name an export writes is not one of its files either.
  fs::remove(dir / "config.json");
  fs::create_directory(dir / "config.json");
  EXPECT_NE(pollen::testing::error_of([&] {
              io::export_hf(model::Llama(config(48), 7), dir, {});
            }).find("holds 'config.json'"),
            std::string::npos);
  EXPECT_TRUE(fs::is_directory(dir / "config.json"));
  EXPECT_TRUE(staging_left(dir).empty());
  fs::remove_all(root);
}

// `--output .` (or a folder above the working one) would delete the working folder under the
// shell that ran the export: refused, and the folder left as it was.
TEST(HfExport, TheWorkingFolderIsNotReplaced) {
  const fs::path root = temp_dir("working_folder"), dir = root / "out";
  io::export_hf(model::Llama(config(48), 7), dir, {});
  const auto before = contents(dir);
  fs::create_directory(dir / "sub");
  const fs::path was = fs::current_path();
  for (const fs::path& cwd : {dir, dir / "sub"}) {
    fs::current_path(cwd);
    const std::string e =
        pollen::testing::error_of([&] { io::export_hf(model::Llama(config(96), 8), dir, {}); });
    fs::current_path(was);
    EXPECT_NE(e.find("is the working folder or holds it"), std::string::npos) << e;
  }
  fs::current_path(dir);
  const std::string e =
      pollen::testing::error_of([&] { io::export_hf(model::Llama(config(96), 8), ".", {}); });
  fs::current_path(was);
  EXPECT_NE(e.find("is the working folder or holds it"), std::string::npos) << e;
  fs::remove(dir / "sub");
  EXPECT_EQ(contents(dir), before);
  fs::remove_all(root);
}

}  // namespace
