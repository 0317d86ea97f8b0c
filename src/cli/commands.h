#pragma once
// Each subcommand registers itself on the root app; its callback does the wiring and nothing
// else (logic lives in the library layers).
#include <CLI/CLI.hpp>

#include <charconv>
#include <cstdint>
#include <string>
#include <vector>

namespace pollen::cli {

void add_version_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_bench_checkpoint_command(CLI::App& app);  // under `bench`: call after add_bench_command
void add_bench_secagg_command(CLI::App& app);      // under `bench`: call after add_bench_command
void add_train_command(CLI::App& app);
void add_plot_command(CLI::App& app);
void add_tokenizer_command(CLI::App& app);
void add_data_command(CLI::App& app);
void add_fed_command(CLI::App& app);
void add_fed_post_command(CLI::App& app);     // under `fed`: call after add_fed_command
void add_fed_privacy_command(CLI::App& app);  // under `fed`: call after add_fed_command
void add_export_command(CLI::App& app);
void add_generate_command(CLI::App& app);
void add_eval_command(CLI::App& app);
void add_score_command(CLI::App& app);
void add_launch_command(CLI::App& app);
// Refuses, before any command runs, a command other than train and fed client that a launcher
// (mpirun, srun, pollen launch) started as several ranks (dist/launch.h).
void refuse_ranks_unless_supported(const CLI::App& app);
void add_chat_command(CLI::App& app);
void add_serve_command(CLI::App& app);
void add_sft_command(CLI::App& app);
void add_dpo_command(CLI::App& app);
void add_rm_command(CLI::App& app);
void add_grpo_command(CLI::App& app);

// --set's form, KEY=VALUE with a key, checked while the command line is parsed (exit code 2).
inline CLI::Validator key_equals_value() {
  return CLI::Validator(
      [](const std::string& text) -> std::string {
        const size_t eq = text.find('=');
        return eq != std::string::npos && eq > 0 ? std::string()
                                                 : "'" + text + "': expected KEY=VALUE";
      },
      "KEY=VALUE");
}

// The options the ranks of a job compare: the --set values as they were given ("--set k=v") and
// --resume (ranks that resume and ranks that start afresh would fall out of step).
inline std::vector<std::string> rank_options(const std::vector<std::string>& sets, bool resume) {
  std::vector<std::string> options;
  for (const std::string& set : sets) options.push_back("--set " + set);
  if (resume) options.push_back("--resume");
  return options;
}

// A number of 1 or more, checked while the command line is parsed (CLI11's PositiveNumber
// says a 0 is "not in range 0 to 1.8e308").
inline CLI::Validator one_or_more() {
  return CLI::Validator(
      [](const std::string& text) -> std::string {
        long double value = 0;
        return CLI::detail::lexical_cast(text, value) && value >= 1
                   ? std::string()
                   : "'" + text + "': expected a number of 1 or more";
      },
      "1 or more");
}

// A seed: a whole number from 0 to 2^64-1 in decimal, checked while the command line is parsed
// (CLI11 itself turns -1 and anything past 2^64-1 into 2^64-1, so different seeds would give
// the same run).
inline CLI::Validator seed_number() {
  return CLI::Validator(
      [](const std::string& text) -> std::string {
        uint64_t value = 0;
        const char* end = text.data() + text.size();
        const auto [stop, error] = std::from_chars(text.data(), end, value);
        return !text.empty() && error == std::errc() && stop == end
                   ? std::string()
                   : "'" + text + "': expected a whole number from 0 to 18446744073709551615";
      },
      "0 to 2^64-1");
}

// The process's exit code when a command finishes without an error (`pollen train` tells a
// preempted run from a finished one this way).
inline int& exit_code_slot() {
  static int code = 0;
  return code;
}
inline void set_exit_code(int code) {
  exit_code_slot() = code;
}

}  // namespace pollen::cli
