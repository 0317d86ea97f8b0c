#pragma once
// A tiny dataset (token shards + manifest) and run file for trainer tests: documents count up
// by one from a varying start, so a small model can learn them quickly.
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/files.h"
#include "data/shards.h"

namespace pollen::test_support {

// An empty folder for one test: pollen_<name>_<pid> under the system's temp folder, emptied first.
inline std::filesystem::path fresh_temp_dir(const std::string& name) {
  namespace fs = std::filesystem;
  fs::path d = fs::temp_directory_path() / ("pollen_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

inline std::filesystem::path make_tiny_dataset(const std::filesystem::path& dir, int docs = 200) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  auto write_split = [&](const std::string& split, int n, int salt) {
    data::ShardWriter w(dir, "tiny", split, data::TokenDType::u16, 4000);
    for (int d = 0; d < n; ++d) {
      std::vector<uint32_t> ids(static_cast<size_t>(12 + (d * 7 + salt) % 29));
      for (size_t p = 0; p < ids.size(); ++p)
        ids[p] = static_cast<uint32_t>((d * 5 + salt + static_cast<int>(p)) % 60 + 1);
      w.add_document(ids);
    }
    return w.finish();
  };
  auto shards = write_split("train", docs, 0);
  auto val = write_split("validation", 40, 3);
  shards.insert(shards.end(), val.begin(), val.end());
  nlohmann::json m{{"format", "pollen-shards-v1"}, {"token_dtype", "u16"}, {"vocab_size", 64}};
  m["shards"] = nlohmann::json::array();
  for (const auto& s : shards) m["shards"].push_back(s.to_json());
  write_file_atomic(dir / "manifest.json", data::manifest_text(m));
  return dir / "manifest.json";
}

// A run file over that dataset; `extra` is appended (more keys or tables).
inline std::string tiny_run_toml(const std::filesystem::path& run_dir,
                                 const std::filesystem::path& manifest, int steps,
                                 const std::string& extra = "") {
  return "[run]\ndir = \"" + run_dir.string() +
         "\"\nseed = 7\nthreads = 2\n\n"
         "[model]\nvocab_size = 64\nhidden_size = 32\nintermediate_size = 64\n"
         "num_hidden_layers = 2\nnum_attention_heads = 2\nnum_key_value_heads = 1\n"
         "max_position_embeddings = 64\n\n"
         "[data]\nmanifests = [\"" +
         manifest.string() +
         "\"]\n\n"
         "[train]\nsteps = " +
         std::to_string(steps) +
         "\nmicro_batch = 4\nseq = 16\nbatch_tokens = 128\n\n"
         "[optimizer]\nlr = 3e-3\n\n[schedule]\nkind = \"cosine\"\nwarmup_steps = 3\n"
         "min_lr = 3e-4\n\n[eval]\ninterval = 10\nbatches = 2\n\n"
         "[checkpoint]\ninterval = 4\nkeep = 2\n\n[metrics]\npeak_flops = 1e11\n" +
         extra;
}

}  // namespace pollen::test_support
