#pragma once
// What the post-training commands (`pollen sft`, `dpo`, `rm`, `grpo`) share: the run options
// --config, --set and --resume, the exit codes they end with, and `synth` for the task templates.
#include <CLI/CLI.hpp>
#include <functional>
#include <string>

#include "train/post_config.h"
#include "train/post_run.h"
#include "train/synth_tasks.h"

namespace pollen::cli {

// The exit codes of a post-training run, appended to each command's description.
extern const char* const kPostExitCodes;
// The help's line for the objectives that run as several ranks (sft, dpo, rm, grpo).
extern const char* const kPostDataParallel;

using PostRun =
    std::function<train::PostResult(const train::PostConfig&, const train::PostOptions&)>;

// --config, --set and --resume of the command whose run-file section is [objective]; --set's help
// shows `set_example` ("sft.seq=512"). When no subcommand ran, `run` gets the loaded run file and
// its status becomes the exit code.
void add_post_run_options(CLI::App* cmd, const std::string& objective,
                          const std::string& set_example, PostRun run);

// `<cmd> synth --task T --count N --seed S [--digits D] --out FILE`: `what` ("conversations",
// "prompts") made from the task templates (train/synth_tasks.h), written one `line(example)` per
// line.
void add_task_synth(CLI::App* cmd, const std::string& description, const std::string& what,
                    std::function<std::string(const train::SynthExample&)> line);

}  // namespace pollen::cli
