#pragma once
// The run file of `pollen train`: one TOML file describes a run (model, data, optimizer,
// schedule, batch, evaluation, checkpoints, metrics). docs/training.md documents every key.
// Unknown keys and wrong types are errors naming the file and the key.
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "base/config.h"
#include "model/config.h"
#include "optim/adamw.h"
#include "optim/dp_sgd.h"
#include "optim/schedule.h"

namespace pollen::train {

// The keys every training loop's run file has (pre- and post-training), read and written by the
// helpers below.
struct LoopSettings {
  // [run]
  std::string name;
  std::filesystem::path dir;  // where checkpoints/, metrics.jsonl, tensorboard/ go
  uint64_t seed = 0;
  int threads = 0;  // 0: every hardware thread
  // [train]
  int64_t steps = 0;
  double grad_clip = 1.0;
  int64_t max_bad_steps = 5;  // non-finite losses in a row before the run stops
  // [schedule]
  optim::Schedule schedule;  // lr and total_steps come from optimizer.lr and train.steps
  // [eval]
  int64_t eval_interval = 0;  // 0: at the end only
  // [checkpoint]
  int64_t checkpoint_interval = 0;
  int keep_checkpoints = 3;
  // [metrics]
  bool tensorboard = true;
  int64_t log_interval = 10;
};

struct OptimizerSettings {  // [optimizer]: AdamW
  double lr = 3e-4, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
  std::vector<std::string> no_decay = {"norms", "biases", "embeddings"};
  // AdamW's options: these, with global-norm clipping at `max_grad_norm` (train.grad_clip).
  optim::AdamWOptions adamw(double max_grad_norm) const;
};

struct TrainConfig : LoopSettings {
  // [run]
  std::string device = "cpu", precision = "f32";
  // [model]
  model::LlamaConfig model;
  std::string init_from;  // weights to start from (io::resolve_model's specs); empty: run.seed
  // [data]
  std::vector<std::string> manifests;
  std::vector<double> weights;  // empty: proportional to each dataset's tokens
  std::string train_split = "train", validation_split = "validation";
  std::vector<std::string> validation_manifests;  // default: manifests
  // [train]
  int64_t batch_tokens = 0;  // global batch in tokens; a multiple of micro_batch * seq
  int64_t micro_batch = 8, seq = 128;
  bool recompute = false;
  OptimizerSettings optimizer;  // [optimizer]
  // [eval]
  int64_t eval_batches = 8;
  // [samples]: text generated from the model at each evaluation (none without prompts)
  std::vector<std::string> sample_prompts;
  int64_t sample_max_tokens = 32;
  double sample_temperature = 0.8;
  int64_t sample_top_k = 0;
  uint64_t sample_seed = 0;
  std::string sample_tokenizer;  // default: tokenizer.json beside the first data manifest
  // [metrics]
  double peak_flops = 0;  // FLOP/s for MFU; 0: measure this machine's GEMM rate at start
  // [parallel] (several ranks: docs/parallel.md)
  int zero = 0;            // 1: shard AdamW's state across ranks (ZeRO-1)
  double bucket_mb = 25;   // gradients reduced in buckets of about this many MiB
  double timeout_s = 300;  // a collective that takes longer means a dead or hung rank
  // [privacy]: DP-SGD, each training sequence the unit protected (docs/training.md)
  optim::DpSgdOptions privacy;

  int64_t accumulation() const { return batch_tokens / (micro_batch * seq); }

