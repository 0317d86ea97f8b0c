// `pollen train` under [privacy] (DP-SGD): the step's gradient against each sequence's gradient
// clipped by hand in float64, a preempted run resumed bitwise with the epsilon the accountant
// gives, and what a private run refuses.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "autograd/tape.h"
#include "base/files.h"
#include "base/hash.h"
#include "io/checkpoint.h"
#include "support/errors.h"
#include "train/config.h"
#include "train/private_gradients.h"
#include "train/run_checks.h"
#include "train/tiny_run.h"
#include "train/trainer.h"

namespace fs = std::filesystem;
using namespace pollen;
using test_support::error_of;
using test_support::read_metrics;
using test_support::train_quiet;

namespace {

fs::path temp_dir(const std::string& name) {
  return test_support::fresh_temp_dir("private_" + name);
}

const fs::path& dataset() {
  static const fs::path m = test_support::make_tiny_dataset(temp_dir("data"));
  return m;
}

const std::string kPrivacy = "\n[privacy]\nclip = 1.0\nnoise_multiplier = 0.3\nnoise_seed = 11\n";

train::TrainConfig tiny(const fs::path& run, int steps, std::vector<std::string> sets = {},
                        const std::string& privacy = kPrivacy) {
  return train::parse_train_config(test_support::tiny_run_toml(run, dataset(), steps, privacy),
                                   "tiny.toml", sets);
}

data::Loader open_loader(const train::TrainConfig& c) {
  data::LoaderOptions o;
  o.manifests = {dataset()};
  o.batch = c.micro_batch;
  o.seq = c.seq;
  return data::Loader(o);
}

// Each parameter's gradient of `row`'s mean token loss, in float64, in parameter order.
std::vector<std::vector<double>> row_gradient(const model::Llama& model, const model::Batch& row) {
  for (auto p : model.parameters()) p.zero_grad();
  ag::Tape tape;
  ag::Var loss;
  {
    ag::TapeScope scope(tape);
    loss = model.loss(row, ag::Reduction::mean);
  }
  tape.backward(loss);
  std::vector<std::vector<double>> g;
  for (auto p : model.parameters()) {
    const float* v = p.grad().data<float>();
    g.emplace_back(v, v + p.grad().numel());
    p.zero_grad();
  }
  return g;
}

std::string final_weights(const fs::path& run, int64_t step) {
  const fs::path c = run / "checkpoints" / io::checkpoint_name(step);
  return sha256_file(c / "model.safetensors") + sha256_file(c / "optimizer.safetensors");
}

}  // namespace

