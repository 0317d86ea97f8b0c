// Record-level DP inside a silo ([dp_sgd]): a client's DP-SGD accounts every local step it runs,
// across rounds and restarts, in its state folder; what it cannot protect is refused.
#include <gtest/gtest.h>

#include <memory>

#include "base/files.h"
#include "base/thread_pool.h"
#include "fed/client.h"
#include "fed/config.h"
#include "fed/coordinator.h"
#include "fed/fixtures.h"
#include "support/errors.h"
#include "train/trainer.h"

using namespace pollen;
using namespace pollen::fed;
using namespace pollen::fed::testing;

namespace {

optim::DpSgdOptions dp_sgd(double z) {
  optim::DpSgdOptions o;
  o.enabled = true;
  o.clip = 1.0;
  o.noise_multiplier = z;
  o.noise_seed = 9;
  return o;
}

// The silo's training split cut into sequences as the client's loader cuts them.
std::unique_ptr<data::Loader> silo_loader(const fs::path& manifest) {
  data::LoaderOptions o;
  o.manifests = {manifest};
  o.batch = 4;
  o.seq = 16;
  return std::make_unique<data::Loader>(o);
}

// One round that `client`, alone in the federation, trains and the server aggregates.
void train_a_round(Coordinator& server, Client& client) {
  ASSERT_TRUE(server.begin_round());
  ASSERT_EQ(client.poll_once(), pb::TASK_TRAIN);
  ASSERT_TRUE(server.end_round().aggregated);
}

}  // namespace

TEST(SiloDpSgd, EveryLocalStepIsAccountedAcrossRoundsAndRestarts) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("silo_dp_sgd");
  const auto silo = make_silo(dir / "a", 3);
  auto cfg = sim_config(dir / "run", {silo}, "fedavg", 3, 2);
  cfg.clients[0].dp_sgd = dp_sgd(1.0);
  cfg.clients[0].state_dir = dir / "state";
  Coordinator server(cfg.server, false);
  LocalTransport transport(server);
  auto client = std::make_unique<Client>(cfg.clients[0], transport);
  client->join();
  for (int round = 1; round <= 3; ++round) {
    if (round == 3) {  // the silo is killed between rounds and started again from its state
      client.reset();
      client = std::make_unique<Client>(cfg.clients[0], transport);
      client->join();
    }
    train_a_round(server, *client);
  }
  // 3 rounds of 2 local steps, each a Poisson-sampled Gaussian of multiplier 1 at q = 4 / N.
  const auto ledger = nlohmann::json::parse(read_file(dir / "state" / "dp_sgd.json"));
  EXPECT_EQ(ledger["steps"], 6) << "the restarted client forgot the steps before the restart";
  const auto loader = silo_loader(silo);
  const int64_t n = loader->windows_total();
  optim::PrivacyAccountant accountant;
  accountant.add(4.0 / static_cast<double>(n), 1.0, 6);
  optim::DpSgd reread(dp_sgd(1.0), n, 4, 1);
  reread.restore_accountant(ledger);
  EXPECT_DOUBLE_EQ(reread.epsilon().epsilon, accountant.epsilon(reread.delta()).epsilon);
  // The client trained on each step's Poisson sample (steps 1 to 6 of the seeded draw): the
  // server's aggregation weight is the scored tokens of the sequences sampled.
  int64_t sampled_tokens = 0;
  for (int64_t step = 1; step <= 6; ++step)
    sampled_tokens += train::count_scored(loader->windows(reread.sample(step)));
  const auto rounds = read_jsonl(cfg.server.dir / "metrics.jsonl");
  ASSERT_EQ(rounds.size(), 3u);
  int64_t tokens = 0;
  for (const auto& r : rounds) tokens += r["tokens"].get<int64_t>();
  EXPECT_EQ(tokens, sampled_tokens);
  fs::remove_all(dir);
}

TEST(SiloDpSgd, RefusesWhatItCannotKeepPrivate) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("silo_dp_sgd_refused");
  const auto silo = make_silo(dir / "a", 3);
  auto cfg = sim_config(dir / "run", {silo}, "fedavg", 1, 2);
  cfg.clients[0].dp_sgd = dp_sgd(1.0);
  Coordinator server(cfg.server, false);
  LocalTransport transport(server);
  // No state folder: a restart would forget the steps it ran.
  EXPECT_NE(pollen::testing::error_of([&] {
              Client c(cfg.clients[0], transport);
            }).find("set client.state_dir"),
            std::string::npos);
  // A state that took more local steps than its account holds: steps no epsilon covers.
  cfg.clients[0].state_dir = dir / "state";
  {
    Client c(cfg.clients[0], transport);
    c.join();
    train_a_round(server, c);
  }
  fs::remove(dir / "state" / "dp_sgd.json");
  EXPECT_NE(pollen::testing::error_of([&] {
              Client c(cfg.clients[0], transport);
            }).find("no epsilon covers them"),
            std::string::npos);
  // A client does not know how many steps it will run: no target epsilon.
  const fs::path toml = dir / "client.toml";
  write_file_atomic(toml, client_toml("127.0.0.1:1", dir / "state", silo) +
                              "[dp_sgd]\nclip = 1.0\ntarget_epsilon = 8\n");
  EXPECT_NE(
      pollen::testing::error_of([&] { load_client_config(toml); }).find("give noise_multiplier"),
      std::string::npos);
  // A seeded sample and noise only where the client says it takes them.
  write_file_atomic(toml, client_toml("127.0.0.1:1", dir / "state", silo) +
                              "[dp_sgd]\nclip = 1.0\nnoise_multiplier = 1\nnoise_seed = 3\n");
  EXPECT_NE(
      pollen::testing::error_of([&] { load_client_config(toml); }).find("allow_repeatable_noise"),
      std::string::npos);
  fs::remove_all(dir);
}
