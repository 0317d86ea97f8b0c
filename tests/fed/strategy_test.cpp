// Strategies: hand-computed rounds, and agreement with Flower's implementations over several
// rounds of the same client updates.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "base/files.h"
#include "base/rng.h"
#include "fed/fixtures.h"
#include "fed/strategy.h"
#include "support/peer.h"

using namespace pollen;
using namespace pollen::fed;
using namespace pollen::fed::testing;

namespace {

std::vector<float> values(const Tensor& t) {
  auto d = t.to_doubles();
  return {d.begin(), d.end()};
}

std::unique_ptr<Strategy> strategy(const std::string& name, double lr = -1, double mom = -1) {
  StrategyOptions o;
  o.name = name;
  o.lr = lr;
  o.momentum = mom;
  return make_strategy(o);
}

}  // namespace

TEST(Strategy, FedAvgWeightsByTokens) {
  // Client a: delta 1 with 100 tokens; b: delta 4 with 300 tokens: mean delta 3.25.
  Weights x{vec({10, 0})};
  auto s = strategy("fedavg");
  s->aggregate(1, x, {update("a", 100, {1, -2}), update("b", 300, {4, 2})});
  EXPECT_EQ(values(x[0]), (std::vector<float>{10 - 3.25f, 0 - 1.0f}));
}

TEST(Strategy, FedAvgLrOneIsTheMeanOfLocalModels) {
  Weights x{vec({1, 2, 3})};
  auto s = strategy("fedavg");
  // Local models 0.5 and 2.5 (deltas 0.5, -1.5 from x = 1, and so on), equal tokens.
  s->aggregate(1, x, {update("a", 7, {0.5f, 0, 1}), update("b", 7, {-1.5f, 2, 1})});
  EXPECT_EQ(values(x[0]), (std::vector<float>{1.5f, 1, 2}));
}

TEST(Strategy, ArrivalOrderDoesNotChangeTheResult) {
  Rng rng(3);
  std::vector<ClientUpdate> ups;
  for (int c = 0; c < 5; ++c) {
    std::vector<float> d(64);
    for (auto& v : d) v = static_cast<float>(rng.normal());
    ups.push_back(update("c" + std::to_string(c), 10 + c * 7, d));
  }
  Weights a{Tensor::zeros({64}, DType::f32)}, b{Tensor::zeros({64}, DType::f32)};
  auto s1 = strategy("fedavg"), s2 = strategy("fedavg");
  s1->aggregate(1, a, ups);
  std::reverse(ups.begin(), ups.end());
  s2->aggregate(1, b, ups);
  EXPECT_EQ(values(a[0]), values(b[0]));
}

TEST(Strategy, DiLoCoNesterovByHand) {
  // lr 0.5, mu 0.9. Round 1: Delta 1 -> m = 1, step = 1 + 0.9 = 1.9, x = 10 - 0.95 = 9.05.
  // Round 2: Delta 2 -> m = 0.9 + 2 = 2.9, step = 2 + 2.61 = 4.61, x = 9.05 - 2.305 = 6.745.
  Weights x{vec({10})};
  auto s = strategy("diloco", 0.5, 0.9);
  s->aggregate(1, x, {update("a", 1, {1})});
  EXPECT_FLOAT_EQ(values(x[0])[0], 9.05f);
  s->aggregate(2, x, {update("a", 1, {2})});
  EXPECT_FLOAT_EQ(values(x[0])[0], 6.745f);
}

