// The pollen binary as a user runs it: help, version, bench step and its errors.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "base/error.h"
#include "base/files.h"

namespace {

struct CliRun {
  int status;
  std::string output;
};

CliRun run_shell(const std::string& command) {
  const std::string cmd = command + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf{};
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  int status = pclose(p);
  return {WEXITSTATUS(status), out};
}

CliRun run_pollen(const std::string& args) {
  return run_shell(std::string(POLLEN_BINARY) + " " + args);
}

// Results on stdout that cannot be written (a full disk) fail the command, not exit 0.
TEST(Cli, OutputThatCannotBeWrittenFailsTheCommand) {
  CliRun r = run_shell("{ " + std::string(POLLEN_BINARY) + " version > /dev/full; }");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("pollen: error: cannot write to standard output: No space left on "
                          "device"),
            std::string::npos)
      << r.output;
}

// fed certs --revoke makes no certificate: options that would shape one are refused beside it,
// not silently left out (a --client given with it got no certificate, and exit 0).
TEST(Cli, FedCertsRevokeRefusesTheOptionsOfANewCertificate) {
  for (const std::string& other :
       {"--client ok3", "--server-name localhost", "--days 3", "--replace"}) {
    const CliRun r = run_pollen("fed certs --dir " + ::testing::TempDir() +
                                "pollen_revoke_only --revoke ok1 " + other);
    EXPECT_EQ(r.status, 2) << other << ": " << r.output;
    EXPECT_NE(r.output.find("excludes --revoke"), std::string::npos) << other << ": " << r.output;
  }
  EXPECT_FALSE(std::filesystem::exists(::testing::TempDir() + "pollen_revoke_only"));
}

TEST(Cli, HelpListsCommands) {
  CliRun r = run_pollen("--help");
  EXPECT_EQ(r.status, 0);
  EXPECT_NE(r.output.find("version"), std::string::npos);
  EXPECT_NE(r.output.find("bench"), std::string::npos);
}

