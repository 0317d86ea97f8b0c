#pragma once
// The run file of post-training (`pollen sft`, `dpo`, `rm`, `grpo`): one TOML file describes a
// run: the base model, the loop's settings shared by every objective ([run], [model], [train],
// [optimizer], [schedule], [eval], [checkpoint], [metrics], [lora]) and the objective's own
// section ([sft], ...), which the objective reads. docs/posttraining.md documents every key.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/config.h"
#include "model/config.h"
#include "model/lora.h"
#include "optim/schedule.h"
#include "train/config.h"

namespace pollen::train {

// [lora]: low-rank adapters on the named linear layers instead of training the whole model
// (model/lora.h reads the keys: rank, alpha, dropout, target_modules, rslora, train_a, seed).
struct LoraSettings {
  bool enabled = false;  // the run file has a [lora] table (and no enabled = false)
  model::LoraConfig config;
};

struct PostConfig : LoopSettings {
  std::string objective;  // the objective's section: "sft", "dpo", "rm", "grpo"
  // [model]
  std::string base;           // anything io::resolve_model accepts
  std::string tokenizer;      // tokenizer file; empty: the one that goes with the base
  std::string chat_template;  // "chatml" or "llama3"; empty: the base's
  // The base's architecture, present in a resolved config (a checkpoint's config.toml).
  std::optional<model::LlamaConfig> architecture;
  // [optimizer]
  OptimizerSettings optimizer;
  // [lora]
  LoraSettings lora;
  // [parallel]: a run of several ranks (docs/parallel.md, "Post-training as several ranks")
  int zero = 0;            // 1: shard AdamW's state across the ranks (ZeRO-1)
  double bucket_mb = 25;   // gradients reduced in buckets of about this many MiB
  double timeout_s = 300;  // a collective that takes longer means a dead or hung rank
  // The objective's section, as given: its keys in TOML ("sft.seq", "1024"), and as a table
  // for the objective to read (errors name the run file).
  std::vector<std::pair<std::string, std::string>> objective_keys;
  std::string objective_text;      // "[sft]\n..." (empty section when the file has none)
  std::string objective_identity;  // the same section as earlier pollen printed it (hashed)
  std::string source;              // the run file's name in errors
  std::filesystem::path base_dir;  // relative paths in the objective's section are from here

  ConfigTable objective_section() const;
  // The files the objective reads its examples from (its data, validation and eval_data keys),
  // resolved: what the ranks of a job compare.
  std::vector<std::filesystem::path> data_files() const;

  // Every key with its resolved value; `architecture` (the base's) is written into [model] so
  // that the resolved config of a checkpoint is a model that io::resolve_model can open.
  std::vector<std::pair<std::string, std::string>> flat(
      const model::LlamaConfig& architecture) const;
  std::string to_toml(const model::LlamaConfig& architecture) const;
};

// Reads a run file for `objective` ("sft", ...), applying `overrides` ("key=value", TOML
// syntax) first. Relative paths (run.dir, model.base when it names a file or folder,
// model.tokenizer) are relative to the run file's folder. Unknown sections and keys are refused.
PostConfig load_post_config(const std::filesystem::path& path, const std::string& objective,
                            const std::vector<std::string>& overrides = {});
PostConfig parse_post_config(const std::string& text, const std::string& source,
                             const std::string& objective,
                             const std::vector<std::string>& overrides = {},
                             const std::filesystem::path& base_dir = {});

}  // namespace pollen::train