namespace {

// Each way of clipping (train::ClipMethod) against each sampled sequence's gradient clipped by
// hand in float64, with a clip between the norms: some sequences are clipped, some are not.
void expect_every_way_clips_as_by_hand(const train::TrainConfig& c) {
  const model::Llama model(c.model, 3);
  const data::Loader loader = open_loader(c);
  const int64_t expected_rows = c.batch_tokens / c.seq;  // 8
  optim::DpSgdOptions o = c.privacy;
  o.noise_multiplier = 0;
  // The sample of step 5, and each drawn sequence's gradient and its norm, by hand.
  const std::vector<int64_t> sample =
      optim::DpSgd(o, loader.windows_total(), expected_rows, 10).sample(5);
  ASSERT_GE(sample.size(), 3u);
  std::vector<std::vector<std::vector<double>>> grads;
  std::vector<double> norms;
  for (int64_t w : sample) {
    grads.push_back(row_gradient(model, loader.windows({w})));
    double squares = 0;
    for (const auto& t : grads.back())
      for (double v : t) squares += v * v;
    norms.push_back(std::sqrt(squares));
  }
  std::vector<double> sorted = norms;
  std::sort(sorted.begin(), sorted.end());
  const size_t half = sorted.size() / 2;
  o.clip = (sorted[half - 1] + sorted[half]) / 2;
  const int64_t clipped =
      std::count_if(norms.begin(), norms.end(), [&](double n) { return n > o.clip; });
  ASSERT_GT(clipped, 0);
  ASSERT_LT(clipped, static_cast<int64_t>(sample.size()));
  // sum_i min(1, C / |g_i|) g_i / B, against what the step left in the parameters' grads.
  const std::vector<ag::Var> params = model.parameters();
  auto relative_error = [&] {
    double error = 0, reference = 0;
    for (size_t p = 0; p < params.size(); ++p) {
      const float* g = params[p].grad().data<float>();
      for (size_t j = 0; j < grads[0][p].size(); ++j) {
        double want = 0;
        for (size_t i = 0; i < grads.size(); ++i)
          want += std::min(1.0, o.clip / (norms[i] + 1e-6)) * grads[i][p][j];
        want /= static_cast<double>(expected_rows);
        error += (g[j] - want) * (g[j] - want);
        reference += want * want;
      }
    }
    return std::sqrt(error / reference);
  };
  // The trainer's way: whole sample, automatic choice (batched for this short sequence).
  ASSERT_TRUE(train::batched_clipping_is_cheaper(c.model, c.seq));
  {
    optim::DpSgd dp(o, loader.windows_total(), expected_rows, 10);
    const train::PrivateGradient got =
        train::private_gradients(model, loader, dp, 5, c.micro_batch);
    EXPECT_EQ(got.rows, static_cast<int64_t>(sample.size()));
    EXPECT_EQ(got.clipped, clipped);
    EXPECT_LT(relative_error(), 1e-5);
  }
  // Each way by name; batched in passes of 1, 2 and every row.
  const model::Batch rows = loader.windows(sample);
  const std::pair<train::ClipMethod, int64_t> ways[] = {{train::ClipMethod::one_by_one, 1},
                                                        {train::ClipMethod::batched, 1},
                                                        {train::ClipMethod::batched, 2},
                                                        {train::ClipMethod::batched, 64}};
  for (const auto& [method, chunk] : ways) {
    SCOPED_TRACE("method " + std::to_string(static_cast<int>(method)) + ", rows per pass " +
                 std::to_string(chunk));
    for (auto p : params) p.zero_grad();  // the last way's release
    optim::DpSgd dp(o, loader.windows_total(), expected_rows, 10);
    dp.begin(params);
    train::add_clipped_rows(model, rows, dp, chunk, method);
    EXPECT_EQ(dp.clipped(), clipped);
    dp.release(5);
    EXPECT_LT(relative_error(), 1e-5);
  }
}

}  // namespace

TEST(PrivateTraining, TheStepsGradientIsTheMeanOfEachSequencesClippedGradient) {
  expect_every_way_clips_as_by_hand(tiny(temp_dir("grad"), 10));
  // The embedding table as the output head too: batched clipping adds the two uses' cross term.
  SCOPED_TRACE("tied embeddings");
  expect_every_way_clips_as_by_hand(
      tiny(temp_dir("grad_tied"), 10, {"model.tie_word_embeddings=true"}));
}

