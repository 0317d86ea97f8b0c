// `pollen eval` and `pollen score` as a user runs them: an option of another mode is refused
// rather than ignored, input with nothing to score is an error rather than a perfect score, an
// output path that cannot be written is refused before any scoring, score's output lines are its
// input's, and another model's tokenizer or text that is not UTF-8 is refused naming it.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/files.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "support/tiny_lm.h"

namespace pollen {
namespace {

struct CliRun {
  int status;
  std::string output;  // stdout and stderr
};

CliRun pollen(const std::string& args) {
  FILE* p = popen((std::string(POLLEN_BINARY) + " " + args + " 2>&1").c_str(), "r");
  std::string out;
  std::array<char, 4096> buf{};
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  return {WEXITSTATUS(pclose(p)), out};
}

class EvalCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = testing::unique_temp_dir("eval_cli");
    const tokenizer::Tokenizer tok = testing::tiny_tokenizer();
    testing::write_hf_dir(testing::tiny_model(tok.vocab_size()), tok, dir_ / "model");
    write_file_atomic(
        dir_ / "task.jsonl",
        "{\"context\": \"The cat\", \"choices\": [\"sat\", \"ran far\"], \"gold\": 0}\n"
        "{\"context\": \"A dog\", \"choices\": [\"barks\", \"sleeps\"], \"gold\": 1}\n");
    write_file_atomic(dir_ / "empty.jsonl", "{\"text\": \"\"}\n\n{\"text\": \"\"}\n");
    write_file_atomic(dir_ / "docs.jsonl",
                      "{\"text\": \"the cat sat\"}\n\n{\"text\": \"a dog\"}\n");
    write_file_atomic(dir_ / "latin1.txt", "a cat\nthe caf\xe9 sat\n");
    // Another model's tokenizer: more ids than this model's embedding has rows.
    testing::write_hf_dir(testing::tiny_model(tok.vocab_size() - 8), tok, dir_ / "narrow");
  }
  static void TearDownTestSuite() { std::filesystem::remove_all(dir_); }

  static std::string model() { return "--model " + (dir_ / "model").string() + " --threads 1"; }
  static std::string file(const std::string& name) { return (dir_ / name).string(); }

  static inline std::filesystem::path dir_;
};

