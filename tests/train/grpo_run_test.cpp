// GRPO through the post-training loop: a run whose [grpo] section has a nested [grpo.verifier]
// table resumes from its checkpoint; end to end, a model taught the "#### ANSWER" format by SFT
// gains reward on a fixed set of 8 sums under GRPO, against the same run at learning rate 0.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <fstream>

#include "base/files.h"
#include "io/checkpoint.h"
#include "io/model_source.h"
#include "train/grpo.h"
#include "train/post_config.h"
#include "train/post_fixtures.h"
#include "train/post_run.h"
#include "train/sft.h"

namespace fs = std::filesystem;
using namespace pollen;

namespace {

struct GrpoRunFiles : test_support::PostFiles {
  fs::path prompts;
};

GrpoRunFiles grpo_run_files(const std::string& name) {
  GrpoRunFiles f{test_support::make_post_files(name), {}};
  f.prompts = f.dir / "prompts.jsonl";
  std::ofstream out(f.prompts);
  for (const auto& e : train::synth_examples("arithmetic", 16, 5))
    out << train::grpo_jsonl_line(e) << "\n";
  return f;
}

train::PostResult run_grpo(const std::string& text, bool resume, int64_t stop_after = -1) {
  const train::PostConfig c = train::parse_post_config(text, "grpo.toml", "grpo");
  return test_support::run_post(
      c,
      [&](const train::ObjectiveContext& context) {
        return train::make_grpo_objective(context, c.base);
      },
      resume, stop_after);
}

// Strings that open with a line break (GRPO's stop strings) keep it however often the run file
// is written back: by --set, and into the objective's section. toml++ would write them as
// multi-line literals, where TOML drops the first line break.
TEST(GrpoRun, StopStringsThatOpenWithALineBreakKeepIt) {
  const GrpoRunFiles f = grpo_run_files("grpo_stop_newline");
  const std::string section =
      "[grpo]\ndata = \"" + f.prompts.string() + "\"\nstop = [\"\\n\\nQ:\", \"\\n\", \" =\"]\n";
  const std::string text =
      test_support::tiny_post_toml(f.dir / "run", f.model_file, f.tokenizer_path, 4, section);
  for (const std::vector<std::string>& overrides :
       {std::vector<std::string>{}, std::vector<std::string>{"grpo.group_size=2"}}) {
    const train::PostConfig c = train::parse_post_config(text, "run.toml", "grpo", overrides);
    ConfigTable grpo = c.objective_section();
    EXPECT_EQ(grpo.get_strings("stop"), (std::vector<std::string>{"\n\nQ:", "\n", " ="}))
        << c.objective_text;
  }
}

TEST(GrpoRun, ResumesARunWhoseSectionHasANestedVerifierTable) {
  const GrpoRunFiles f = grpo_run_files("grpo_resume");
  const std::string section = "[grpo]\ndata = \"" + f.prompts.string() +
                              "\"\ngroup_size = 2\nprompts_per_step = 2\nmicro_batch = 4\n"
                              "max_completion_tokens = 6\n\n[grpo.verifier]\nkind = \"numeric\"\n"
                              "abs_tol = 0.5\n";
  const fs::path run_dir = f.dir / "run";
  const std::string text =
      test_support::tiny_post_toml(run_dir, f.model_file, f.tokenizer_path, 4, section);
  const train::PostResult first = run_grpo(text, false, 2);
  ASSERT_FALSE(first.last_checkpoint.empty());
  // The checkpoint's resolved config holds the nested table as dotted keys and reads back.
  const train::PostConfig saved =
      train::load_post_config(first.last_checkpoint / "config.toml", "grpo");
  ConfigTable saved_section = saved.objective_section();
  auto verifier = saved_section.table("verifier");
  ASSERT_TRUE(verifier.has_value());
  EXPECT_EQ(verifier->get_string("kind", ""), "numeric");
  EXPECT_EQ(verifier->get_double("abs_tol", 0), 0.5);

  const train::PostResult resumed = run_grpo(text, true);
  EXPECT_EQ(resumed.status, train::RunStatus::finished) << resumed.message;
  // The error of resuming a copy of the run (in `dir`) with `grpo` keys before its verifier's and
  // `verifier` keys.
  const auto resume_error = [&](const std::string& dir, const std::string& grpo,
                                const std::string& verifier) {
    const std::string text = test_support::tiny_post_toml(
        f.dir / dir, f.model_file, f.tokenizer_path, 4,
        "[grpo]\ndata = \"" + f.prompts.string() +
            "\"\ngroup_size = 2\nprompts_per_step = 2\nmicro_batch = 4\n"
            "max_completion_tokens = 6\n" +
            grpo + "\n[grpo.verifier]\nkind = \"numeric\"\n" + verifier);
    fs::copy(run_dir, f.dir / dir, fs::copy_options::recursive);
    try {
      run_grpo(text, true);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  // A changed verifier is a changed objective: the resumed run refuses it, naming the key.
  std::string error = resume_error("run2", "", "abs_tol = 0.25\n");
  EXPECT_NE(error.find("grpo.verifier.abs_tol (0.5 -> 0.25)"), std::string::npos) << error;
  // So is a key added: named alone, not both sections in full.
  error = resume_error("run3", "temperature = 0.5\n", "abs_tol = 0.5\n");
  EXPECT_NE(error.find("differs from the checkpoint's: grpo.temperature added (= 0.5); "),
            std::string::npos)
      << error;
  fs::remove_all(f.dir);
}

// A checkpoint's batches index the prompts of the run's data: resuming on other prompts (which
// the index range check alone lets through when the count is unchanged) is refused.
TEST(GrpoRun, AResumeOnChangedPromptsIsRefused) {
  const GrpoRunFiles f = grpo_run_files("grpo_resume_data");
  const std::string text = test_support::tiny_post_toml(
      f.dir / "run", f.model_file, f.tokenizer_path, 4,
      "[grpo]\ndata = \"" + f.prompts.string() +
          "\"\ngroup_size = 2\nprompts_per_step = 2\nmicro_batch = 4\nmax_completion_tokens = 6\n");
  ASSERT_EQ(run_grpo(text, false, 2).status, train::RunStatus::preempted);
  {
    std::ofstream out(f.prompts);
    for (const auto& e : train::synth_examples("arithmetic", 16, 6))
      out << train::grpo_jsonl_line(e) << "\n";
  }
  std::string error;
  try {
    run_grpo(text, true);
  } catch (const std::exception& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("cannot resume"), std::string::npos) << error;
  EXPECT_NE(error.find("grpo.data '" + f.prompts.string() + "'"), std::string::npos) << error;
  fs::remove_all(f.dir);
}

// grpo.reference naming a run folder stands for the checkpoint that was its newest when the run
// began: a resumed run keeps that KL reference, although the folder has moved on since, and so
// continues the uninterrupted run.
TEST(GrpoRun, AReferenceRunFolderIsPinnedToTheCheckpointTheRunBeganWith) {
  const GrpoRunFiles f = grpo_run_files("grpo_pinned_reference");
  const std::string section = "[grpo]\ndata = \"" + f.prompts.string() +
                              "\"\ngroup_size = 2\nprompts_per_step = 2\nmicro_batch = 4\n"
                              "max_completion_tokens = 4\n";
  // The reference: an SFT run (its weights move every step), its newest checkpoint step 2.
  const fs::path sft_data = test_support::write_sft_data(f.dir / "sft.jsonl", "arithmetic", 40, 1);
  const train::PostConfig reference_run = train::parse_post_config(
      test_support::tiny_post_toml(f.dir / "ref", f.model_file, f.tokenizer_path, 4,
                                   "[sft]\ndata = \"" + sft_data.string() + "\"\nseq = 64\n"),
      "ref.toml", "sft");
  ASSERT_EQ(test_support::run_post(reference_run, train::make_sft_objective, false, 2).status,
            train::RunStatus::preempted);
  const std::string with_kl =
      section + "beta = 0.1\nreference = \"" + (f.dir / "ref").string() + "\"\n";
  const train::PostResult whole = run_grpo(
      test_support::tiny_post_toml(f.dir / "whole", f.model_file, f.tokenizer_path, 4, with_kl),
      false);
  ASSERT_EQ(whole.status, train::RunStatus::finished) << whole.message;
  const std::string split =
      test_support::tiny_post_toml(f.dir / "split", f.model_file, f.tokenizer_path, 4, with_kl);
  ASSERT_EQ(run_grpo(split, false, 2).status, train::RunStatus::preempted);
  ASSERT_EQ(test_support::run_post(reference_run, train::make_sft_objective, true).status,
            train::RunStatus::finished);  // its newest is now step 4
  const train::PostResult resumed = run_grpo(split, true);
  ASSERT_EQ(resumed.status, train::RunStatus::finished) << resumed.message;

  const auto a = test_support::read_metrics(f.dir / "whole"),
             b = test_support::read_metrics(f.dir / "split");
  ASSERT_EQ(a.size(), b.size());
  int steps_with_kl = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].contains("grpo/kl")) {
      EXPECT_EQ(a[i]["grpo/kl"].dump(), b[i]["grpo/kl"].dump()) << i;
      ++steps_with_kl;
    }
  }
  EXPECT_EQ(steps_with_kl, 4);
  const auto state = nlohmann::json::parse(read_file(resumed.last_checkpoint / "state.json"));
  EXPECT_EQ(fs::path(state["objective"].value("reference", "")).filename(), io::checkpoint_name(2));
  fs::remove_all(f.dir);
}