TEST(Cli, VersionNamesCommitAndBackends) {
  CliRun r = run_pollen("version");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("commit "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("cuda: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("OpenBLAS"), std::string::npos) << r.output;
}

TEST(Cli, BenchStepPrintsOneJsonLine) {
  CliRun r = run_pollen(
      "bench step --model llama-tiny --batch 1 --seq 16 --steps 1 --warmup 0 --threads 1");
  ASSERT_EQ(r.status, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["model"], "llama-tiny");
  EXPECT_EQ(j["params"], 4 * (4 * 256 * 256 + 3 * 256 * 688 + 512) + 256 + 2 * 4096 * 256);
  EXPECT_GT(j["tokens_per_s"].get<double>(), 0);
  EXPECT_GT(j["peak_rss_mb"].get<double>(), 0);
  EXPECT_NEAR(j["loss"].get<double>(), std::log(4096.0), 0.5);  // random init: about log V
  EXPECT_EQ(j["device"], "cpu");
  // In tensors at the peak at least the f32 weights, their gradients and AdamW's two moments.
  const double state_mb = 16.0 * j["params"].get<double>() / (1 << 20);
  EXPECT_GE(j["peak_device_mb"].get<double>(), std::floor(state_mb));
  EXPECT_GE(j["peak_device_reserved_mb"].get<double>(), j["peak_device_mb"].get<double>());
}

// A CUDA build loads cuBLASLt at its first GEMM on a GPU (about 150 MB mapped), so a CPU run
// never maps it. The loader's own log (LD_DEBUG) names every library a process opens.
TEST(Cli, CpuTrainingStepNeverLoadsCublasLt) {
  const CliRun r = run_shell("env LD_DEBUG=files " + std::string(POLLEN_BINARY) +
                             " bench step --model llama-tiny --batch 1 --seq 16 --steps 1 "
                             "--warmup 0 --threads 1 --device cpu");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("file=libopenblas"), std::string::npos) << r.output;  // the log works
#ifdef POLLEN_HAVE_CUDA
  EXPECT_NE(r.output.find("file=libcudart"), std::string::npos) << r.output;
#endif
  EXPECT_EQ(r.output.find("libcublasLt"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("\"tokens_per_s\""), std::string::npos) << r.output;
}

TEST(Cli, BenchStepHoldsLessAtItsPeakWhenLayersAreRecomputed) {
  const std::string args =
      "bench step --model llama-tiny --batch 4 --seq 256 --steps 1 --warmup 1 --threads 1";
  CliRun kept = run_pollen(args), recomputed = run_pollen(args + " --recompute");
  ASSERT_EQ(kept.status, 0) << kept.output;
  ASSERT_EQ(recomputed.status, 0) << recomputed.output;
  const auto jk = nlohmann::json::parse(kept.output), jr = nlohmann::json::parse(recomputed.output);
  // Four layers' activations of 1024 tokens, about 16 KB a token each (64 MiB), against one
  // layer's and the layers' inputs: at the start of backward, the peak of both runs.
  EXPECT_LT(jr["peak_device_mb"].get<double>() + 40, jk["peak_device_mb"].get<double>());
  EXPECT_EQ(jr["losses"], jk["losses"]);  // the same steps
}

TEST(Cli, BenchStepListsEveryStepsLossTheSameForTheSameSeed) {
  const std::string args =
      "bench step --model llama-tiny --batch 1 --seq 16 --steps 2 --warmup 1 --threads 1 --seed 3";
  CliRun a = run_pollen(args), b = run_pollen(args);
  ASSERT_EQ(a.status, 0) << a.output;
  ASSERT_EQ(b.status, 0) << b.output;
  const auto ja = nlohmann::json::parse(a.output), jb = nlohmann::json::parse(b.output);
  ASSERT_EQ(ja["losses"].size(), 3u);  // the warm-up step first
  EXPECT_EQ(ja["losses"], jb["losses"]);
  EXPECT_NEAR(ja["losses"][2].get<double>(), ja["loss"].get<double>(), 1e-3);
  // AdamW stepped between them: another loss on the same tokens.
  EXPECT_NE(ja["losses"][0], ja["losses"][1]);
}

TEST(Cli, BenchStepProfileTimesEveryOpOfTheStep) {
  CliRun r = run_pollen(
      "bench step --model llama-tiny --batch 1 --seq 16 --steps 2 --warmup 1 --threads 1 "
      "--profile");
  ASSERT_EQ(r.status, 0) << r.output;
  // The table (stderr) names the time no op covers; the JSON line is the last line.
  EXPECT_NE(r.output.find("other"), std::string::npos) << r.output;
  const size_t line = r.output.rfind("\n{");
  ASSERT_NE(line, std::string::npos) << r.output;
  const auto j = nlohmann::json::parse(r.output.substr(line + 1));
  std::map<std::string, double> calls;
  double ms = 0;
  for (const auto& op : j["ops"]) {
    calls[op["op"].get<std::string>()] = op["calls_per_step"].get<double>();
    ms += op["ms_per_step"].get<double>();
  }
  // llama-tiny: 4 layers, each with two norms, one attention and one MLP; the final norm, the
  // embedding and the loss once. Per timed step, whatever the warm-up.
  EXPECT_EQ(calls["embedding_forward"], 1);
  EXPECT_EQ(calls["rmsnorm_forward"], 9);
  EXPECT_EQ(calls["rmsnorm_backward"], 9);
  EXPECT_EQ(calls["attention_forward"], 4);
  EXPECT_EQ(calls["attention_backward"], 4);
  EXPECT_EQ(calls["swiglu_forward"], 4);
  EXPECT_EQ(calls["cross_entropy"], 1);
  EXPECT_EQ(calls["adamw"], 1);
  EXPECT_GT(calls["gemm"], 0);
  EXPECT_GT(ms, 0);
  EXPECT_LE(ms, j["step_ms"].get<double>() * 1.01);  // the ops lie inside the step
}

TEST(Cli, CudaWithoutAUsableGpuFailsNamingTheReason) {
  CliRun r = run_pollen("bench step --model llama-tiny --batch 1 --seq 16 --steps 1 --device cuda");
  if (r.status == 0) GTEST_SKIP() << "a GPU is usable here";
  EXPECT_EQ(r.status, 1) << r.output;
  // Built with CUDA: "device 'cuda' is not usable here: <the runtime's reason>"; without: the
  // missing backend.
  EXPECT_NE(r.output.find("device 'cuda'"), std::string::npos) << r.output;
  r = run_pollen("bench step --device tpu");  // a bad command line: exit code 2
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--device: tpu not in {cpu,cuda}"), std::string::npos) << r.output;
}

TEST(Cli, UnknownPresetAndBadFlagsFailClearly) {
  CliRun r = run_pollen("bench step --model llama-huge --steps 1");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("unknown model preset 'llama-huge'"), std::string::npos) << r.output;
  r = run_pollen("bench step --batch nine");
  EXPECT_NE(r.status, 0);
  // Noise without clipping would run plain steps and print them as DP-SGD.
  r = run_pollen("bench step --model llama-tiny --steps 1 --dp-clip 0 --dp-noise 1");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("--dp-noise needs a positive --dp-clip"), std::string::npos) << r.output;
  // Past the model's positions rotary has no trained angles (and --seq 100000 ran for minutes).
  r = run_pollen("bench step --model llama-tiny --seq 5000 --steps 1");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("--seq 5000 is more than the model's max_position_embeddings (2048)"),
            std::string::npos)
      << r.output;
  // Every example of synth is made in memory first: a count past the bound is refused by name.
  r = run_pollen(
      "sft synth --task arithmetic --count 10000000000 --out /tmp/pollen_cli_synth.jsonl");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--count"), std::string::npos) << r.output;
  r = run_pollen("frobnicate");
  EXPECT_NE(r.status, 0);
}