TEST_F(EvalCli, AnOptionOfAnotherModeIsRefusedNamingTheModesItServes) {
  CliRun r = pollen("eval " + model() + " --jsonl " + file("docs.jsonl") + " --details " +
                    file("d.jsonl"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("--details applies to --task, not to --jsonl"), std::string::npos)
      << r.output;
  r = pollen("eval " + model() + " --task " + file("task.jsonl") + " --max-docs 1");
  EXPECT_NE(r.output.find("--max-docs applies to --text or --jsonl, not to --task"),
            std::string::npos)
      << r.output;
  r = pollen("eval " + model() + " --task " + file("task.jsonl") + " --fewshot -1");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--fewshot"), std::string::npos) << r.output;
}

TEST_F(EvalCli, TextWithNothingToScoreIsAnErrorNotAPerfectScore) {
  const CliRun r = pollen("eval " + model() + " --jsonl " + file("empty.jsonl"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("empty.jsonl' holds no text to score"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("perplexity"), std::string::npos) << r.output;
}

TEST_F(EvalCli, AnOutputThatCannotBeWrittenIsRefusedBeforeScoring) {
  const CliRun r = pollen("eval " + model() + " --task " + file("task.jsonl") +
                          " --details /nonexistent-folder/d.jsonl");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("--details '/nonexistent-folder/d.jsonl'"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("choices scored"), std::string::npos) << "scored before refusing";
  // Both written once the summary is printed.
  const CliRun ok = pollen("eval " + model() + " --task " + file("task.jsonl") + " --details " +
                           file("d.jsonl") + " --output " + file("t.json"));
  ASSERT_EQ(ok.status, 0) << ok.output;
  EXPECT_EQ(nlohmann::json::parse(read_file(dir_ / "t.json"))["items"], 2);
  std::ifstream details(dir_ / "d.jsonl");
  std::string line;
  int lines = 0;
  while (std::getline(details, line)) ++lines;
  EXPECT_EQ(lines, 2);
}

TEST_F(EvalCli, ATokenizerWithMoreIdsThanTheModelIsRefusedNamingIt) {
  const std::string narrow = "--model " + file("narrow") + " --threads 1";
  for (const std::string& cmd : {"eval " + narrow + " --jsonl " + file("docs.jsonl"),
                                 "score " + narrow + " --input " + file("docs.jsonl") +
                                     " --jsonl --output " + file("narrow.jsonl"),
                                 "generate " + narrow + " --prompt 'the cat' --max-tokens 2"}) {
    const CliRun r = pollen(cmd);
    EXPECT_EQ(r.status, 1) << cmd << "\n" << r.output;
    EXPECT_NE(r.output.find("narrow/tokenizer.json' has "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("more than the model's vocabulary"), std::string::npos) << r.output;
  }
}

TEST_F(EvalCli, TextThatIsNotUtf8IsRefusedNamingTheLineAndByte) {
  const CliRun r = pollen("eval " + model() + " --text " + file("latin1.txt"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("latin1.txt' line 2: not valid UTF-8 at byte 8"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("perplexity"), std::string::npos) << r.output;
}

TEST_F(EvalCli, ScoreRefusesAFolderAsItsInput) {
  const CliRun r = pollen("score " + model() + " --input " + dir_.string() + " --output " +
                          file("folder.jsonl"));
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("--input"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir_ / "folder.jsonl"));
}

TEST_F(EvalCli, ScoreWritesOneLinePerInputLineBlankOnesIncluded) {
  const CliRun r = pollen("score " + model() + " --input " + file("docs.jsonl") +
                          " --jsonl --output " + file("scores.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  std::ifstream in(dir_ / "scores.jsonl");
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_FALSE(lines[0]["tokens"].empty());
  EXPECT_TRUE(lines[1]["tokens"].empty());
  EXPECT_FALSE(lines[2]["tokens"].empty());
}

// A text file's Windows line breaks are not scored as text: the same tokens as with "\n"; a
// --window past the model names score, not eval.
TEST_F(EvalCli, ScoreLeavesOutWindowsLineBreaksAndNamesItselfInErrors) {
  write_file_atomic(dir_ / "lf.txt", "the cat sat\nbirds sang\n");
  write_file_atomic(dir_ / "crlf.txt", "the cat sat\r\nbirds sang\r\n");
  for (const char* name : {"lf", "crlf"})
    ASSERT_EQ(pollen(cat("score ", model(), " --input ", file(cat(name, ".txt")), " --output ",
                         file(cat(name, ".out"))))
                  .status,
              0);
  EXPECT_EQ(read_file(dir_ / "crlf.out"), read_file(dir_ / "lf.out"));
  const CliRun wide = pollen("score " + model() + " --input " + file("lf.txt") + " --output " +
                             file("wide.out") + " --window 100000");
  EXPECT_NE(wide.output.find("score: --window 100000 is longer"), std::string::npos) << wide.output;
}

// Results of --checkpoint's weights name the checkpoint beside the model.
TEST_F(EvalCli, ResultsNameTheCheckpointScored) {
  const CliRun r = pollen("eval " + model() + " --checkpoint " + file("model") + " --jsonl " +
                          file("docs.jsonl") + " --output " + file("checkpoint.json"));
  ASSERT_EQ(r.status, 0) << r.output;
  const auto j = nlohmann::json::parse(read_file(dir_ / "checkpoint.json"));
  EXPECT_EQ(j["checkpoint"], file("model")) << j.dump();
  // A run folder stands for its newest checkpoint, which moves on while the run trains: the
  // results name the one scored.
  const model::Llama m = testing::tiny_model(testing::tiny_tokenizer().vocab_size());
  io::NamedTensors weights;
  for (const auto& [name, v] : m.named_parameters()) weights.emplace_back(name, v.value());
  const model::LlamaConfig& c = m.config();
  io::CheckpointWriter w(dir_ / "run" / "checkpoints", 3);
  w.add_tensors("model.safetensors", weights);
  w.add_text("config.toml",
             cat("[model]\nvocab_size = ", c.vocab_size, "\nhidden_size = ", c.hidden_size,
                 "\nintermediate_size = ", c.intermediate_size, "\nnum_hidden_layers = ",
                 c.num_hidden_layers, "\nnum_attention_heads = ", c.num_attention_heads,
                 "\nnum_key_value_heads = ", c.num_key_value_heads,
                 "\nmax_position_embeddings = ", c.max_position_embeddings, "\n"));
  const std::filesystem::path newest = w.commit();
  const CliRun run =
      pollen("eval --model " + file("run") + " --tokenizer " + file("model/tokenizer.json") +
             " --jsonl " + file("docs.jsonl") + " --output " + file("run.json"));
  ASSERT_EQ(run.status, 0) << run.output;
  const auto of_run = nlohmann::json::parse(read_file(dir_ / "run.json"));
  EXPECT_EQ(of_run["model"], file("run")) << of_run.dump();
  EXPECT_EQ(of_run["checkpoint"], newest.string()) << of_run.dump();
}

}  // namespace
}  // namespace pollen
