#include "cli/post_command.h"

#include <cctype>
#include <filesystem>
#include <fstream>
#include <memory>
#include <vector>

#include "base/error.h"
#include "base/log.h"
#include "cli/commands.h"
#include "cli/run_job.h"
#include "dist/communicator.h"
#include "dist/same_inputs.h"

namespace pollen::cli {

const char* const kPostExitCodes =
    "\nExit codes: 0 finished, 1 failed (bad config or data, too many non-finite losses in a "
    "row, any error), 3 preempted (SIGINT or SIGTERM: the step finished and a checkpoint was "
    "written; rerun with --resume), 4 a rank of a data-parallel job died or hung (sft, dpo, rm, "
    "grpo; rerun with --resume), 2 bad command line.";

const char* const kPostDataParallel =
    "\nData parallel: run it under mpirun -np N, srun, or pollen launch --nproc N "
    "(docs/parallel.md).";

void add_post_run_options(CLI::App* cmd, const std::string& objective,
                          const std::string& set_example, PostRun run) {
  cmd->require_subcommand(0, 1);
  auto config = std::make_shared<std::string>();
  auto sets = std::make_shared<std::vector<std::string>>();
  auto resume = std::make_shared<bool>(false);
  cmd->add_option("--config", *config, "Run file (TOML)");
  cmd->add_option("--set", *sets,
                  "Override a key, e.g. --set train.steps=200 --set " + set_example +
                      " (value in TOML syntax; a bare word is a string)")
      ->check(key_equals_value());
  cmd->add_flag("--resume", *resume,
                "Continue from the newest checkpoint under run.dir/checkpoints that verifies "
                "(starts at step 0 when there is none yet)");
  cmd->callback([cmd, config, sets, resume, objective, run] {
    if (!cmd->get_subcommands().empty()) return;  // a subcommand ran
    if (config->empty()) throw CLI::RequiredError("--config");
    const train::PostConfig cfg = train::load_post_config(*config, objective, *sets);
    // One process unless a launcher (mpirun, srun) started several (docs/parallel.md).
    train::PostOptions o;
    o.fault = train::fault_from_environment();
    const auto comm = train::connect_ranks(cfg.timeout_s, o.fault);
    if (comm->rank() != 0) log::follow_job_lead();  // rank 0 reports for the job
    o.resume = *resume;
    o.comm = comm.get();
    run_as_job(*comm, [&]() -> train::RunResult {
      dist::check_ranks_run_the_same(*comm,
                                     {*config, rank_options(*sets, *resume), cfg.data_files()});
      return run(cfg, o);
    });
  });
}

void add_task_synth(CLI::App* cmd, const std::string& description, const std::string& what,
                    std::function<std::string(const train::SynthExample&)> line) {
  auto* synth = cmd->add_subcommand("synth", description);
  struct Args {
    std::string task, out;
    int64_t count = 1000;
    uint64_t seed = 0;
    int digits = 2;
  };
  auto a = std::make_shared<Args>();
  std::string count_help = what + " to write";
  count_help[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(count_help[0])));
  synth->add_option("--task", a->task, "arithmetic, reverse or upper")
      ->required()
      ->check(CLI::IsMember(train::synth_task_names()));
  // Every example is made in memory before the file is written.
  synth->add_option("--count", a->count, count_help + " (1 to 10000000)")
      ->check(CLI::Range(int64_t{1}, int64_t{10'000'000}))
      ->capture_default_str();
  synth->add_option("--seed", a->seed, "Seed (the same seed writes the same file)")
      ->check(seed_number())
      ->capture_default_str();
  synth->add_option("--digits", a->digits, "arithmetic: operands of at most this many digits")
      ->check(CLI::Range(1, 9))
      ->capture_default_str();
  synth->add_option("--out", a->out, "JSONL file to write")->required();
  synth->callback([a, what, line] {
    const auto examples = train::synth_examples(a->task, a->count, a->seed, a->digits);
    const std::filesystem::path parent = std::filesystem::path(a->out).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent);
    std::ofstream out(a->out, std::ios::binary);
    POLLEN_CHECK(out.good(), "cannot write '", a->out, "'");
    for (const auto& e : examples) out << line(e) << "\n";
    out.close();
    POLLEN_CHECK(out.good(), "cannot write '", a->out, "'");
    log::info("wrote ", examples.size(), " ", a->task, " ", what, " to '", a->out, "'");
  });
}

}  // namespace pollen::cli
