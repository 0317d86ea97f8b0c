#pragma once
// What the federation tests share: tiny models, silos with learnable patterns, simulation
// configs, and comparisons of weights.
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "base/files.h"
#include "base/log.h"
#include "data/shards.h"
#include "fed/config.h"
#include "io/safetensors.h"

namespace pollen::fed::testing {

namespace fs = std::filesystem;

inline fs::path temp_dir(const std::string& name) {
  fs::path p =
      fs::temp_directory_path() / ("pollen_fed_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

inline model::LlamaConfig tiny_model() {
  model::LlamaConfig c;
  c.vocab_size = 64;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  c.validate();
  return c;
}

// A silo's data: documents counting up by `stride` modulo 60 from varying starts, so each silo
// has its own learnable pattern.
inline fs::path make_silo(const fs::path& dir, int stride, int train_docs = 300,
                          int validation_docs = 40) {
  fs::create_directories(dir);
  std::vector<data::ShardInfo> shards;
  for (const char* split : {"train", "validation"}) {
    data::ShardWriter w(dir, "silo", split, data::TokenDType::u16, 1 << 20);
    const int docs = std::string(split) == "train" ? train_docs : validation_docs;
    for (int d = 0; d < docs; ++d) {
      std::vector<uint32_t> ids(24);
      for (size_t p = 0; p < ids.size(); ++p) {
        ids[p] = static_cast<uint32_t>(1 + (d * 7 + static_cast<int>(p) * stride) % 60);
      }
      w.add_document(ids);
    }
    auto s = w.finish();
    shards.insert(shards.end(), s.begin(), s.end());
  }
  nlohmann::json m{{"format", "pollen-shards-v1"}, {"token_dtype", "u16"}, {"vocab_size", 64}};
  m["shards"] = nlohmann::json::array();
  for (const auto& s : shards) m["shards"].push_back(s.to_json());
  write_file_atomic(dir / "manifest.json", data::manifest_text(m));
  return dir / "manifest.json";
}

inline LocalTrainConfig local_train() {
  LocalTrainConfig t;
  t.micro_batch = 4;
  t.seq = 16;
  t.lr = 3e-3;
  t.weight_decay = 0;
  t.eval_batches = 2;
  return t;
}

inline SimConfig sim_config(const fs::path& dir, const std::vector<fs::path>& manifests,
                            const std::string& strategy, int64_t rounds, int64_t local_steps) {
  SimConfig c;
  c.threads = 1;
  c.server.dir = dir / "server";
  c.server.seed = 5;
  c.server.model = tiny_model();
  c.server.tokenizer_fingerprint = "test-tokenizer";
  c.server.rounds = rounds;
  c.server.local_steps = local_steps;
  c.server.strategy.name = strategy;
  for (size_t i = 0; i < manifests.size(); ++i) {
    ClientConfig cc;
    cc.id = "silo-" + std::to_string(i);
    cc.seed = 100 + i;
    cc.threads = 1;
    cc.model = c.server.model;
    cc.tokenizer_fingerprint = c.server.tokenizer_fingerprint;
    cc.manifests = {manifests[i].string()};
    cc.train = local_train();
    c.clients.push_back(cc);
  }
  return c;
}

inline Weights read_model(const fs::path& ckpt) {
  Weights w;
  for (auto& [n, t] : io::read_safetensors(ckpt / "model.safetensors").tensors) w.push_back(t);
  return w;
}

inline bool bitwise_equal(const Weights& a, const Weights& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].shape() != b[i].shape() || std::memcmp(a[i].raw(), b[i].raw(), a[i].nbytes()) != 0) {
      return false;
    }
  }
  return true;
}

inline std::vector<nlohmann::json> read_jsonl(const fs::path& p) {
  std::vector<nlohmann::json> out;
  std::ifstream in(p);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

// Runs a shell command; its stdout and stderr together.
inline std::string run_capture(const std::string& cmd, int* status) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  *status = WEXITSTATUS(pclose(p));
  return out;
}

struct Quiet {
  Quiet() { log::set_level(log::Level::error); }
  ~Quiet() { log::set_level(log::Level::info); }
};

}  // namespace pollen::fed::testing