// GRPO's loss is about 0 by construction: the run's lines and summary show the reward instead,
// and a held-out reward of 0 is 0 in the summary, not -0.
TEST(GrpoRun, SummaryShowsTheRewardAndNoNegativeZero) {
  const GrpoRunFiles f = grpo_run_files("grpo_summary");
  const std::string section = "[grpo]\ndata = \"" + f.prompts.string() + "\"\neval_data = \"" +
                              f.prompts.string() +
                              "\"\neval_prompts = 2\ngroup_size = 2\nprompts_per_step = 2\n"
                              "micro_batch = 4\nmax_completion_tokens = 4\n";
  const std::string text =
      test_support::tiny_post_toml(f.dir / "run", f.model_file, f.tokenizer_path, 1, section);
  const train::PostResult r = run_grpo(text, false);
  ASSERT_EQ(r.status, train::RunStatus::finished) << r.message;
  // An untrained model answers no sum in 4 tokens.
  EXPECT_EQ(r.last_val_metrics["reward"].get<double>(), 0.0);
  EXPECT_FALSE(std::signbit(r.last_val_loss));
  EXPECT_NE(r.message.find(": reward "), std::string::npos) << r.message;
  EXPECT_NE(r.message.find(", validation reward 0, "), std::string::npos) << r.message;
  EXPECT_EQ(r.message.find("loss"), std::string::npos) << r.message;
  const auto summary = nlohmann::json::parse(read_file(f.dir / "run/summary.json"));
  EXPECT_FALSE(std::signbit(summary["val_loss"].get<double>())) << summary.dump();

  // A run stopped between its last checkpoint and its summary writes the summary on --resume
  // from what that checkpoint recorded: the same losses and metrics.
  fs::remove(f.dir / "run/summary.json");
  const train::PostResult again = run_grpo(text, true);
  ASSERT_EQ(again.status, train::RunStatus::finished) << again.message;
  EXPECT_NE(again.message.find(", validation reward 0, "), std::string::npos) << again.message;
  auto rewritten = nlohmann::json::parse(read_file(f.dir / "run/summary.json"));
  for (const char* varies : {"elapsed_s", "peak_rss_mb"}) {
    ASSERT_TRUE(rewritten.contains(varies)) << rewritten.dump();
    rewritten[varies] = summary[varies];
  }
  EXPECT_EQ(rewritten, summary);
  fs::remove_all(f.dir);
}