TEST(PrivateTraining, APreemptedRunResumesBitwiseAndReportsTheEpsilonItSpent) {
  const fs::path base = temp_dir("resume");
  const auto full = train_quiet(tiny(base / "full", 14));
  ASSERT_EQ(full.status, train::RunStatus::finished) << full.message;
  const auto cut = tiny(base / "cut", 14);
  auto r = train_quiet(cut, false, 6);
  ASSERT_EQ(r.status, train::RunStatus::preempted) << r.message;
  r = train_quiet(cut, true);
  ASSERT_EQ(r.status, train::RunStatus::finished) << r.message;
  EXPECT_EQ(final_weights(base / "cut", 14), final_weights(base / "full", 14));

  // Every step's record: the sample's size, the clipped and the epsilon spent so far, which is
  // the accountant's for that many Poisson-sampled Gaussians of multiplier 0.3 at q = 8 / N.
  const int64_t windows = open_loader(cut).windows_total();
  const double q = 8.0 / static_cast<double>(windows);
  const double delta = std::min(1e-5, 0.1 / static_cast<double>(windows));
  std::vector<nlohmann::json> steps;
  for (const auto& j : read_metrics(base / "cut"))
    if (j.contains("loss")) steps.push_back(j);
  ASSERT_EQ(steps.size(), 14u);
  EXPECT_EQ(steps, [&] {
    std::vector<nlohmann::json> s;
    for (const auto& j : read_metrics(base / "full"))
      if (j.contains("loss")) s.push_back(j);
    for (size_t i = 0; i < s.size(); ++i) {  // timings differ between the runs
      for (const char* k : {"tokens_per_s", "mfu", "elapsed_s", "rss_mb"}) s[i][k] = steps[i][k];
    }
    return s;
  }());
  optim::PrivacyAccountant accountant;
  for (size_t i = 0; i < steps.size(); ++i) {
    accountant.add(q, 0.3);
    EXPECT_NEAR(steps[i]["epsilon"].get<double>(), accountant.epsilon(delta).epsilon,
                1e-9 * accountant.epsilon(delta).epsilon);
    EXPECT_GT(steps[i]["sampled"].get<int64_t>(), 0);
    EXPECT_EQ(steps[i]["tokens"].get<int64_t>() - (i ? steps[i - 1]["tokens"].get<int64_t>() : 0),
              steps[i]["sampled"].get<int64_t>() * 16);
  }
  const auto summary = nlohmann::json::parse(read_file(base / "cut" / "summary.json"));
  EXPECT_EQ(summary["privacy"]["private_steps"], 14);
  EXPECT_DOUBLE_EQ(summary["privacy"]["noise_multiplier"].get<double>(), 0.3);
  EXPECT_DOUBLE_EQ(summary["privacy"]["epsilon"].get<double>(), steps.back()["epsilon"]);
  // The checkpoints are covered by the guarantee: no loss computed on the sample without noise.
  for (const auto& ck : io::list_checkpoints(base / "cut" / "checkpoints"))
    EXPECT_FALSE(nlohmann::json::parse(read_file(ck / "state.json")).contains("last_loss")) << ck;
  fs::remove_all(base);
}

TEST(PrivateTraining, StepsLostToACrashStayAccounted) {
  // Preempted at step 6 (checkpoints at 4 and 6), then the checkpoint of step 6 lost, as a crash
  // after step 4's checkpoint would leave it: steps 5 and 6 were released (their metrics
  // written) and are trained again, so 14 + 2 releases are accounted.
  const fs::path run = temp_dir("crash");
  const auto c = tiny(run, 14);
  ASSERT_EQ(train_quiet(c, false, 6).status, train::RunStatus::preempted);
  fs::remove_all(run / "checkpoints" / io::checkpoint_name(6));
  ::testing::internal::CaptureStderr();
  const auto r = train_quiet(c, true);
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(r.status, train::RunStatus::finished) << r.message;
  EXPECT_NE(log.find("2 private step(s) ran after the checkpoint resumed"), std::string::npos)
      << log;
  const auto summary = nlohmann::json::parse(read_file(run / "summary.json"));
  EXPECT_EQ(summary["privacy"]["private_steps"], 16);
  const int64_t windows = open_loader(c).windows_total();
  optim::PrivacyAccountant accountant;
  accountant.add(8.0 / static_cast<double>(windows), 0.3, 16);
  EXPECT_DOUBLE_EQ(summary["privacy"]["epsilon"].get<double>(),
                   accountant.epsilon(std::min(1e-5, 0.1 / static_cast<double>(windows))).epsilon);
  // The account outlives the checkpoints: a run without [privacy] there is refused, resumed
  // or not, as one with it is without --resume.
  fs::remove_all(run / "checkpoints");
  for (const bool resume : {false, true}) {
    const std::string e =
        pollen::testing::error_of([&] { train_quiet(tiny(run, 14, {}, ""), resume); });
    EXPECT_NE(e.find("this run's config has no [privacy] table"), std::string::npos) << e;
  }
  // A run that resumes non-private checkpoints of its own beside such an account goes on.
  const fs::path plain = temp_dir("crash_plain");
  ASSERT_EQ(train_quiet(tiny(plain, 4, {}, "")).status, train::RunStatus::finished);
  fs::copy_file(run / "privacy.json", plain / "privacy.json");
  EXPECT_EQ(train_quiet(tiny(plain, 6, {}, ""), true).status, train::RunStatus::finished);
  fs::remove_all(plain);
  fs::remove_all(run);
}

