// The server process killed mid-run and restarted with --resume: it continues after its last
// checkpointed round, the client (still running) joins it again, and nothing is lost or counted
// twice in metrics.jsonl and lineage.jsonl.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

#include "base/files.h"
#include "base/hash.h"
#include "base/thread_pool.h"
#include "fed/client.h"
#include "fed/coordinator.h"
#include "fed/fixtures.h"
#include "io/checkpoint.h"
#include "support/errors.h"

using namespace pollen;
using namespace pollen::fed;
using namespace pollen::fed::testing;

TEST(ServerRestart, KilledServerResumesAndTheClientRejoins) {
  const auto dir = temp_dir("server_killed");
  const auto silo = make_silo(dir / "a", 3);
  const std::string address = loopback_address();
  write_file_atomic(dir / "fed.toml",
                    cat("[server]\ndir = '", (dir / "run").string(), "'\naddress = '", address,
                        "'\nseed = 5\nrounds = 4\nlocal_steps = 100\nround_timeout_s = 120\n"
                        "wait_for_clients_s = 60\n[strategy]\nname = 'fedadam'\n",
                        kTinyModelToml));
  write_file_atomic(dir / "client.toml", client_toml(address, dir / "state", silo));
  auto spawn = [&](std::vector<std::string> args, const std::string& log) {
    return spawn_pollen(std::move(args), dir / log);
  };
  const std::string fed = (dir / "fed.toml").string();
  pid_t server = spawn({"fed", "server", "--config", fed}, "server-1.log");
  const pid_t client =
      spawn({"fed", "client", "--config", (dir / "client.toml").string()}, "client.log");
  auto rounds_checkpointed = [&] {
    const auto c = io::list_checkpoints(dir / "run/checkpoints");
    return c.empty() ? int64_t{0} : io::checkpoint_step(c.back());
  };
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (rounds_checkpointed() < 1 && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ::kill(server, SIGKILL);  // in round 2 (or later), mid-round
  waitpid(server, nullptr, 0);
  const int64_t before = rounds_checkpointed();
  ASSERT_GE(before, 1) << "see " << dir.string() << "/*.log";
  server = spawn({"fed", "server", "--config", fed, "--resume"}, "server-2.log");
  for (pid_t pid : {server, client}) {
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "a process failed; see " << dir.string() << "/*.log";
  }
  EXPECT_NE(read_file(dir / "server-2.log").find(cat("resumed from")), std::string::npos);
  EXPECT_EQ(rounds_checkpointed(), 4);
  // One aggregated line per round, in order: nothing lost, nothing twice.
  std::vector<int> rounds;
  for (const auto& m : read_jsonl(dir / "run/metrics.jsonl")) {
    if (m["status"] == "aggregated") rounds.push_back(m["round"].get<int>());
  }
  EXPECT_EQ(rounds, (std::vector<int>{1, 2, 3, 4}));
  std::vector<int> lineage;
  for (const auto& l : read_jsonl(dir / "run/lineage.jsonl")) lineage.push_back(l["round"]);
  EXPECT_EQ(lineage, (std::vector<int>{1, 2, 3, 4}));
  fs::remove_all(dir);
}

namespace {

// `rounds` rounds of the server with the simulation's one client, each aggregated.
void train_rounds(Coordinator& server, const SimConfig& cfg, int rounds) {
  LocalTransport transport(server);
  Client client(cfg.clients[0], transport);
  client.join();
  for (int i = 0; i < rounds; ++i) {
    ASSERT_TRUE(server.begin_round());
    client.poll_once();
    ASSERT_TRUE(server.end_round().aggregated);
  }
}

}  // namespace

// A server whose newest checkpoint does not verify resumes from the one before and moves the bad
// one aside, so that retention never counts it as the newest; with none that verifies it refuses
// to start rather than begin round 1 beside them (and delete the run's metrics); a checkpoint
// trained with another tokenizer is refused.
TEST(ServerRestart, CorruptCheckpointsAreSetAsideOrRefused) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("server_corrupt");
  const auto cfg = sim_config(dir, {make_silo(dir / "a", 1)}, "fedavg", 4, 1);
  auto train = [&](Coordinator& server, int rounds) { train_rounds(server, cfg, rounds); };
  const fs::path ckpts = cfg.server.dir / "checkpoints";
  auto step = [&](int round) { return ckpts / io::checkpoint_name(round); };
  {
    Coordinator server(cfg.server, false);
    train(server, 2);
  }
  flip_a_byte(step(2) / "model.safetensors");
  {
    Coordinator server(cfg.server, true);
    EXPECT_EQ(server.rounds_done(), 1);
    EXPECT_TRUE(fs::exists(ckpts / ".corrupt-step-00000002" / "manifest.json"));
    train(server, 3);
  }
  EXPECT_EQ(io::list_checkpoints(ckpts), (std::vector<fs::path>{step(2), step(3), step(4)}));

  auto refusal = [&](const ServerConfig& c) {
    try {
      Coordinator server(c, true);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("resumed");
  };
  ServerConfig other_tokenizer = cfg.server;
  other_tokenizer.tokenizer_fingerprint = "another-tokenizer";
  EXPECT_NE(refusal(other_tokenizer).find("tokenizer fingerprint test-tokenizer"),
            std::string::npos)
      << refusal(other_tokenizer);
  // Fewer rounds than were done leave nothing to run: refused, not taken for a finished run.
  ServerConfig fewer = cfg.server;
  fewer.rounds = 3;
  EXPECT_NE(refusal(fewer).find("server.rounds (3) is below the 4 rounds of checkpoint"),
            std::string::npos)
      << refusal(fewer);

  for (int round = 2; round <= 4; ++round) flip_a_byte(step(round) / "state.json");
  const std::string why = refusal(cfg.server);
  EXPECT_NE(why.find("no checkpoint under"), std::string::npos) << why;
  EXPECT_NE(why.find("(3 skipped"), std::string::npos) << why;
  // Nothing was changed: the checkpoints and the four rounds' metrics are all still there.
  EXPECT_EQ(io::list_checkpoints(ckpts), (std::vector<fs::path>{step(2), step(3), step(4)}));
  int aggregated = 0;
  for (const auto& m : read_jsonl(cfg.server.dir / "metrics.jsonl"))
    aggregated += m["status"] == "aggregated";
  EXPECT_EQ(aggregated, 4);
  fs::remove_all(dir);
}

// A resume on a config whose keys that shape the training differ from the checkpoint's (as its
// file was written) names each, with both values; deadlines and the number of rounds may change
// without a word.
TEST(ServerRestart, AResumeNamesTheConfigKeysThatChanged) {
  const auto dir = temp_dir("server_settings");
  const auto text = [&](const std::string& lr, int rounds) {
    return cat("[server]\ndir = '", (dir / "run").string(), "'\nrounds = ", rounds,
               "\nround_timeout_s = ", rounds * 10,
               "\nlocal_steps = 1\nseed = 5\n[strategy]\nname = 'diloco'\nlr = ", lr, "\n",
               kTinyModelToml);
  };
  {
    Quiet q;
    set_num_threads(1);
    Coordinator first(parse_server_config(text("0.7", 2), "fed.toml"), false);
    LocalTransport transport(first);
    Client client(sim_config(dir, {make_silo(dir / "a", 1)}, "diloco", 2, 1).clients[0], transport);
    client.join();
    ASSERT_TRUE(first.begin_round());
    client.poll_once();
    ASSERT_TRUE(first.end_round().aggregated);
  }
  const auto warnings = [&](const std::string& config) {
    ::testing::internal::CaptureStderr();
    { Coordinator resumed(parse_server_config(config, "fed.toml"), true); }
    return ::testing::internal::GetCapturedStderr();
  };
  const std::string changed = warnings(text("0.5", 2));
  EXPECT_NE(changed.find("fed server --resume: the config differs from that of checkpoint"),
            std::string::npos)
      << changed;
  EXPECT_NE(changed.find("strategy.lr (0.7 -> 0.5)"), std::string::npos) << changed;
  EXPECT_EQ(warnings(text("0.7", 3)).find("the config differs"), std::string::npos);
  // Evaluating more or less often, or naming the model otherwise, trains the same weights.
  std::string evaluated = text("0.7", 3);
  evaluated.insert(evaluated.find("local_steps"), "eval_every = 2\n");
  EXPECT_EQ(warnings(evaluated).find("the config differs"), std::string::npos) << evaluated;
  // A checkpoint of an older pollen, whose model config lacks sliding_window and rope_scaling,
  // resumes; one of another model is refused naming the key.
  const fs::path ckpt = dir / "run" / "checkpoints" / io::checkpoint_name(1);
  const auto rewrite_model = [&](const std::function<void(nlohmann::json&)>& edit) {
    auto state = nlohmann::json::parse(read_file(ckpt / "state.json"));
    auto model = nlohmann::json::parse(state["model_config"].get<std::string>());
    edit(model);
    state["model_config"] = model.dump();
    write_file_atomic(ckpt / "state.json", state.dump(1));
    auto manifest = nlohmann::json::parse(read_file(ckpt / "manifest.json"));
    manifest["files"]["state.json"] = {{"bytes", fs::file_size(ckpt / "state.json")},
                                       {"sha256", sha256_file(ckpt / "state.json")}};
    write_file_atomic(ckpt / "manifest.json", manifest.dump(1));
  };
  rewrite_model([](nlohmann::json& m) {
    m.erase("sliding_window");
    m.erase("rope_scaling");
  });
  EXPECT_EQ(warnings(text("0.7", 3)).find("error"), std::string::npos);
  rewrite_model([](nlohmann::json& m) { m["hidden_size"] = 48; });
  const std::string other = pollen::testing::error_of(
      [&] { Coordinator refused(parse_server_config(text("0.7", 3), "fed.toml"), true); });
  EXPECT_NE(other.find("holds another model than the config's [model]: model.hidden_size: "
                       "checkpoint 48, config 32"),
            std::string::npos)
      << other;
  fs::remove_all(dir);
}

// Under central DP, a resume from an older checkpoint (the newest does not verify) keeps
// counting the releases made since, from server.dir/privacy.json: the rounds run again are
// charged anew, not instead. A fresh run in that folder is refused.
TEST(ServerRestart, CentralDpReleasesStayCountedWhenAResumeGoesBack) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("server_dp_back");
  auto cfg = sim_config(dir, {make_silo(dir / "a", 1)}, "fedavg", 4, 1);
  cfg.server.privacy = PrivacyOptions{};
  cfg.server.privacy.enabled = true;
  cfg.server.privacy.noise_multiplier = 1.0;
  cfg.server.privacy.clip = 0.05;
  auto train = [&](Coordinator& server, int rounds) { train_rounds(server, cfg, rounds); };
  const auto released = [&] {
    return nlohmann::json::parse(read_file(cfg.server.dir / "privacy.json"))["steps"];
  };
  {
    Coordinator server(cfg.server, false);
    train(server, 3);
  }
  EXPECT_EQ(released(), 3);
  flip_a_byte(cfg.server.dir / "checkpoints" / io::checkpoint_name(3) / "model.safetensors");
  {
    Coordinator server(cfg.server, true);
    EXPECT_EQ(server.rounds_done(), 2);
    train(server, 2);  // rounds 3 and 4: two more releases after the three made
  }
  EXPECT_EQ(released(), 5);
  fs::remove_all(cfg.server.dir / "checkpoints");  // the ledger alone still counts
  const std::string fresh =
      pollen::testing::error_of([&] { Coordinator server(cfg.server, false); });
  EXPECT_NE(fresh.find("privacy.json' holds the privacy account of an earlier private run"),
            std::string::npos)
      << fresh;
  fs::remove_all(dir);
}
