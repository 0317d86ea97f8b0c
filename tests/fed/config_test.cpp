// The federation's config readers: integers that would wrap, devices, and the inner AdamW's keys.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "base/error.h"
#include "base/files.h"
#include "fed/client.h"
#include "fed/config.h"
#include "fed/grpc.h"
#include "support/errors.h"
#include "tensor/device.h"

using namespace pollen;

namespace {

constexpr const char* kClient = R"([client]
id = "silo-a"
seed = SEED
threads = THREADS
state_dir = "runs/silo-a"
[data]
manifests = ["data/silo-a/manifest.json"]
[train]
micro_batch = 8
seq = 64
[model]
preset = "llama-tiny"
[tokenizer]
fingerprint = "f"
)";

std::string client_toml(const std::string& seed, const std::string& threads) {
  std::string text = kClient;
  text.replace(text.find("SEED"), 4, seed);
  text.replace(text.find("THREADS"), 7, threads);
  return text;
}

// What parsing `text` as client.toml throws.
std::string error_of(const std::string& text) {
  return pollen::testing::error_of([&] { fed::parse_client_config(text, "client.toml"); });
}

// What parsing `text` as fed.toml throws ("" when it is accepted).
std::string error_of_server(const std::string& text) {
  try {
    fed::parse_server_config(text, "fed.toml");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(FedConfig, SeedsAndThreadCountsThatWouldWrapAreRefused) {
  EXPECT_EQ(fed::parse_client_config(client_toml("7", "2"), "client.toml").seed, 7u);
  // -1 was taken as seed 2^64 - 1, and 2^32 threads as 0 (every core).
  std::string e = error_of(client_toml("-1", "2"));
  EXPECT_NE(e.find("client.seed"), std::string::npos) << e;
  EXPECT_NE(e.find("got -1"), std::string::npos) << e;
  e = error_of(client_toml("7", "4294967296"));
  EXPECT_NE(e.find("client.threads"), std::string::npos) << e;
  EXPECT_NE(e.find("expected an integer from 0 to 65536"), std::string::npos) << e;
}

// The client's timeouts must be positive: 0 would time out every call, and a busy_timeout_s of 0
// would end the client at the first call a busy server answers late.
// Positive, and within what a deadline holds: a stall limit of 1e10 s overflowed the steady
// clock and cancelled every pull and push at once.
TEST(FedConfig, ClientTimeoutsMustBePositive) {
  for (const char* key : {"connect_timeout_s", "busy_timeout_s"}) {
    for (const char* value : {"0", "1e10"}) {
      std::string text = client_toml("7", "2");
      text.insert(text.find("state_dir"), cat(key, " = ", value, "\n"));
      const std::string e = error_of(text);
      EXPECT_NE(e.find(cat("client.", key, "': must be more than 0 and at most 1000000000")),
                std::string::npos)
          << e;
    }
  }
  std::string text = client_toml("7", "2");
  text.insert(text.find("state_dir"), "busy_timeout_s = 90\n");
  EXPECT_EQ(fed::parse_client_config(text, "client.toml").busy_timeout_s, 90);
}

// A server address without a port would have gRPC dial 443 and fail as an unreachable server;
// no validation batches would report a validation loss of 0.
TEST(FedConfig, AServerWithoutAPortAndNoValidationBatchesAreRefused) {
  std::string text = client_toml("7", "2");
  text.insert(text.find("state_dir"), "server = \"127.0.0.1\"\n");
  std::string e = error_of(text);
  EXPECT_NE(e.find("client.server': expected host:port with a port in [0, 65535] (an IPv6 host "
                   "in brackets), or unix:PATH, got '127.0.0.1'"),
            std::string::npos)
      << e;
  for (const char* bad : {"127.0.0.1:86916", "::1:50051", ":50051", "fed.org:"}) {
    std::string t = client_toml("7", "2");
    t.insert(t.find("state_dir"), cat("server = \"", bad, "\"\n"));
    EXPECT_NE(error_of(t).find(cat("got '", bad, "'")), std::string::npos) << bad;
  }
  for (const char* ok :
       {"[::1]:50051", "unix:/tmp/f.sock", "dns:///fed.org:443", "dns:fed.org:1", "fed.org:0"}) {
    std::string t = client_toml("7", "2");
    t.insert(t.find("state_dir"), cat("server = \"", ok, "\"\n"));
    EXPECT_EQ(error_of(t), "") << ok;
  }
  // A local step's sequences must fit the model's positions.
  text = client_toml("7", "2");
  text.insert(text.find("[tokenizer]"), "max_position_embeddings = 32\n");
  e = error_of(text);
  EXPECT_NE(e.find("key 'train.seq': 64 is more than model.max_position_embeddings (32)"),
            std::string::npos)
      << e;
  text = client_toml("7", "2");
  text.insert(text.find("seq = 64"), "eval_batches = 0\n");
  e = error_of(text);
  EXPECT_NE(e.find("train.eval_batches': expected 1 or more validation batches, got 0"),
            std::string::npos)
      << e;
  EXPECT_NE(pollen::testing::error_of([] {
              fed::make_dev_certs(std::filesystem::temp_directory_path() / "pollen_certs_days",
                                  {"a"}, {"localhost"}, 3000000);
            }).find("--days must be 1 to 36500"),
            std::string::npos);
}

// The server's keys are checked when its config is read, each error naming the key and its
// bound: a negative max_round_retries stopped the run after its first round, and local_steps past
// what a client takes failed every client's task without naming the key.
TEST(FedConfig, ServerKeysOutOfRangeAreRefusedByName) {
  auto server_error = [](const std::string& key, const std::string& value) {
    return error_of_server(
        cat("[server]\ndir = 'x'\n", key, " = ", value,
            "\n[model]\npreset = 'llama-tiny'\n[tokenizer]\nfingerprint = 'f'\n"));
  };
  const struct {
    const char* key;
    const char* value;
    const char* says;
  } refused[] = {
      {"max_round_retries", "-1", "server.max_round_retries': must be 0 or more, got -1"},
      {"local_steps", "10000001", "server.local_steps': must be 1 to 10000000, got 10000001"},
      {"local_steps", "0", "server.local_steps': must be 1 to 10000000"},
      {"client_timeout_s", "0", "server.client_timeout_s': must be more than 0"},
      {"client_timeout_s", "-3", "server.client_timeout_s': must be more than 0"},
      {"client_timeout_s", "nan", "server.client_timeout_s'"},
      {"wait_for_clients_s", "-1", "server.wait_for_clients_s': must be 0 or more"},
      {"wait_for_clients_s", "1e10", "at most 1000000000 seconds, got 1e+10"},
      {"wait_for_clients_s", "inf", "server.wait_for_clients_s'"},
      {"round_timeout_s", "1e30", "server.round_timeout_s': must be more than 0 and at most"},
      {"round_timeout_s", "inf", "server.round_timeout_s'"},
  };
  for (const auto& r : refused) {
    const std::string e = server_error(r.key, r.value);
    EXPECT_NE(e.find(r.says), std::string::npos) << r.key << " = " << r.value << ": " << e;
  }
  for (const auto& [key, value] :
       std::vector<std::pair<std::string, std::string>>{{"max_round_retries", "0"},
                                                        {"local_steps", "10000000"},
                                                        {"wait_for_clients_s", "0"},
                                                        {"client_timeout_s", "0.5"}}) {
    EXPECT_EQ(server_error(key, value), "") << key << " = " << value;
  }
}

// A compression setting out of range names the key that is: the block, or topk within it.
TEST(FedConfig, CompressionMistakesNameTheirKey) {
  auto compression_error = [](const std::string& keys) {
    return error_of_server(
        cat("[server]\ndir = 'x'\n[compression]\n", keys,
            "\n[model]\npreset = 'llama-tiny'\n[tokenizer]\nfingerprint = 'f'\n"));
  };
  std::string e = compression_error("codec = 'topk'\ntopk = 2\nblock = 70000");
  EXPECT_NE(e.find("compression.block': compression block must be at most 65536 with topk"),
            std::string::npos)
      << e;
  e = compression_error("codec = 'topk'\ntopk = 100\nblock = 64");
  EXPECT_NE(e.find("compression.topk': compression topk must be in [1, block = 64]"),
            std::string::npos)
      << e;
  e = compression_error("codec = 'int8'\nblock = 0");
  EXPECT_NE(e.find("compression.block': compression block must be in [1, 1048576]"),
            std::string::npos)
      << e;
}

// Without [tls] a server is unauthenticated: listening where other hosts reach it is refused,
// naming the key, unless server.allow_plaintext says the network is trusted; loopback is fine.
TEST(FedConfig, APlaintextServerListensOnlyOnThisHostUnlessAllowed) {
  auto server_error = [](const std::string& address, const std::string& more) {
    return error_of_server(cat("[server]\ndir = 'x'\naddress = '", address, "'\n", more,
                               "[model]\npreset = 'llama-tiny'\n[tokenizer]\nfingerprint = 'f'\n"));
  };
  for (const std::string open :
       {"0.0.0.0:50051", "10.1.2.3:7000", "[::]:50051", "fed.org:1", "127.example.org:1"}) {
    const std::string e = server_error(open, "");
    EXPECT_NE(e.find("key 'server.address': '" + open +
                     "' is reachable from other hosts, and "
                     "without [tls] anyone there could join"),
              std::string::npos)
        << e;
    EXPECT_EQ(server_error(open, "allow_plaintext = true\n"), "") << open;
  }
  for (const std::string local : {"127.0.0.1:50051", "localhost:9", "LocalHost:9", "[::1]:50051",
                                  "[::ffff:127.0.0.1]:50051", "unix:/tmp/s", "unix-abstract:s"})
    EXPECT_EQ(server_error(local, ""), "") << local;
  // An address without a port would listen on 443; one past 65535 on another port.
  for (const std::string bad : {"127.0.0.1", "127.0.0.1:86916"})
    EXPECT_NE(server_error(bad, "").find("key 'server.address': expected host:port"),
              std::string::npos)
        << bad;
  // The /metrics address is checked with the config, before anything listens.
  for (const std::string bad : {"127.0.0.1", ":9999", "127.0.0.1:70000"})
    EXPECT_NE(server_error("127.0.0.1:1", "metrics_address = '" + bad + "'\n")
                  .find("key 'server.metrics_address': expected host:port"),
              std::string::npos)
        << bad;
  EXPECT_EQ(server_error("127.0.0.1:1", "metrics_address = '[::1]:0'\n"), "");
  // A simulation does not listen: its [server] address is no reason to refuse it.
  EXPECT_NO_THROW(fed::parse_sim_config(
      "[server]\ndir = 'x'\naddress = '0.0.0.0:50051'\n[model]\npreset = 'llama-tiny'\n"
      "[tokenizer]\nfingerprint = 'f'\n[sim]\nclients = ['a']\nmanifests = ['m.json']\n",
      "sim.toml"));
}

// The outer optimizer's settings: in range, and ones the strategy (or aggregation rule) uses;
// -1 or absent takes the strategy's default.
TEST(FedConfig, StrategySettingsOutOfRangeOrOfAnotherStrategyAreRefused) {
  const auto strategy_error = [](const std::string& settings) {
    return error_of_server(
        "[server]\ndir = 'x'\n[model]\npreset = 'llama-tiny'\n[tokenizer]\n"
        "fingerprint = 'f'\n[strategy]\n" +
        settings);
  };
  const std::pair<const char*, const char*> refused[] = {
      {"name = 'fedadam'\nbeta2 = 2", "strategy.beta2 must be in [0, 1)"},
      {"name = 'fedadam'\nlr = -0.5", "strategy.lr must be positive"},
      {"name = 'fedadam'\ntau = 0", "strategy.tau must be positive"},
      {"name = 'fedavgm'\nmomentum = 2", "strategy.momentum must be in [0, 1)"},
      {"name = 'fedadam'\nmomentum = 0.5", "strategy.momentum is not a setting of strategy "},
      {"name = 'diloco'\nbeta1 = 0.5", "strategy.beta1 is not a setting of strategy 'diloco'"},
      {"name = 'fedadagrad'\nbeta2 = 0.5", "strategy.beta2 is not a setting of strategy"},
      {"name = 'fedavg'\ntrim_fraction = 0.3", "applies to strategy.aggregation trimmed_mean"},
      {"name = 'fedavg'\nbyzantine = 1", "applies to strategy.aggregation krum or multi_krum"},
  };
  for (const auto& [settings, says] : refused) {
    const std::string e = strategy_error(settings);
    EXPECT_NE(e.find(says), std::string::npos) << settings << ": " << e;
    EXPECT_NE(e.find("config file 'fed.toml'"), std::string::npos) << settings << ": " << e;
  }
  // A misspelt strategy is named as such, not as its keys' fault.
  const std::string misspelt = strategy_error("name = 'dilocoo'\nmomentum = 0.9");
  EXPECT_NE(misspelt.find("key 'strategy.name': unknown strategy 'dilocoo'; expected one of"),
            std::string::npos)
      << misspelt;
  for (const char* settings :
       {"name = 'fedadam'\nlr = -1\nbeta1 = 0.5", "name = 'diloco'\nmomentum = 0",
        "name = 'fedadagrad'\nbeta1 = 0.1\ntau = 1e-6",
        "name = 'fedavg'\naggregation = 'trimmed_mean'\ntrim_fraction = 0.2"})
    EXPECT_EQ(strategy_error(settings), "") << settings;
}

// A busy server is waited out for busy_timeout_s in a row, then the client ends naming the key;
// an answer starts the count again. The streak begins when the call that found the server busy
// began, a call timeout (here 0.5 s) before the ServerBusy.
TEST(FedConfig, ABusyServerIsWaitedOutForBusyTimeoutSInARow) {
  fed::BusyServerWait wait("silo-a", 2.0, 0.5);
  const fed::ServerBusy busy("the federation server is busy");
  EXPECT_NO_THROW(wait.busy(busy, "asking again"));  // 0.5 s of the 2
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_NO_THROW(wait.busy(busy, "asking again"));  // 0.7 s
  wait.answered();
  std::this_thread::sleep_for(std::chrono::milliseconds(2100));
  EXPECT_NO_THROW(wait.busy(busy, "asking again"));  // 0.5 s again
  std::this_thread::sleep_for(std::chrono::milliseconds(1600));
  const std::string e = pollen::testing::error_of([&] { wait.busy(busy, "asking again"); });
  EXPECT_NE(e.find("past client.busy_timeout_s = 2 s"), std::string::npos) << e;
  EXPECT_NE(e.find("fed client 'silo-a'"), std::string::npos) << e;
}

// A client id names folders (its certificate, a simulated client's state under
// server.dir/clients/<id>): one of dots only would name the folder itself or its parent.
TEST(FedConfig, ClientIdsOfDotsOnlyAreRefused) {
  for (const char* id : {"..", "."}) {
    std::string text = client_toml("7", "2");
    text.replace(text.find("silo-a"), 6, id);
    const std::string e = error_of(text);
    EXPECT_NE(e.find("made of dots only"), std::string::npos) << id << ": " << e;
  }
  std::string text = client_toml("7", "2");
  text.replace(text.find("silo-a"), 6, "silo.a");
  EXPECT_EQ(error_of(text), "");
}

// train.device: "cpu" (the default) or "cuda"; anything else is refused naming the key, and a
// silo on "cuda" where no GPU can be used is refused when its trainer starts, naming the key and
// saying why, before any data is read.
TEST(FedConfig, TrainDeviceIsCpuOrCudaAndAGpuSiloNeedsAGpu) {
  EXPECT_EQ(fed::parse_client_config(client_toml("7", "2"), "client.toml").train.device, "cpu");
  std::string text = client_toml("7", "2");
  text.replace(text.find("seq = 64"), 8, "seq = 64\ndevice = \"cuda\"");
  const fed::ClientConfig gpu = fed::parse_client_config(text, "client.toml");
  EXPECT_EQ(gpu.train.device, "cuda");
  text.replace(text.find("\"cuda\""), 6, "\"tpu\"");
  const std::string e = error_of(text);
  EXPECT_NE(e.find("train.device"), std::string::npos) << e;
  EXPECT_NE(e.find("expected \"cpu\" or \"cuda\", got \"tpu\""), std::string::npos) << e;
  // bf16 compute keeps f32 master weights on the GPU; the CPU trains in f32.
  std::string bf16 = client_toml("7", "2");
  bf16.replace(bf16.find("seq = 64"), 8, "seq = 64\nprecision = \"bf16\"");
  const std::string p = error_of(bf16);
  EXPECT_NE(p.find("train.precision"), std::string::npos) << p;
  EXPECT_NE(p.find("needs train.device = \"cuda\""), std::string::npos) << p;
  bf16.replace(bf16.find("precision"), 9, "device = \"cuda\"\nprecision");
  EXPECT_EQ(fed::parse_client_config(bf16, "client.toml").train.precision, "bf16");

  // --device of `fed client` and `fed simulate` sets the key, checked as the key is.
  fed::ClientConfig flagged = fed::parse_client_config(client_toml("7", "2"), "client.toml");
  fed::set_train_device(flagged, "cuda");
  EXPECT_EQ(flagged.train.device, "cuda");
  flagged.train.precision = "bf16";
  const std::string cpu_bf16 =
      pollen::testing::error_of([&] { fed::set_train_device(flagged, "cpu"); });
  EXPECT_NE(cpu_bf16.find("--device cpu: client 'silo-a' has train.precision = \"bf16\""),
            std::string::npos)
      << cpu_bf16;
  flagged.post.run = "r.toml";
  const std::string post =
      pollen::testing::error_of([&] { fed::set_train_device(flagged, "cuda"); });
  EXPECT_NE(post.find("post-training silo ([post]), which trains on the CPU"), std::string::npos)
      << post;

  // Where a GPU is usable, tests/cuda/fed_client_test.cpp trains such a silo instead.
  if (cuda_devices().empty()) {
    const std::string m = pollen::testing::error_of([&] { fed::LocalTrainer trainer(gpu); });
    EXPECT_NE(m.find("client 'silo-a': train.device"), std::string::npos) << m;
    EXPECT_NE(m.find(cuda_built() ? "not usable here" : "built without the CUDA backend"),
              std::string::npos)
        << m;
  }
}

// The inner AdamW's keys are pollen train's [optimizer] keys, read from [train] and checked alike.
TEST(FedConfig, TrainTakesPollenTrainsOptimizerKeys) {
  const fed::ClientConfig plain = fed::parse_client_config(client_toml("7", "2"), "client.toml");
  EXPECT_EQ(plain.train.optimizer.no_decay,
            (std::vector<std::string>{"norms", "biases", "embeddings"}));
  EXPECT_DOUBLE_EQ(plain.train.optimizer.weight_decay, 0.1);
  std::string text = client_toml("7", "2");
  text.replace(text.find("seq = 64"), 8, "seq = 64\nno_decay = [\"norms\"]\nbeta2 = 0.99");
  const fed::ClientConfig set = fed::parse_client_config(text, "client.toml");
  EXPECT_EQ(set.train.optimizer.no_decay, std::vector<std::string>{"norms"});
  EXPECT_DOUBLE_EQ(set.train.optimizer.beta2, 0.99);
  text.replace(text.find("[\"norms\"]"), 9, "[\"weights\"]");
  const std::string e = error_of(text);
  EXPECT_NE(e.find("train.no_decay"), std::string::npos) << e;
  EXPECT_NE(e.find("unknown group 'weights'"), std::string::npos) << e;
  std::string beta = client_toml("7", "2");
  beta.replace(beta.find("seq = 64"), 8, "seq = 64\nbeta1 = 1.0");
  const std::string b = error_of(beta);
  EXPECT_NE(b.find("train.beta1"), std::string::npos) << b;
}

// Every example in configs/fed reads as the command it names reads it (sim*.toml as
// `pollen fed simulate`, fed.toml as the server, client.toml as a client).
TEST(FedConfig, EveryExampleReads) {
  const std::filesystem::path dir = std::filesystem::path(POLLEN_SOURCE_DIR) / "configs/fed";
  int read = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (e.path().extension() != ".toml" || name == "tokenizer.toml") continue;
    SCOPED_TRACE(name);
    if (name.starts_with("sim")) {
      EXPECT_FALSE(fed::load_sim_config(e.path()).clients.empty());
    } else if (name == "client.toml") {
      EXPECT_FALSE(fed::load_client_config(e.path()).id.empty());
    } else {
      EXPECT_GT(fed::load_server_config(e.path()).rounds, 0);
    }
    ++read;
  }
  EXPECT_GE(read, 6);
  // A client id given twice in [sim] would share one state folder and count once a round.
  const std::string sim = read_file(dir / "sim.toml");
  const std::string e = pollen::testing::error_of([&] {
    const auto c = fed::parse_sim_config(sim, (dir / "sim.toml").string());
    std::string twice = sim;
    twice.replace(twice.find(c.clients[1].id), c.clients[1].id.size(), c.clients[0].id);
    fed::parse_sim_config(twice, "twice.toml");
  });
  EXPECT_NE(e.find("appears twice"), std::string::npos) << e;
}
