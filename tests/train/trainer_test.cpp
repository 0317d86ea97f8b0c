// The trainer: schedules, the run file, gradient accumulation, overfitting a tiny dataset,
// bitwise resume (in process and across a SIGKILLed process), corrupt checkpoints, NaN stops,
// text samples at each evaluation, and `pollen eval --run` over every checkpoint of a run.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <toml++/toml.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <thread>

#include "autograd/tape.h"
#include "base/folder_lock.h"
#include "base/hash.h"
#include "base/log.h"
#include "base/thread_pool.h"
#include "io/checkpoint.h"
#include "obs/metrics.h"
#include "optim/schedule.h"
#include "support/process.h"
#include "tokenizer/open.h"
#include "tokenizer/trainer.h"
#include "train/config.h"
#include "train/run_checks.h"
#include "train/run_eval.h"
#include "train/tiny_run.h"
#include "train/trainer.h"

namespace fs = std::filesystem;
using namespace pollen;

namespace {

fs::path temp_dir(const std::string& name) {
  return test_support::fresh_temp_dir("train_" + name);
}

const fs::path& dataset() {
  static const fs::path m = test_support::make_tiny_dataset(temp_dir("data"));
  return m;
}

using test_support::error_of;
using test_support::read_metrics;

// (step, loss) of every training record, and every validation loss, as exact text.
std::vector<std::string> losses(const fs::path& run) {
  std::vector<std::string> out;
  for (const auto& j : read_metrics(run)) {
    if (j.contains("loss")) out.push_back("train " + j["step"].dump() + " " + j["loss"].dump());
    if (j.contains("val_loss"))
      out.push_back("val " + j["step"].dump() + " " + j["val_loss"].dump());
  }
  return out;
}

std::string final_weights(const fs::path& run, int64_t step) {
  const fs::path c = run / "checkpoints" / io::checkpoint_name(step);
  return sha256_file(c / "model.safetensors") + sha256_file(c / "optimizer.safetensors");
}

train::TrainConfig tiny(const fs::path& run, int steps, std::vector<std::string> sets = {}) {
  return train::parse_train_config(test_support::tiny_run_toml(run, dataset(), steps), "tiny.toml",
                                   sets);
}

using test_support::train_quiet;

}  // namespace

TEST(Schedule, DocumentedShapes) {
  optim::Schedule s;
  s.lr = 1.0;
  s.min_lr = 0.1;
  s.warmup_steps = 10;
  s.total_steps = 110;
  for (auto kind : {optim::ScheduleKind::constant, optim::ScheduleKind::cosine,
                    optim::ScheduleKind::linear, optim::ScheduleKind::wsd}) {
    s.kind = kind;
    EXPECT_DOUBLE_EQ(optim::lr_at(s, 0), 0.1);  // warmup: (step + 1) / warmup
    EXPECT_DOUBLE_EQ(optim::lr_at(s, 4), 0.5);
    EXPECT_DOUBLE_EQ(optim::lr_at(s, 9), 1.0);
    EXPECT_DOUBLE_EQ(optim::lr_at(s, 10), 1.0);  // peak right after warmup
    const double end = optim::lr_at(s, 109);
    EXPECT_NEAR(end, kind == optim::ScheduleKind::constant ? 1.0 : 0.1, 1e-12);
    for (int64_t t = 10; t < 109; ++t)
      EXPECT_LE(optim::lr_at(s, t + 1), optim::lr_at(s, t) + 1e-15) << "monotone after warmup";
  }
  s.kind = optim::ScheduleKind::cosine;  // halfway: the mean of lr and min_lr
  s.total_steps = 111;
  EXPECT_NEAR(optim::lr_at(s, 60), 0.55, 1e-12);
  // A quarter of the way (25 of the 100 steps from 10 to 110), where cosine and linear part:
  // 0.1 + 0.9 * (1 + cos(pi / 4)) / 2 against 1 - 0.9 / 4.
  EXPECT_NEAR(optim::lr_at(s, 35), 0.1 + 0.45 * (1 + std::sqrt(0.5)), 1e-12);
  s.kind = optim::ScheduleKind::linear;
  EXPECT_NEAR(optim::lr_at(s, 60), 0.55, 1e-12);
  EXPECT_NEAR(optim::lr_at(s, 35), 0.775, 1e-12);
  s.kind = optim::ScheduleKind::wsd;  // stable until the last 20% of steps, then linear
  s.total_steps = 110;
  EXPECT_DOUBLE_EQ(optim::lr_at(s, 87), 1.0);
  EXPECT_LT(optim::lr_at(s, 88), 1.0);
  EXPECT_NEAR(optim::lr_at(s, 98), 0.55, 1e-12);
  EXPECT_NEAR(optim::lr_at(s, 92), 1 - 0.9 * 5 / 22, 1e-12);  // 5 of the 22 decaying steps
  EXPECT_THROW(optim::parse_schedule_kind("exp"), Error);
}

// Runs too short for the general rule: one step after warmup trains at the peak (a one-step run
// at the default min_lr 0 would change nothing), and WSD decays over at least one step.
TEST(Schedule, ShortRuns) {
  optim::Schedule s;
  s.lr = 1.0;
  s.min_lr = 0.0;
  for (auto kind :
       {optim::ScheduleKind::cosine, optim::ScheduleKind::linear, optim::ScheduleKind::wsd}) {
    s.kind = kind;
    s.warmup_steps = 0;
    s.total_steps = 1;
    EXPECT_DOUBLE_EQ(optim::lr_at(s, 0), 1.0);
    s.warmup_steps = 10;
    s.total_steps = 11;
    EXPECT_DOUBLE_EQ(optim::lr_at(s, 10), 1.0);
  }
  s.kind = optim::ScheduleKind::wsd;
  s.warmup_steps = 0;
  s.total_steps = 2;
  EXPECT_DOUBLE_EQ(optim::lr_at(s, 0), 1.0);
  EXPECT_DOUBLE_EQ(optim::lr_at(s, 1), 0.0);
}

// A run file named by a relative path (pollen train --config run.toml) resolves its paths to
// absolute ones: the run folder's config.toml, which generate, serve, export and eval --run read
// from wherever they run, names the data and the warm-up it used.
TEST(TrainConfig, PathsOfARunFileGivenRelativelyBecomeAbsolute) {
  const fs::path dir = temp_dir("relative_run_file");
  write_file_atomic(dir / "run.toml",
                    "[run]\ndir = 'runs/x'\n[model]\npreset = 'llama-tiny'\ninit_from = 'w'\n"
                    "[data]\nmanifests = ['../data/manifest.json']\n[train]\nsteps = 1\n");
  const fs::path relative = fs::relative(dir / "run.toml", fs::current_path());
  ASSERT_TRUE(relative.is_relative());
  const train::TrainConfig c = train::load_train_config(relative, {});
  EXPECT_EQ(c.manifests[0], (dir.parent_path() / "data" / "manifest.json").string());
  EXPECT_EQ(c.dir, dir / "runs" / "x");
  EXPECT_EQ(c.init_from, (dir / "w").string());
  // run.dir left out: runs/<name> in the current folder, recorded as absolute too.
  write_file_atomic(dir / "run.toml",
                    "[model]\npreset = 'llama-tiny'\n[data]\nmanifests = ['m.json']\n"
                    "[train]\nsteps = 1\n");
  EXPECT_EQ(train::load_train_config(relative, {}).dir, fs::current_path() / "runs" / "run");
  fs::remove_all(dir);
}

