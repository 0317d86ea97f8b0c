#pragma once
// Shared pieces of the preference tests (DPO, reward model): the tiny ChatML tokenizer, pairs
// written by the synthetic rules, an objective's context from a TOML section, and a hand loop of
// AdamW over an objective's train_step.
#include <filesystem>
#include <string>

#include "base/config.h"
#include "optim/adamw.h"
#include "support/tiny_lm.h"
#include "train/objective.h"
#include "train/preference_synth.h"

namespace pollen::testing {

inline const tokenizer::Tokenizer& chat_tokenizer() {
  static const tokenizer::Tokenizer tok = tiny_tokenizer();
  return tok;
}

inline std::filesystem::path synth_pairs(const std::filesystem::path& dir, const std::string& task,
                                         int64_t count, uint64_t seed) {
  const auto path =
      dir / (task + "_" + std::to_string(count) + "_" + std::to_string(seed) + ".jsonl");
  train::PreferenceSynthOptions o;
  o.task = task;
  o.count = count;
  o.seed = seed;
  train::write_preference_synth(o, path);
  return path;
}

// The context of objective `name` built from the TOML text of its section.
inline train::ObjectiveContext objective_context(const std::string& name,
                                                 const std::string& section_toml,
                                                 const model::LlamaConfig& config,
                                                 const std::filesystem::path& run_dir = {}) {
  ConfigTable root = ConfigTable::parse("[" + name + "]\n" + section_toml, name + ".toml");
  train::ObjectiveContext ctx{*root.table(name)};
  ctx.tokenizer = &chat_tokenizer();
  ctx.seed = 3;
  ctx.max_seq = config.max_position_embeddings;
  ctx.model_config = config;
  ctx.run_dir = run_dir;
  return ctx;
}

// `steps` optimizer steps of AdamW (constant lr) over the model's parameters and `extra`.
inline void train_steps(train::Objective& objective, model::Llama& model, int64_t steps, double lr,
                        int64_t first_step = 1) {
  std::vector<ag::Var> params = model.parameters();
  for (auto& [name, v] : objective.extra_parameters()) params.push_back(v);
  optim::AdamW opt(params, {.lr = lr, .weight_decay = 0.0, .max_grad_norm = 1.0});
  for (int64_t s = first_step; s < first_step + steps; ++s) {
    opt.zero_grad();
    objective.train_step(model, s);
    opt.step(lr);
  }
}

}  // namespace pollen::testing
