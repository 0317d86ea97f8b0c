#pragma once
// The config files of `pollen fed server`, `pollen fed client` and `pollen fed simulate`.
// docs/federated.md documents every key; unknown keys and wrong types are errors naming the file
// and the key.
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "fed/compress.h"
#include "fed/privacy.h"
#include "fed/secagg/options.h"
#include "fed/strategy.h"
#include "model/config.h"
#include "train/config.h"

namespace pollen {
class ConfigTable;
}

namespace pollen::fed {

// [tls]: PEM files. Without ca the connection is plaintext (loopback tests and simulation only).
struct TlsFiles {
  std::string ca, cert, key;
  std::string crl;          // server: revoked client certificates (optional)
  std::string server_name;  // client: the name to check the server's certificate against
  bool enabled() const { return !ca.empty(); }
};

// [post] of fed.toml and client.toml: a post-training federation (docs/federated.md, 'Federated
// post-training over the wire'). The exchanged state is the LoRA adapters' B (fed/post_lora.h)
// instead of the whole model; the base, its tokenizer and the adapters' config come from the
// post-training run file, which both sides read, and the base never travels.
struct PostSettings {
  std::filesystem::path run;      // the post-training run file (docs/posttraining.md)
  std::string objective = "sft";  // sft, dpo, grpo or rm: the run file's section the silo trains
  std::string data;               // client: the silo's data file, set as <objective>.data
  bool enabled() const { return !run.empty(); }
};

struct ServerConfig {
  std::filesystem::path dir;           // checkpoints/, metrics.jsonl, lineage.jsonl
  std::string dir_key = "server.dir";  // the config key that names dir, for errors
  std::string command = "fed server";  // what runs it, for its messages ("fed simulate", ...)
  // The config file's keys as written (ConfigTable::flat; empty when built in code): recorded
  // with each checkpoint, so that a resume names those that changed.
  std::map<std::string, std::string> settings;
  std::string address = "127.0.0.1:50051";
  std::string metrics_address;   // host:port of the Prometheus /metrics endpoint (empty: off)
  bool allow_plaintext = false;  // listen beyond this host without [tls] (check_plaintext)
  uint64_t seed = 0;
  model::LlamaConfig model;
  std::string init_from;  // model.init_from: weights of round 1 (empty: drawn from seed)
  std::string tokenizer_fingerprint;
  int64_t rounds = 10;
  int64_t local_steps = 100;  // H: inner steps per round
  int64_t eval_every = 1;     // clients evaluate the global model every this many rounds (0: never)
  double round_timeout_s = 600;      // a round closes then with the updates it has
  double wait_for_clients_s = 3600;  // how long to wait for min_clients before a round
  double client_timeout_s = 120;     // a client not heard from this long is not selected
  int64_t max_round_retries = 3;     // rounds with fewer than min_clients updates are retried
  int keep_checkpoints = 3;
  StrategyOptions strategy;
  CompressOptions compression;  // what clients send
  // what the server sends (the round's model), with the same block, topk and scale format
  Codec server_codec = Codec::none;
  CompressOptions download() const {
    return {server_codec, compression.block, compression.topk, compression.scale};
  }
  secagg::Options secure_aggregation;
  PrivacyOptions privacy;  // central DP ([privacy]); off unless the table is given
  TlsFiles tls;
  PostSettings post;  // [post]: model and tokenizer come from post.run's base
};

// The inner (silo) training of a client.
struct LocalTrainConfig {
  int64_t micro_batch = 8, seq = 128, accumulation = 1;
  // AdamW's lr, betas, eps, weight decay and the groups it spares (no_decay): pollen train's
  // [optimizer] keys and defaults, read from [train]
  train::OptimizerSettings optimizer;
  double min_lr = 0;
  std::string schedule = "constant";  // constant cosine linear wsd, over total_steps
  int64_t warmup_steps = 0,
          total_steps = 0;         // 0: rounds * local_steps is unknown; constant after warmup
  int64_t round_warmup_steps = 0;  // each round's first steps ramp the lr up again (0: off)
  double drift_correction = 0;     // beta of fed/drift_correction.h, in [0, 1] (0: off)
  // FedProx's mu: each local step's gradient also has mu (w - w_start), w_start the weights the
  // round's training started from (the gradient of mu / 2 |w - w_start|^2); 0: off
  double proximal_mu = 0;
  double grad_clip = 1.0;
  int64_t eval_batches = 4;
  // Where the silo trains: "cpu", or "cuda" (one GPU; the pseudo-gradients, moments and state are
  // still exchanged and kept from host memory)
  std::string device = "cpu";
  // "f32", or on the GPU "bf16": the model computes with bf16 copies of the f32 weights, which
  // AdamW keeps as master weights and which are what the silo exchanges and saves
  std::string precision = "f32";
};

// [parallel] of client.toml: a silo run as several ranks (docs/parallel.md); one process ignores
// it. The keys of `pollen train`'s [parallel].
struct SiloParallel {
  int zero = 0;            // 1: shard the inner AdamW's state across ranks (ZeRO-1)
  double bucket_mb = 25;   // gradients reduced in buckets of about this many MiB
  double timeout_s = 300;  // a collective that takes longer means a dead or hung rank
};

struct ClientConfig {
  std::string id;
  std::string server = "127.0.0.1:50051";
  uint64_t seed = 0;  // data order
  int threads = 0;    // 0: every hardware thread
  model::LlamaConfig model;
  // model.init_from: the weights the silo starts from, as the server's (so that round 1's
  // compressed model comes as a delta); empty: drawn from seed
  std::string init_from;
  std::string tokenizer_fingerprint;
  std::vector<std::string> manifests;
  double connect_timeout_s = 60;
  // A server connected but busy (its calls time out) for longer than this in a row ends the client
  double busy_timeout_s = 3600;
  LocalTrainConfig train;
  LocalDpOptions local_dp;  // [local_dp]; off unless the table is given
  // [dp_sgd]: record-level DP of the silo's local steps (DP-SGD, docs/federated.md); off unless
  // the table is given
  optim::DpSgdOptions dp_sgd;
  // Distributed DP: take repeatable noise when the server's privacy.noise_seed asks for it (a
  // test setting: the update then has no privacy); else such a round stops the client.
  bool allow_repeatable_noise = false;
  TlsFiles tls;
  // Where the client keeps its local state between rounds and resumes it after a restart
  // (empty: in memory only).
  std::filesystem::path state_dir;
  int keep_checkpoints = 2;
  SiloParallel parallel;
  PostSettings post;  // [post]: a LoRA silo instead of [data], [train], [model], [tokenizer]
};

struct SimConfig {
  ServerConfig server;
  std::vector<ClientConfig> clients;  // every client shares [train], [model] and the tokenizer
  int threads = 0;
  bool client_states = true;  // each client keeps its state under server.dir/clients/<id>
  std::string command = "fed simulate";  // how its log lines name it ("fed post")
};

ServerConfig load_server_config(const std::filesystem::path& path);
ClientConfig load_client_config(const std::filesystem::path& path);
SimConfig load_sim_config(const std::filesystem::path& path);
// The same from TOML text; `source` names it in errors.
ServerConfig parse_server_config(const std::string& text, const std::string& source);
ClientConfig parse_client_config(const std::string& text, const std::string& source);
SimConfig parse_sim_config(const std::string& text, const std::string& source);

ServerConfig read_server_config(ConfigTable& root);
// root's [compression] into c.compression and c.server_codec (absent: both none).
void read_compression(ConfigTable& root, ServerConfig& c);
LocalTrainConfig read_local_train(ConfigTable& table);
// `--device` of `pollen fed client` and `fed simulate`: sets train.device, checked as the key is
// (bf16 needs the GPU; a post-training silo has no [train] and trains on the CPU).
void set_train_device(ClientConfig& c, const std::string& device);
TlsFiles read_tls(ConfigTable& root, bool server);
SiloParallel read_silo_parallel(ConfigTable& table);
PostSettings read_post_settings(ConfigTable& table, bool client);
// The longest wait a config may name (about 31 years): deadlines are taken as now + seconds.
constexpr double kMaxConfigSeconds = 1e9;
// Refuses `seconds`, read from `key` of `table`, unless finite, within kMaxConfigSeconds and
// more than 0 (`positive`) or at least 0, naming the key and the bound.
void check_seconds(const ConfigTable& table, const std::string& key, double seconds, bool positive);
// A gRPC address: host:port (port 0 to 65535, an IPv6 host in brackets) or a gRPC scheme
// (unix:PATH, dns:[//AUTHORITY/]host:port, ...); `where` names the key or option in the error.
void check_grpc_address(const std::string& address, const std::string& where);

// A server without [tls] is unauthenticated: anyone who reaches it may join, pull and push as any
// client. Refused on an address other hosts reach (not loopback, not a Unix socket) unless
// `server.allow_plaintext` says the network is trusted; `where` names the config's address key.
void check_plaintext(const std::string& address, const TlsFiles& tls, bool allowed,
                     const std::string& where);

}  // namespace pollen::fed