// CLI11 alone turns -1 and numbers past 2^64-1 into 2^64-1: two different seeds would give the
// same file. Every seed option takes decimal whole numbers that fit and refuses the rest.
TEST(Cli, SeedsOutsideSixtyFourBitsAreRefused) {
  for (const char* command :
       {"dpo synth --count 2 --out /tmp/pollen_cli_seed.jsonl", "bench step --steps 1",
        "sft synth --task arithmetic --count 2 --out /tmp/pollen_cli_seed.jsonl"}) {
    for (const char* seed : {"-1", "18446744073709551616", "12abc"}) {
      CliRun r = run_pollen(pollen::cat(command, " --seed ", seed));
      EXPECT_EQ(r.status, 2) << command << " --seed " << seed << ": " << r.output;
      EXPECT_NE(r.output.find(pollen::cat("'", seed,
                                          "': expected a whole number from 0 to "
                                          "18446744073709551615")),
                std::string::npos)
          << r.output;
    }
  }
  CliRun r = run_pollen(
      "dpo synth --count 2 --seed 18446744073709551615 --out /tmp/pollen_cli_seed.jsonl");
  EXPECT_EQ(r.status, 0) << r.output;
  std::remove("/tmp/pollen_cli_seed.jsonl");
}

// The bench commands' numbers out of range are refused naming the flag (exit code 2), rather
// than run as something else (--reps 0 ran once, --threads -3 on every thread).
TEST(Cli, BenchNumbersOutOfRangeAreRefusedByFlag) {
  const std::pair<const char*, const char*> refused[] = {
      {"bench gemm --size 0", "--size"},
      {"bench gemm --size -5", "--size"},
      {"bench gemm --reps 0 --size 16", "--reps"},
      {"bench gemm --threads -1 --size 16", "--threads"},
      {"bench step --warmup -5 --steps 1", "--warmup"},
      {"bench step --threads -3 --steps 1", "--threads"}};
  for (const auto& [args, flag] : refused) {
    CliRun r = run_pollen(args);
    EXPECT_EQ(r.status, 2) << args << ": " << r.output;
    EXPECT_NE(r.output.find(flag), std::string::npos) << args << ": " << r.output;
  }
  // secagg reports the graph's degree the round ran on beside the --neighbours asked for.
  CliRun r = run_pollen("bench secagg --clients 3 --params 10 --neighbours 10");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output.substr(r.output.find('{')));
  EXPECT_EQ(j["neighbours"], 10);
  EXPECT_EQ(j["degree"], 2);
}

// bench checkpoint writes step 1 of random weights and deletes it: a folder already holding a
// step 1 (a run's checkpoints) is refused and left as it was.
TEST(Cli, BenchCheckpointLeavesARunsCheckpointAlone) {
  const std::string dir = "/tmp/pollen_cli_bench_checkpoint";
  std::filesystem::remove_all(dir);
  CliRun r = run_pollen(pollen::cat("bench checkpoint --model llama-tiny --dir ", dir));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("\"bytes\":"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir + "/step-00000001"));
  // One it kept is its own: written over.
  r = run_pollen(pollen::cat("bench checkpoint --model llama-tiny --keep --dir ", dir));
  ASSERT_EQ(r.status, 0) << r.output;
  r = run_pollen(pollen::cat("bench checkpoint --model llama-tiny --dir ", dir));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir + "/step-00000001"));
  std::filesystem::create_directories(dir + "/step-00000001");
  pollen::write_file_atomic(dir + "/step-00000001/model.safetensors", "a run's weights");
  r = run_pollen(pollen::cat("bench checkpoint --model llama-tiny --dir ", dir));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("already holds"), std::string::npos) << r.output;
  EXPECT_EQ(pollen::read_file(dir + "/step-00000001/model.safetensors"), "a run's weights");
  std::filesystem::remove_all(dir);
}

// CLI11 checks required options before unknown ones: a mistyped --config must be named as not
// understood, not reported as a missing --config; exit code 2 either way.
TEST(Cli, AMistypedRequiredOptionIsNamedNotReportedMissing) {
  for (const char* command : {"train", "fed simulate", "sft"}) {
    CliRun r = run_pollen(pollen::cat(command, " --confg run.toml"));
    EXPECT_EQ(r.status, 2) << command << ": " << r.output;
    EXPECT_NE(r.output.find("were not expected:"), std::string::npos)
        << command << ": " << r.output;
    EXPECT_NE(r.output.find(" --confg"), std::string::npos) << command << ": " << r.output;
    EXPECT_EQ(r.output.find("--config is required"), std::string::npos) << r.output;
    r = run_pollen(command);
    EXPECT_EQ(r.status, 2) << command << ": " << r.output;
    EXPECT_NE(r.output.find("--config is required"), std::string::npos)
        << command << ": " << r.output;
  }
  // launch passes the rest on: a missing --nproc is named, not the command it would start.
  const CliRun r = run_pollen("launch train --config x.toml");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--nproc is required"), std::string::npos) << r.output;
}

}  // namespace
