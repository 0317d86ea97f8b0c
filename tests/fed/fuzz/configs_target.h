#pragma once
// What the config fuzz target runs on each input: the readers of the TOML files users and
// operators write, fed arbitrary text. Each input must be read or refused with pollen::Error;
// anything else (another exception, a crash, a sanitizer report, a hang) is a finding, and so is
// a training config whose resolved form (what a checkpoint keeps and a resumed run reads back)
// does not read back. Shared by the libFuzzer target and the deterministic corpus test.
//
// Input: byte 0 chooses the reader (its value minus '0', modulo the count, so that the seeds
// start with a digit), the rest is the TOML text:
//   0 training run file         train::parse_train_config, then its to_toml() read back
//   1 post-training, sft        train::parse_post_config, then [sft] as the objective reads it
//   2 post-training, dpo        train::parse_post_config, the section as text
//   3 post-training, rm         the same for [rm]
//   4 post-training, grpo       train::parse_post_config, then [grpo] and its verifier
//   5 federation server         fed::parse_server_config (fed.toml)
//   6 federation client         fed::parse_client_config (client.toml)
//   7 federation simulation     fed::parse_sim_config (sim.toml)
//   8 data preparation          data::PipelineConfig::parse, then the manifest's JSON of it
// Paths in the configs are only resolved, never opened, except a model file (model.file),
// which is read as the real readers do.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "base/config.h"
#include "base/error.h"
#include "data/pipeline.h"
#include "fed/config.h"
#include "train/config.h"
#include "train/grpo.h"
#include "train/post_config.h"
#include "train/sft.h"

namespace pollen::fuzz {

inline constexpr int kConfigReaders = 9;

// True when the config was read, false when it was refused.
inline bool read_untrusted_config(const uint8_t* data, size_t size) {
  if (size == 0) return false;
  const int reader = static_cast<uint8_t>(data[0] - '0') % kConfigReaders;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    switch (reader) {
      case 0: {
        const train::TrainConfig c = train::parse_train_config(text, "fuzz.toml");
        std::string resolved;
        try {
          resolved = c.to_toml();
          train::parse_train_config(resolved, "config.toml");
        } catch (const Error& e) {
          // The resolved config of an accepted run file must read back: a checkpoint keeps it.
          fprintf(stderr, "resolved config does not read back: %s\n%s\n", e.what(),
                  resolved.c_str());
          abort();
        }
        break;
      }
      case 1:
      case 2:
      case 3:
      case 4: {
        static const char* const kObjectives[] = {"sft", "dpo", "rm", "grpo"};
        const std::string objective = kObjectives[reader - 1];
        const train::PostConfig c = train::parse_post_config(text, "fuzz.toml", objective);
        ConfigTable section = c.objective_section();
        const int64_t max_seq = c.architecture ? c.architecture->max_position_embeddings : 2048;
        if (objective == "sft") {
          train::read_sft_settings(section, c.base_dir, max_seq);
        } else if (objective == "grpo") {
          train::RewardFunction verifier;
          train::read_grpo_options(section, c.base_dir, &verifier);
          section.finish();
        }
        break;
      }
      case 5:
        fed::parse_server_config(text, "fed.toml");
        break;
      case 6:
        fed::parse_client_config(text, "client.toml");
        break;
      case 7:
        fed::parse_sim_config(text, "sim.toml");
        break;
      default:
        data::PipelineConfig::parse(text, "fuzz/prepare.toml").to_json().dump();
        break;
    }
    return true;
  } catch (const Error&) {
    return false;
  }
}

}  // namespace pollen::fuzz
