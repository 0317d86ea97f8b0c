// train.proximal_mu of a client (fed/proximal.h): FedProx's term mu / 2 |w - w_start|^2 added to
// each local step's loss, its gradient where the step's gradients start. (A silo of several ranks
// takes the steps of one process: tests/dist/fed_silo_test.cpp.)
#include <gtest/gtest.h>

#include <cmath>

#include "base/thread_pool.h"
#include "fed/client.h"
#include "fed/coordinator.h"
#include "fed/fixtures.h"
#include "fed/proximal.h"
#include "fed/wire.h"

using namespace pollen;
using namespace pollen::fed;
using namespace pollen::fed::testing;

namespace {

// The Euclidean distance between two sets of weights.
double distance(const Weights& a, const Weights& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    for (int64_t j = 0; j < a[i].numel(); ++j) {
      const double d =
          static_cast<double>(a[i].data<float>()[j]) - static_cast<double>(b[i].data<float>()[j]);
      s += d * d;
    }
  }
  return std::sqrt(s);
}

struct OneRound {
  Weights start;  // the global model the round trained from
  Weights local;  // the client's weights after its local steps
  Weights global;
};

// One round of one client (FedAvg) of `local_steps` steps with train.proximal_mu = mu.
OneRound one_round(const fs::path& dir, const fs::path& silo, int64_t local_steps, double mu) {
  SimConfig cfg = sim_config(dir, {silo}, "fedavg", 1, local_steps);
  cfg.clients[0].train.proximal_mu = mu;
  Coordinator server(cfg.server, false);
  LocalTransport transport(server);
  Client client(cfg.clients[0], transport);
  client.join();
  OneRound r;
  r.start = server.global_weights();
  EXPECT_TRUE(server.begin_round());
  EXPECT_EQ(client.poll_once(), pb::TASK_TRAIN);
  EXPECT_TRUE(server.end_round().aggregated);
  r.local = model_weights(client.trainer().model());
  r.global = server.global_weights();
  return r;
}

}  // namespace

TEST(Proximal, SeedsEachGradientWithItsShareOfMuTimesTheDistanceFromTheStart) {
  std::vector<ag::Var> params{ag::Var(vec({1.0f, -2.0f, 0.5f}), true), ag::Var(vec({4.0f}), true)};
  params[0].grad() = vec({9.0f, 9.0f, 9.0f});  // what a step left behind is replaced
  const Weights anchor{vec({0.5f, -2.0f, 1.5f}), vec({3.0f})};
  seed_proximal_gradients(params, {params[0].value(), params[1].value()}, anchor, 0.25);
  const float* g0 = params[0].grad().data<float>();
  EXPECT_FLOAT_EQ(g0[0], 0.125f);
  EXPECT_FLOAT_EQ(g0[1], 0.0f);
  EXPECT_FLOAT_EQ(g0[2], -0.25f);
  EXPECT_FLOAT_EQ(params[1].grad().data<float>()[0], 0.25f);
  // The weights themselves are left alone.
  EXPECT_FLOAT_EQ(params[0].value().data<float>()[0], 1.0f);
}

TEST(Proximal, TheFirstStepIsUnchangedAndLaterStepsStayNearerTheStart) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("proximal");
  const auto silo = make_silo(dir / "a", 5);
  // A round of one step: the weights are still the start's, the term and its gradient are zero
  // and the step is bitwise the plain one.
  EXPECT_TRUE(bitwise_equal(one_round(dir / "one-0", silo, 1, 0).local,
                            one_round(dir / "one-1", silo, 1, 1.0).local));
  // Six steps: the larger mu, the nearer the start the client ends; the server's FedAvg takes
  // the client's move as it is.
  const OneRound plain = one_round(dir / "six-0", silo, 6, 0);
  double last = distance(plain.local, plain.start);
  for (double mu : {1.0, 10.0, 100.0}) {
    const OneRound prox = one_round(dir / cat("six-", mu), silo, 6, mu);
    ASSERT_TRUE(bitwise_equal(prox.start, plain.start));
    const double moved = distance(prox.local, prox.start);
    EXPECT_LT(moved, last) << "mu " << mu;
    EXPECT_LT(distance(prox.global, prox.local), 1e-6 * moved) << "mu " << mu;
    last = moved;
  }
  EXPECT_LT(last, 0.5 * distance(plain.local, plain.start));
  fs::remove_all(dir);
}

TEST(Proximal, ANegativeMuIsRefusedNamingTheKey) {
  const auto dir = temp_dir("proximal_config");
  std::string toml = client_toml("127.0.0.1:1", dir / "state", dir / "manifest.json");
  const std::string at = "eval_batches = 2\n";
  toml.insert(toml.find(at) + at.size(), "proximal_mu = -0.1\n");
  write_file_atomic(dir / "client.toml", toml);
  try {
    load_client_config(dir / "client.toml");
    ADD_FAILURE() << "proximal_mu = -0.1 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("train.proximal_mu"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("0 or more"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}
