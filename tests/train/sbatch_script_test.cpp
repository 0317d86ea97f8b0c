// configs/train/parallel-sbatch.sh's resubmission, run with stand-ins for srun (exits with the
// code the test asks for) and sbatch (records its arguments): a job that stopped resubmits
// itself, and exit code 4 in a row stops doing so after the third resubmission.
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <utility>

#include "base/files.h"
#include "support/process.h"
#include "train/tiny_run.h"

namespace fs = std::filesystem;
using namespace pollen;

namespace {

struct Job {
  int exit_code = -1;
  std::string output, sbatch_args;  // sbatch_args: empty when the job did not resubmit
};

// One batch job whose srun exits with `srun_status`; `failed_before`: the job's
// POLLEN_FAILED_RESUBMITS (empty: unset, as in the first job).
Job run_job(const fs::path& dir, int srun_status, const std::string& failed_before) {
  const fs::path bin = dir / "bin", recorded = dir / "sbatch-args";
  fs::create_directories(bin);
  fs::remove(recorded);
  write_file_atomic(bin / "srun", "#!/bin/sh\nexit " + std::to_string(srun_status) + "\n");
  write_file_atomic(bin / "sbatch", "#!/bin/sh\necho \"$*\" > '" + recorded.string() + "'\n");
  fs::permissions(bin / "srun", fs::perms::owner_all);
  fs::permissions(bin / "sbatch", fs::perms::owner_all);
  std::string cmd = "env -u POLLEN_FAILED_RESUBMITS PATH=" + bin.string() +
                    ":\"$PATH\" SLURM_JOB_NUM_NODES=1 SLURM_NTASKS=2 SLURM_NTASKS_PER_NODE=2 "
                    "SLURM_CPUS_PER_TASK=1 ";
  if (!failed_before.empty()) cmd += "POLLEN_FAILED_RESUBMITS=" + failed_before + " ";
  cmd += "bash " + std::string(POLLEN_SOURCE_DIR) +
         "/configs/train/parallel-sbatch.sh run.toml --set train.steps=9";
  Job job;
  job.output = pollen::testing::run_capture(cmd, &job.exit_code);
  std::ifstream in(recorded);
  std::getline(in, job.sbatch_args);
  return job;
}

TEST(SbatchScript, ResubmitsAStoppedJobAndStopsAfterThreeFailuresInARow) {
  const fs::path dir = test_support::fresh_temp_dir("sbatch_script");
  // Finished: nothing to resubmit.
  Job job = run_job(dir, 0, "");
  EXPECT_EQ(job.exit_code, 0) << job.output;
  EXPECT_EQ(job.sbatch_args, "");
  // A rank died or hung: resubmitted with the same shape and options, counting the failure.
  const std::pair<std::string, std::string> counts[] = {{"", "1"}, {"1", "2"}, {"2", "3"}};
  for (const auto& [before, after] : counts) {
    job = run_job(dir, 4, before);
    EXPECT_EQ(job.exit_code, 4) << job.output;
    EXPECT_NE(job.sbatch_args.find("--export=ALL,POLLEN_FAILED_RESUBMITS=" + after +
                                   " --nodes=1 --ntasks=2 --ntasks-per-node=2 --cpus-per-task=1 "),
              std::string::npos)
        << before << ": " << job.sbatch_args;
    EXPECT_NE(job.sbatch_args.find("run.toml --set train.steps=9"), std::string::npos)
        << job.sbatch_args;
  }
  // The fourth exit code 4 in a row: not resubmitted, saying why.
  job = run_job(dir, 4, "3");
  EXPECT_EQ(job.exit_code, 4) << job.output;
  EXPECT_EQ(job.sbatch_args, "");
  EXPECT_NE(job.output.find("exit code 4 (a rank died or hung) again after 3 resubmissions in a "
                            "row; not resubmitting"),
            std::string::npos)
      << job.output;
  // Preempted: resubmitted, and the count of failures starts again.
  job = run_job(dir, 3, "3");
  EXPECT_EQ(job.exit_code, 3) << job.output;
  EXPECT_NE(job.sbatch_args.find("--export=ALL,POLLEN_FAILED_RESUBMITS=0 "), std::string::npos)
      << job.sbatch_args;
}

}  // namespace
