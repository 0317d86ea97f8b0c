// Post-training as several ranks under mpirun: sft, dpo, rm and grpo train as one process does
// (LoRA dropout included), one rank writes the run's files, and a checkpoint resumes at another
// world size.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "base/files.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "support/process.h"
#include "train/post_fixtures.h"

namespace fs = std::filesystem;
using namespace pollen;

namespace {

// A LoRA SFT run of 6 steps of 4 micro-batches of 2 rows, with adapter dropout, evaluated at
// steps 3 and 6 and checkpointed every 2 steps (all kept).
struct SftRun {
  fs::path dir, config;
};

const SftRun& sft_run() {
  static const SftRun r = [] {
    const auto files = test_support::make_post_files("sft_ranks");
    const fs::path data = test_support::write_sft_data(files.dir / "upper.jsonl", "upper", 300, 7);
    std::string toml = test_support::tiny_post_toml(
        files.dir / "run", files.model_file, files.tokenizer_path, 6,
        cat("[eval]\ninterval = 3\n\n[lora]\nrank = 4\ndropout = 0.1\n\n"
            "[parallel]\ntimeout_s = 60\n\n[sft]\ndata = \"",
            data.string(), "\"\nseq = 64\nmicro_batch = 2\naccumulation = 4\n"));
    toml.replace(toml.find("threads = 2"), 11, "threads = 1");
    write_file_atomic(files.dir / "run.toml", toml);
    return SftRun{files.dir, files.dir / "run.toml"};
  }();
  return r;
}

// `pollen <objective>` on `config` as `ranks` processes (1: no mpirun) into run.dir = `out`;
// `fault`: a POLLEN_FAULT_INJECT value that every rank gets.
int post(const std::string& objective, const fs::path& config, int ranks, const fs::path& out,
         const std::string& extra, std::string* output, const std::string& fault = "") {
  std::string cmd = fault.empty() ? "" : "POLLEN_FAULT_INJECT=" + fault + " ";
  if (ranks > 1) {
    cmd += "mpirun --oversubscribe --bind-to none -np " + std::to_string(ranks) + " ";
    if (geteuid() == 0) cmd += "--allow-run-as-root ";
    if (!fault.empty()) cmd += "-x POLLEN_FAULT_INJECT ";
  }
  cmd += std::string(POLLEN_BINARY) + " " + objective + " --config " + config.string() +
         " --set run.dir=" + out.string() + " " + extra;
  int status = 0;
  *output = pollen::testing::run_capture(cmd, &status);
  return status;
}

int sft(int ranks, const fs::path& out, const std::string& extra, std::string* output) {
  return post("sft", sft_run().config, ranks, out, extra, output);
}

std::vector<nlohmann::json> records(const fs::path& run, const char* key) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains(key)) out.push_back(j);
  }
  return out;
}

std::vector<double> values(const fs::path& run, const char* key) {
  std::vector<double> out;
  for (const auto& j : records(run, key)) out.push_back(j[key].get<double>());
  return out;
}

void expect_close(const std::vector<double>& a, const std::vector<double>& b,
                  const std::string& what, double tolerance = 1e-5) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(a[i], b[i], tolerance * std::max(1.0, std::abs(b[i]))) << what << " record " << i;
}

// |B_a - B_b| / |B_b| over the LoRA B tensors of two runs' last checkpoints.
double relative_b_difference(const fs::path& a, const fs::path& b) {
  auto adapters = [](const fs::path& run) {
    return io::read_safetensors(io::list_checkpoints(run / "checkpoints").back() /
                                "adapter_model.safetensors");
  };
  const auto fa = adapters(a), fb = adapters(b);
  double diff = 0, norm = 0;
  for (const auto& [name, tb] : fb.tensors) {
    if (name.find("lora_B") == std::string::npos) continue;
    const Tensor* ta = fa.find(name);
    EXPECT_NE(ta, nullptr) << name;
    if (ta == nullptr) continue;
    const std::vector<double> va = ta->to_doubles(), vb = tb.to_doubles();
    for (size_t i = 0; i < vb.size(); ++i) {
      diff += (va[i] - vb[i]) * (va[i] - vb[i]);
      norm += vb[i] * vb[i];
    }
  }
  EXPECT_GT(norm, 0) << "the adapters did not move";
  return std::sqrt(diff / std::max(norm, 1e-300));
}

}  // namespace