TEST(Strategy, MomentumWarmsUpOverTheFirstRounds) {
  // diloco, lr 1, mu 0.8, 2 warm-up rounds, Delta 1 every round: mu is 0, 0.4, then 0.8.
  // Round 1: m = 1, step = 1, x = 9. Round 2: m = 0.4 + 1 = 1.4, step = 1 + 0.56, x = 7.44.
  // Round 3: m = 1.12 + 1 = 2.12, step = 1 + 1.696, x = 4.744.
  // Round 4: m = 1.696 + 1 = 2.696, step = 1 + 2.1568, x = 1.5872.
  StrategyOptions o;
  o.name = "diloco";
  o.lr = 1.0;
  o.momentum = 0.8;
  o.momentum_warmup_rounds = 2;
  auto s = make_strategy(o);
  Weights x{vec({10})};
  const std::vector<float> expected{9, 7.44f, 4.744f, 1.5872f};
  for (int r = 1; r <= 3; ++r) {
    s->aggregate(r, x, {update("a", 1, {1})});
    EXPECT_FLOAT_EQ(values(x[0])[0], expected[r - 1]) << "round " << r;
  }
  // A restarted server resumes the ramp from the round number and the checkpointed momentum.
  auto resumed = make_strategy(o);
  resumed->load_state(s->state());
  resumed->aggregate(4, x, {update("a", 1, {1})});
  EXPECT_FLOAT_EQ(values(x[0])[0], expected[3]);

  // fedavgm, lr 1, mu 0.5, 2 warm-up rounds: m1 = 1, x = 9; mu 0.25: m2 = 1.25, x = 7.75
  // (7.5 without the warm-up).
  o.name = "fedavgm";
  o.momentum = 0.5;
  auto h = make_strategy(o);
  Weights y{vec({10})};
  h->aggregate(1, y, {update("a", 1, {1})});
  h->aggregate(2, y, {update("a", 1, {1})});
  EXPECT_FLOAT_EQ(values(y[0])[0], 7.75f);

  // Without momentum there is nothing to warm up; a negative count is refused too.
  o.name = "fedadam";
  EXPECT_THROW(make_strategy(o), Error);
  o.name = "diloco";
  o.momentum_warmup_rounds = -1;
  EXPECT_THROW(make_strategy(o), Error);
}

