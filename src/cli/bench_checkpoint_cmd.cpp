// `pollen bench checkpoint`: how fast a model's checkpoint (weights and AdamW state, hashed and
// synced) is written, split into serialise, hash and sync, and the CPU time it took (all
// threads); one JSON line.
#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/files.h"
#include "base/thread_pool.h"
#include "cli/commands.h"
#include "io/checkpoint.h"
#include "model/config.h"
#include "model/llama.h"
#include "optim/adamw.h"
#include "train/trainer.h"

namespace pollen::cli {

namespace {

constexpr char kBenchConfig[] = "# bench\n";  // the config.toml of the bench's checkpoint

}  // namespace

void add_bench_checkpoint_command(CLI::App& app) {
  CLI::App* bench = app.get_subcommand("bench");
  auto* cmd = bench->add_subcommand(
      "checkpoint",
      "Write one checkpoint of a model with its AdamW state into --dir (then delete it); "
      "prints bytes, seconds, MB/s, the serialise/hash/sync split and the CPU seconds as one "
      "JSON line");
  auto model = std::make_shared<std::string>("llama-124m");
  auto dir = std::make_shared<std::string>("build/bench-checkpoint");
  auto keep = std::make_shared<bool>(false);
  cmd->add_option("--model", *model, "Preset or model .toml file")->capture_default_str();
  cmd->add_option("--dir", *dir, "Folder to write into (on the disk to measure)")
      ->capture_default_str();
  cmd->add_flag("--keep", *keep, "Keep the checkpoint written");
  cmd->callback([model, dir, keep] {
    // The bench's checkpoint is step 1 of random weights: a run's own step 1 must not be replaced
    // by it (and then deleted); one the bench kept (--keep) is known by its config.
    const std::filesystem::path target = std::filesystem::path(*dir) / io::checkpoint_name(1);
    const bool benches = !std::filesystem::exists(target) ||
                         (std::filesystem::is_regular_file(target / "config.toml") &&
                          read_file(target / "config.toml") == kBenchConfig);
    POLLEN_CHECK(benches, "--dir '", *dir, "' already holds '", target.string(),
                 "' (a run's checkpoint?): the bench writes its own step 1 there; give an empty "
                 "folder or a new one");
    const auto cfg = model::resolve_config(*model);
    model::Llama m(cfg, 0);
    optim::AdamW opt(m.parameters(), optim::AdamWOptions{});
    nlohmann::ordered_json state{{"step", 1}};
    const std::clock_t cpu0 = std::clock();  // user + system time of all threads
    const auto w = train::write_checkpoint(*dir, 1, m, opt, state, kBenchConfig);
    const double cpu_s = static_cast<double>(std::clock() - cpu0) / CLOCKS_PER_SEC;
    nlohmann::ordered_json j;
    const double mb = static_cast<double>(w.stats.bytes) / 1e6;
    j["model"] = cfg.name;
    j["bytes"] = w.stats.bytes;
    j["seconds"] = std::round(w.seconds * 1000) / 1000;
    j["mb_per_s"] = std::round(mb / w.seconds);
    j["serialise_s"] = std::round(w.stats.serialise_s * 1000) / 1000;
    j["hash_s"] = std::round(w.stats.hash_s * 1000) / 1000;
    j["sync_s"] = std::round(w.stats.sync_s * 1000) / 1000;
    j["cpu_s"] = std::round(cpu_s * 1000) / 1000;
    j["dir"] = w.dir.string();
    std::printf("%s\n", j.dump().c_str());
    if (!*keep) std::filesystem::remove_all(w.dir);
  });
}

}  // namespace pollen::cli