// A run that takes its chat template from its base (no model.chat_template) names it in its
// checkpoints all the same, so that chat and serve on its result find it; it resumes.
TEST(GrpoRun, ACheckpointNamesTheChatTemplateItsBaseGave) {
  const GrpoRunFiles f = grpo_run_files("grpo_template");
  const std::string section = "[grpo]\ndata = \"" + f.prompts.string() +
                              "\"\ngroup_size = 2\nprompts_per_step = 1\nmicro_batch = 2\n"
                              "max_completion_tokens = 2\n";
  ASSERT_EQ(run_grpo(test_support::tiny_post_toml(f.dir / "first", f.model_file, f.tokenizer_path,
                                                  1, section),
                     false)
                .status,
            train::RunStatus::finished);
  std::string text =
      test_support::tiny_post_toml(f.dir / "second", f.dir / "first", f.tokenizer_path, 2, section);
  const std::string named = "chat_template = \"chatml\"\n";
  ASSERT_NE(text.find(named), std::string::npos);
  text.erase(text.find(named), named.size());
  ASSERT_EQ(run_grpo(text, false, 1).status, train::RunStatus::preempted);
  EXPECT_EQ(io::resolve_model((f.dir / "second").string()).chat_template,
            std::optional<std::string>("chatml"));
  EXPECT_EQ(run_grpo(text, true).status, train::RunStatus::finished);
  fs::remove_all(f.dir);
}

// --- end to end: SFT teaches the format, GRPO raises the reward ------------------------------