TEST(Strategy, EmbeddingLrScaleMultipliesOnlyTheEmbeddingsStep) {
  // Tensors: an embedding [2, 2], an untied output layer [2, 2], a norm [2]; every delta is 1 in
  // round 1 and 2 in round 2.
  auto model = [] { return Weights{vec({10, 10, 10, 10}), vec({10, 10, 10, 10}), vec({10, 10})}; };
  auto deltas = [](float d) {
    ClientUpdate u = update("a", 1, {d, d, d, d});
    u.delta.push_back(vec({d, d, d, d}));
    u.delta.push_back(vec({d, d}));
    return u;
  };
  StrategyOptions o;
  o.name = "diloco";
  o.lr = 0.5;
  o.momentum = 0.9;
  o.embedding_lr_scale = 3;
  auto s = make_strategy(o);
  s->set_token_rows({0, 1});
  Weights x = model();
  // As DiLoCoNesterovByHand: the other tensors step 0.95, then 2.305; the embedding 3 times that.
  s->aggregate(1, x, {deltas(1)});
  s->aggregate(2, x, {deltas(2)});
  for (float v : values(x[0])) EXPECT_NEAR(v, 10 - 3 * (0.95 + 2.305), 1e-6);
  for (size_t t : {1u, 2u}) {
    for (float v : values(x[t])) EXPECT_FLOAT_EQ(v, 6.745f) << "tensor " << t;
  }
  // The momentum is the unscaled one (2.9 after round 2), so a restarted server continues the
  // same way. Round 3, Delta 1: m = 2.61 + 1 = 3.61, step = 1 + 3.249 = 4.249, x -= 0.5 * 4.249
  // (times 3 for the embedding).
  auto state = s->state();
  for (auto& [name, t] : state) t = t.clone();
  ASSERT_EQ(state.size(), 3u);
  for (const auto& [name, t] : state) {
    for (float v : values(t)) EXPECT_FLOAT_EQ(v, 2.9f) << name;
  }
  auto resumed = make_strategy(o);
  resumed->set_token_rows({0, 1});
  resumed->load_state(state);
  resumed->aggregate(3, x, {deltas(1)});
  for (float v : values(x[0])) EXPECT_NEAR(v, 10 - 3 * (0.95 + 2.305 + 2.1245), 1e-5);
  for (size_t t : {1u, 2u}) {
    for (float v : values(x[t])) EXPECT_NEAR(v, 6.745 - 2.1245, 1e-5) << "tensor " << t;
  }

  // fedavg (lr 1) and fedadam: the embedding moves exactly 3 times as far as the output layer,
  // which receives the same deltas.
  for (const std::string name : {"fedavg", "fedadam"}) {
    o.name = name;
    o.lr = -1;
    o.momentum = -1;
    auto f = make_strategy(o);
    f->set_token_rows({0, 1});
    Weights z = model();
    f->aggregate(1, z, {deltas(1)});
    f->aggregate(2, z, {deltas(2)});
    const float out = values(z[1])[0] - 10, emb = values(z[0])[0] - 10;
    EXPECT_NE(out, 0) << name;
    EXPECT_NEAR(emb, 3 * out, 1e-5 * std::fabs(out) + 1e-6) << name;
    EXPECT_EQ(values(z[2])[0], values(z[1])[0]) << name;  // same deltas, same unscaled steps
  }

  // Only an untied embedding has a scale of its own: a tied one (no output tensor) or none is
  // refused when the model's tensors are named, and a scale that is not positive when read.
  o.name = "diloco";
  for (TokenRowTensors rows : {TokenRowTensors{0, -1}, TokenRowTensors{-1, -1}}) {
    auto t = make_strategy(o);
    try {
      t->set_token_rows(rows);
      ADD_FAILURE() << "scale 3 accepted without an untied embedding";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("strategy.embedding_lr_scale"), std::string::npos)
          << e.what();
    }
  }
  o.embedding_lr_scale = 1;
  EXPECT_NO_THROW(make_strategy(o)->set_token_rows({0, -1}));
  for (double bad : {0.0, -1.0, std::nan("")}) {
    o.embedding_lr_scale = bad;
    EXPECT_THROW(make_strategy(o), Error) << bad;
  }
  const auto dir = temp_dir("embedding_lr_scale");
  const std::string server = "[server]\ndir = 'x'\n" + kTinyModelToml + "[strategy]\n";
  write_file_atomic(dir / "ok.toml", server + "embedding_lr_scale = 2.5\n");
  EXPECT_EQ(load_server_config(dir / "ok.toml").strategy.embedding_lr_scale, 2.5);
  const std::string zero =
      server_config_error(dir / "zero.toml", server + "embedding_lr_scale = 0\n");
  EXPECT_NE(zero.find("strategy.embedding_lr_scale must be a positive number"), std::string::npos)
      << zero;
  fs::remove_all(dir);
}

TEST(Strategy, FedAvgMByHand) {
  // lr 1, mu 0.5: m1 = 1, x = 9; m2 = 0.5 + 1 = 1.5, x = 7.5.
  Weights x{vec({10})};
  auto s = strategy("fedavgm", 1.0, 0.5);
  s->aggregate(1, x, {update("a", 1, {1})});
  s->aggregate(2, x, {update("a", 1, {1})});
  EXPECT_FLOAT_EQ(values(x[0])[0], 7.5f);
}

TEST(Strategy, FedAdamByHand) {
  // d = -Delta = 2; m = 0.1 * 2 = 0.2; v = 0.01 * 4 = 0.04;
  // eta_norm = 0.1 * sqrt(1 - 0.99^2) / (1 - 0.9^2); x = 1 + eta_norm * 0.2 / 0.2.
  Weights x{vec({1})};
  auto s = strategy("fedadam");
  s->aggregate(1, x, {update("a", 1, {-2})});
  const double eta = 0.1 * std::sqrt(1 - 0.99 * 0.99) / (1 - 0.81);
  EXPECT_FLOAT_EQ(values(x[0])[0], static_cast<float>(1 + eta * 0.2 / (0.2 + 1e-9)));
}

