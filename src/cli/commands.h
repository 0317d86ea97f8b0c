#pragma once
// Each subcommand registers itself on the root app; its callback does the wiring and nothing
// else (logic lives in the library layers).
#include <CLI/CLI.hpp>

namespace pollen::cli {

void add_version_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_tokenizer_command(CLI::App& app);
void add_data_command(CLI::App& app);
void add_fed_command(CLI::App& app);

}  // namespace pollen::cli