// Sums of single digits, in the synthetic arithmetic task's format.
std::vector<train::SynthExample> single_digit_sums() {
  std::vector<train::SynthExample> out;
  for (int a = 0; a < 10; ++a)
    for (int b = 0; b < 10; ++b) {
      const std::string expr = std::to_string(a) + " + " + std::to_string(b);
      const std::string answer = std::to_string(a + b);
      out.push_back({"What is " + expr + "?", expr + " = " + answer + "\n#### " + answer, answer});
    }
  return out;
}

std::vector<double> step_rewards(const fs::path& run_dir) {
  std::vector<double> out;
  std::ifstream in(run_dir / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("grpo/reward")) out.push_back(j["grpo/reward"].get<double>());
  }
  return out;
}

TEST(GrpoRun, AfterSftRaisesTheRewardBeyondTheSameRunAtLearningRateZero) {
  const GrpoRunFiles f = grpo_run_files("grpo_e2e");
  const std::vector<train::SynthExample> examples = single_digit_sums();
  {
    std::ofstream sft(f.dir / "sft.jsonl"), prompts(f.dir / "sums.jsonl");
    for (const auto& e : examples) sft << train::sft_jsonl_line(e) << "\n";
    const int n = 8;
    for (int i = 0; i < n; ++i) prompts << train::grpo_jsonl_line(examples[(i * 37) % 100]) << "\n";
  }
  train::PostOptions quiet;
  quiet.quiet = true;
  quiet.handle_signals = false;
  const auto t0 = std::chrono::steady_clock::now();
  const std::string sft_text =
      test_support::tiny_post_toml(
          f.dir / "sft", f.model_file, f.tokenizer_path, 400,
          "[sft]\ndata = \"" + (f.dir / "sft.jsonl").string() +
              "\"\nvalidation_fraction = 0.0\nseq = 64\nmicro_batch = 8\n") +
      "";
  ASSERT_EQ(
      train::run_post_training(train::parse_post_config(sft_text, "sft.toml", "sft",
                                                        {"optimizer.lr=" + std::string("3e-3"),
                                                         "checkpoint.interval=0"}),
                               quiet, train::make_sft_objective)
          .status,
      train::RunStatus::finished);
  const auto t1 = std::chrono::steady_clock::now();
  auto grpo_run = [&](const std::string& name, const std::string& lr) {
    const std::string text =
        "[run]\ndir = \"" + (f.dir / name).string() +
        "\"\nseed = 3\nthreads = 2\n\n[model]\nbase = \"" + (f.dir / "sft").string() +
        "\"\n\n[train]\nsteps = " + "60" + "\n\n[optimizer]\nlr = " + lr +
        "\n\n[schedule]\nkind = \"constant\"\n\n[metrics]\ntensorboard = false\n\n"
        "[grpo]\ndata = \"" +
        (f.dir / "sums.jsonl").string() + "\"\ngroup_size = 8\nprompts_per_step = " + "8" +
        "\nmicro_batch = 64\nmax_completion_tokens = 12\n";
    const train::PostConfig c = train::parse_post_config(text, "grpo.toml", "grpo");
    const train::PostResult r = train::run_post_training(
        c, quiet,
        [&](const train::ObjectiveContext& x) { return train::make_grpo_objective(x, c.base); });
    EXPECT_EQ(r.status, train::RunStatus::finished) << r.message;
    return step_rewards(f.dir / name);
  };
  // At 1e-3 every seed tried (1-5, with and without AVX-512) ends at 0.42-0.53 against 0.17-0.20
  // frozen; at 3e-3 the policy collapses on most seeds (late reward 0-0.12).
  const std::vector<double> trained = grpo_run("grpo", "1e-3");
  const auto t2 = std::chrono::steady_clock::now();
  const std::vector<double> frozen = grpo_run("frozen", "0");
  // Same prompts, same random streams: at lr 0 every step samples from the SFT model.
  ASSERT_EQ(trained.size(), 60u);
  ASSERT_EQ(frozen.size(), 60u);
  double late_trained = 0, late_frozen = 0;
  for (size_t i = 50; i < 60; ++i) {
    late_trained += trained[i] / 10;
    late_frozen += frozen[i] / 10;
  }
  std::printf(
      "mean reward over steps 51-60: lr 1e-3 %.4f, lr 0 %.4f (step 1: %.4f); sft %.1f s, "
      "grpo %.1f s\n",
      late_trained, late_frozen, trained[0], std::chrono::duration<double>(t1 - t0).count(),
      std::chrono::duration<double>(t2 - t1).count());
  EXPECT_GT(late_trained, late_frozen + 0.15);
  fs::remove_all(f.dir);
}

}  // namespace
