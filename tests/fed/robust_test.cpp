// Robust aggregation: each rule by hand, its preconditions refused with messages that name the
// key, per-client reports, and agreement with Flower's FedMedian, FedTrimmedAvg, Krum and
// Multi-Krum on the same client updates.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/rng.h"
#include "fed/fixtures.h"
#include "fed/robust.h"
#include "fed/strategy.h"
#include "support/peer.h"

using namespace pollen;
using namespace pollen::fed;
using namespace pollen::fed::testing;

namespace {

std::vector<float> values(const Weights& w) {
  auto d = w[0].to_doubles();
  return {d.begin(), d.end()};
}

RobustOptions rule(const std::string& name) {
  RobustOptions o;
  o.aggregation = name;
  return o;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

const Weights kLike{vec({0, 0})};

}  // namespace

TEST(Robust, MedianIsCoordinateWiseAndUnweighted) {
  const std::vector<ClientUpdate> odd{update("a", 1, {1, 10}), update("b", 1000, {5, -3}),
                                      update("c", 1, {2, 100})};
  EXPECT_EQ(values(robust_aggregate(rule("median"), kLike, odd, nullptr)),
            (std::vector<float>{2, 10}));
  auto even = odd;
  even.push_back(update("d", 1, {-7, 0}));
  // Sorted: (-7, 1, 2, 5) -> 1.5; (-3, 0, 10, 100) -> 5.
  EXPECT_EQ(values(robust_aggregate(rule("median"), kLike, even, nullptr)),
            (std::vector<float>{1.5f, 5}));
}

TEST(Robust, TrimmedMeanDropsTheExtremesAndReportsThem) {
  RobustOptions o = rule("trimmed_mean");
  o.trim_fraction = 0.2;  // floor(0.2 * 5) = 1 at each side
  const std::vector<ClientUpdate> ups{update("a", 1, {1, 0}), update("b", 1, {2, 0}),
                                      update("c", 1, {3, 0}), update("d", 1, {4, 0}),
                                      update("e", 1, {-100, 50})};
  AggregationReport report;
  const auto d = values(robust_aggregate(o, kLike, ups, &report));
  EXPECT_FLOAT_EQ(d[0], (1 + 2 + 3) / 3.0f);  // -100 and 4 dropped
  EXPECT_FLOAT_EQ(d[1], 0);                   // 50 and one 0 dropped
  EXPECT_DOUBLE_EQ(report.clients["e"].trimmed, 1.0);
  EXPECT_DOUBLE_EQ(report.clients["d"].trimmed, 0.5);
}

TEST(Robust, KrumPicksTheUpdateClosestToItsNeighbours) {
  RobustOptions o = rule("krum");
  o.byzantine = 1;
  // n = 5 > 2f + 2. Scores over n - f - 2 = 2 nearest: a (0,0) to b, c: 1 + 1 = 2; b (1,0): a 1,
  // d 1 (d = (1,1)): 2; c (0,1): a 1, d 1: 2; d: b 1, c 1: 2; e far away. Ties go to the first id.
  const std::vector<ClientUpdate> ups{update("a", 1, {0, 0}), update("b", 1, {1, 0}),
                                      update("c", 1, {0, 1}), update("d", 1, {1, 1}),
                                      update("e", 1, {-40, 90})};
  AggregationReport report;
  EXPECT_EQ(values(robust_aggregate(o, kLike, ups, &report)), (std::vector<float>{0, 0}));
  EXPECT_EQ(report.rejected(), 4);
  EXPECT_FALSE(report.clients["a"].rejected);

  o.aggregation = "multi_krum";
  o.multi_krum = 0;  // n - f = 4 kept, token-weighted: e rejected
  auto weighted = ups;
  weighted[3].tokens = 3;
  AggregationReport mk;
  EXPECT_EQ(values(robust_aggregate(o, kLike, weighted, &mk)),
            (std::vector<float>{4 / 6.0f, 4 / 6.0f}));
  EXPECT_TRUE(mk.clients["e"].rejected);
  EXPECT_EQ(mk.rejected(), 1);
}

TEST(Robust, NormBoundClipsBeforeAnyRuleAndIsReported) {
  RobustOptions o = rule("mean");
  o.norm_bound = 1;
  AggregationReport report;
  // (30, 40) becomes (0.6, 0.8); the mean with (0.2, 0) by tokens 1:1.
  const auto d = values(
      robust_aggregate(o, kLike, {update("a", 1, {30, 40}), update("b", 1, {0.2f, 0})}, &report));
  EXPECT_FLOAT_EQ(d[0], 0.4f);
  EXPECT_FLOAT_EQ(d[1], 0.4f);
  EXPECT_TRUE(report.clients["a"].clipped);
  EXPECT_DOUBLE_EQ(report.clients["a"].norm, 50);
  EXPECT_FALSE(report.clients["b"].clipped);
  EXPECT_EQ(report.clipped(), 1);
}

TEST(Robust, MeanIsTheTokenWeightedMeanOfBefore) {
  AggregationReport report;
  EXPECT_EQ(
      values(robust_aggregate(rule("mean"), kLike,
                              {update("a", 100, {1, -2}), update("b", 300, {4, 2})}, &report)),
      (std::vector<float>{3.25f, 1}));
  EXPECT_EQ(report.clipped() + report.rejected(), 0);
}

TEST(Robust, PreconditionsAreRefusedWithTheirReason) {
  RobustOptions krum = rule("krum");
  krum.byzantine = 1;
  std::string m = message_of([&] { validate(krum, 4); });
  EXPECT_NE(m.find("more than 2f + 2 = 4"), std::string::npos) << m;
  EXPECT_NE(m.find("strategy.min_clients"), std::string::npos) << m;
  EXPECT_NO_THROW(validate(krum, 5));
  const std::vector<ClientUpdate> four{update("a", 1, {0, 0}), update("b", 1, {0, 0}),
                                       update("c", 1, {0, 0}), update("d", 1, {0, 0})};
  m = message_of([&] { robust_aggregate(krum, kLike, four, nullptr); });
  EXPECT_NE(m.find("the round has 4"), std::string::npos) << m;

  RobustOptions mk = rule("multi_krum");
  mk.byzantine = 1, mk.multi_krum = 5;
  m = message_of([&] { validate(mk, 5); });
  EXPECT_NE(m.find("strategy.multi_krum"), std::string::npos) << m;

  RobustOptions trim = rule("trimmed_mean");
  trim.trim_fraction = 0.5;
  m = message_of([&] { validate(trim, 4); });
  EXPECT_NE(m.find("strategy.trim_fraction"), std::string::npos) << m;

  m = message_of([] { validate(rule("average"), 1); });
  EXPECT_NE(m.find("mean, median, trimmed_mean, krum, multi_krum"), std::string::npos) << m;

  StrategyOptions so;
  so.robust = krum;
  so.min_clients = 3;
  EXPECT_THROW(make_strategy(so), Error);
}

TEST(Robust, StrategyAggregatesWithTheRuleAndReports) {
  StrategyOptions so;
  so.robust = rule("median");
  auto s = make_strategy(so);
  Weights x{vec({10, 10})};
  AggregationReport report;
  s->aggregate(1, x,
               {update("a", 1, {1, 1}), update("b", 1, {2, 2}), update("c", 1, {-1000, 1000})},
               &report);
  EXPECT_EQ(values(x), (std::vector<float>{9, 8}));
  EXPECT_DOUBLE_EQ(report.clients["b"].norm, std::sqrt(8.0));
}

// ---- Flower ---------------------------------------------------------------------------------

namespace {

// Three rounds of five clients (one of them far off) through pollen's fedavg (lr 1, so the new
// global model is x - Delta) with rule `o`, and through Flower's `flower_name`.
void compare_with_flower(const std::string& flower_name, const RobustOptions& o,
                         const nlohmann::json& flower_options) {
  const std::string missing = peer::missing("flwr");
  if (!missing.empty()) GTEST_SKIP() << missing;
  StrategyOptions so;
  so.robust = o;
  so.min_clients = 5;
  auto s = make_strategy(so);
  Rng rng(11);
  const std::vector<Shape> shapes{{3, 4}, {7}};
  Weights x;
  for (const auto& sh : shapes) {
    Tensor t = Tensor::empty(sh, DType::f32);
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(rng.normal());
    x.push_back(t);
  }
  nlohmann::json spec;
  spec["strategy"] = flower_name;
  spec["options"] = flower_options;
  for (const auto& t : x) spec["initial"].push_back(t.to_doubles());
  std::vector<Weights> ours;
  const int rounds = 3;
  for (int r = 1; r <= rounds; ++r) {
    nlohmann::json clients = nlohmann::json::array();
    std::vector<ClientUpdate> ups;
    for (int c = 0; c < 5; ++c) {
      ClientUpdate u;
      u.client_id = "client-" + std::to_string(c);
      u.tokens = 500 + 113 * c + 17 * r;
      const double spread = c == 3 ? 5.0 : 0.05;  // client-3 is far from the others
      nlohmann::json local;
      for (const auto& t : x) {
        Tensor l = Tensor::empty(t.shape(), DType::f32), d = Tensor::empty(t.shape(), DType::f32);
        for (int64_t i = 0; i < t.numel(); ++i) {
          l.data<float>()[i] = t.data<float>()[i] + static_cast<float>(spread * rng.normal());
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
  const auto theirs = peer::run("fed/flower_reference.py", spec, flower_name);
  ASSERT_EQ(theirs.size(), static_cast<size_t>(rounds));
  for (int r = 0; r < rounds; ++r) {
    for (size_t t = 0; t < shapes.size(); ++t) {
      const auto mine = ours[static_cast<size_t>(r)][t].to_doubles();
      const auto& ref = theirs[static_cast<size_t>(r)][t];
      ASSERT_EQ(ref.size(), mine.size());
      for (size_t i = 0; i < mine.size(); ++i) {
        const double f = ref[i].get<double>();
        // float32 deltas and weights against Flower's float64 arithmetic on local weights.
        EXPECT_NEAR(mine[i], f, 4e-6 + 4e-6 * std::abs(f))
            << flower_name << " round " << r + 1 << " tensor " << t << " element " << i;
      }
    }
  }
}

}  // namespace

TEST(RobustVsFlower, FedMedian) {
  compare_with_flower("fedmedian", rule("median"), nlohmann::json::object());
}

TEST(RobustVsFlower, FedTrimmedAvg) {
  RobustOptions o = rule("trimmed_mean");
  o.trim_fraction = 0.2;
  compare_with_flower("fedtrimmedavg", o, {{"beta", 0.2}});
}

TEST(RobustVsFlower, Krum) {
  RobustOptions o = rule("krum");
  o.byzantine = 1;
  compare_with_flower("krum", o, {{"num_malicious", 1}, {"to_keep", 0}});
}

TEST(RobustVsFlower, MultiKrum) {
  RobustOptions o = rule("multi_krum");
  o.byzantine = 1;
  o.multi_krum = 3;
  compare_with_flower("krum", o, {{"num_malicious", 1}, {"to_keep", 3}});
}