TEST(TrainConfig, ErrorsNameFileKeyAndType) {
  const std::string base = test_support::tiny_run_toml("/tmp/x", dataset(), 5);
  auto err = [&](const std::string& text, std::vector<std::string> sets = {}) {
    return error_of([&] { train::parse_train_config(text, "run.toml", sets); });
  };
  std::string e = err(base + "[extra]\nlr = 1\n");
  EXPECT_NE(e.find("run.toml"), std::string::npos) << e;
  EXPECT_NE(e.find("'extra'"), std::string::npos) << e;
  e = err(base, {"optimizer.lrr=0.1"});
  EXPECT_NE(e.find("'optimizer.lrr'"), std::string::npos) << e;
  e = err(base, {"train.steps=\"ten\""});
  EXPECT_NE(e.find("train.steps"), std::string::npos) << e;
  EXPECT_NE(e.find("expected an integer"), std::string::npos) << e;
  e = err(base, {"train.batch_tokens=100"});
  EXPECT_NE(e.find("multiple of micro_batch"), std::string::npos) << e;
  // A model file holds the whole architecture: a key beside it is named as such, not unknown.
  e = err(base, {"model.file=\"m.toml\""});
  EXPECT_NE(e.find("key 'model."), std::string::npos) << e;
  EXPECT_NE(e.find("model.file holds the whole architecture"), std::string::npos) << e;
  // A misspelt key beside it is still named as unknown.
  std::string with_file = base;
  const std::string vocab = "[model]\nvocab_size = 64\n";
  ASSERT_NE(with_file.find(vocab), std::string::npos);
  with_file.replace(with_file.find(vocab), vocab.size(), "[model]\nfile = \"m.toml\"\n");
  e = err(with_file.substr(0, with_file.find("hidden_size")) + "init_form = \"x\"\n" +
          with_file.substr(with_file.find("[data]")));
  EXPECT_NE(e.find("unknown key 'model.init_form'"), std::string::npos) << e;
  // micro_batch * seq would wrap to 0 and divide by it
  e = err(base, {"train.micro_batch=4611686018427387904", "train.batch_tokens=8"});
  EXPECT_NE(e.find("train.micro_batch"), std::string::npos) << e;
  EXPECT_NE(e.find("1 to 2^24"), std::string::npos) << e;
  // an embedding of 2^60 x 4 would wrap its byte count to 0 and be written past its end
  e = err(base, {"model.vocab_size=1152921504606846976"});
  EXPECT_NE(e.find("vocab_size must be 1 to 2^24"), std::string::npos) << e;
  // TOML's spaces around '=' belong to neither key nor value.
  EXPECT_EQ(train::parse_train_config(base, "run.toml", {"train.steps = 7"}).steps, 7);
  e = err(base, {" = 7"});
  EXPECT_NE(e.find("expected key=value"), std::string::npos) << e;
  // A folder given as the run file is named as one, not read as an empty config.
  e = error_of([&] { train::load_train_config(fs::temp_directory_path()); });
  EXPECT_NE(e.find("is a folder; expected a TOML run file"), std::string::npos) << e;
  e = err(base, {"schedule.kind=exp"});
  EXPECT_NE(e.find("unknown schedule 'exp'"), std::string::npos) << e;
  EXPECT_NE(e.find("config file 'run.toml with schedule.kind set', key 'schedule.kind'"),
            std::string::npos)
      << e;
  // A manifest that does not exist is named by its key, before any work.
  e = error_of([&] {
    train::check_manifests_exist(
        train::parse_train_config(base, "run.toml", {"data.manifests=[\"/nope/m.json\"]"}),
        "run.toml");
  });
  EXPECT_NE(e.find("config file 'run.toml', key 'data.manifests': '/nope/m.json' does not exist"),
            std::string::npos)
      << e;
  EXPECT_NO_THROW(train::check_manifests_exist(train::parse_train_config(base, "run.toml"), ""));
  e = err(base, {"model.preset=\"llama-huge\""});
  EXPECT_NE(e.find("key 'model.preset': unknown model preset 'llama-huge'"), std::string::npos)
      << e;
  e = err(base, {"model.hidden_sise=8"});
  EXPECT_NE(e.find("model.hidden_sise"), std::string::npos) << e;
  // A number past 64 bits is not taken for the text it is; a bare word still is.
  e = err(base, {"train.steps=9999999999999999999"});
  EXPECT_NE(e.find("--set 'train.steps=9999999999999999999': the value is not a number"),
            std::string::npos)
      << e;
  EXPECT_EQ(train::parse_train_config(base, "run.toml", {"run.name=7b-run"}).name, "7b-run");
  for (const std::string word : {"1.5.0", "E2", "2-1", "e5", "1e"})
    EXPECT_EQ(train::parse_train_config(base, "run.toml", {"run.name=" + word}).name, word);

  // --set overrides, the resolved config round-trips, and resume refuses changed keys.
  const auto c =
      train::parse_train_config(base, "run.toml", {"train.steps=9", "optimizer.lr=0.01"});
  EXPECT_EQ(c.steps, 9);
  EXPECT_EQ(c.accumulation(), 2);
  const auto again = train::parse_train_config(c.to_toml(), "resolved.toml");
  EXPECT_EQ(again.flat(), c.flat());
  auto changed = c;
  changed.steps = 20;
  changed.eval_interval = 3;
  EXPECT_EQ(train::check_resume_compatible(c, changed).size(), 1u);  // a warning for steps
  // A GPU run may continue on the CPU and back: warned, not refused.
  changed.device = "cuda";
  EXPECT_EQ(train::check_resume_compatible(c, changed).size(), 2u);
  // So may its precision: checkpoints hold f32 weights either way.
  changed.precision = "bf16";
  EXPECT_EQ(train::check_resume_compatible(c, changed).size(), 3u);
  // A thread count against an older checkpoint's 0 ("all", the count unknown): not warned of;
  // against a recorded count, warned of.
  auto all = c, two = c;
  all.threads = 0;
  two.threads = 2;
  EXPECT_TRUE(train::check_resume_compatible(all, two).empty());
  all.threads = 1;
  EXPECT_EQ(train::check_resume_compatible(all, two).size(), 1u);
  e = err(base, {"run.device=\"tpu\""});
  EXPECT_NE(e.find("run.device"), std::string::npos) << e;
  EXPECT_NE(e.find("expected \"cpu\" or \"cuda\""), std::string::npos) << e;
  e = err(base, {"run.precision=\"fp16\""});
  EXPECT_NE(e.find("run.precision"), std::string::npos) << e;
  EXPECT_NE(e.find("expected \"f32\" or \"bf16\""), std::string::npos) << e;
  // bf16 compute needs the GPU: refused on the CPU, naming both keys.
  e = err(base, {"run.precision=\"bf16\""});
  EXPECT_NE(e.find("run.precision = \"bf16\" needs run.device = \"cuda\""), std::string::npos) << e;
  // The rows of a forward may change (a step still trains on batch_tokens): warned.
  changed.micro_batch = c.micro_batch / 2;
  const auto warnings = train::check_resume_compatible(c, changed);
  ASSERT_EQ(warnings.size(), 4u);
  // Validation reads eval.batches micro-batches, now half as many windows: the warning says so
  // and how many batches keep the windows it scored.
  const std::string& halved = warnings.back();
  EXPECT_NE(halved.find(cat("validation now scores up to ", c.eval_batches * changed.micro_batch,
                            " windows against up to ", c.eval_batches * c.micro_batch,
                            " (--set eval.batches=", c.eval_batches * 2, " keeps them)")),
            std::string::npos)
      << halved;
  changed.eval_batches = c.eval_batches * 2;
  EXPECT_EQ(train::check_resume_compatible(c, changed).back().find("validation"),
            std::string::npos);
  // A sliding window or rope scaling added or removed changes the model's attention, though
  // the checkpoint's keys hold them only when set.
  auto windowed = c;
  windowed.model.sliding_window = 4;
  e = error_of([&] { train::check_resume_compatible(c, windowed); });
  EXPECT_NE(e.find("model.sliding_window (none -> 4)"), std::string::npos) << e;
  e = error_of([&] { train::check_resume_compatible(windowed, c); });
  EXPECT_NE(e.find("model.sliding_window (4 -> none)"), std::string::npos) << e;
  auto scaled = c;
  scaled.model.rope_scaling.kind = ops::RopeScaling::Kind::linear;
  scaled.model.rope_scaling.factor = 2.0;
  e = error_of([&] { train::check_resume_compatible(c, scaled); });
  EXPECT_NE(e.find("model.rope_scaling.kind (none -> \"linear\")"), std::string::npos) << e;
  changed.optimizer.lr = 0.5;
  changed.seq = 8;
  e = error_of([&] { train::check_resume_compatible(c, changed); });
  EXPECT_NE(e.find("optimizer.lr"), std::string::npos) << e;
  EXPECT_NE(e.find("train.seq"), std::string::npos) << e;
  EXPECT_NE(e.find("(see docs/training.md, 'Resuming')"), std::string::npos) << e;
}

// parallel.bucket_mb becomes whole bytes: below one f32 gradient it would be 0 bytes, and far
// above it the conversion overflows; both are refused naming the key and the range.
TEST(TrainConfig, GradientBucketSizeIsRefusedOutsideOneFloatTo4096MiB) {
  const std::string base = test_support::tiny_run_toml("/tmp/x", dataset(), 5);
  for (const char* bad : {"1e13", "4096.5", "1e-9", "3.8e-6"}) {
    const std::string e = error_of(
        [&] { train::parse_train_config(base, "run.toml", {cat("parallel.bucket_mb=", bad)}); });
    EXPECT_NE(e.find("parallel.bucket_mb"), std::string::npos) << bad << ": " << e;
    EXPECT_NE(e.find("expected 4 bytes (one f32 gradient, 3.8147e-06 MiB) to 4096 MiB"),
              std::string::npos)
        << bad << ": " << e;
  }
  for (double good : {4.0 / 1048576.0, 0.01, 4096.0}) {
    const auto c = train::parse_train_config(
        base, "run.toml", {cat("parallel.bucket_mb=", train::toml_double(good))});
    EXPECT_EQ(c.bucket_mb, good);
  }
}

// A resume compares recorded settings by value: 0 and 0.0 are one setting (a --set written either
// way), and a difference names the key, added and removed keys too.
TEST(TrainConfig, RecordedSettingsCompareByValueAndChangesNameTheirKey) {
  EXPECT_TRUE(train::same_setting("0", "0.0"));
  EXPECT_TRUE(train::same_setting("0.05", "5e-2"));
  EXPECT_TRUE(train::same_setting("\"x\"", "\"x\""));
  EXPECT_TRUE(train::same_setting("0.05", "0.050000000000000003"));  // the same double
  EXPECT_FALSE(train::same_setting("0.05", "0.051"));
  EXPECT_FALSE(train::same_setting("1", "\"1\""));
  // Whole numbers compare exactly: two seeds past 2^53 are one double but not one seed.
  EXPECT_FALSE(train::same_setting("9007199254740992", "9007199254740993"));
  using Keys = std::vector<std::pair<std::string, std::string>>;
  const Keys saved{{"grpo.beta", "0"}, {"grpo.group_size", "4"}, {"grpo.temperature", "1.0"}};
  EXPECT_EQ(train::changed_settings(
                saved, {{"grpo.beta", "0.0"}, {"grpo.group_size", "4"}, {"grpo.temperature", "1"}}),
            "");
  EXPECT_EQ(train::changed_settings(
                saved, {{"grpo.beta", "0"}, {"grpo.group_size", "2"}, {"grpo.top_p", "0.9"}}),
            "grpo.group_size (4 -> 2), grpo.top_p added (= 0.9), grpo.temperature removed (was "
            "1.0)");
  // The recorded texts of a resume's check: another spelling of a value resumes, another value
  // (a seed past 2^53 included) is refused.
  const Keys run{{"run.seed", "9007199254740992"}, {"optimizer.weight_decay", "0"}};
  const std::string doc = "docs/training.md";
  EXPECT_NO_THROW(train::check_resume_compatible(
      run, {{"run.seed", "9007199254740992"}, {"optimizer.weight_decay", "0.0"}}, doc));
  const std::string e = error_of([&] {
    train::check_resume_compatible(
        run, {{"run.seed", "9007199254740993"}, {"optimizer.weight_decay", "0"}}, doc);
  });
  EXPECT_NE(e.find("run.seed (9007199254740992 -> 9007199254740993)"), std::string::npos) << e;
}

