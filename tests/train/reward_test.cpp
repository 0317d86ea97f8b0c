// The reward model: the Bradley-Terry loss on the head's scores, ranking held-out pairs after
// training on a synthetic preference rule, and the HF sequence-classification export scored by
// transformers (PyPI) exactly as pollen scores it.
#include "train/reward.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>

#include "base/files.h"
#include "support/errors.h"
#include "support/file_size_limit.h"
#include "support/process.h"
#include "tokenizer/hf_format.h"
#include "train/preference_support.h"

namespace fs = std::filesystem;
using namespace pollen;
namespace pt = pollen::testing;

namespace {

class RewardModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = pt::unique_temp_dir(
        "rm_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    train_ = pt::synth_pairs(dir_, "case", 96, 1);
    eval_ = pt::synth_pairs(dir_, "case", 40, 2);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string section(const std::string& extra = "") const {
    return "data = \"" + train_.string() + "\"\nvalidation = \"" + eval_.string() +
           "\"\nbatch_pairs = 16\nmicro_batch_pairs = 8\n" + extra;
  }
  static model::LlamaConfig config() { return pt::tiny_config(pt::chat_tokenizer().vocab_size()); }

  fs::path dir_, train_, eval_;
};

// TRL's reward data may carry a margin per pair, which pollen's loss has not: such a file is
// refused, naming the line, rather than trained on as if the margin were 0.
TEST_F(RewardModelTest, APairWithAMarginIsRefused) {
  write_file_atomic(dir_ / "margin.jsonl",
                    "{\"prompt\": \"a\", \"chosen\": \"b\", \"rejected\": \"c\"}\n"
                    "{\"prompt\": \"a\", \"chosen\": \"b\", \"rejected\": \"c\", "
                    "\"margin\": 1.5}\n");
  const train::SequenceFormat format{&pt::chat_tokenizer(), tokenizer::ChatFormat{}, 256};
  const std::string e =
      pt::error_of([&] { train::read_preference_pairs(dir_ / "margin.jsonl", format); });
  EXPECT_NE(e.find("line 2"), std::string::npos) << e;
  EXPECT_NE(e.find("has a \"margin\""), std::string::npos) << e;
  // An empty reply names its field.
  write_file_atomic(dir_ / "empty.jsonl",
                    "{\"prompt\": \"a\", \"chosen\": \"b\", \"rejected\": \"\"}\n");
  const std::string empty =
      pt::error_of([&] { train::read_preference_pairs(dir_ / "empty.jsonl", format); });
  EXPECT_NE(empty.find("line 1: field 'rejected' has no token"), std::string::npos) << empty;
}

// A pair longer than max_seq keeps its completion's first tokens and its prompt's last, and is
// counted as shortened; one that fits is left whole and not counted.
TEST_F(RewardModelTest, ALongPairKeepsTheCompletionsStartAndThePromptsEndAndIsCounted) {
  write_file_atomic(dir_ / "long.jsonl",
                    "{\"prompt\": \"one two three four five six\", \"chosen\": \" seven eight\", "
                    "\"rejected\": \" nine\"}\n");
  const train::SequenceFormat whole{&pt::chat_tokenizer(), tokenizer::ChatFormat{}, 256};
  const auto full = train::read_preference_pairs(dir_ / "long.jsonl", whole);
  ASSERT_EQ(full.size(), 1u);
  EXPECT_FALSE(full[0].chosen.shortened);
  EXPECT_EQ(train::shortened_pairs(full), 0);
  const auto& f = full[0].chosen;
  ASSERT_GE(f.prompt_tokens, 4);
  ASSERT_GE(f.completion_tokens(), 2);
  // Room for the completion and 2 prompt tokens: the prompt loses its start.
  const int64_t fit = f.completion_tokens() + 2;
  const train::SequenceFormat tight{&pt::chat_tokenizer(), tokenizer::ChatFormat{}, fit};
  const auto cut = train::read_preference_pairs(dir_ / "long.jsonl", tight);
  EXPECT_EQ(train::shortened_pairs(cut), 1);
  EXPECT_TRUE(cut[0].chosen.shortened);
  EXPECT_EQ(cut[0].chosen.prompt_tokens, 2);
  EXPECT_EQ(cut[0].chosen.ids,
            std::vector<uint32_t>(f.ids.begin() + (f.prompt_tokens - 2), f.ids.end()));
  // The rejected reply, shorter, keeps more of the prompt and may still fit whole.
  EXPECT_EQ(cut[0].rejected.shortened, std::ssize(full[0].rejected.ids) > fit);
  // Room for 2 tokens: the prompt's last, then the completion's first.
  const train::SequenceFormat one{&pt::chat_tokenizer(), tokenizer::ChatFormat{}, 2};
  const auto two = train::read_preference_pairs(dir_ / "long.jsonl", one);
  EXPECT_EQ(two[0].chosen.ids,
            (std::vector<uint32_t>{f.ids[static_cast<size_t>(f.prompt_tokens) - 1],
                                   f.ids[static_cast<size_t>(f.prompt_tokens)]}));
}

// A resumed run draws the same steps' pairs only from the same data: a checkpoint's state names
// the data, and other pairs (or another validation file) are refused, naming the keys.
TEST_F(RewardModelTest, AResumeOnChangedDataIsRefused) {
  const nlohmann::ordered_json state =
      train::RewardObjective(pt::objective_context("rm", section(), config())).state();
  train::RewardObjective same(pt::objective_context("rm", section(), config()));
  same.restore(state);
  const fs::path other_eval = pt::synth_pairs(dir_, "case", 40, 3);
  write_file_atomic(eval_, read_file(other_eval));
  train::RewardObjective changed(pt::objective_context("rm", section(), config()));
  const std::string e = pt::error_of([&] { changed.restore(state); });
  EXPECT_NE(e.find("cannot resume"), std::string::npos) << e;
  EXPECT_NE(e.find("rm.validation '" + eval_.string() + "' ("), std::string::npos) << e;
  EXPECT_EQ(e.find("rm.data"), std::string::npos) << e;  // only the held-out file changed
}

TEST_F(RewardModelTest, LossIsBradleyTerryOnTheScoresOfEachSequencesLastToken) {
  model::Llama m = pt::tiny_model(pt::chat_tokenizer().vocab_size());
  train::RewardObjective rm(pt::objective_context("rm", section(), config()));
  const auto extra = rm.extra_parameters();
  ASSERT_EQ(extra.size(), 1u);
  EXPECT_EQ(extra[0].first, "score.weight");
  EXPECT_EQ(extra[0].second.shape(), (Shape{1, 32}));

  // Scores one sequence at a time (no padding), then the loss by hand from them.
  const train::SequenceFormat format{&pt::chat_tokenizer(), tokenizer::ChatFormat{}, 256};
  const auto pairs = train::read_preference_pairs(eval_, format);
  std::vector<train::ScoredSequence> chosen, rejected;
  for (const auto& p : pairs) {
    chosen.push_back(p.chosen);
    rejected.push_back(p.rejected);
  }
  const auto rc = train::score_sequences(m, rm.score_head(), chosen, 1);
  const auto rr = train::score_sequences(m, rm.score_head(), rejected, 1);
  double loss = 0, correct = 0;
  for (size_t i = 0; i < pairs.size(); ++i) {
    loss += std::log1p(std::exp(-(rc[i] - rr[i])));
    correct += rc[i] > rr[i];
  }
  const train::ObjectiveStep e = rm.evaluate(m);  // padded micro-batches of 8 pairs
  EXPECT_NEAR(e.loss, loss / static_cast<double>(pairs.size()), 1e-5);
  EXPECT_NEAR(e.metrics["accuracy"].get<double>(), correct / static_cast<double>(pairs.size()),
              1e-12);
  // The last token is what is scored: the same sequence with one more token scores otherwise.
  train::ScoredSequence longer = chosen[0];
  longer.ids.push_back(longer.ids.back());
  EXPECT_NE(train::score_sequences(m, rm.score_head(), {longer}, 1)[0], rc[0]);
}

TEST_F(RewardModelTest, RanksHeldOutPairsAfterTrainingOnASyntheticRule) {
  model::Llama m(config(), 5);
  train::RewardObjective rm(pt::objective_context("rm", section(), config()));
  const double before = rm.evaluate(m).metrics["accuracy"].get<double>();
  pt::train_steps(rm, m, 40, 3e-3);
  const train::ObjectiveStep after = rm.evaluate(m);
  std::printf("held-out pairs ranked correctly: %.3f before, %.3f after 40 steps (loss %.4f)\n",
              before, after.metrics["accuracy"].get<double>(), after.loss);
  EXPECT_GE(after.metrics["accuracy"].get<double>(), 0.9);
}

// An export onto a full disk leaves the earlier export as it was (weights, tokenizer files and
// config.json) and no temporary file behind.
TEST_F(RewardModelTest, AFailedExportLeavesTheOldExportAndNoTemporaryFile) {
  const model::Llama m = pt::tiny_model(pt::chat_tokenizer().vocab_size());
  pt::write_hf_dir(m, pt::chat_tokenizer(), dir_ / "lm");  // for the tokenizer files
  const fs::path out = dir_ / "rm";
  const auto head = [](double v) { return ag::Var(Tensor::full({1, 32}, v, DType::f32), false); };
  train::export_reward_model_with_tokenizer(m, head(0.5), 0, dir_ / "lm" / "tokenizer.json", out);
  std::map<std::string, std::string> old;
  for (const std::string& name : pt::file_names(out)) old[name] = read_file(out / name);
  {
    pt::FileSizeLimit full_disk(old.at("model.safetensors").size() / 2);
    EXPECT_NE(pt::error_of([&] {
                train::export_reward_model_with_tokenizer(m, head(-0.5), 0,
                                                          dir_ / "lm" / "tokenizer.json", out);
              }).find("cannot write"),
              std::string::npos);
  }
  std::map<std::string, std::string> now;
  for (const std::string& name : pt::file_names(out)) now[name] = read_file(out / name);
  EXPECT_EQ(now.size(), old.size());
  EXPECT_TRUE(now == old) << "a file of the earlier export changed";
  // pollen rm score reads it, within the model's positions only.
  write_file_atomic(dir_ / "s.jsonl", "{\"prompt\": \"2+2\", \"response\": \"4\"}\n");
  const std::string score = cat(POLLEN_BINARY, " rm score --model ", out.string(), " --data ",
                                (dir_ / "s.jsonl").string(), " --out ",
                                (dir_ / "scored.jsonl").string(), " --chat-template chatml");
  int status = 0;
  std::string said = pollen::testing::run_capture(score + " 2>&1", &status);
  EXPECT_EQ(status, 0) << said;
  EXPECT_NE(said.find("scored 1 records of"), std::string::npos) << said;
  EXPECT_EQ(said.find("longer than"), std::string::npos) << said;
  // A record longer than --max-seq is scored on what fits, and counted.
  said = pollen::testing::run_capture(score + " --max-seq 3 2>&1", &status);
  EXPECT_EQ(status, 0) << said;
  EXPECT_NE(said.find("1 of them longer than 3 positions"), std::string::npos) << said;
  said = pollen::testing::run_capture(
      cat(score, " --max-seq ", m.config().max_position_embeddings + 1, " 2>&1"), &status);
  EXPECT_NE(status, 0);
  EXPECT_NE(said.find("is more than the model's"), std::string::npos) << said;
  said = pollen::testing::run_capture(score + " --max-seq 0 2>&1", &status);
  EXPECT_NE(status, 0) << said;
}

TEST_F(RewardModelTest, HfExportScoresAsTransformersDoes) {
  ASSERT_TRUE(fs::exists(POLLEN_HF_PEERS_PYTHON)) << "run scripts/test-peers first";
  model::Llama m = pt::tiny_model(pt::chat_tokenizer().vocab_size());
  train::RewardObjective rm(pt::objective_context("rm", section(), config()));
  pt::train_steps(rm, m, 2, 3e-3);  // a head that is not its initial value
  const fs::path out = dir_ / "rm";
  pt::write_hf_dir(m, pt::chat_tokenizer(), dir_ / "lm");  // for the tokenizer files
  train::export_reward_model(
      m, rm.score_head(), rm.pad_token_id(), out,
      {dir_ / "lm" / "tokenizer.json", dir_ / "lm" / "tokenizer_config.json"});

  const train::SequenceFormat format{&pt::chat_tokenizer(), tokenizer::ChatFormat{}, 256};
  const auto pairs = train::read_preference_pairs(eval_, format);
  std::vector<train::ScoredSequence> sequences;
  nlohmann::json ids = nlohmann::json::array();
  for (size_t i = 0; i < 6; ++i) {
    sequences.push_back(pairs[i].chosen);
    sequences.push_back(pairs[i].rejected);
  }
  for (const auto& s : sequences) ids.push_back(s.ids);
  write_file_atomic(out / "sequences.json", ids.dump());
  const std::string cmd = std::string(POLLEN_HF_PEERS_PYTHON) + " " + POLLEN_SOURCE_DIR +
                          "/tests/train/hf_reward_reference.py " + out.string();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const auto hf = nlohmann::json::parse(read_file(out / "scores.json"));

  // pollen scores the exported directory, loaded back, and the model it came from.
  const train::RewardModel loaded = train::load_reward_model(out);
  EXPECT_EQ(loaded.pad_token_id, rm.pad_token_id());
  const auto ours = train::score_sequences(m, rm.score_head(), sequences, 4);
  const auto reloaded = train::score_sequences(*loaded.decoder, loaded.score, sequences, 4);
  for (size_t i = 0; i < sequences.size(); ++i) {
    const double alone = hf["alone"][i].get<double>(), batched = hf["batched"][i].get<double>();
    EXPECT_NEAR(ours[i], alone, 1e-4 * std::max(1.0, std::fabs(alone))) << i;
    EXPECT_NEAR(ours[i], batched, 1e-4 * std::max(1.0, std::fabs(batched))) << i;
    EXPECT_EQ(reloaded[i], ours[i]) << i;
  }
  std::printf("first scores: pollen %.6f %.6f, transformers %.6f %.6f\n", ours[0], ours[1],
              hf["alone"][0].get<double>(), hf["alone"][1].get<double>());
}

TEST_F(RewardModelTest, PadTokenInTheDataOrUnknownIsRefused) {
  auto error = [&](const std::string& toml) {
    try {
      train::RewardObjective r(pt::objective_context("rm", toml, config()));
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error(section("pad_token = \"<pad>\"")).find("no added token \"<pad>\""),
            std::string::npos);
  const fs::path bad = dir_ / "pad.jsonl";
  std::ofstream(bad)
      << "{\"prompt\": \"a\", \"chosen\": \"b<|endoftext|>\", \"rejected\": \"c\"}\n";
  EXPECT_NE(error("data = \"" + bad.string() + "\"\nvalidation_fraction = 0.5\n")
                .find("contains the pad token"),
            std::string::npos);
  EXPECT_NE(error(section("micro_batch = 3")).find("micro_batch"), std::string::npos);
}

}  // namespace
