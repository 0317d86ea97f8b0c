#pragma once
// What the federation tests share: tiny models, silos with learnable patterns, simulation
// configs, client updates made by hand, deployments as processes, and comparisons of weights.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/files.h"
#include "base/log.h"
#include "base/rng.h"
#include "data/shards.h"
#include "fed/config.h"
#include "fed/strategy.h"
#include "fed/wire.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "support/process.h"

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

// The tiny model as fed.toml and client.toml give it, with the tokenizer fingerprint
// tiny_model()'s simulations use.
inline const std::string kTinyModelToml =
    "[model]\nvocab_size = 64\nhidden_size = 32\nintermediate_size = 64\n"
    "num_hidden_layers = 2\nnum_attention_heads = 2\nnum_key_value_heads = 2\n"
    "max_position_embeddings = 64\n[tokenizer]\nfingerprint = 'test-tokenizer'\n";

// A loopback address with a port the kernel had free just now, for a server started as another
// process (which cannot report the port it bound). A port derived from the process id could be
// one another test's connection already holds.
// A loopback port for a server that another process starts later. Drawn below the kernel's
// ephemeral range (ip_local_port_range), which outgoing connections and port-0 binds take from
// (MPI's, gRPC's, other tests'): one handed out there could be taken before the server binds it.
inline std::string loopback_address() {
  int low = 32768;
  if (std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range"); range) range >> low;
  const int first = 10000, count = std::max(1000, low - first);
  static uint64_t draws = 0;
  Rng rng(static_cast<uint64_t>(::getpid()) * 1000003u + draws++ +
          static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int port = first + static_cast<int>(rng.next_u64() % static_cast<uint64_t>(count));
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    POLLEN_CHECK(fd >= 0, "loopback_address: socket() failed");
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    ::close(fd);
    if (free) return cat("127.0.0.1:", port);
  }
  fail("loopback_address: no free loopback port below ", low);
}

// client.toml of client silo-0 (local_train()'s settings) of the server at `address`.
inline std::string client_toml(const std::string& address, const fs::path& state_dir,
                               const fs::path& manifest) {
  return cat("[client]\nid = 'silo-0'\nserver = '", address,
             "'\nseed = 100\nthreads = 1\nstate_dir = '", state_dir.string(),
             "'\n[data]\nmanifests = ['", manifest.string(),
             "']\n[train]\nmicro_batch = 4\nseq = 16\nlr = 3e-3\nweight_decay = 0\n"
             "eval_batches = 2\n",
             kTinyModelToml);
}

// Starts `pollen args...` as a child process with its stderr in `log`; the child's pid.
inline pid_t spawn_pollen(std::vector<std::string> args, const fs::path& log) {
  const pid_t pid = fork();
  if (pid == 0) {
    freopen(log.c_str(), "w", stderr);
    std::vector<char*> argv{const_cast<char*>(POLLEN_BINARY)};
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(POLLEN_BINARY, argv.data());
    _exit(127);
  }
  return pid;
}

// Waits for every child; how many of them did not exit with status 0.
inline int failed_children(const std::vector<pid_t>& pids) {
  int failed = 0;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  return failed;
}

// A one-tensor vector, and a client's update of one such tensor weighted by `tokens`.
inline Tensor vec(std::vector<float> v) {
  const auto n = static_cast<int64_t>(v.size());
  return Tensor::from<float>({n}, v);
}
inline ClientUpdate update(const std::string& id, int64_t tokens, std::vector<float> delta) {
  ClientUpdate u;
  u.client_id = id;
  u.tokens = tokens;
  u.delta.push_back(vec(std::move(delta)));
  return u;
}

inline LocalTrainConfig local_train() {
  LocalTrainConfig t;
  t.micro_batch = 4;
  t.seq = 16;
  t.optimizer.lr = 3e-3;
  t.optimizer.weight_decay = 0;
  t.eval_batches = 2;
  return t;
}

// A Join for tiny_model() with the fixtures' tokenizer fingerprint, as a client `id` sends it.
inline pb::JoinRequest tiny_join(const std::string& id) {
  pb::JoinRequest r;
  r.set_protocol_version(kProtocolVersion);
  r.set_client_id(id);
  r.set_model_config(model_config_json(tiny_model()));
  r.set_tokenizer_fingerprint("test-tokenizer");
  return r;
}

// Central DP with noise multiplier z and clip norm `clip`, its noise repeatable (noise_seed 7).
inline PrivacyOptions central_dp(double z, double clip, const std::string& sampling = "fixed") {
  PrivacyOptions o;
  o.enabled = true;
  o.noise_multiplier = z;
  o.clip = clip;
  o.noise_seed = 7;
  o.sampling = sampling;
  return o;
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
    cc.allow_repeatable_noise = true;  // as `pollen fed simulate` sets it
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

// Runs `pollen fed server` on dir/fed.toml (its run under dir/dep) and a `pollen fed client` on
// each dir/client<i>.toml as processes, their stderr in dir/<name>.log, then expects each to
// exit 0 and the deployment's newest checkpoint to be round `rounds` with the weights of the
// simulation's under dir/sim/server, bit for bit.
inline void expect_deployment_equals_simulation(const fs::path& dir, int clients, int64_t rounds) {
  std::vector<std::string> names{"fed"};
  for (int i = 0; i < clients; ++i) names.push_back(cat("client", i));
  std::vector<pid_t> pids;
  for (const std::string& name : names)
    pids.push_back(spawn_pollen(
        {"fed", name == "fed" ? "server" : "client", "--config", (dir / (name + ".toml")).string()},
        dir / (name + ".log")));
  EXPECT_EQ(failed_children(pids), 0) << "a process failed; see " << dir.string() << "/*.log";
  const auto sim = io::list_checkpoints(dir / "sim/server/checkpoints");
  const auto dep = io::list_checkpoints(dir / "dep/checkpoints");
  ASSERT_FALSE(sim.empty());
  ASSERT_FALSE(dep.empty());
  EXPECT_EQ(io::checkpoint_step(dep.back()), rounds);
  EXPECT_TRUE(bitwise_equal(read_model(sim.back()), read_model(dep.back())))
      << "the deployed run's global model differs from the simulation's (" << dir.string() << ")";
}

// a + b per value, in float32 as a view adds a decoded delta.
inline Weights plus(const Weights& a, const Weights& b) {
  Weights out;
  for (size_t i = 0; i < a.size(); ++i) {
    Tensor t = Tensor::empty(a[i].shape(), DType::f32);
    for (int64_t j = 0; j < t.numel(); ++j)
      t.data<float>()[j] = a[i].data<float>()[j] + b[i].data<float>()[j];
    out.push_back(std::move(t));
  }
  return out;
}

// The largest |a - b| over every value.
inline double worst_difference(const Weights& a, const Weights& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    for (int64_t j = 0; j < a[i].numel(); ++j) {
      worst = std::max(worst, std::fabs(static_cast<double>(a[i].data<float>()[j]) -
                                        static_cast<double>(b[i].data<float>()[j])));
    }
  }
  return worst;
}

// What load_server_config says of `toml` written to `file`: the error, or "" when it accepts it.
inline std::string server_config_error(const fs::path& file, const std::string& toml) {
  write_file_atomic(file, toml);
  try {
    load_server_config(file);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

inline std::vector<nlohmann::json> read_jsonl(const fs::path& p) {
  std::vector<nlohmann::json> out;
  std::ifstream in(p);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

// Flips one byte in the middle of `file`, as a failing disk would, so that a checkpoint holding
// it no longer verifies.
inline void flip_a_byte(const fs::path& file) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  const auto middle = static_cast<std::streamoff>(fs::file_size(file) / 2);
  f.seekg(middle);
  const char c = static_cast<char>(f.get());
  f.seekp(middle);
  f.put(static_cast<char>(c ^ 0x55));
}

using pollen::testing::run_capture;  // stdout and stderr together

struct Quiet {
  Quiet() { log::set_level(log::Level::error); }
  ~Quiet() { log::set_level(log::Level::info); }
};

}  // namespace pollen::fed::testing
