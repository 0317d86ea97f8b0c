// Row weighting (strategy.row_weighting): the embedding's and the output layer's rows averaged
// over the clients weighted by how often each saw the row's token; the counts' wire checks; the
// keys it cannot go with; and a simulated round whose rows come out as the clients' own.
#include <gtest/gtest.h>

#include <cmath>

#include "base/files.h"
#include "base/thread_pool.h"
#include "fed/client.h"
#include "fed/coordinator.h"
#include "fed/fixtures.h"
#include "model/llama.h"

using namespace pollen;
using namespace pollen::fed;
using namespace pollen::fed::testing;

namespace {

// Tensor 0: an embedding [4 tokens, 2], tensor 1: an output layer [4, 2], tensor 2: a norm [3].
Weights zero_model() {
  return {Tensor::zeros({4, 2}, DType::f32), Tensor::zeros({4, 2}, DType::f32),
          Tensor::zeros({3}, DType::f32)};
}

ClientUpdate update(const std::string& id, int64_t tokens, float base, TokenCounts inputs,
                    TokenCounts targets) {
  // delta value = base + 10 * tensor + row + 0.5 * column: every client's every entry differs.
  ClientUpdate u;
  u.client_id = id;
  u.tokens = tokens;
  for (const Tensor& t : zero_model()) {
    Tensor d = Tensor::empty(t.shape(), DType::f32);
    const int64_t cols = t.dim() == 2 ? t.shape()[1] : 1;
    for (int64_t j = 0; j < d.numel(); ++j) {
      d.data<float>()[j] = base + 10.0f * static_cast<float>(u.delta.size()) +
                           static_cast<float>(j / cols) + 0.5f * static_cast<float>(j % cols);
    }
    u.delta.push_back(std::move(d));
  }
  u.input_counts = std::move(inputs);
  u.target_counts = std::move(targets);
  return u;
}

float at(const Weights& w, size_t tensor, int64_t row, int64_t col) {
  const int64_t cols = w[tensor].dim() == 2 ? w[tensor].shape()[1] : 1;
  return w[tensor].data<float>()[row * cols + col];
}

std::unique_ptr<Strategy> fedavg(const std::string& row_weighting, TokenRowTensors rows) {
  StrategyOptions o;
  o.name = "fedavg";  // lr 1: the new model is minus the aggregated delta
  o.row_weighting = row_weighting;
  auto s = make_strategy(o);
  s->set_token_rows(rows);
  return s;
}

}  // namespace

TEST(RowWeighting, DisjointTokensGiveEachRowItsOwnClientsDelta) {
  // a saw tokens 0 and 1 as inputs, b token 2; nobody token 3. Targets: a 1, b 2 and 3.
  const auto a = update("a", 6, 100, {{0, 1}, {2, 4}}, {{1}, {6}});
  const auto b = update("b", 2, 200, {{2}, {2}}, {{2, 3}, {1, 1}});
  for (const std::string mode : {"input_counts", "target_counts", "token_counts"}) {
    Weights x = zero_model();
    fedavg(mode, {0, 1})->aggregate(1, x, {b, a});  // arrival order must not matter
    const Weights plain_x = [&] {
      Weights y = zero_model();
      fedavg("none", {0, 1})->aggregate(1, y, {a, b});
      return y;
    }();
    for (int64_t c = 0; c < 2; ++c) {
      if (mode == "target_counts") {
        for (int64_t r = 0; r < 4; ++r) EXPECT_EQ(at(x, 0, r, c), at(plain_x, 0, r, c)) << mode;
      } else {
        EXPECT_EQ(at(x, 0, 0, c), -at(a.delta, 0, 0, c)) << mode;
        EXPECT_EQ(at(x, 0, 1, c), -at(a.delta, 0, 1, c)) << mode;
        EXPECT_EQ(at(x, 0, 2, c), -at(b.delta, 0, 2, c)) << mode;
        EXPECT_EQ(at(x, 0, 3, c), at(plain_x, 0, 3, c)) << mode;  // nobody saw it: token-weighted
      }
      if (mode != "input_counts") {
        EXPECT_EQ(at(x, 1, 0, c), at(plain_x, 1, 0, c));  // no target 0 anywhere
        EXPECT_EQ(at(x, 1, 1, c), -at(a.delta, 1, 1, c));
        EXPECT_EQ(at(x, 1, 2, c), -at(b.delta, 1, 2, c));
        EXPECT_EQ(at(x, 1, 3, c), -at(b.delta, 1, 3, c));
      } else {
        for (int64_t r = 0; r < 4; ++r) EXPECT_EQ(at(x, 1, r, c), at(plain_x, 1, r, c)) << mode;
      }
    }
    // Everything else is the token-weighted mean: (6 * 120 + 2 * 220) / 8 = 145 at entry 0.
    EXPECT_FLOAT_EQ(at(x, 2, 0, 0), -145.0f);
    EXPECT_EQ(at(x, 2, 2, 0), at(plain_x, 2, 2, 0));
    // The plain mean would have given row 2 of the embedding (and of the output layer) a mix:
    // that is what changed.
    EXPECT_NE(at(x, mode == "target_counts" ? 1 : 0, 2, 0),
              at(plain_x, mode == "target_counts" ? 1 : 0, 2, 0));
  }
}