TEST(Strategy, FedYogiAndAdagradByHand) {
  // Yogi: d = 1, m = 0.1, v = 0 - 0.01 * 1 * sign(0 - 1) = 0.01, x = 0 + 0.01 * 0.1 / (0.1+1e-3).
  Weights y{vec({0})};
  strategy("fedyogi")->aggregate(1, y, {update("a", 1, {-1})});
  const double y1 = 0.01 * 0.1 / (0.1 + 1e-3);
  EXPECT_FLOAT_EQ(values(y[0])[0], static_cast<float>(y1));
  // Round 2, d = 0.01 below sqrt(v): Yogi moves v by -(1 - b2) d^2 sign(v - d^2), v = 0.01 - 1e-6,
  // where Adam's 0.99 v + 0.01 d^2 would be 0.009901; m = 0.09 + 0.001.
  auto yogi = strategy("fedyogi");
  Weights y2{vec({0})};
  yogi->aggregate(1, y2, {update("a", 1, {-1})});
  yogi->aggregate(2, y2, {update("a", 1, {-0.01f})});
  const double v2 = 0.01 - 0.01 * 0.01 * 0.01;
  EXPECT_FLOAT_EQ(values(y2[0])[0], static_cast<float>(static_cast<float>(y1) +
                                                       0.01 * 0.091 / (std::sqrt(v2) + 1e-3)));
  // Adagrad: d = 3, v = 9, x = 0 + 0.1 * 3 / 3.
  Weights a{vec({0})};
  strategy("fedadagrad")->aggregate(1, a, {update("a", 1, {-3})});
  EXPECT_FLOAT_EQ(values(a[0])[0], 0.1f);
}

TEST(Strategy, StateRoundTripsThroughCheckpoint) {
  Weights x1{vec({1, 2})}, x2;
  auto a = strategy("fedadam");
  a->aggregate(1, x1, {update("a", 1, {0.1f, -0.2f})});
  x2 = clone_weights(x1);
  auto b = strategy("fedadam");
  b->load_state(a->state());
  a->aggregate(2, x1, {update("a", 1, {0.3f, 0.1f})});
  b->aggregate(2, x2, {update("a", 1, {0.3f, 0.1f})});
  EXPECT_EQ(values(x1[0]), values(x2[0]));
}

TEST(Strategy, RefusesBadUpdates) {
  Weights x{vec({1, 2})};
  auto s = strategy("fedavg");
  EXPECT_THROW(s->aggregate(1, x, {update("a", 0, {1, 1})}), Error);
  EXPECT_THROW(s->aggregate(1, x, {update("a", 5, {1, 1, 1})}), Error);
  EXPECT_THROW(s->aggregate(1, x, {}), Error);
  StrategyOptions o;
  o.name = "fedsgd";
  try {
    make_strategy(o);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("diloco"), std::string::npos) << e.what();
  }
}

TEST(Strategy, ClientSamplingIsSeededAndRespectsMinimum) {
  StrategyOptions o;
  o.fraction_fit = 0.3;
  o.min_clients = 2;
  auto s = make_strategy(o);
  std::vector<std::string> ids{"a", "b", "c", "d", "e", "f", "g", "h", "i", "j"};
  Rng r1(7), r2(7);
  auto p1 = s->configure_round(1, ids, r1), p2 = s->configure_round(1, ids, r2);
  EXPECT_EQ(p1.size(), 3u);
  EXPECT_EQ(p1, p2);
  o.fraction_fit = 0.01;
  EXPECT_EQ(make_strategy(o)->configure_round(1, ids, r1).size(), 2u);
}

// ---- Flower ---------------------------------------------------------------------------------