TEST(PrivateTraining, ALargeSampleLearnsThroughTheNoise) {
  // 128 of the 305 sequences expected per step: the noise's norm, 0.3 sqrt(22688) / 128 = 0.35,
  // is below the clipped mean's.
  const fs::path run = temp_dir("learns");
  const auto r = train_quiet(tiny(run, 30, {"train.batch_tokens=2048", "eval.interval=0"}));
  ASSERT_EQ(r.status, train::RunStatus::finished) << r.message;
  std::vector<double> losses;
  for (const auto& j : read_metrics(run))
    if (j.contains("loss")) losses.push_back(j["loss"].get<double>());
  ASSERT_EQ(losses.size(), 30u);
  EXPECT_LT(losses.back(), losses.front() - 1.0);  // 4.15 to 2.58 when written
  fs::remove_all(run);
}

TEST(PrivateTraining, RefusesWhatWouldBreakItsGuarantee) {
  const fs::path base = temp_dir("refuse");
  // A private run resumed without [privacy], and a plain one resumed with it.
  ASSERT_EQ(train_quiet(tiny(base / "private", 4)).status, train::RunStatus::finished);
  EXPECT_NE(error_of([&] {
              train_quiet(tiny(base / "private", 6, {}, ""), true);
            }).find("trained under [privacy]"),
            std::string::npos);
  // A changed key of [privacy], or one it did not have (delta took its default).
  for (const std::string key : {"privacy.delta", "privacy.noise_seed"}) {
    const std::string set = key + (key == "privacy.delta" ? "=1e-3" : "=12");
    const std::string error =
        error_of([&] { train_quiet(tiny(base / "private", 6, {set}), true); });
    EXPECT_NE(error.find("cannot resume: "), std::string::npos) << error;
    EXPECT_NE(error.find(key), std::string::npos) << error;
    // The checkpoint's unset key is named so, not by the 0 or -1 that stands for it.
    if (key == "privacy.delta")
      EXPECT_NE(error.find("privacy.delta (unset -> 0.001)"), std::string::npos) << error;
  }
  // How the noise is drawn may change (docs/training.md): the accountant sees the same steps.
  const auto secure = train_quiet(tiny(base / "private", 6, {"privacy.secure_noise=true"}), true);
  EXPECT_EQ(secure.status, train::RunStatus::finished) << secure.message;
  ASSERT_EQ(train_quiet(tiny(base / "plain", 4, {}, "")).status, train::RunStatus::finished);
  EXPECT_NE(error_of([&] {
              train_quiet(tiny(base / "plain", 6), true);
            }).find("were not trained under [privacy]"),
            std::string::npos);
  // A fresh run in a folder that holds an earlier private run's account.
  fs::remove_all(base / "private" / "checkpoints");
  EXPECT_NE(error_of([&] { train_quiet(tiny(base / "private", 4)); }).find("--resume"),
            std::string::npos);
  // What DP-SGD does not do yet.
  EXPECT_NE(error_of([&] {
              train_quiet(tiny(base / "gpu", 2, {"run.device=\"cuda\""}));
            }).find("on the CPU"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              train_quiet(tiny(base / "mix", 2, {"data.weights=[1.0]"}));
            }).find("data.weights"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              train_quiet(tiny(base / "val", 2, {"data.validation_split=\"train\""}));
            }).find("held-out split"),
            std::string::npos);
  // The training data's manifest by another path (a link or a copy would do the same): the same
  // dataset, so the same records.
  const std::string respelled = (dataset().parent_path() / "." / dataset().filename()).string();
  EXPECT_NE(error_of([&] {
              train_quiet(tiny(base / "val2", 2,
                               {"data.validation_split=\"train\"",
                                "data.validation_manifests=[\"" + respelled + "\"]"}));
            }).find("held-out split"),
            std::string::npos);
  // The run file: a clip, and exactly one of the noise and the target epsilon.
  EXPECT_NE(error_of([&] {
              tiny(base / "x", 2, {}, "\n[privacy]\nnoise_multiplier = 1.0\n");
            }).find("privacy.clip"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              tiny(base / "x", 2, {},
                   "\n[privacy]\nclip = 1.0\nnoise_multiplier = 1.0\ntarget_epsilon = 3\n");
            }).find("either noise_multiplier"),
            std::string::npos);
  fs::remove_all(base);
}