TEST(SftRanks, TwoRanksTrainAsOneProcessAndResumeAsOne) {
  const fs::path dir = sft_run().dir;
  std::string out;
  ASSERT_EQ(sft(1, dir / "one", "", &out), 0) << out;
  ASSERT_EQ(sft(2, dir / "two", "", &out), 0) << out;
  const std::vector<double> one = values(dir / "one", "loss");
  ASSERT_EQ(one.size(), 6u);  // rank 0 alone wrote the metrics
  expect_close(values(dir / "two", "loss"), one, "train loss, 2 ranks");
  expect_close(values(dir / "two", "val_loss"), values(dir / "one", "val_loss"),
               "held-out loss, 2 ranks");
  // The same step's micro-batches: the same examples and scored tokens.
  EXPECT_EQ(records(dir / "two", "loss").back()["sft/scored"],
            records(dir / "one", "loss").back()["sft/scored"]);
  EXPECT_LT(relative_b_difference(dir / "two", dir / "one"), 1e-4);
  const auto summary = nlohmann::json::parse(read_file(dir / "two/summary.json"));
  EXPECT_EQ(summary["ranks"], 2);
  EXPECT_EQ(summary["step"], 6);

  // The 2-rank run's checkpoint of step 2, resumed by one process: steps 3 to 6 as before.
  for (const auto& c : io::list_checkpoints(dir / "two/checkpoints"))
    if (io::checkpoint_step(c) > 2) fs::remove_all(c);
  fs::remove(dir / "two/summary.json");
  ASSERT_EQ(sft(1, dir / "two", "--resume", &out), 0) << out;
  expect_close(values(dir / "two", "loss"), one, "train loss, resumed by 1 process");
  expect_close(values(dir / "two", "val_loss"), values(dir / "one", "val_loss"),
               "held-out loss, resumed by 1 process");

  // Its step-4 checkpoint resumed with the step's 8 rows as 2 micro-batches of 4 (as a world
  // size that does not divide sft.accumulation needs): taken, the same examples per step; a
  // step of other rows is refused.
  for (const auto& c : io::list_checkpoints(dir / "two/checkpoints"))
    if (io::checkpoint_step(c) > 4) fs::remove_all(c);
  fs::remove(dir / "two/summary.json");
  EXPECT_EQ(sft(2, dir / "two", "--resume --set sft.accumulation=2", &out), 1) << out;
  EXPECT_NE(out.find("may not change in a resumed run: sft.accumulation (4 -> 2)"),
            std::string::npos)
      << out;
  ASSERT_EQ(sft(2, dir / "two", "--resume --set sft.accumulation=2 --set sft.micro_batch=4", &out),
            0)
      << out;
  EXPECT_NE(out.find("sft.micro_batch x sft.accumulation (2 x 4 -> 4 x 2)"), std::string::npos)
      << out;
  EXPECT_EQ(records(dir / "two", "loss").back()["sft/scored"],
            records(dir / "one", "loss").back()["sft/scored"]);
  EXPECT_EQ(values(dir / "two", "loss").size(), 6u);

  // Three ranks cannot share 4 micro-batches evenly: refused naming the key.
  EXPECT_EQ(sft(3, dir / "three", "", &out), 1) << out;
  EXPECT_NE(out.find("sft.accumulation (4) is not a multiple of the job's 3 ranks"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("(sft.accumulation = 3 or a multiple of it; the step's batch grows with it; "
                     "set them in the run file"),
            std::string::npos)
      << out;
}

// A rank that hangs before step 4 (SIGSTOP-like: it never reaches a collective) ends the job
// after parallel.timeout_s with exit code 4 and a message naming it; --resume continues from the
// checkpoint of step 2 and ends as one process does.
TEST(SftRanks, AHungRankIsNamedWithExitCodeFourAndResumeFinishesTheRun) {
  const fs::path dir = sft_run().dir;
  std::string out;
  ASSERT_EQ(sft(1, dir / "hung-one", "", &out), 0) << out;
  const int hung = post("sft", sft_run().config, 2, dir / "hung", "--set parallel.timeout_s=5",
                        &out, "hang:1:4");
  EXPECT_EQ(hung, 4) << out;
  EXPECT_NE(out.find("rank 1 never reached it (dead or hung)"), std::string::npos) << out;
  EXPECT_NE(out.find("--resume"), std::string::npos) << out;
  // Its summary says the run failed, not that it still runs.
  EXPECT_EQ(nlohmann::json::parse(read_file(dir / "hung/summary.json"))["status"], "failed");
  EXPECT_EQ(io::checkpoint_step(io::list_checkpoints(dir / "hung/checkpoints").back()), 2);
  ASSERT_EQ(sft(2, dir / "hung", "--resume", &out), 0) << out;
  expect_close(values(dir / "hung", "loss"), values(dir / "hung-one", "loss"),
               "train loss, resumed after a hang");
}

// ZeRO-1 (parallel.zero = 1): each of 2 ranks keeps half of AdamW's state, the run trains as one
// process does, and its checkpoint (the whole moments, gathered) resumes in one process.
TEST(SftRanks, ZeroShardedRanksTrainAsOneProcessInHalfTheOptimizerState) {
  const fs::path dir = sft_run().dir;
  std::string out;
  ASSERT_EQ(sft(1, dir / "zero-one", "", &out), 0) << out;
  ASSERT_EQ(sft(2, dir / "zero-replicated", "", &out), 0) << out;
  ASSERT_EQ(sft(2, dir / "zero", "--set parallel.zero=1", &out), 0) << out;
  const std::vector<double> one = values(dir / "zero-one", "loss");
  expect_close(values(dir / "zero", "loss"), one, "train loss, ZeRO-1");
  expect_close(values(dir / "zero", "val_loss"), values(dir / "zero-one", "val_loss"),
               "held-out loss, ZeRO-1");
  EXPECT_LT(relative_b_difference(dir / "zero", dir / "zero-one"), 1e-4);
  const auto summary = [&](const char* run) {
    return nlohmann::json::parse(read_file(dir / run / "summary.json"));
  };
  EXPECT_EQ(summary("zero")["zero"], 1);
  EXPECT_EQ(summary("zero-replicated")["zero"], 0);
  const auto whole = summary("zero-replicated")["optimizer_state_bytes_per_rank"];
  const auto sharded = summary("zero")["optimizer_state_bytes_per_rank"];
  ASSERT_EQ(sharded.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    // Half, up to the padding of each bucket to a multiple of the ranks.
    EXPECT_LE(sharded[r].get<double>(), 0.5 * whole[r].get<double>() + 64) << "rank " << r;
    EXPECT_GE(sharded[r].get<double>(), 0.5 * whole[r].get<double>() - 64) << "rank " << r;
  }

  // The checkpoint of step 2 holds the whole moments: one process resumes it and ends alike.
  for (const auto& c : io::list_checkpoints(dir / "zero/checkpoints"))
    if (io::checkpoint_step(c) > 2) fs::remove_all(c);
  fs::remove(dir / "zero/summary.json");
  ASSERT_EQ(sft(1, dir / "zero", "--resume", &out), 0) << out;
  expect_close(values(dir / "zero", "loss"), one, "train loss, ZeRO-1 resumed by 1 process");
}

// DPO and a reward model on synthetic preference pairs, 3 micro-batches of 2 pairs a step (so
// that 2 ranks run 2 and 1 of them), LoRA with dropout: the same losses and metrics as one
// process, with ZeRO-1 too, and one reward model exported.
TEST(PreferenceRanks, DpoAndRewardModelsTrainAsOneProcess) {
  const auto files = test_support::make_post_files("preference_ranks");
  for (const std::string objective : {"dpo", "rm"}) {
    const fs::path data = files.dir / (objective + ".jsonl");
    int status = 0;
    const std::string made = pollen::testing::run_capture(
        cat(POLLEN_BINARY, " ", objective, " synth --task arithmetic --digits 1 --count 120 ",
            "--seed 3 --out ", data.string()),
        &status);
    ASSERT_EQ(status, 0) << made;
    std::string toml = test_support::tiny_post_toml(
        files.dir / objective, files.model_file, files.tokenizer_path, 4,
        cat("[eval]\ninterval = 2\n\n[lora]\nrank = 4\ndropout = 0.1\n\n[", objective,
            "]\ndata = \"", data.string(),
            "\"\nvalidation_fraction = 0.1\nbatch_pairs = 6\nmicro_batch_pairs = 2\n"));
    toml.replace(toml.find("threads = 2"), 11, "threads = 1");
    toml.replace(toml.find("lr = 3e-3"), 9, "lr = 1e-4");
    const fs::path config = files.dir / (objective + ".toml");
    write_file_atomic(config, toml);
    std::string out;
    const fs::path one = files.dir / (objective + "-one"), two = files.dir / (objective + "-two");
    ASSERT_EQ(post(objective, config, 1, one, "", &out), 0) << out;
    ASSERT_EQ(post(objective, config, 2, two, "", &out), 0) << out;
    ASSERT_EQ(values(one, "loss").size(), 4u) << objective;
    expect_close(values(two, "loss"), values(one, "loss"), objective + " train loss", 1e-4);
    expect_close(values(two, "val_loss"), values(one, "val_loss"), objective + " held-out loss",
                 1e-4);
    const char* metric = objective == "dpo" ? "dpo/rewards/margins" : "rm/accuracy";
    expect_close(values(two, metric), values(one, metric), objective + " " + metric, 1e-4);
    EXPECT_EQ(records(two, "loss").back()["tokens"], records(one, "loss").back()["tokens"]);
    // The adapters' B (zero at the start): 4 steps' moves, the same to float rounding.
    EXPECT_LT(relative_b_difference(two, one), 1e-4) << objective;
    // ZeRO-1, a reward model's score head among the sharded parameters: the same run.
    const fs::path zero = files.dir / (objective + "-zero");
    ASSERT_EQ(post(objective, config, 2, zero, "--set parallel.zero=1", &out), 0) << out;
    expect_close(values(zero, "loss"), values(one, "loss"), objective + " train loss, ZeRO-1",
                 1e-4);
    expect_close(values(zero, metric), values(one, metric), objective + " " + metric + ", ZeRO-1",
                 1e-4);
    EXPECT_LT(relative_b_difference(zero, one), 1e-4) << objective << ", ZeRO-1";
  }
  EXPECT_TRUE(fs::exists(files.dir / "rm-two/reward_model/config.json"));
}

// A reward model never uses the LM head: under several ranks, as in one process, it stays as it
// was, weight decay or not (a reduced zero gradient would have let AdamW decay it).
TEST(PreferenceRanks, ARewardModelLeavesTheUnusedHeadAloneUnderRanks) {
  const auto files = test_support::make_post_files("rm_head_ranks");
  const fs::path data = files.dir / "rm.jsonl";
  int status = 0;
  const std::string made = pollen::testing::run_capture(
      cat(POLLEN_BINARY, " rm synth --task arithmetic --digits 1 --count 60 --seed 3 --out ",
          data.string()),
      &status);
  ASSERT_EQ(status, 0) << made;
  std::string toml = test_support::tiny_post_toml(
      files.dir / "rm", files.model_file, files.tokenizer_path, 2,
      cat("[optimizer]\nweight_decay = 0.5\n\n[rm]\ndata = \"", data.string(),
          "\"\nvalidation_fraction = 0.1\nbatch_pairs = 4\nmicro_batch_pairs = 2\n"));
  toml.replace(toml.find("threads = 2"), 11, "threads = 1");
  toml.erase(toml.find("[optimizer]\nlr = 3e-3\n"), 21);  // one [optimizer] table
  toml.replace(toml.find("[optimizer]\nweight_decay"), 11, "[optimizer]\nlr = 3e-3");
  write_file_atomic(files.dir / "rm.toml", toml);
  std::string out;
  ASSERT_EQ(post("rm", files.dir / "rm.toml", 1, files.dir / "one", "", &out), 0) << out;
  ASSERT_EQ(post("rm", files.dir / "rm.toml", 2, files.dir / "two", "", &out), 0) << out;
  auto head = [](const fs::path& run) {
    const auto f = io::read_safetensors(io::list_checkpoints(run / "checkpoints").back() /
                                        "model.safetensors");
    const Tensor* t = f.find("lm_head.weight");
    EXPECT_NE(t, nullptr);
    return t ? t->to_doubles() : std::vector<double>{};
  };
  const std::vector<double> one = head(files.dir / "one"), two = head(files.dir / "two");
  ASSERT_FALSE(one.empty());
  EXPECT_EQ(one, two) << "the 2-rank run moved the head the reward model does not use";
}

// GRPO on a random tiny model with a regex verifier (a completion holding a digit scores 1), so
// that groups disagree and the policy moves: 12 completions a batch (2 ranks sample 6 each), 3
// micro-batches (2 ranks run 2 and 1), two updates per batch (the old policy's log-probabilities
// are split and gathered too), a KL term to the base model, LoRA with dropout. The samples, the
// rewards, the losses and the adapters equal one process's, and one process resumes the 2-rank
// run's checkpoint.
TEST(GrpoRanks, TwoRanksSampleAndTrainAsOneProcessAndResumeAsOne) {
  const auto files = test_support::make_post_files("grpo_ranks");
  int status = 0;
  for (const auto& [name, count, seed] :
       {std::tuple{"prompts", 16, 2}, std::tuple{"held-out", 6, 3}}) {
    const std::string made = pollen::testing::run_capture(
        cat(POLLEN_BINARY, " grpo synth --task arithmetic --digits 1 --count ", count, " --seed ",
            seed, " --out ", (files.dir / (std::string(name) + ".jsonl")).string()),
        &status);
    ASSERT_EQ(status, 0) << made;
  }
  std::string toml = test_support::tiny_post_toml(
      files.dir / "run", files.model_file, files.tokenizer_path, 4,
      cat("[eval]\ninterval = 2\n\n[lora]\nrank = 4\ndropout = 0.1\n\n[grpo]\ndata = \"",
          (files.dir / "prompts.jsonl").string(), "\"\neval_data = \"",
          (files.dir / "held-out.jsonl").string(),
          "\"\ngroup_size = 4\nprompts_per_step = 3\nmicro_batch = 5\nupdates_per_batch = 2\n"
          "max_completion_tokens = 8\nbeta = 0.05\n\n[grpo.verifier]\nkind = \"regex\"\n"
          "pattern = \"[0-9]\"\n"));
  toml.replace(toml.find("threads = 2"), 11, "threads = 1");
  const fs::path config = files.dir / "grpo.toml";
  write_file_atomic(config, toml);
  std::string out;
  const fs::path one = files.dir / "one", two = files.dir / "two";
  ASSERT_EQ(post("grpo", config, 1, one, "", &out), 0) << out;
  ASSERT_EQ(post("grpo", config, 2, two, "", &out), 0) << out;
  const std::vector<double> rewards = values(one, "grpo/reward");
  ASSERT_EQ(rewards.size(), 4u);
  // Neither all right nor all wrong: the advantages are not all zero.
  EXPECT_GT(*std::max_element(rewards.begin(), rewards.end()), 0.0);
  EXPECT_LT(*std::min_element(rewards.begin(), rewards.end()), 1.0);
  EXPECT_EQ(values(two, "grpo/reward"), rewards) << "2 ranks sampled other completions";
  EXPECT_EQ(values(two, "grpo/completion_length"), values(one, "grpo/completion_length"));
  expect_close(values(two, "loss"), values(one, "loss"), "grpo loss, 2 ranks", 1e-4);
  expect_close(values(two, "grpo/kl"), values(one, "grpo/kl"), "grpo kl, 2 ranks", 1e-4);
  expect_close(values(two, "val_loss"), values(one, "val_loss"), "held-out reward, 2 ranks");
  EXPECT_EQ(records(two, "loss").back()["tokens"], records(one, "loss").back()["tokens"]);
  EXPECT_LT(relative_b_difference(two, one), 1e-4);
  const fs::path zero = files.dir / "zero";
  ASSERT_EQ(post("grpo", config, 2, zero, "--set parallel.zero=1", &out), 0) << out;
  EXPECT_EQ(values(zero, "grpo/reward"), rewards) << "ZeRO-1";
  EXPECT_LT(relative_b_difference(zero, one), 1e-4) << "ZeRO-1";

  for (const auto& c : io::list_checkpoints(two / "checkpoints"))
    if (io::checkpoint_step(c) > 2) fs::remove_all(c);
  fs::remove(two / "summary.json");
  ASSERT_EQ(post("grpo", config, 1, two, "--resume", &out), 0) << out;
  EXPECT_EQ(values(two, "grpo/reward"), rewards) << "resumed by 1 process";
  EXPECT_LT(relative_b_difference(two, one), 1e-4);
}