TEST(RowWeighting, SharedTokensTakeTheCountWeightedMean) {
  // Token 0: a 3 times, b 1 time (tokens 4 and 12: the plain weights would be 1/4 and 3/4).
  const auto a = update("a", 4, 100, {{0, 1}, {3, 1}}, {{0}, {4}});
  const auto b = update("b", 12, 200, {{0, 2}, {1, 11}}, {{0, 3}, {2, 10}});
  Weights x = zero_model();
  fedavg("token_counts", {0, 1})->aggregate(1, x, {a, b});
  for (int64_t c = 0; c < 2; ++c) {
    const double col = 0.5 * static_cast<double>(c);
    EXPECT_FLOAT_EQ(at(x, 0, 0, c), static_cast<float>(-(3 * (100 + col) + 1 * (200 + col)) / 4));
    EXPECT_FLOAT_EQ(at(x, 0, 1, c), -(100 + 1 + static_cast<float>(col)));  // a alone
    // Output row 0: targets a 4, b 2.
    EXPECT_FLOAT_EQ(at(x, 1, 0, c), static_cast<float>(-(4 * (110 + col) + 2 * (210 + col)) / 6));
  }
}

TEST(RowWeighting, ATiedEmbeddingWeighsByInputsAndTargetsTogetherOrByEitherAlone) {
  const auto a = update("a", 2, 100, {{0}, {2}}, {{0, 1}, {1, 1}});
  const auto b = update("b", 2, 200, {{1}, {2}}, {{0}, {2}});
  Weights x = zero_model();
  fedavg("token_counts", {0, -1})->aggregate(1, x, {a, b});
  // Row 0: a counted 2 + 1, b 0 + 2; row 1: a 0 + 1, b 2 + 0.
  EXPECT_FLOAT_EQ(at(x, 0, 0, 0), -(3.0f * 100 + 2.0f * 200) / 5);
  EXPECT_FLOAT_EQ(at(x, 0, 1, 0), -(1.0f * 101 + 2.0f * 201) / 3);
  // By one kind of count alone: inputs (row 0: a 2, b 0) or targets (row 0: a 1, b 2).
  Weights by_inputs = zero_model(), by_targets = zero_model();
  fedavg("input_counts", {0, -1})->aggregate(1, by_inputs, {a, b});
  fedavg("target_counts", {0, -1})->aggregate(1, by_targets, {a, b});
  EXPECT_FLOAT_EQ(at(by_inputs, 0, 0, 0), -100.0f);
  EXPECT_FLOAT_EQ(at(by_targets, 0, 0, 0), -(1.0f * 100 + 2.0f * 200) / 3);
}