namespace {

void compare_with_flower(const std::string& name, StrategyOptions o) {
  const std::string missing = peer::missing("flwr");
  if (!missing.empty()) GTEST_SKIP() << missing;

  o.name = name;
  auto s = make_strategy(o);
  Rng rng(42);
  const std::vector<Shape> shapes{{3, 4}, {5}};
  Weights x;
  for (const auto& sh : shapes) {
    Tensor t = Tensor::empty(sh, DType::f32);
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(rng.normal());
    x.push_back(t);
  }
  nlohmann::json spec;
  spec["strategy"] = name;
  spec["options"] = {{"lr", o.lr},
                     {"momentum", o.momentum},
                     {"beta1", o.beta1},
                     {"beta2", o.beta2},
                     {"tau", o.tau}};
  for (const auto& t : x) spec["initial"].push_back(t.to_doubles());
  std::vector<Weights> ours;
  const int rounds = 4;
  for (int r = 1; r <= rounds; ++r) {
    nlohmann::json clients = nlohmann::json::array();
    std::vector<ClientUpdate> ups;
    for (int c = 0; c < 3; ++c) {
      ClientUpdate u;
      u.client_id = "client-" + std::to_string(c);
      u.tokens = 1000 + 517 * c + 31 * r;
      nlohmann::json local;
      for (const auto& t : x) {
        Tensor l = Tensor::empty(t.shape(), DType::f32), d = Tensor::empty(t.shape(), DType::f32);
        for (int64_t i = 0; i < t.numel(); ++i) {
          l.data<float>()[i] = t.data<float>()[i] + static_cast<float>(0.05 * rng.normal());
          d.data<float>()[i] = t.data<float>()[i] - l.data<float>()[i];
        }
        local.push_back(l.to_doubles());
        u.delta.push_back(d);
      }
      clients.push_back({{"weights", local}, {"tokens", u.tokens}});
      ups.push_back(std::move(u));
    }
    spec["rounds"].push_back(clients);
    s->aggregate(r, x, ups);
    ours.push_back(clone_weights(x));
  }
  const nlohmann::json theirs = peer::run("fed/flower_reference.py", spec, "flower_" + name);
  ASSERT_FALSE(theirs.is_null());
  ASSERT_EQ(theirs.size(), static_cast<size_t>(rounds));
  for (int r = 0; r < rounds; ++r) {
    for (size_t t = 0; t < shapes.size(); ++t) {
      const auto mine = ours[static_cast<size_t>(r)][t].to_doubles();
      const auto& ref = theirs[static_cast<size_t>(r)][t];
      ASSERT_EQ(ref.size(), mine.size());
      for (size_t i = 0; i < mine.size(); ++i) {
        const double f = ref[i].get<double>();
        // float32 storage of weights and state against Flower's float64 arithmetic.
        EXPECT_NEAR(mine[i], f, 2e-6 + 2e-6 * std::abs(f))
            << name << " round " << r + 1 << " tensor " << t << " element " << i;
      }
    }
  }
}

}  // namespace

TEST(StrategyVsFlower, FedAvg) {
  compare_with_flower("fedavg", {});
}

TEST(StrategyVsFlower, FedAvgM) {
  StrategyOptions o;
  o.lr = 0.8;
  o.momentum = 0.7;
  compare_with_flower("fedavgm", o);
}

TEST(StrategyVsFlower, FedAdam) {
  StrategyOptions o;
  o.lr = 0.05, o.beta1 = 0.9, o.beta2 = 0.99, o.tau = 1e-3;
  compare_with_flower("fedadam", o);
}

TEST(StrategyVsFlower, FedYogi) {
  StrategyOptions o;
  o.lr = 0.03, o.beta1 = 0.8, o.beta2 = 0.95, o.tau = 1e-3;
  compare_with_flower("fedyogi", o);
}

TEST(StrategyVsFlower, FedAdagrad) {
  StrategyOptions o;
  o.lr = 0.1, o.beta1 = 0, o.tau = 1e-3;
  compare_with_flower("fedadagrad", o);
}