  // Every key with its resolved value, in file order ("train.steps", "1000"), values as TOML.
  std::vector<std::pair<std::string, std::string>> flat() const;
  std::string to_toml() const;  // the resolved config, loadable by load_train_config
};

// Reads a run file, applying `overrides` ("key=value", the value in TOML syntax; a bare word
// is taken as a string) first. Relative paths in it (run.dir, model.file, data manifests) are
// relative to the run file's folder.
TrainConfig load_train_config(const std::filesystem::path& path,
                              const std::vector<std::string>& overrides = {});
// The same from text; relative paths are taken relative to `base_dir` (empty: as they are).
TrainConfig parse_train_config(const std::string& text, const std::string& source,
                               const std::vector<std::string>& overrides = {},
                               const std::filesystem::path& base_dir = {});

// Throws, naming the run file and the key, when a manifest of data.manifests or
// data.validation_manifests does not exist: checked before the run starts, so that a wrong path
// is reported as the key that holds it, not as a file the trainer cannot open.
void check_manifests_exist(const TrainConfig& config, const std::string& source);

// Pieces every run file shares (pre- and post-training).
// The run file's text; an error names it.
std::string read_config_file(const std::filesystem::path& path);
// `path` as given in a run file: relative to `base_dir` (the run file's folder; empty: as it is).
std::string resolve_config_path(const std::filesystem::path& base_dir, const std::string& path);
// The LoopSettings keys of each section, checked; the caller reads its own keys of the section
// and finishes it. `run` absent: the defaults (name: the run file's stem, dir: runs/<name>).
void read_run_keys(ConfigTable* run, const std::string& source,
                   const std::filesystem::path& base_dir, LoopSettings& settings);
void read_train_keys(ConfigTable& train, LoopSettings& settings);
void read_eval_keys(ConfigTable& eval, LoopSettings& settings);
void read_checkpoint(ConfigTable& checkpoint, LoopSettings& settings);  // finishes the section
void read_metrics_keys(ConfigTable& metrics, LoopSettings& settings);
// [run]'s and then [checkpoint]'s and [metrics]' LoopSettings keys as flat keys.
void flat_run(const LoopSettings& settings, std::vector<std::pair<std::string, std::string>>& flat);
void flat_checkpoint_metrics(const LoopSettings& settings,
                             std::vector<std::pair<std::string, std::string>>& flat);
// The text with `overrides` ("key=value") applied, and the name errors give it.
std::pair<std::string, std::string> apply_overrides(const std::string& text,
                                                    const std::string& source,
                                                    const std::vector<std::string>& overrides);
// [optimizer]: AdamW's keys (lr, beta1, beta2, eps, weight_decay, no_decay), checked;
// read_optimizer_keys leaves the section's other keys to the caller (a federated client's
// [train] holds them beside its own).
void read_optimizer(ConfigTable& section, OptimizerSettings& settings);
void read_optimizer_keys(ConfigTable& section, OptimizerSettings& settings);
// [privacy] (DP-SGD, optim/dp_sgd.h), checked and finished: clip, and exactly one of
// noise_multiplier and target_epsilon; delta and noise_seed.
optim::DpSgdOptions read_dp_sgd(ConfigTable& section);
// [parallel]'s keys (several ranks), checked: zero (0 or 1, default 0), and bucket_mb (4 bytes to
// 4096 MiB) and timeout_s, whose values passed in are the defaults.
int read_zero_key(ConfigTable& section);
void read_reduction_keys(ConfigTable& section, double& bucket_mb, double& timeout_s);
// [schedule]; `schedule.lr` must already be the optimizer's.
void read_schedule(ConfigTable& section, optim::Schedule& schedule);
void flat_optimizer(const OptimizerSettings& optimizer, const optim::Schedule& schedule,
                    std::vector<std::pair<std::string, std::string>>& flat);
// The architecture as [model] keys ("model.hidden_size", ...), as model::read_config reads them.
void flat_model(const model::LlamaConfig& model,
                std::vector<std::pair<std::string, std::string>>& flat);
// Flat keys ("section.key", TOML value) as a TOML document after `header`.
std::string flat_to_toml(const std::vector<std::pair<std::string, std::string>>& flat,
                         const std::string& header);
std::string toml_string(const std::string& s);
std::string toml_double(double v);
std::string toml_strings(const std::vector<std::string>& v);
std::string toml_doubles(const std::vector<double>& v);

// Keys that may differ between a checkpoint's config and the resumed run's.
bool key_may_change_on_resume(const std::string& key);
// Two recorded values of a key: the same text, or numbers of equal value (0 and 0.0).
bool same_setting(const std::string& a, const std::string& b);
// How `now` differs from `saved`, key by key ("k (a -> b)", "k added (= v)", "k removed (was
// v)"), comma-separated; empty when every key holds the same setting.
std::string changed_settings(const std::vector<std::pair<std::string, std::string>>& saved,
                             const std::vector<std::pair<std::string, std::string>>& now);
// Throws listing every key that differs and may not change; returns warnings for those that
// may change but alter the run (train.steps moves the schedule's end, run.threads the bits).
std::vector<std::string> check_resume_compatible(const TrainConfig& saved, const TrainConfig& now);
// The same over flat keys; errors point at `doc`, a page and its section, for the rules.
std::vector<std::string> check_resume_compatible(
    const std::vector<std::pair<std::string, std::string>>& saved,
    const std::vector<std::pair<std::string, std::string>>& now, const std::string& doc);

}  // namespace pollen::train