// A resolved config writes each float as the shortest TOML float that reads back as it: 3e-3 as
// 0.003 (not 0.0030000000000000001, which a resume refusal would show), 3 as 3.0.
TEST(TrainConfig, FloatsAreWrittenShortestAndReadBackExactly) {
  EXPECT_EQ(train::toml_double(3e-3), "0.003");
  EXPECT_EQ(train::toml_double(3.0), "3.0");
  EXPECT_EQ(train::toml_double(1e-5), "1e-05");
  EXPECT_EQ(train::toml_double(-0.5), "-0.5");
  for (double v : {3e-3, 0.1 + 0.2, 1e-300, 1e300, 4.0 / 1048576.0, -7.0}) {
    const auto t = toml::parse("x = " + train::toml_double(v));
    ASSERT_TRUE(t["x"].is_floating_point()) << train::toml_double(v);
    EXPECT_EQ(t["x"].value<double>().value(), v) << train::toml_double(v);
  }
}

// eval --run takes runs of pollen train; a post-training run's config.toml (its base model and
// objective's section) is named as such, with the command that evaluates it.
TEST(RunEval, APostTrainingRunIsPointedAtEvalModel) {
  const fs::path run = temp_dir("post_run_eval");
  write_file_atomic(run / "config.toml",
                    "[model]\nbase = 'llama-tiny'\ntokenizer = 't.json'\n[sft]\nseq = 64\n");
  const std::string e = error_of([&] { train::evaluate_run(run, {}); });
  EXPECT_NE(e.find("is a run of pollen sft, and eval --run evaluates runs of pollen train"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("pollen eval --model " + run.string() + " --data MANIFEST"), std::string::npos)
      << e;
  fs::remove_all(run);
}

TEST(Accumulation, MicroBatchesWithUnequalScoredTokensEqualOneBigBatch) {
  set_num_threads(2);
  model::LlamaConfig mc;
  mc.vocab_size = 50;
  mc.hidden_size = 16;
  mc.intermediate_size = 32;
  mc.num_hidden_layers = 2;
  mc.num_attention_heads = 2;
  mc.num_key_value_heads = 2;
  const int64_t B = 4, T = 8;
  std::vector<int32_t> tok(B * T), tgt(B * T);
  for (int64_t i = 0; i < B * T; ++i) {
    tok[i] = static_cast<int32_t>((i * 7) % 50);
    tgt[i] = static_cast<int32_t>((i * 3 + 1) % 50);
  }
  // Row r scores T - 2r targets: 8, 6, 4, 2.
  for (int64_t r = 0; r < B; ++r)
    for (int64_t t = 0; t < 2 * r; ++t) tgt[r * T + t] = -100;
  const auto big = model::Batch::contiguous_rows(Tensor::from<int32_t>({B, T}, tok),
                                                 Tensor::from<int32_t>({B, T}, tgt));
  std::vector<model::Batch> micro;
  for (int64_t r = 0; r < B; ++r)
    micro.push_back(model::Batch::contiguous_rows(
        Tensor::from<int32_t>({1, T},
                              std::vector<int32_t>(tok.begin() + r * T, tok.begin() + (r + 1) * T)),
        Tensor::from<int32_t>(
            {1, T}, std::vector<int32_t>(tgt.begin() + r * T, tgt.begin() + (r + 1) * T))));

  model::Llama a(mc, 3), b(mc, 3);
  ag::Tape tape;
  ag::Var l;
  {
    ag::TapeScope scope(tape);
    l = a.loss(big, ag::Reduction::mean);
  }
  tape.backward(l);
  const auto acc = train::accumulate_gradients(b, micro);
  EXPECT_EQ(acc.scored, 20);
  EXPECT_NEAR(acc.loss, l.value().item(), 1e-5);
  // The mean of per-micro-batch means would weight the 2-token row like the 8-token one.
  const auto pa = a.named_parameters(), pb = b.named_parameters();
  double max_rel = 0;
  for (size_t i = 0; i < pa.size(); ++i) {
    const Tensor ga = pa[i].second.grad(), gb = pb[i].second.grad();
    ASSERT_TRUE(ga.defined() && gb.defined()) << pa[i].first;
    double num = 0, den = 0;
    for (int64_t k = 0; k < ga.numel(); ++k) {
      const double d = ga.data<float>()[k] - gb.data<float>()[k];
      num += d * d;
      den += static_cast<double>(ga.data<float>()[k]) * ga.data<float>()[k];
    }
    max_rel = std::max(max_rel, std::sqrt(num / std::max(den, 1e-30)));
  }
  EXPECT_LT(max_rel, 1e-5);
}

TEST(DecayMask, NormsBiasesEmbeddingsGroups) {
  model::LlamaConfig mc = model::preset("llama-tiny");
  mc.num_hidden_layers = 1;
  mc.attention_bias = true;
  model::Llama m(mc, 0);
  const auto named = m.named_parameters();
  const auto mask = train::decay_mask(named, {"norms", "biases", "embeddings"});
  for (size_t i = 0; i < named.size(); ++i) {
    const auto& n = named[i].first;
    const bool expect = !(n.find("norm") != std::string::npos || n.ends_with(".bias") ||
                          n.find("embed_tokens") != std::string::npos);
    EXPECT_EQ(mask[i], expect) << n;
  }
  const auto none = train::decay_mask(named, {});
  EXPECT_EQ(std::count(none.begin(), none.end(), true), static_cast<long>(named.size()));
}

TEST(Trainer, TinyModelOverfitsTinyData) {
  const fs::path run = temp_dir("overfit");
  // 60 steps over a 16-window dataset: many epochs of the same data.
  const auto c = train::parse_train_config(
      test_support::tiny_run_toml(run, test_support::make_tiny_dataset(run / "data", 12), 60),
      "tiny.toml", {"optimizer.lr=1e-2", "schedule.min_lr=1e-3", "checkpoint.interval=0"});
  const auto r = train_quiet(c);
  ASSERT_EQ(r.status, train::RunStatus::finished) << r.message;
  const auto m = read_metrics(run);
  EXPECT_GT(m.front()["loss"].get<double>(), 3.5);  // ln 64 = 4.16 at start
  EXPECT_LT(r.last_loss, 0.5) << "stated bound: train loss under 0.5 after 60 steps";
  EXPECT_TRUE(fs::exists(run / "summary.json"));
  EXPECT_EQ(io::list_checkpoints(run / "checkpoints").size(), 1u);
  for (const char* key :
       {"step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "elapsed_s", "rss_mb"})
    EXPECT_TRUE(m.front().contains(key)) << key;
  fs::remove_all(run);
}

// A validation split of fewer windows than one micro-batch is scored whole, as one batch: the
// same loss as scoring it window by window.
TEST(Trainer, AValidationSplitSmallerThanAMicroBatchIsScoredWhole) {
  const fs::path base = temp_dir("small_validation");
  const auto val_loss = [&](const std::string& name, int micro_batch) {
    const auto r = train_quiet(tiny(base / name, 2,
                                    {"train.seq=60", cat("train.micro_batch=", micro_batch),
                                     "train.batch_tokens=1920", "eval.batches=1000"}));
    EXPECT_EQ(r.status, train::RunStatus::finished) << r.message;
    std::vector<double> losses;
    for (const auto& j : read_metrics(base / name))
      if (j.contains("val_loss")) losses.push_back(j["val_loss"].get<double>());
    EXPECT_EQ(losses.size(), 1u) << name;
    return losses.empty() ? NAN : losses.back();
  };
  const double whole = val_loss("whole", 32), window_by_window = val_loss("windows", 1);
  EXPECT_NEAR(whole, window_by_window, 1e-4 * window_by_window);
  fs::remove_all(base);
}

// A checkpoint of a pollen that did not record the validation loss's step: its loss is reported
// as of an earlier step, not as the final weights'.
TEST(Trainer, AnUnrecordedValidationStepIsAnEarlierOne) {
  nlohmann::ordered_json state = {
      {"step", 4},        {"tokens", 512},    {"bad_steps_in_row", 0}, {"skipped_steps", 0},
      {"elapsed_s", 1.0}, {"last_loss", 3.5}, {"last_val_loss", 3.7}};
  train::LoopCounters c;
  c.restore(state);
  c.step = 6;
  EXPECT_EQ(train::val_step_note(c), " (at or before step 4)");
  state["last_val_loss"] = nullptr;
  c.restore(state);
  EXPECT_EQ(c.last_val_step, -1);
}

// A run resumed with evaluation off reports the last validation loss with the step it was
// measured at, not as though it were the final weights'.
TEST(Trainer, AResumeWithoutEvaluationReportsTheValidationLossesStep) {
  const fs::path base = temp_dir("val_step");
  auto r = train_quiet(tiny(base / "run", 4));
  ASSERT_EQ(r.status, train::RunStatus::finished) << r.message;
  auto summary = nlohmann::json::parse(read_file(base / "run" / "summary.json"));
  ASSERT_TRUE(summary["val_loss"].is_number()) << summary.dump();
  EXPECT_EQ(summary["val_loss_step"], 4);
  EXPECT_EQ(r.message.find("(at step"), std::string::npos) << r.message;
  r = train_quiet(tiny(base / "run", 6, {"eval.batches=0"}), true);
  ASSERT_EQ(r.status, train::RunStatus::finished) << r.message;
  EXPECT_NE(r.message.find("(at step 4)"), std::string::npos) << r.message;
  summary = nlohmann::json::parse(read_file(base / "run" / "summary.json"));
  EXPECT_EQ(summary["step"], 6);
  EXPECT_EQ(summary["val_loss_step"], 4);
  // Its TensorBoard file gone, a resume says so, as for a missing metrics.jsonl.
  fs::remove_all(base / "run" / "tensorboard");
  ::testing::internal::CaptureStderr();
  r = train_quiet(tiny(base / "run", 8, {"eval.batches=0"}), true);
  const std::string said = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(r.status, train::RunStatus::finished) << r.message;
  EXPECT_NE(said.find("is missing: going on with a new file (this run's TensorBoard curves "
                      "before step 7 are gone)"),
            std::string::npos)
      << said;
}

TEST(Trainer, ResumeIsBitwiseAndSkipsACorruptCheckpoint) {
  const fs::path base = temp_dir("resume");
  // Uninterrupted: 14 steps, checkpoints at 4, 8, 12, 14; evaluation at 10 and 14.
  const auto full = train_quiet(tiny(base / "full", 14));
  ASSERT_EQ(full.status, train::RunStatus::finished) << full.message;

  // Preempted after 6 steps (checkpoint at 4 and the preemption's at 6), resumed to the end.
  const auto cut = tiny(base / "cut", 14);
  auto r = train_quiet(cut, false, 6);
  ASSERT_EQ(r.status, train::RunStatus::preempted) << r.message;
  EXPECT_EQ(r.step, 6);
  EXPECT_NE(r.message.find("step-00000006"), std::string::npos) << r.message;
  r = train_quiet(cut, true);
  ASSERT_EQ(r.status, train::RunStatus::finished) << r.message;
  EXPECT_EQ(losses(base / "cut"), losses(base / "full"));
  EXPECT_EQ(final_weights(base / "cut", 14), final_weights(base / "full", 14));
  // --resume of the finished run (a scheduler always passes it) trains nothing and keeps the
  // summary of the run that did (it was overwritten with null losses).
  const std::string summary = read_file(base / "cut" / "summary.json");
  r = train_quiet(cut, true);
  ASSERT_EQ(r.status, train::RunStatus::finished) << r.message;
  EXPECT_NE(r.message.find("already finished at step 14"), std::string::npos) << r.message;
  EXPECT_EQ(read_file(base / "cut" / "summary.json"), summary);
  // A run that ended without its summary (killed after its last checkpoint) writes it on resume
  // with the losses the checkpoint recorded.
  fs::remove(base / "cut" / "summary.json");
  r = train_quiet(cut, true);
  ASSERT_EQ(r.status, train::RunStatus::finished) << r.message;
  const auto before = nlohmann::json::parse(summary),
             after = nlohmann::json::parse(read_file(base / "cut" / "summary.json"));
  ASSERT_TRUE(before["loss"].is_number());
  EXPECT_EQ(after["loss"], before["loss"]);
  EXPECT_EQ(after["val_loss"], before["val_loss"]);
  // The summary of an earlier stop (the preemption at step 6), left by a run killed after its
  // last checkpoint, is written again as the finished run's.
  auto preempted = before;
  preempted["status"] = "preempted";
  preempted["step"] = 6;
  write_file_atomic(base / "cut" / "summary.json", preempted.dump(2) + "\n");
  r = train_quiet(cut, true);
  ASSERT_EQ(r.status, train::RunStatus::finished) << r.message;
  EXPECT_EQ(r.message.find("already finished"), std::string::npos) << r.message;
  const auto rewritten = nlohmann::json::parse(read_file(base / "cut" / "summary.json"));
  EXPECT_EQ(rewritten["status"], "finished");
  EXPECT_EQ(rewritten["step"], 14);
  // Fewer steps than the checkpoint took leave nothing to train: refused, not "finished".
  EXPECT_NE(error_of([&] {
              train_quiet(tiny(base / "cut", 10), true);
            }).find("train.steps (10) is below the step of checkpoint"),
            std::string::npos);

  // Stop at 9 (checkpoints 8 and 9), corrupt 9: resume takes 8 and still ends bitwise equal.
  const auto bad = tiny(base / "bad", 14);
  r = train_quiet(bad, false, 9);
  ASSERT_EQ(r.status, train::RunStatus::preempted);
  {
    std::fstream f(base / "bad/checkpoints/step-00000009/optimizer.safetensors",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(200);
    f.put('\x55');
  }
  ::testing::internal::CaptureStderr();
  r = train_quiet(bad, true);
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(r.status, train::RunStatus::finished) << r.message;
  EXPECT_NE(err.find("skipping checkpoint"), std::string::npos) << err;
  EXPECT_NE(err.find("optimizer.safetensors has SHA-256"), std::string::npos) << err;
  EXPECT_NE(err.find("resuming from"), std::string::npos) << err;
  EXPECT_EQ(losses(base / "bad"), losses(base / "full"));
  EXPECT_EQ(final_weights(base / "bad", 14), final_weights(base / "full", 14));
  // The corrupt one was moved aside, and retention kept the newest two good ones.
  EXPECT_TRUE(fs::exists(base / "bad/checkpoints/.corrupt-step-00000009/manifest.json"));
  EXPECT_EQ(io::list_checkpoints(base / "bad/checkpoints"),
            (std::vector<fs::path>{base / "bad/checkpoints/step-00000012",
                                   base / "bad/checkpoints/step-00000014"}));

  // A fresh start in a run folder with checkpoints is refused; a changed key on resume too.
  EXPECT_NE(error_of([&] { train_quiet(bad); }).find("--resume"), std::string::npos);
  const auto changed = tiny(base / "bad", 20, {"optimizer.lr=1e-2"});
  EXPECT_NE(error_of([&] { train_quiet(changed, true); }).find("optimizer.lr"), std::string::npos);
  fs::remove_all(base);
}

// A warm-up longer than the run (a short test run of a long config) trains, with a warning that
// the rate never reaches its peak.
TEST(Trainer, AWarmupLongerThanTheRunIsWarned) {
  const fs::path base = temp_dir("warmup");
  ::testing::internal::CaptureStderr();
  const auto r = train_quiet(tiny(base / "run", 2, {"schedule.warmup_steps=8"}));
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(r.status, train::RunStatus::finished) << r.message;
  EXPECT_NE(err.find("schedule.warmup_steps (8) is more than train.steps (2)"), std::string::npos)
      << err;
  fs::remove_all(base);
}

// A run an error stops (a full disk, say; here an injected error before step 3) leaves
// summary.json "failed" at its last step, not "running".
TEST(Trainer, AnErrorLeavesTheSummaryFailed) {
  const fs::path base = temp_dir("error_summary");
  train::TrainOptions o;
  o.handle_signals = false;
  o.quiet = true;
  o.fault = train::parse_fault_injection("error:0:3");
  EXPECT_THROW(train::run_training(tiny(base / "run", 4), o), Error);
  const auto summary = nlohmann::json::parse(read_file(base / "run" / "summary.json"));
  EXPECT_EQ(summary["status"], "failed") << summary;
  EXPECT_EQ(summary["step"], 2) << summary;
  fs::remove_all(base);
}

// run.threads = 0 ("all") is recorded as the count that ran, so that a resume compares thread
// counts, not the text 0: at the same count it warns of nothing, at another it does.
TEST(Trainer, AResumeComparesTheThreadCountThatRan) {
  const fs::path base = temp_dir("threads_all");
  ASSERT_EQ(train_quiet(tiny(base / "run", 2, {"run.threads=0"})).status,
            train::RunStatus::finished);
  const std::string saved =
      read_file(io::list_checkpoints(base / "run" / "checkpoints").back() / "config.toml");
  EXPECT_NE(saved.find(cat("threads = ", available_cpus(), "\n")), std::string::npos) << saved;
  const auto resume = [&](int steps, int threads) {
    train::TrainOptions o;
    o.resume = true;
    o.handle_signals = false;
    log::set_level(log::Level::warn);
    ::testing::internal::CaptureStderr();
    train::run_training(tiny(base / "run", steps, {cat("run.threads=", threads)}), o);
    return ::testing::internal::GetCapturedStderr();
  };
  std::string said = resume(3, available_cpus());
  EXPECT_EQ(said.find("run.threads"), std::string::npos) << said;
  said = resume(4, available_cpus() + 1);
  EXPECT_NE(said.find("run.threads"), std::string::npos) << said;
  fs::remove_all(base);
}

// What a run evaluates on must fit the model and speak the training data's ids, and a split the
// config names must exist: each refused before step 0, not at the first evaluation. A manifest
// without the validation split leaves the others' evaluated. A resumed run must read the data
// its checkpoint trained on: re-prepared data under the same path is refused.
TEST(Trainer, DataIsCheckedBeforeTheFirstStepAndOnResume) {
  const fs::path base = temp_dir("data_checks");
  const fs::path manifest = test_support::make_tiny_dataset(base / "data");
  const nlohmann::json m = nlohmann::json::parse(read_file(manifest));
  // Manifests beside the tiny one's shards, changed by `change`.
  const auto variant = [&](const std::string& name,
                           const std::function<void(nlohmann::json&)>& change) {
    nlohmann::json v = m;
    change(v);
    write_file_atomic(base / "data" / name, data::manifest_text(v));
    return (base / "data" / name).string();
  };
  const auto run = [&](const std::string& name, const std::string& train_manifest,
                       std::vector<std::string> sets) {
    return train::parse_train_config(test_support::tiny_run_toml(base / name, train_manifest, 8),
                                     "tiny.toml", sets);
  };
  const std::string wide = variant("wide.json", [](auto& v) { v["vocab_size"] = 100; });
  std::string e = error_of([&] {
    train_quiet(run("wide", manifest, {"data.validation_manifests=[\"" + wide + "\"]"}));
  });
  EXPECT_NE(e.find("data.validation_manifests: manifest '" + wide + "' has vocab_size 100"),
            std::string::npos)
      << e;
  EXPECT_FALSE(fs::exists(base / "wide" / "checkpoints" / io::checkpoint_name(4)));
  const std::string other = variant("other.json", [](auto& v) {
    v["tokenizer"] = {{"fingerprint", std::string(64, 'b')}};
  });
  e = error_of([&] {
    train_quiet(run("other", manifest, {"data.validation_manifests=[\"" + other + "\"]"}));
  });
  EXPECT_NE(e.find("was tokenized unlike"), std::string::npos) << e;
  e = error_of(
      [&] { train_quiet(run("typo", manifest, {"data.validation_split=\"validaton\""})); });
  EXPECT_NE(e.find("data.validation_split 'validaton'"), std::string::npos) << e;
  EXPECT_NE(e.find("(the manifests' splits: 'train', 'validation')"), std::string::npos) << e;

  const std::string no_validation = variant("no_validation.json", [](auto& v) {
    nlohmann::json kept = nlohmann::json::array();
    for (const auto& shard : v["shards"])
      if (shard["split"] != "validation") kept.push_back(shard);
    v["shards"] = kept;
  });
  const auto mixed =
      train_quiet(run("mixed", manifest,
                      {"data.manifests=[\"" + manifest.string() + "\", \"" + no_validation + "\"]",
                       "data.weights=[1.0, 1.0]", "eval.interval=4"}));
  ASSERT_EQ(mixed.status, train::RunStatus::finished) << mixed.message;
  int evaluations = 0;
  for (const auto& j : read_metrics(base / "mixed")) evaluations += j.contains("val_loss");
  EXPECT_EQ(evaluations, 2);

  const std::string resumed = variant("resumed.json", [](auto&) {});
  auto r = train_quiet(run("resumed", resumed, {}), false, 6);
  ASSERT_EQ(r.status, train::RunStatus::preempted) << r.message;
  variant("resumed.json", [](auto& v) { v["prepared_again"] = true; });
  e = error_of([&] { train_quiet(run("resumed", resumed, {}), true); });
  EXPECT_NE(e.find("data manifest '" + resumed + "' is not the data the checkpoint trained on"),
            std::string::npos)
      << e;
  fs::remove_all(base);
}

// A checkpoint's config.toml is the model it trained: an HF base's sliding window and rope
// scaling are written and read back (a model file may set them too), so that loading the
// checkpoint builds the same model.
TEST(TrainConfig, SlidingWindowAndRopeScalingRoundTripThroughACheckpointsConfig) {
  for (const auto kind : {ops::RopeScaling::Kind::llama3, ops::RopeScaling::Kind::yarn}) {
    model::LlamaConfig m = model::preset("llama-tiny");
    m.sliding_window = 7;
    m.rope_scaling.kind = kind;
    m.rope_scaling.factor = 8;
    if (kind == ops::RopeScaling::Kind::llama3) {
      m.rope_scaling.low_freq_factor = 2;
      m.rope_scaling.high_freq_factor = 5;
      m.rope_scaling.original_max_position_embeddings = 64;
    } else {
      m.rope_scaling.original_max_position_embeddings = m.max_position_embeddings;
      m.rope_scaling.attention_factor = 1.2;
      m.rope_scaling.beta_fast = 16;
      m.rope_scaling.beta_slow = 2;
    }
    std::vector<std::pair<std::string, std::string>> flat;
    train::flat_model(m, flat);
    const fs::path file = temp_dir("model_roundtrip") / "config.toml";
    write_file_atomic(file, train::flat_to_toml(flat, ""));
    const model::LlamaConfig back = model::load_config(file);
    EXPECT_EQ(back.sliding_window, 7);
    EXPECT_EQ(back.rope_scaling, m.rope_scaling) << read_file(file);
    EXPECT_TRUE(model::architecture_differences(m, back).empty());
  }
}

// Data of one-token documents has no target to score (each is a document's first token): named as
// the data, not taken for a diverging run.
TEST(Trainer, ABatchWithNoTargetToScoreNamesTheData) {
  const fs::path run = temp_dir("unscored");
  const fs::path dir = run / "data";
  data::ShardWriter w(dir, "ones", "train", data::TokenDType::u16, 4000);
  for (int d = 0; d < 400; ++d)
    w.add_document(std::vector<uint32_t>{static_cast<uint32_t>(d % 60 + 1)});
  nlohmann::json m{{"format", "pollen-shards-v1"}, {"token_dtype", "u16"}, {"vocab_size", 64}};
  m["shards"] = nlohmann::json::array();
  for (const auto& s : w.finish()) m["shards"].push_back(s.to_json());
  write_file_atomic(dir / "manifest.json", data::manifest_text(m));
  const auto c =
      train::parse_train_config(test_support::tiny_run_toml(run, dir / "manifest.json", 4),
                                "tiny.toml", {"data.validation_split=\"\""});
  const std::string e = error_of([&] { train_quiet(c); });
  EXPECT_NE(e.find("step 1: its batch holds no target to score"), std::string::npos) << e;
  fs::remove_all(run);
}

TEST(Trainer, NonFiniteLossesSkipUpdatesThenStop) {
  const fs::path run = temp_dir("nan");
  // A learning rate of 1e30 blows the weights up after the first update.
  const auto c = tiny(
      run, 20,
      {"optimizer.lr=1e30", "schedule.kind=constant", "schedule.warmup_steps=0",
       "schedule.min_lr=0", "train.grad_clip=0", "train.max_bad_steps=3", "checkpoint.interval=1"});
  const auto r = train_quiet(c);
  EXPECT_EQ(r.status, train::RunStatus::failed);
  EXPECT_NE(r.message.find("3 non-finite steps in a row"), std::string::npos) << r.message;
  EXPECT_EQ(r.skipped_steps, 3);
  // Checkpoints stop at the last good step; the failed steps wrote none. That step's own
  // update is what diverged (the next loss is not finite), so no checkpoint is called good.
  const auto all = io::list_checkpoints(run / "checkpoints");
  ASSERT_FALSE(all.empty());
  EXPECT_EQ(io::checkpoint_step(all.back()), r.step - 3);
  EXPECT_NE(r.message.find("The last good checkpoint is none (the newest, '" + all.back().string() +
                           "', holds step " + std::to_string(r.step - 3) +
                           "'s update, which may be what diverged)"),
            std::string::npos)
      << r.message;
  fs::remove_all(run);
  // A learning rate that diverges after a few steps: the good checkpoint is the one before the
  // last good step, whose weights that step trained on cleanly.
  const auto slower = train_quiet(tiny(
      run, 30,
      {"optimizer.lr=100", "schedule.kind=constant", "schedule.warmup_steps=0", "schedule.min_lr=0",
       "train.grad_clip=0", "train.max_bad_steps=3", "checkpoint.interval=1"}));
  ASSERT_EQ(slower.status, train::RunStatus::failed) << slower.message;
  ASSERT_GE(slower.step - 4, 1) << slower.message;
  EXPECT_NE(slower.message.find(
                "The last good checkpoint is '" +
                (run / "checkpoints" / io::checkpoint_name(slower.step - 4)).string() + "'"),
            std::string::npos)
      << slower.message;
  EXPECT_NE(slower.message.find("model.init_from set to it"), std::string::npos) << slower.message;
  fs::remove_all(run);
}

// A run whose last steps were skipped still ends with its checkpoint (the last good update's
// weights): without periodic checkpoints it would otherwise keep nothing.
TEST(Trainer, ARunEndingInSkippedStepsStillWritesItsLastCheckpoint) {
  const fs::path run = temp_dir("nan_last");
  const auto c = tiny(
      run, 4,
      {"optimizer.lr=1e30", "schedule.kind=constant", "schedule.warmup_steps=0",
       "schedule.min_lr=0", "train.grad_clip=0", "train.max_bad_steps=5", "checkpoint.interval=0"});
  const auto r = train_quiet(c);
  EXPECT_EQ(r.status, train::RunStatus::finished) << r.message;
  EXPECT_GT(r.skipped_steps, 0);
  const auto all = io::list_checkpoints(run / "checkpoints");
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(io::checkpoint_step(all.back()), 4);
  fs::remove_all(run);
}

// The pollen binary: SIGTERM is a preemption (exit 3), SIGKILL mid-step or mid-checkpoint loses
// nothing that a fresh process cannot redo bitwise, and the resumed run equals the uninterrupted
// one.
TEST(TrainCli, SigkillThenResumeInAFreshProcessIsBitwise) {
  const fs::path base = temp_dir("cli");
  const auto write_cfg = [&](const std::string& name) {
    const fs::path p = base / (name + ".toml");
    write_file_atomic(p, test_support::tiny_run_toml(base / name, dataset(), 40));
    return p;
  };
  auto run = [&](const std::string& args) {
    const std::string cmd = std::string(POLLEN_BINARY) + " " + args + " > /dev/null 2>&1";
    const int status = std::system(cmd.c_str());
    return WEXITSTATUS(status);
  };
  // Slow steps down just enough (more micro-batches) that a kill lands mid-run.
  const std::string slow = " --set train.batch_tokens=1024 --set checkpoint.interval=2";
  ASSERT_EQ(run("train --config " + write_cfg("full").string() + slow), 0);

  auto spawn = [&](const fs::path& cfg, bool resume) {
    const pid_t pid = fork();
    if (pid == 0) {
      const int fd = ::open("/dev/null", O_WRONLY);
      dup2(fd, 1);
      dup2(fd, 2);
      std::vector<std::string> args = {POLLEN_BINARY, "train",
                                       "--config",    cfg.string(),
                                       "--set",       "train.batch_tokens=1024",
                                       "--set",       "checkpoint.interval=2"};
      if (resume) args.push_back("--resume");
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(POLLEN_BINARY, argv.data());
      _exit(127);
    }
    return pid;
  };
  auto lines = [&](const fs::path& run_dir) { return read_metrics(run_dir).size(); };
  const fs::path kcfg = write_cfg("killed");
  // Kill once a few steps past the first checkpoint, then again mid-way after a resume.
  for (size_t kill_at : {size_t{5}, size_t{19}}) {
    const pid_t pid = spawn(kcfg, kill_at != 5);
    for (int i = 0; i < 3000 && (!fs::exists(base / "killed/metrics.jsonl") ||
                                 lines(base / "killed") < kill_at);
         ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ::kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the run ended before it could be killed";
    // A run that ended without its summary leaves "running", not an earlier run's status.
    EXPECT_EQ(nlohmann::json::parse(read_file(base / "killed/summary.json"))["status"], "running");
  }
  // Then in the middle of writing a checkpoint: killed while its temp folder exists (tried a
  // few times, since a tiny checkpoint takes only milliseconds to write).
  const fs::path kroot = base / "killed/checkpoints";
  auto temp_folder = [&] {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(kroot, ec))
      if (e.path().filename().string().starts_with(".tmp-step-")) return e.path();
    return fs::path();
  };
  bool mid_checkpoint = false;
  for (int attempt = 0; attempt < 5 && !mid_checkpoint; ++attempt) {
    const pid_t pid = spawn(kcfg, true);
    int status = 0;
    while (temp_folder().empty() && waitpid(pid, &status, WNOHANG) == 0) {
    }
    ::kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    mid_checkpoint = WIFSIGNALED(status) && !temp_folder().empty();
  }
  ASSERT_TRUE(mid_checkpoint) << "no kill landed while a checkpoint was being written";
  ASSERT_EQ(run("train --resume --config " + kcfg.string() + slow), 0);
  EXPECT_TRUE(temp_folder().empty());  // the dead process's temp folder was cleaned up
  EXPECT_EQ(losses(base / "killed"), losses(base / "full"));
  EXPECT_EQ(final_weights(base / "killed", 40), final_weights(base / "full", 40));

  // SIGTERM: exit code 3 with a checkpoint at the step it stopped at.
  const fs::path tcfg = write_cfg("term");
  const pid_t pid = spawn(tcfg, false);
  while (!fs::exists(base / "term/metrics.jsonl") || lines(base / "term") < 3)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ::kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 3);
  const auto ck = io::list_checkpoints(base / "term/checkpoints");
  ASSERT_FALSE(ck.empty());
  EXPECT_FALSE(io::verify_checkpoint(ck.back()).has_value());
  EXPECT_EQ(
      io::checkpoint_step(ck.back()),
      static_cast<int64_t>(nlohmann::json::parse(read_file(base / "term/summary.json"))["step"]));

  // A second process on the run folder (a scheduler's --resume while the first still runs) is
  // refused, naming the process that holds it; a second signal of either kind aborts at once.
  const fs::path lcfg = base / "locked.toml";  // long enough to outlast the second process
  write_file_atomic(lcfg, test_support::tiny_run_toml(base / "locked", dataset(), 100000));
  const pid_t first = spawn(lcfg, false);
  while (!fs::exists(base / "locked/metrics.jsonl") || lines(base / "locked") < 2)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const std::string out = base.string() + "/second.txt";
  const int second = std::system((std::string(POLLEN_BINARY) + " train --resume --config " +
                                  lcfg.string() + slow + " > " + out + " 2>&1")
                                     .c_str());
  EXPECT_EQ(WEXITSTATUS(second), 1);
  EXPECT_NE(read_file(out).find("is in use by another process"), std::string::npos)
      << read_file(out);
  EXPECT_NE(read_file(out).find(" " + std::to_string(first)), std::string::npos) << read_file(out);
  ::kill(first, SIGINT);
  ::kill(first, SIGTERM);
  waitpid(first, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status))
      << "a second signal let the step finish: exit " << WEXITSTATUS(status);
  // By whichever of the two its threads took second.
  EXPECT_TRUE(WTERMSIG(status) == SIGINT || WTERMSIG(status) == SIGTERM) << WTERMSIG(status);
  fs::remove_all(base);
}

TEST(TrainCli, HelpDocumentsExitCodesAndPlotDrawsRuns) {
  std::array<char, 4096> buf{};
  std::string out;
  FILE* p = popen((std::string(POLLEN_BINARY) + " train --help 2>&1").c_str(), "r");
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  pclose(p);
  EXPECT_NE(out.find("0 finished"), std::string::npos) << out;
  EXPECT_NE(out.find("1 failed"), std::string::npos) << out;
  EXPECT_NE(out.find("3 preempted"), std::string::npos) << out;

  const fs::path run = temp_dir("plot");
  ASSERT_EQ(train_quiet(tiny(run / "a", 6)).status, train::RunStatus::finished);
  ASSERT_EQ(train_quiet(tiny(run / "b", 6, {"optimizer.lr=1e-2"})).status,
            train::RunStatus::finished);
  const std::string cmd = std::string(POLLEN_BINARY) + " plot " + (run / "a").string() + " " +
                          (run / "b").string() + " --output " + (run / "c.svg").string() +
                          " > /dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  const std::string svg = read_file(run / "c.svg");
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find(">a</text>"), std::string::npos);
  EXPECT_NE(svg.find(">b</text>"), std::string::npos);
  EXPECT_NE(svg.find("stroke-dasharray"), std::string::npos);  // validation curves
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  // A run that has only just started (no loss yet) is left out beside the others, with a word;
  // alone, it is refused.
  fs::create_directories(run / "new");
  write_file_atomic(run / "new" / "metrics.jsonl", "");
  int status = 0;
  std::string said = pollen::testing::run_capture(
      cat(POLLEN_BINARY, " plot ", (run / "a").string(), " ", (run / "new").string(), " --output ",
          (run / "d.svg").string(), " 2>&1"),
      &status);
  EXPECT_EQ(status, 0) << said;
  EXPECT_NE(said.find("metrics.jsonl' holds no loss records yet: left out"), std::string::npos)
      << said;
  EXPECT_NE(read_file(run / "d.svg").find(">a</text>"), std::string::npos);
  said = pollen::testing::run_capture(cat(POLLEN_BINARY, " plot ", (run / "new").string(),
                                          " --output ", (run / "e.svg").string(), " 2>&1"),
                                      &status);
  EXPECT_NE(status, 0);
  EXPECT_NE(said.find("holds no loss records"), std::string::npos) << said;
  EXPECT_FALSE(fs::exists(run / "e.svg"));
  fs::remove_all(run);
}

namespace {

// A byte-level BPE tokenizer beside the tiny dataset's manifest, where `pollen data prepare`
// puts it (and where [samples] looks by default). The model's 300 ids outnumber its 260, as
// padded vocabularies do: samples keep to the ids it knows.
void write_tiny_tokenizer() {
  const fs::path path = dataset().parent_path() / "tokenizer.json";
  if (fs::exists(path)) return;
  tokenizer::PieceCounts counts(tokenizer::pattern_regex("gpt2"));
  const std::vector<std::string_view> docs = {"ABAB ABBA BABA", "AB BA AB"};
  counts.add_documents(docs);
  const auto tok =
      tokenizer::train_bpe(counts, {260, {"<|endoftext|>"}, tokenizer::pattern_regex("gpt2")});
  tokenizer::save_tokenizer(tok, path);
}

std::vector<std::string> sample_sets() {
  return {"model.vocab_size=300", "samples.prompts=[\"AB\", \"BA B\"]", "samples.max_tokens=6",
          "samples.temperature=1.0", "samples.seed=5"};
}

}  // namespace

// Samples come from their own seeded sampler: a run with them trains bitwise as one without,
// and a resumed run writes the same samples as the uninterrupted one.
TEST(Trainer, SamplesAtEachEvalLeaveTrainingBitwiseAndResume) {
  write_tiny_tokenizer();
  const fs::path base = temp_dir("samples");
  const auto plain = train_quiet(tiny(base / "plain", 12, {"model.vocab_size=300"}));
  ASSERT_EQ(plain.status, train::RunStatus::finished) << plain.message;
  const auto with = train_quiet(tiny(base / "with", 12, sample_sets()));
  ASSERT_EQ(with.status, train::RunStatus::finished) << with.message;
  EXPECT_EQ(losses(base / "with"), losses(base / "plain"));
  EXPECT_EQ(final_weights(base / "with", 12), final_weights(base / "plain", 12));

  // Evaluations at step 10 (eval.interval) and 12 (the end): two prompts each.
  std::vector<nlohmann::json> samples;
  {
    std::ifstream in(base / "with/samples.jsonl");
    std::string line;
    while (std::getline(in, line)) samples.push_back(nlohmann::json::parse(line));
  }
  ASSERT_EQ(samples.size(), 4u);
  EXPECT_EQ(samples[0]["step"], 10);
  EXPECT_EQ(samples[0]["prompt"], "AB");
  EXPECT_EQ(samples[1]["prompt"], "BA B");
  EXPECT_EQ(samples[3]["step"], 12);
  EXPECT_EQ(samples[3]["tokens"], 12 * 128);
  for (const auto& s : samples) {
    EXPECT_TRUE(s["text"].is_string() && s.contains("finish_reason"));
    EXPECT_EQ(s["text"].get<std::string>().find("<id "), std::string::npos) << s.dump();
  }
  // The text summary went to TensorBoard too.
  bool tagged = false;
  for (const auto& e : fs::directory_iterator(base / "with/tensorboard"))
    tagged |= read_file(e.path()).find("samples") != std::string::npos;
  EXPECT_TRUE(tagged);

  const auto cut = tiny(base / "cut", 12, sample_sets());
  ASSERT_EQ(train_quiet(cut, false, 6).status, train::RunStatus::preempted);
  ASSERT_EQ(train_quiet(cut, true).status, train::RunStatus::finished);
  EXPECT_EQ(losses(base / "cut"), losses(base / "with"));
  EXPECT_EQ(read_file(base / "cut/samples.jsonl"), read_file(base / "with/samples.jsonl"));

  // A prompt too long for the context is refused, naming the key.
  const auto err = error_of([&] {
    auto sets = sample_sets();
    sets.push_back("samples.max_tokens=64");
    train_quiet(tiny(base / "long", 2, sets));
  });
  EXPECT_NE(err.find("samples.max_tokens"), std::string::npos) << err;
  // A resume refused for its samples' tokenizer writes nothing (no TensorBoard file of its own);
  // a fresh run without samples in the folder leaves none of the earlier run's.
  const auto tb_files = [&] {
    return std::distance(fs::directory_iterator(base / "cut/tensorboard"),
                         fs::directory_iterator{});
  };
  const auto files_before = tb_files();
  auto bad = sample_sets();
  bad.push_back("samples.tokenizer=\"" + (base / "missing.json").string() + "\"");
  train::TrainOptions resume;
  resume.resume = true;
  resume.handle_signals = false;
  resume.quiet = true;
  EXPECT_THROW(train::run_training(tiny(base / "cut", 14, bad), resume), Error);
  EXPECT_EQ(tb_files(), files_before);
  fs::remove_all(base / "cut" / "checkpoints");
  ASSERT_EQ(train_quiet(tiny(base / "cut", 2)).status, train::RunStatus::finished);
  EXPECT_FALSE(fs::exists(base / "cut/samples.jsonl"));
  fs::remove_all(base);
}

// `pollen eval --run`: every checkpoint of a run, the same numbers as `pollen eval` of each
// checkpoint, skipped when already done, a corrupt one skipped with its reason, and drawn by plot.
TEST(TrainCli, EvalRunScoresEveryCheckpointAsEvalDoes) {
  const fs::path run = temp_dir("evalrun");
  const auto c = tiny(run, 12, {"checkpoint.keep=0"});
  ASSERT_EQ(train_quiet(c).status, train::RunStatus::finished);
  const auto all = io::list_checkpoints(run / "checkpoints");
  ASSERT_EQ(all.size(), 3u);  // steps 4, 8, 12

  auto pollen = [](const std::string& args) {
    std::array<char, 4096> buf{};
    std::string out;
    FILE* p = popen((std::string(POLLEN_BINARY) + " " + args + " 2>/dev/null").c_str(), "r");
    while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
    EXPECT_EQ(pclose(p), 0) << args;
    std::vector<nlohmann::json> lines;
    std::istringstream in(out);
    std::string line;
    while (std::getline(in, line))
      if (!line.empty()) lines.push_back(nlohmann::json::parse(line));
    return lines;
  };
  const auto printed = pollen("eval --run " + run.string() + " --threads 2");
  ASSERT_EQ(printed.size(), 3u);
  const auto written = train::read_run_evals(run);
  ASSERT_EQ(written.size(), 3u);
  for (size_t i = 0; i < all.size(); ++i) {
    const auto one = pollen("eval --model " + all[i].string() + " --data " + dataset().string() +
                            " --split validation --seq 16 --batch 4 --threads 2");
    ASSERT_EQ(one.size(), 1u);
    EXPECT_EQ(written[i]["step"], io::checkpoint_step(all[i]));
    EXPECT_EQ(written[i]["tokens"], io::checkpoint_step(all[i]) * 128);
    EXPECT_EQ(written[i]["loss"].get<double>(), one[0]["loss"].get<double>()) << i;
    EXPECT_EQ(written[i]["perplexity"].get<double>(), one[0]["perplexity"].get<double>());
    EXPECT_EQ(printed[i]["loss"], written[i]["loss"]);
  }
  EXPECT_GT(written[0]["loss"].get<double>(), written[2]["loss"].get<double>());
  // --seq's default (128) is longer than this model reads (64 positions): the error names it.
  int status = 0;
  const std::string too_long =
      pollen::testing::run_capture(std::string(POLLEN_BINARY) + " eval --model " + all[0].string() +
                                       " --data " + dataset().string() + " --threads 2",
                                   &status);
  EXPECT_NE(status, 0);
  EXPECT_NE(too_long.find("--seq 128 (its default) is longer than model"), std::string::npos)
      << too_long;
  // So is a --window past it (the text is scored in windows).
  write_file_atomic(run / "text.txt", "Some text to score in windows.\n");
  const std::string wide = pollen::testing::run_capture(
      std::string(POLLEN_BINARY) + " eval --model " + all[0].string() + " --text " +
          (run / "text.txt").string() + " --window 100000 --threads 2",
      &status);
  EXPECT_NE(status, 0);
  EXPECT_NE(wide.find("--window 100000 is longer than the model reads"), std::string::npos) << wide;

  // Done ones are skipped; --again redoes them, passing over a checkpoint that fails to verify.
  train::RunEvalOptions o;
  o.quiet = true;
  auto r = train::evaluate_run(run, o);
  EXPECT_TRUE(r.evaluated.empty());
  EXPECT_EQ(r.already, 3);
  // The same data named by a relative path is the same dataset, done already.
  o.manifests = {fs::relative(dataset(), fs::current_path()).string()};
  ASSERT_TRUE(fs::path(o.manifests[0]).is_relative());
  r = train::evaluate_run(run, o);
  EXPECT_TRUE(r.evaluated.empty());
  EXPECT_EQ(r.already, 3);
  o.manifests.clear();
  fs::resize_file(all[1] / "model.safetensors", 100);
  o.again = true;
  const auto event_files = [&] {  // name and size of each event file
    std::map<fs::path, uintmax_t> files;
    for (const auto& e : fs::directory_iterator(run / "tensorboard"))
      files[e.path()] = e.file_size();
    return files;
  };
  const auto events_before = event_files();
  ::testing::internal::CaptureStderr();
  r = train::evaluate_run(run, o);
  ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(event_files(), events_before) << "the same results written to TensorBoard again";
  EXPECT_EQ(r.evaluated.size(), 2u);
  ASSERT_EQ(r.unverified.size(), 1u);
  EXPECT_NE(r.unverified[0].second.find("model.safetensors holds 100 bytes"), std::string::npos);
  EXPECT_EQ(train::read_run_evals(run), written);  // the same numbers again
  // A checkpoint without its manifest (retention removing it while eval --run goes on) is passed
  // over as well, not the end of the evaluation.
  fs::remove(all[0] / "manifest.json");
  ::testing::internal::CaptureStderr();
  r = train::evaluate_run(run, o);
  ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(r.evaluated.size(), 1u);
  EXPECT_EQ(r.unverified.size(), 2u);

  const std::string plot = std::string(POLLEN_BINARY) + " plot " + run.string() + " --output " +
                           (run / "c.svg").string() + " > /dev/null 2>&1";
  ASSERT_EQ(std::system(plot.c_str()), 0);
  EXPECT_NE(read_file(run / "c.svg").find("<rect x="), std::string::npos);

  // A fresh run in the folder (its checkpoints moved away) starts without the old evaluations,
  // whose step numbers would name its own checkpoints: step 4 is evaluated again.
  fs::remove_all(run / "checkpoints");
  const std::string evaluated = read_file(run / "eval.jsonl");
  write_file_atomic(run / "eval.jsonl.old", "{\"set aside\":1}\n");  // by an earlier run
  ASSERT_EQ(train_quiet(tiny(run, 4, {"checkpoint.keep=0", "optimizer.lr=0.01"})).status,
            train::RunStatus::finished);
  EXPECT_FALSE(fs::exists(run / "eval.jsonl"));
  EXPECT_EQ(train::read_run_evals(run).size(), 0u);
  // Kept aside, not lost, after what was there.
  EXPECT_EQ(read_file(run / "eval.jsonl.old"), "{\"set aside\":1}\n" + evaluated);
  o.again = false;
  r = train::evaluate_run(run, o);
  EXPECT_EQ(r.already, 0);
  ASSERT_EQ(r.evaluated.size(), 1u);
  EXPECT_NE(r.evaluated[0]["loss"], written[0]["loss"]);
  fs::remove_all(run);
}

// The bytes of every TensorBoard event file of a run: its tags are in there as text.
std::string event_files_text(const fs::path& run) {
  std::string all;
  for (const auto& e : fs::directory_iterator(run / "tensorboard")) all += read_file(e.path());
  return all;
}

// Datasets in folders of one name get TensorBoard tags of their own (the folders above tell them
// apart), a dataset named twice is evaluated once, and one named alone later keeps its tag.
TEST(RunEval, DatasetsInFoldersOfOneNameKeepTagsOfTheirOwn) {
  const fs::path run = temp_dir("evalrun_labels");
  ASSERT_EQ(train_quiet(tiny(run, 2, {})).status, train::RunStatus::finished);
  const fs::path data = dataset().parent_path();
  for (const char* parent : {"a", "b"}) {
    fs::create_directories(run / parent);
    fs::copy(data, run / parent / data.filename(), fs::copy_options::recursive);
  }
  const auto manifest = [&](const char* parent) {
    return (run / parent / data.filename() / "manifest.json").string();
  };
  const auto tags = [&] { return event_files_text(run); };
  train::RunEvalOptions o;
  o.quiet = true;
  o.manifests = {manifest("a"), manifest("b"), "./" + fs::relative(manifest("a")).string()};
  const auto r = train::evaluate_run(run, o);
  EXPECT_EQ(r.evaluated.size(), 2u);  // step 2 on a and b
  const std::string label = "/" + data.filename().string() + "/loss";
  EXPECT_NE(tags().find("eval/a" + label), std::string::npos);
  EXPECT_NE(tags().find("eval/b" + label), std::string::npos);
  // b alone, from scratch: still b's tag (the run's own validation data is in a folder of that
  // name too), not the folder's name alone.
  fs::remove_all(run / "tensorboard");
  fs::remove(run / "eval.jsonl");
  o.manifests = {manifest("b")};
  ASSERT_EQ(train::evaluate_run(run, o).evaluated.size(), 1u);
  EXPECT_NE(tags().find("eval/b" + label), std::string::npos) << tags();
  // Killed after its points reached the event file but before eval.jsonl said so: the next
  // eval --run cuts the file back to the size the mark holds and writes the points once more,
  // without evaluating again, so each point is there once.
  const auto occurrences = [&](const std::string& needle) {
    const std::string all = tags();
    size_t n = 0;
    for (size_t at = all.find(needle); at != std::string::npos; at = all.find(needle, at + 1)) ++n;
    return n;
  };
  ASSERT_EQ(occurrences("eval/b" + label), 1u);
  fs::path written;
  for (const auto& e : fs::directory_iterator(run / "tensorboard")) written = e.path();
  const uint64_t header =  // an event file's size before its first point
      obs::EventFileWriter::create(run / "header-only", std::nullopt).file().position();
  std::string text = read_file(run / "eval.jsonl");
  ASSERT_TRUE(text.ends_with("}\n"));
  text.insert(text.size() - 2, cat(",\"tensorboard\":{\"file\":\"", written.filename().string(),
                                   "\",\"bytes\":", header, "}"));
  write_file_atomic(run / "eval.jsonl", text);
  const auto resumed = train::evaluate_run(run, o);
  EXPECT_TRUE(resumed.evaluated.empty());
  EXPECT_EQ(resumed.already, 1);
  EXPECT_EQ(occurrences("eval/b" + label), 1u) << "a point lost or written twice";
  EXPECT_EQ(fs::file_size(written), header);
  EXPECT_EQ(read_file(run / "eval.jsonl").find("tensorboard"), std::string::npos);
  const std::string shown = tags();
  train::evaluate_run(run, o);
  EXPECT_EQ(tags(), shown) << "a point written twice";
  // A mark that is not one is refused naming the file and line.
  text = read_file(run / "eval.jsonl");
  text.insert(text.size() - 2, ",\"tensorboard\":{\"file\":\"../x\",\"bytes\":0}");
  write_file_atomic(run / "eval.jsonl", text);
  const std::string bad = pollen::testing::error_of([&] { train::evaluate_run(run, o); });
  EXPECT_NE(bad.find("eval.jsonl' line 1: expected"), std::string::npos) << bad;
  fs::remove_all(run);
}

// A series (dataset, split, window) keeps the tag its first result recorded in eval.jsonl: a
// dataset added later in a folder of the same name does not move the earlier curve, and another
// split or window is a curve of its own rather than points mixed into the run's.
TEST(RunEval, ASeriesKeepsItsTagAndOtherSplitsGetTheirOwn) {
  const fs::path run = temp_dir("evalrun_series");
  ASSERT_EQ(train_quiet(tiny(run, 2, {})).status, train::RunStatus::finished);
  const fs::path data = dataset().parent_path();
  for (const char* parent : {"c", "d"}) {
    fs::create_directories(run / parent);
    fs::copy(data, run / parent / "held", fs::copy_options::recursive);
  }
  const auto manifest = [&](const char* parent) {
    return (run / parent / "held" / "manifest.json").string();
  };
  const auto tags = [&] { return event_files_text(run); };
  train::RunEvalOptions o;
  o.quiet = true;
  o.manifests = {manifest("c")};
  ASSERT_EQ(train::evaluate_run(run, o).evaluated.size(), 1u);
  EXPECT_NE(tags().find("eval/held/loss"), std::string::npos) << tags();
  EXPECT_EQ(train::read_run_evals(run).at(0)["tag"], "held");
  // d/held joins: it is told apart from c/held, and c/held's curve stays where it was.
  o.manifests = {manifest("c"), manifest("d")};
  o.again = true;
  ASSERT_EQ(train::evaluate_run(run, o).evaluated.size(), 2u);
  EXPECT_NE(tags().find("eval/d/held/loss"), std::string::npos) << tags();
  EXPECT_EQ(tags().find("eval/c/held/loss"), std::string::npos) << "c/held's curve moved";
  // Another split of c/held: its own curve, named as a new series is (c/held beside d/held).
  o.manifests = {manifest("c")};
  o.split = "train";
  o.again = false;
  ASSERT_EQ(train::evaluate_run(run, o).evaluated.size(), 1u);
  EXPECT_NE(tags().find("eval/c/held/train/loss"), std::string::npos) << tags();
  std::set<std::string> recorded;
  for (const auto& j : train::read_run_evals(run)) recorded.insert(j["tag"].get<std::string>());
  EXPECT_EQ(recorded, (std::set<std::string>{"held", "d/held", "c/held/train"}));
  fs::remove_all(run);
}

// A resume from an earlier checkpoint than eval --run scored trains those steps again: the old
// results are of weights set aside, so they move to eval.jsonl.old and are scored again.
TEST(RunEval, AResumeThatTrainsEvaluatedStepsAgainSetsTheirResultsAside) {
  const fs::path run = temp_dir("evalrun_resume");
  const std::vector<std::string> sets = {"checkpoint.interval=2", "checkpoint.keep=0"};
  ASSERT_EQ(train_quiet(tiny(run, 4, sets)).status, train::RunStatus::finished);
  train::RunEvalOptions o;
  o.quiet = true;
  ASSERT_EQ(train::evaluate_run(run, o).evaluated.size(), 2u);  // steps 2 and 4
  fs::remove_all(run / "checkpoints" / io::checkpoint_name(4));
  ::testing::internal::CaptureStderr();
  ASSERT_EQ(train_quiet(tiny(run, 6, sets), true).status, train::RunStatus::finished);
  const std::string said = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(said.find("1 result(s) of eval.jsonl"), std::string::npos) << said;
  const auto kept = train::read_run_evals(run);
  ASSERT_EQ(kept.size(), 1u);
  EXPECT_EQ(kept[0]["step"], 2);
  EXPECT_NE(read_file(run / "eval.jsonl.old").find("\"step\":4"), std::string::npos);
  // Step 4 is scored again (its new weights), and 6 for the first time.
  EXPECT_EQ(train::evaluate_run(run, o).evaluated.size(), 2u);
  fs::remove_all(run);
}

// eval --run scores only data tokenized like the run's training data.
TEST(RunEval, DataOfAnotherTokenizerIsRefused) {
  const fs::path run = temp_dir("evalrun_tokenizer");
  ASSERT_EQ(train_quiet(tiny(run, 4, {})).status, train::RunStatus::finished);
  const fs::path other = test_support::make_tiny_dataset(run / "other", 20);
  auto m = nlohmann::json::parse(read_file(other));
  m["tokenizer"] = {{"fingerprint", "0123456789abcdef0123"}};
  write_file_atomic(other, data::manifest_text(m));
  train::RunEvalOptions o;
  o.quiet = true;
  o.manifests = {other.string()};
  const std::string e = error_of([&] { train::evaluate_run(run, o); });
  EXPECT_NE(e.find("was tokenized unlike '" + dataset().string()), std::string::npos) << e;
  EXPECT_TRUE(train::read_run_evals(run).empty()) << "nothing scored";
  // A second evaluation of the run while one goes on is refused: each rewrites eval.jsonl from
  // what it read, and would drop the other's results.
  o.manifests.clear();
  {
    const pollen::FolderLock busy(run, "eval --run", run / ".eval.lock");
    EXPECT_NE(error_of([&] { train::evaluate_run(run, o); }).find("in use by another process"),
              std::string::npos);
  }
  EXPECT_FALSE(train::evaluate_run(run, o).evaluated.empty());
  fs::remove_all(run);
}

// Every run file in configs/train reads, resolving its model file (its data is made elsewhere).
TEST(TrainConfig, EveryExampleReads) {
  int read = 0;
  for (const auto& e : fs::directory_iterator(fs::path(POLLEN_SOURCE_DIR) / "configs/train")) {
    if (e.path().extension() != ".toml") continue;
    SCOPED_TRACE(e.path().filename().string());
    EXPECT_GT(train::load_train_config(e.path()).steps, 0);
    ++read;
  }
  EXPECT_GE(read, 2);
}
