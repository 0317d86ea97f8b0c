// model.init_from of `pollen train`: a run starts from exactly a checkpoint's weights with a
// fresh optimizer, and a checkpoint of another architecture is refused naming what differs.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>

#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "train/config.h"
#include "train/run_checks.h"
#include "train/tiny_run.h"
#include "train/trainer.h"

namespace fs = std::filesystem;
using namespace pollen;

namespace {

fs::path temp_dir(const std::string& name) {
  return test_support::fresh_temp_dir("init_from_" + name);
}

using test_support::train_quiet;

// The tiny run over `manifest` in `run`, `steps` long, with --set's `sets`.
train::TrainConfig tiny_config(const fs::path& run, const fs::path& manifest, int steps,
                               std::vector<std::string> sets) {
  return train::parse_train_config(test_support::tiny_run_toml(run, manifest, steps), "t.toml",
                                   sets);
}

// Names of the tensors whose bytes differ between two safetensors files (all of them must exist
// in both).
std::vector<std::string> differing_tensors(const fs::path& a, const fs::path& b) {
  const auto fa = io::read_safetensors(a), fb = io::read_safetensors(b);
  EXPECT_EQ(fa.tensors.size(), fb.tensors.size());
  std::vector<std::string> out;
  for (const auto& [name, t] : fa.tensors) {
    const Tensor* u = fb.find(name);
    if (!u || u->nbytes() != t.nbytes() || std::memcmp(u->raw(), t.raw(), t.nbytes()) != 0)
      out.push_back(name);
  }
  return out;
}

}  // namespace

TEST(InitFrom, RunStartsFromExactlyTheCheckpointsWeightsWithAFreshOptimizer) {
  const fs::path dir = temp_dir("exact");
  const fs::path manifest = test_support::make_tiny_dataset(dir / "data", 60);
  auto config = [&](const fs::path& run, int steps, std::vector<std::string> sets) {
    return tiny_config(run, manifest, steps, std::move(sets));
  };
  ASSERT_EQ(train_quiet(config(dir / "a", 8, {})).status, train::RunStatus::finished);
  const fs::path a8 = dir / "a/checkpoints" / io::checkpoint_name(8);

  // One step at lr 1e-30 (weight decay 0) moves no float32 weight of these magnitudes, so the
  // first checkpoint holds the weights the run started from.
  const std::vector<std::string> still = {"optimizer.lr=1e-30", "schedule.min_lr=0",
                                          "optimizer.weight_decay=0", "checkpoint.interval=1"};
  auto with = [&](std::vector<std::string> sets, const std::string& init_from) {
    if (!init_from.empty()) sets.push_back("model.init_from=\"" + init_from + "\"");
    return sets;
  };
  // A step folder and the run folder (its newest checkpoint, step 8) give the same start.
  for (const auto& [name, spec] : {std::pair<std::string, fs::path>{"b", a8}, {"c", dir / "a"}}) {
    const auto r = train_quiet(config(dir / name, 1, with(still, spec.string())));
    ASSERT_EQ(r.status, train::RunStatus::finished) << r.message;
    const fs::path first = dir / name / "checkpoints" / io::checkpoint_name(1);
    EXPECT_EQ(differing_tensors(a8 / "model.safetensors", first / "model.safetensors"),
              std::vector<std::string>{})
        << spec;
    // The optimizer starts fresh: one step taken, not 8 + 1.
    EXPECT_EQ(io::read_safetensors(first / "optimizer.safetensors").metadata.at("step"), "1");
  }
  // The resolved config records where the run started.
  const auto saved = train::load_train_config(dir / "b/config.toml");
  EXPECT_EQ(saved.init_from, a8.string());

  // Without init_from the same run starts from run.seed's weights: every tensor but the norms
  // (ones) differs.
  ASSERT_EQ(train_quiet(config(dir / "d", 1, still)).status, train::RunStatus::finished);
  const auto differ =
      differing_tensors(a8 / "model.safetensors",
                        dir / "d/checkpoints" / io::checkpoint_name(1) / "model.safetensors");
  EXPECT_GE(differ.size(), 7u);
  fs::remove_all(dir);
}

TEST(InitFrom, AnotherArchitectureOrAModelWithoutWeightsIsRefused) {
  const fs::path dir = temp_dir("refused");
  const fs::path manifest = test_support::make_tiny_dataset(dir / "data", 60);
  ASSERT_EQ(train_quiet(train::parse_train_config(
                            test_support::tiny_run_toml(dir / "a", manifest, 4), "t.toml"))
                .status,
            train::RunStatus::finished);
  const std::string a4 = (dir / "a/checkpoints" / io::checkpoint_name(4)).string();
  auto error_of = [&](std::vector<std::string> sets) {
    try {
      train_quiet(train::parse_train_config(test_support::tiny_run_toml(dir / "b", manifest, 2),
                                            "t.toml", sets));
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  // hidden_size 48 (the checkpoint's is 32) and 3 layers (its 2): both named, nothing trained.
  const std::string e = error_of(
      {"model.init_from=\"" + a4 + "\"", "model.hidden_size=48", "model.num_hidden_layers=3"});
  EXPECT_NE(e.find("model.init_from"), std::string::npos) << e;
  EXPECT_NE(e.find("hidden_size: expected 48, got 32"), std::string::npos) << e;
  EXPECT_NE(e.find("num_hidden_layers: expected 3, got 2"), std::string::npos) << e;
  EXPECT_EQ(e.find("intermediate_size"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(dir / "b")) << "a refused run leaves no folder behind";
  // A preset names an architecture, not weights.
  const std::string p = error_of({"model.init_from=\"llama-tiny\""});
  EXPECT_NE(p.find("holds no weights"), std::string::npos) << p;
  // A folder that is no model.
  const std::string f = error_of({"model.init_from=\"" + (dir / "data").string() + "\""});
  EXPECT_NE(f.find("neither an HF directory"), std::string::npos) << f;
  fs::remove_all(dir);
}

TEST(InitFrom, AResumedRunNeedsTheWeightsItStartedFromNoLonger) {
  const fs::path dir = temp_dir("resume");
  const fs::path manifest = test_support::make_tiny_dataset(dir / "data", 60);
  ASSERT_EQ(train_quiet(tiny_config(dir / "warm", manifest, 4, {})).status,
            train::RunStatus::finished);
  const fs::path warm4 = dir / "warm/checkpoints" / io::checkpoint_name(4);
  const std::vector<std::string> from_warm = {"model.init_from=\"" + warm4.string() + "\"",
                                              "checkpoint.interval=2"};
  ASSERT_EQ(train_quiet(tiny_config(dir / "whole", manifest, 6, from_warm)).status,
            train::RunStatus::finished);

  // Stopped after step 2, its starting weights gone, then resumed: the same run as the whole one.
  ASSERT_NE(train_quiet(tiny_config(dir / "split", manifest, 6, from_warm), false, 2).status,
            train::RunStatus::finished);
  fs::rename(dir / "warm", dir / "warm-gone");
  const auto r = train_quiet(tiny_config(dir / "split", manifest, 6, from_warm), true);
  ASSERT_EQ(r.status, train::RunStatus::finished) << r.message;
  const fs::path last = fs::path("checkpoints") / io::checkpoint_name(6) / "model.safetensors";
  EXPECT_EQ(differing_tensors(dir / "whole" / last, dir / "split" / last),
            std::vector<std::string>{});

  // A fresh run still needs them, and says which key named them.
  try {
    train_quiet(tiny_config(dir / "fresh", manifest, 6, from_warm));
    ADD_FAILURE() << "a run from missing weights started";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("model.init_from: "), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}
