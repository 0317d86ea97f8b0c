// pollen sft as several ranks under mpirun: the training of one process (LoRA dropout included),
// one writer of the run's files, and a checkpoint resumed at another world size.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/files.h"
#include "io/checkpoint.h"
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

// `pollen sft` on the run file as `ranks` processes (1: no mpirun) into run.dir = `out`.
int sft(int ranks, const fs::path& out, const std::string& extra, std::string* output) {
  std::string cmd;
  if (ranks > 1) {
    cmd = "mpirun --oversubscribe --bind-to none -np " + std::to_string(ranks) + " ";
    if (geteuid() == 0) cmd += "--allow-run-as-root ";
  }
  cmd += std::string(POLLEN_BINARY) + " sft --config " + sft_run().config.string() +
         " --set run.dir=" + out.string() + " " + extra;
  int status = 0;
  *output = pollen::testing::run_capture(cmd, &status);
  return status;
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
                  const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(a[i], b[i], 1e-5 * std::max(1.0, std::abs(b[i]))) << what << " record " << i;
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

  // Three ranks cannot share 4 micro-batches evenly: refused naming the key.
  EXPECT_EQ(sft(3, dir / "three", "", &out), 1) << out;
  EXPECT_NE(out.find("sft.accumulation (4) is not a multiple of the job's 3 ranks"),
            std::string::npos)
      << out;
}
