// train.drift_correction of a client (fed/drift_correction.h): after every local step the client
// also moves by -beta (G - d) / H, G the global model's last move and d its own last move, and
// sends only its own steps' move. (Its anchor across restarts: tests/fed/client_state_test.cpp.)
#include <gtest/gtest.h>

#include <cmath>

#include "base/thread_pool.h"
#include "fed/client.h"
#include "fed/coordinator.h"
#include "fed/drift_correction.h"
#include "fed/fixtures.h"
#include "fed/wire.h"

using namespace pollen;
using namespace pollen::fed;
using namespace pollen::fed::testing;

namespace {

Weights two(float a, float b) {
  return {vec({a, b})};
}

void expect_near(const Weights& got, std::vector<float> want, const std::string& what) {
  ASSERT_EQ(got.size(), 1u) << what;
  ASSERT_EQ(got[0].numel(), static_cast<int64_t>(want.size())) << what;
  for (size_t j = 0; j < want.size(); ++j) {
    EXPECT_NEAR(got[0].data<float>()[j], want[j], 1e-6) << what << " [" << j << "]";
  }
}

// The Euclidean distance between two sets of weights (from zero when b is empty).
double distance(const Weights& a, const Weights& b = {}) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    for (int64_t j = 0; j < a[i].numel(); ++j) {
      const double d = static_cast<double>(a[i].data<float>()[j]) -
                       (b.empty() ? 0.0 : static_cast<double>(b[i].data<float>()[j]));
      s += d * d;
    }
  }
  return std::sqrt(s);
}

struct Rounds {
  Weights global;              // after the last round
  std::vector<Weights> local;  // each client's weights at the end of the last round
};

// `rounds` rounds of the clients of `cfg` in one process, every client in every round.
Rounds federate(SimConfig cfg, int rounds) {
  Coordinator server(cfg.server, false);
  LocalTransport transport(server);
  std::vector<std::unique_ptr<Client>> clients;
  for (const auto& cc : cfg.clients) {
    clients.push_back(std::make_unique<Client>(cc, transport));
    clients.back()->join();
  }
  for (int r = 1; r <= rounds; ++r) {
    EXPECT_TRUE(server.begin_round());
    for (auto& c : clients) EXPECT_EQ(c->poll_once(), pb::TASK_TRAIN);
    EXPECT_TRUE(server.end_round().aggregated);
  }
  Rounds out{server.global_weights(), {}};
  for (auto& c : clients) out.local.push_back(model_weights(c->trainer().model()));
  return out;
}

}  // namespace

TEST(DriftCorrection, HandComputedStepsAndAnchors) {
  DriftCorrection drift(0.5);
  // Round 1: nothing to correct yet; own = global - local, anchor = global - own = local.
  EXPECT_TRUE(drift.step_drift(1, two(1, 2), 4).empty());
  expect_near(drift.own_move(1, two(1, 2), two(0.5f, 2.5f), {}, 4), {0.5f, -0.5f}, "own 1");
  expect_near(drift.anchor(), {0.5f, 2.5f}, "anchor 1");
  // Round 2 from global (0.8, 2.1): G - d = anchor - global = (-0.3, 0.4); per step 0.5 / 4 of it.
  const Weights step = drift.step_drift(2, two(0.8f, 2.1f), 4);
  expect_near(step, {-0.0375f, 0.05f}, "step drift 2");
  // The local model moved by its own steps and by 4 steps of drift: own = global - local - 4 step.
  expect_near(drift.own_move(2, two(0.8f, 2.1f), two(0.6f, 2.0f), step, 4), {0.35f, -0.1f},
              "own 2");
  expect_near(drift.anchor(), {0.45f, 2.2f}, "anchor 2");
  EXPECT_EQ(drift.anchor_round(), 2);
  // A client that missed round 3 has no last move to correct with in round 4.
  EXPECT_TRUE(drift.step_drift(4, two(0, 0), 4).empty());
  // Off: the plain pseudo-gradient and no anchor.
  DriftCorrection off(0);
  expect_near(off.own_move(1, two(1, 2), two(0.5f, 2.5f), {}, 4), {0.5f, -0.5f}, "own, off");
  EXPECT_TRUE(off.anchor().empty());
  EXPECT_TRUE(off.step_drift(2, two(1, 2), 4).empty());
}

TEST(DriftCorrection, ClientsOnDifferentDataDriftLessApart) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("drift_apart");
  const std::vector<fs::path> silos{make_silo(dir / "a", 1), make_silo(dir / "b", 7)};
  auto run = [&](double beta) {
    SimConfig cfg = sim_config(dir / cat("beta-", beta), silos, "fedavg", 4, 5);
    for (auto& cc : cfg.clients) cc.train.drift_correction = beta;
    return federate(cfg, cfg.server.rounds);
  };
  const Rounds plain = run(0), corrected = run(1);
  const double apart = distance(plain.local[0], plain.local[1]);
  const double closer = distance(corrected.local[0], corrected.local[1]);
  // Each client also followed the federation's last move instead of its own: in round 4 the two
  // local models end nearer each other (measured: 0.45 of the uncorrected distance).
  EXPECT_LT(closer, 0.6 * apart) << "plain " << apart << ", corrected " << closer;
  fs::remove_all(dir);
}

TEST(DriftCorrection, OneClientUnderFedAvgHasNothingToCorrect) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("drift_one");
  const auto silo = make_silo(dir / "a", 3);
  // With one client and FedAvg (server lr 1) the global model moves by the client's own move:
  // G - d = 0, so the run is the uncorrected one up to float rounding.
  auto run = [&](double beta, const std::string& strategy) {
    SimConfig cfg = sim_config(dir / cat(strategy, beta), {silo}, strategy, 3, 10);
    cfg.clients[0].train.drift_correction = beta;
    return federate(cfg, 3).global;
  };
  const Weights plain = run(0, "fedavg");
  EXPECT_LT(distance(run(1, "fedavg"), plain), 1e-5 * distance(plain))
      << "a correction was applied where there is none";
  // Under DiLoCo's Nesterov momentum the global model moves further than the client did, and
  // the correction follows it: another run.
  EXPECT_GT(distance(run(1, "diloco"), run(0, "diloco")), 1e-3);
  fs::remove_all(dir);
}

TEST(DriftCorrection, OutOfRangeIsRefusedNamingTheKey) {
  const auto dir = temp_dir("drift_config");
  std::string toml = client_toml("127.0.0.1:1", dir / "state", dir / "manifest.json");
  const std::string at = "eval_batches = 2\n";
  toml.insert(toml.find(at) + at.size(), "drift_correction = 1.5\n");
  write_file_atomic(dir / "client.toml", toml);
  try {
    load_client_config(dir / "client.toml");
    ADD_FAILURE() << "drift_correction = 1.5 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("drift_correction"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[0, 1]"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}
