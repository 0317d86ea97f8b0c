// `pollen data prepare|stats|inspect`: parsing and wiring; the work is in src/data.
#include <cstdio>
#include <memory>

#include "base/thread_pool.h"
#include "cli/commands.h"
#include "cli/sampling_args.h"
#include "data/pipeline.h"
#include "data/shards.h"

namespace pollen::cli {

void add_data_command(CLI::App& app) {
  auto* data = app.add_subcommand("data", "Curate text into versioned token shards");
  data->require_subcommand(1);

  auto* prep = data->add_subcommand("prepare", "Run the curation pipeline a TOML file describes");
  struct PrepArgs {
    std::string config;
    int threads = 0;
    bool quiet = false, no_tokenize = false;
  };
  auto pa = std::make_shared<PrepArgs>();
  prep->add_option("--config", pa->config, "The pipeline's TOML file (see docs/data.md)")
      ->required()
      ->check(CLI::ExistingFile);
  prep->add_option("--threads", pa->threads, "Threads (overrides the config; default: all)");
  prep->add_flag("--quiet", pa->quiet, "No progress lines");
  prep->add_flag("--no-tokenize", pa->no_tokenize,
                 "Stop at the curated JSONL (to train a tokenizer on it first)");
  prep->callback([pa] {
    auto config = data::PipelineConfig::load(pa->config);
    if (pa->threads > 0) config.threads = pa->threads;
    if (pa->no_tokenize) config.tokenize = false;
    data::PrepareOptions options;
    options.progress = !pa->quiet;
    auto manifest = data::prepare(config, options);
    std::printf("%s\nversion %s\n", manifest.string().c_str(),
                data::dataset_version(manifest).c_str());
  });

  auto* stats = data->add_subcommand("stats", "Print a dataset's version, sizes and stage counts");
  auto manifest = std::make_shared<std::string>();
  stats->add_option("manifest", *manifest, "manifest.json or its folder")
      ->required()
      ->check(CLI::ExistingPath);
  stats->callback([manifest] { std::printf("%s", data::dataset_stats(*manifest).c_str()); });

  auto* insp = data->add_subcommand("inspect", "Print documents of a dataset's shards");
  struct InspArgs {
    std::string manifest, split = "train";
    int64_t doc = 0, count = 3, max_ids = 64;
  };
  auto ia = std::make_shared<InspArgs>();
  insp->add_option("manifest", ia->manifest, "manifest.json or its folder")
      ->required()
      ->check(CLI::ExistingPath);
  insp->add_option("--split", ia->split, "train or validation")->capture_default_str();
  constexpr double kAny = std::numeric_limits<double>::max();
  insp->add_option("--doc", ia->doc, "First document (from 0)")
      ->capture_default_str()
      ->check(number_in(0, kAny, false, ">= 0"));
  insp->add_option("--count", ia->count, "How many documents (1 or more)")
      ->capture_default_str()
      ->check(number_in(1, kAny, false, ">= 1"));
  insp->add_option("--max-ids", ia->max_ids, "Token ids shown per document")
      ->capture_default_str()
      ->check(number_in(0, kAny, false, ">= 0"));
  insp->callback([ia] {
    std::printf(
        "%s",
        data::inspect_documents(ia->manifest, ia->split, ia->doc, ia->count, ia->max_ids).c_str());
  });
}

}  // namespace pollen::cli