TEST(RowWeighting, UpdatesWithoutCountsAndBadOptionsAreRefused) {
  Weights x = zero_model();
  EXPECT_THROW(fedavg("token_counts", {0, 1})->aggregate(1, x, {update("a", 1, 1, {}, {})}), Error);
  StrategyOptions o;
  o.row_weighting = "per_row";
  EXPECT_THROW(make_strategy(o), Error);
  o.row_weighting = "token_counts";
  o.robust.aggregation = "median";
  try {
    make_strategy(o);
    ADD_FAILURE() << "row weighting with the median was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("strategy.aggregation = 'mean'"), std::string::npos)
        << e.what();
  }
}

TEST(RowWeighting, CountsOnTheWireAreChecked) {
  pb::UpdateInfo u;
  u.set_client_id("a");
  u.set_round(1);
  u.set_tokens(5);
  auto set = [](pb::TokenCounts* c, std::vector<uint32_t> ids, std::vector<int64_t> counts) {
    c->Clear();
    for (auto id : ids) c->add_ids(id);
    for (auto n : counts) c->add_counts(n);
  };
  set(u.mutable_input_counts(), {1, 7}, {3, 2});
  set(u.mutable_target_counts(), {0, 63}, {4, 1});
  EXPECT_NO_THROW(validate_token_counts(u, true, 64, "update"));
  auto refused = [&](const pb::UpdateInfo& bad, bool expected, const std::string& says) {
    try {
      validate_token_counts(bad, expected, 64, "update");
      ADD_FAILURE() << "accepted; expected an error saying '" << says << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused(u, false, "not asked for");
  pb::UpdateInfo none = u;
  none.clear_input_counts();
  none.clear_target_counts();
  refused(none, true, "carries none");
  EXPECT_NO_THROW(validate_token_counts(none, false, 64, "update"));
  pb::UpdateInfo bad = u;
  set(bad.mutable_input_counts(), {1, 7}, {5, -1});
  refused(bad, true, "input_counts: token 7 counted -1 times");
  set(bad.mutable_input_counts(), {1, 7}, {5, 0});
  refused(bad, true, "counted 0 times");
  set(bad.mutable_input_counts(), {1, 7}, {5});
  refused(bad, true, "2 token ids but 1 counts");
  set(bad.mutable_input_counts(), {1, 64}, {3, 2});
  refused(bad, true, "token id 64 is not below the vocabulary size 64");
  set(bad.mutable_input_counts(), {7, 1}, {3, 2});
  refused(bad, true, "strictly ascending");
  set(bad.mutable_input_counts(), {1, 1}, {3, 2});
  refused(bad, true, "strictly ascending");
  set(bad.mutable_input_counts(), {1}, {6});
  refused(bad, true, "counted 6 times");  // more than the update's tokens
  set(bad.mutable_input_counts(), {1, 2}, {4, 4});
  refused(bad, true, "pass the update's 5 tokens");
  set(bad.mutable_input_counts(), {1, 2}, {1, 1});
  refused(bad, true, "sum to 2");
  bad = u;
  set(bad.mutable_target_counts(), {0}, {4});
  refused(bad, true, "target_counts: the counts sum to 4");
}

TEST(RowWeighting, SecureAggregationAndCentralDpRefuseIt) {
  const auto dir = temp_dir("row_weighting_config");
  const std::string base =
      "[server]\ndir = 'x'\n" + kTinyModelToml + "[strategy]\nrow_weighting = 'token_counts'\n";
  write_file_atomic(dir / "ok.toml", base);
  EXPECT_EQ(load_server_config(dir / "ok.toml").strategy.row_weighting, "token_counts");
  auto refused = [&](const std::string& name, const std::string& extra, const std::string& says) {
    write_file_atomic(dir / name, base + extra);
    try {
      load_server_config(dir / name);
      ADD_FAILURE() << name << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused("secagg.toml", "[secure_aggregation]\nenabled = true\n",
          "use row_weighting = 'none' with secure aggregation");
  refused("dp.toml", "[privacy]\nnoise_multiplier = 1.0\nclip = 1.0\n",
          "use row_weighting = 'none' with [privacy]");
  fs::remove_all(dir);
}

TEST(RowWeighting, ASimulatedRoundKeepsEachSilosOwnRows) {
  // Silo a writes tokens 1-20, silo b tokens 31-50: no input token in common.
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("row_weighting_sim");
  auto silo = [&](const std::string& name, uint32_t first) {
    fs::create_directories(dir / name);
    std::vector<data::ShardInfo> shards;
    for (const char* split : {"train", "validation"}) {
      data::ShardWriter w(dir / name, "silo", split, data::TokenDType::u16, 1 << 20);
      for (int d = 0; d < 60; ++d) {
        std::vector<uint32_t> ids(24);
        for (size_t p = 0; p < ids.size(); ++p)
          ids[p] = first + static_cast<uint32_t>((d * 3 + static_cast<int>(p) * 7) % 20);
        w.add_document(ids);
      }
      auto s = w.finish();
      shards.insert(shards.end(), s.begin(), s.end());
    }
    nlohmann::json m{{"format", "pollen-shards-v1"}, {"token_dtype", "u16"}, {"vocab_size", 64}};
    m["shards"] = nlohmann::json::array();
    for (const auto& s : shards) m["shards"].push_back(s.to_json());
    write_file_atomic(dir / name / "manifest.json", data::manifest_text(m));
    return dir / name / "manifest.json";
  };
  auto cfg = sim_config(dir, {silo("a", 1), silo("b", 31)}, "fedavg", 1, 3);
  cfg.server.strategy.row_weighting = "token_counts";
  Coordinator server(cfg.server, false);
  LocalTransport transport(server);
  Client a(cfg.clients[0], transport), b(cfg.clients[1], transport);
  a.join();
  b.join();
  const Weights start = server.global_weights();
  ASSERT_TRUE(server.begin_round());
  EXPECT_EQ(a.poll_once(), pb::TASK_TRAIN);
  EXPECT_EQ(b.poll_once(), pb::TASK_TRAIN);
  const auto summary = server.end_round();  // the counts passed the server's checks
  ASSERT_TRUE(summary.aggregated);
  const Weights global = server.global_weights();
  const Weights local_a = model_weights(a.trainer().model());
  const Weights local_b = model_weights(b.trainer().model());
  const auto rows = token_row_tensors(server.specs());
  ASSERT_GE(rows.embedding, 0);
  const auto e = static_cast<size_t>(rows.embedding);
  const int64_t h = global[e].shape()[1];
  auto row_gap = [&](const Weights& w, int64_t token) {
    double worst = 0;
    for (int64_t j = 0; j < h; ++j) {
      worst =
          std::max(worst, std::fabs(static_cast<double>(global[e].data<float>()[token * h + j]) -
                                    w[e].data<float>()[token * h + j]));
    }
    return worst;
  };
  // Each silo's tokens end where that silo put them (up to float rounding of x - (x - l)), not
  // halfway back to the start as the plain mean would leave them.
  for (int64_t t : {1, 5, 20}) {
    EXPECT_LT(row_gap(local_a, t), 1e-6) << "token " << t;
    EXPECT_GT(row_gap(start, t), 1e-4) << "token " << t;  // it did move
  }
  for (int64_t t : {31, 40, 50}) EXPECT_LT(row_gap(local_b, t), 1e-6) << "token " << t;
  // A token nobody saw did not move (no gradient, no weight decay).
  EXPECT_LT(row_gap(start, 60), 1e-7);
  fs::remove_all(dir);
}
