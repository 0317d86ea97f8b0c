// Shared first moments of the token rows (fed/first_moments.h): which tensors travel, their
// average, and a federation in which the server averages what the clients send and every client
// starts the next round from it.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "base/thread_pool.h"
#include "fed/client.h"
#include "fed/config.h"
#include "fed/coordinator.h"
#include "fed/first_moments.h"
#include "fed/fixtures.h"

using namespace pollen;
using namespace pollen::fed;
using namespace pollen::fed::testing;

namespace {

const ParamSpecs kUntied{{"model.embed_tokens.weight", {8, 4}},
                         {"model.layers.0.mlp.up_proj.weight", {6, 4}},
                         {"model.norm.weight", {4}},
                         {"lm_head.weight", {8, 4}}};

std::vector<std::string> names(const ParamSpecs& specs) {
  std::vector<std::string> out;
  for (const auto& s : specs) out.push_back(s.name);
  return out;
}

// The averaged first moments the server hands out for `round`, as client `id` pulls them.
Weights pull_first_moments(Coordinator& server, const ParamSpecs& moments, const std::string& id,
                           int64_t round) {
  pb::PullRequest r;
  r.set_client_id(id);
  r.set_round(round);
  r.set_first_moments(true);
  const auto set = server.pull(r, "");
  return decode_set(set->header, set->bytes, moments, "pull");
}

// Two silos of other data (strides 1 and 3) sharing the output layer's first moments over
// `rounds` rounds of 2 local steps.
SimConfig sharing_output(const fs::path& dir, int64_t rounds) {
  auto cfg =
      sim_config(dir, {make_silo(dir / "a", 1), make_silo(dir / "b", 3)}, "fedavg", rounds, 2);
  cfg.server.strategy.first_moments = "output";
  return cfg;
}

}  // namespace

TEST(FirstMoments, TheOutputLayerAloneOrWithTheEmbeddingInTheModelsOrder) {
  EXPECT_TRUE(first_moment_specs(kUntied, "none").empty());
  EXPECT_EQ(names(first_moment_specs(kUntied, "output")),
            std::vector<std::string>{"lm_head.weight.exp_avg"});
  EXPECT_EQ(
      names(first_moment_specs(kUntied, "token_rows")),
      (std::vector<std::string>{"model.embed_tokens.weight.exp_avg", "lm_head.weight.exp_avg"}));
  EXPECT_EQ(first_moment_specs(kUntied, "output")[0].shape, (Shape{8, 4}));
  EXPECT_EQ(moment_tensor_name(first_moment_specs(kUntied, "output")[0]), "lm_head.weight");
  // Tied: the embedding is the output layer, and it travels once.
  const ParamSpecs tied(kUntied.begin(), kUntied.end() - 1);
  EXPECT_EQ(names(first_moment_specs(tied, "output")),
            std::vector<std::string>{"model.embed_tokens.weight.exp_avg"});
  EXPECT_EQ(names(first_moment_specs(tied, "token_rows")),
            std::vector<std::string>{"model.embed_tokens.weight.exp_avg"});
  // Every name the strategy accepts (and a silo's order codes) names tensors or none.
  for (const auto& name : first_moments_names())
    EXPECT_EQ(first_moment_specs(kUntied, name).empty(), name == "none") << name;
  EXPECT_THROW(first_moment_specs(kUntied, "all"), Error);
  EXPECT_THROW(first_moment_specs({{"w", {2, 2}}}, "output"), Error);  // no token rows
}

TEST(FirstMoments, AverageIsWeightedInDouble) {
  const Weights a{Tensor::from<float>({3}, {1.0f, -2.0f, 1e8f})};
  const Weights b{Tensor::from<float>({3}, {5.0f, 2.0f, 1.0f})};
  const Weights m = average_first_moments({&a, &b}, {1, 3});
  EXPECT_FLOAT_EQ(m[0].data<float>()[0], 4.0f);
  EXPECT_FLOAT_EQ(m[0].data<float>()[1], 1.0f);
  EXPECT_FLOAT_EQ(m[0].data<float>()[2], static_cast<float>((1e8 + 3.0) / 4.0));
  EXPECT_THROW(average_first_moments({&a, &b}, {0, 0}), Error);
}

TEST(FirstMoments, TheTrainersMomentsTakeTheSharedEstimateInItsScale) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("first_moments_trainer");
  ClientConfig cc = sim_config(dir, {make_silo(dir / "a", 1)}, "fedavg", 1, 1).clients[0];
  LocalTrainer trainer(cc);
  const ParamSpecs moments = first_moment_specs(trainer.exchanged_specs(), "token_rows");
  // Before any step AdamW's moments are zero and stay so: there is no estimate to scale.
  Weights twos;
  for (const auto& m : moments) twos.push_back(Tensor::full(m.shape, 2.0f, DType::f32));
  trainer.set_first_moments(moments, twos);
  for (const Tensor& t : trainer.first_moments(moments)) {
    for (int64_t j = 0; j < t.numel(); ++j) ASSERT_EQ(t.data<float>()[j], 0.0f);
  }
  trainer.train(3);
  // The estimate is AdamW's m of the named tensor (the embedding first, then the output layer)
  // over 1 - beta1^3.
  const double bias = 1.0 - std::pow(0.9, 3);
  const auto named = trainer.model().named_parameters();
  auto slot_of = [&](const std::string& name) {
    size_t i = 0;
    while (named[i].first != name) ++i;
    return i;
  };
  const train::OptimizerMoments before = trainer.optimizer_moments();
  const Weights own = trainer.first_moments(moments);
  ASSERT_EQ(own.size(), 2u);
  for (size_t k = 0; k < 2; ++k) {
    const Tensor& m = before.exp_avg[slot_of(moment_tensor_name(moments[k]))];
    for (int64_t j = 0; j < m.numel(); ++j)
      ASSERT_FLOAT_EQ(own[k].data<float>()[j], static_cast<float>(m.data<float>()[j] / bias))
          << moments[k].name << "[" << j << "]";
  }
  EXPECT_GT(worst_difference(own, twos), 1.0);
  // Set to 2 and -3: each named slot holds its value times 1 - beta1^3, the others are untouched.
  const Weights values{Tensor::full(moments[0].shape, 2.0f, DType::f32),
                       Tensor::full(moments[1].shape, -3.0f, DType::f32)};
  trainer.set_first_moments(moments, values);
  const train::OptimizerMoments after = trainer.optimizer_moments();
  for (size_t i = 0; i < named.size(); ++i) {
    const bool embedding = named[i].first == "model.embed_tokens.weight";
    const bool output = named[i].first == "lm_head.weight";
    for (int64_t j = 0; j < after.exp_avg[i].numel(); ++j) {
      const float got = after.exp_avg[i].data<float>()[j];
      if (embedding || output) {
        ASSERT_FLOAT_EQ(got, static_cast<float>((embedding ? 2.0 : -3.0) * bias)) << named[i].first;
      } else {
        ASSERT_EQ(got, before.exp_avg[i].data<float>()[j]) << named[i].first;
      }
    }
  }
  EXPECT_LT(worst_difference(trainer.first_moments(moments), values), 3.0 * 4e-7);
  // A tensor the model does not have is named.
  try {
    trainer.first_moments({{"model.head.weight.exp_avg", {32}}});
    ADD_FAILURE() << "moments of a tensor the model does not have";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no tensor 'model.head.weight'"), std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
}

TEST(FirstMoments, ServerAveragesTheClientsAndTheNextRoundStartsFromIt) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("first_moments");
  const auto silo_a = make_silo(dir / "a", 1), silo_b = make_silo(dir / "b", 3);
  auto run = [&](const std::string& name, const std::string& first_moments) {
    auto cfg = sim_config(dir / name, {silo_a, silo_b}, "fedavg", 2, 3);
    cfg.server.strategy.first_moments = first_moments;
    Coordinator server(cfg.server, false);
    LocalTransport to_a(server), to_b(server);
    Client a(cfg.clients[0], to_a), b(cfg.clients[1], to_b);
    a.join(), b.join();
    const ParamSpecs moments = first_moment_specs(server.specs(), "token_rows");
    EXPECT_TRUE(server.begin_round());
    pb::TaskRequest ask;
    ask.set_client_id("silo-0");
    const pb::TaskReply first = server.task(ask, "");
    EXPECT_EQ(first.first_moments(), first_moments == "none" ? "" : first_moments);
    EXPECT_FALSE(first.pull_first_moments());  // nothing averaged before round 2
    EXPECT_EQ(a.poll_once(), pb::TASK_TRAIN);
    EXPECT_EQ(b.poll_once(), pb::TASK_TRAIN);
    const Weights ma = a.trainer().first_moments(moments);
    const Weights mb = b.trainer().first_moments(moments);
    EXPECT_TRUE(server.end_round().aggregated);
    const auto m = read_jsonl(cfg.server.dir / "metrics.jsonl");
    const auto ta = m[0]["clients"]["silo-0"]["tokens"].get<double>();
    const auto tb = m[0]["clients"]["silo-1"]["tokens"].get<double>();
    EXPECT_TRUE(server.begin_round());
    Weights sent;
    if (first_moments != "none") {
      EXPECT_TRUE(server.task(ask, "").pull_first_moments());
      // Round 2's moments: the clients' round-1 estimates averaged by tokens, exactly (float32
      // both ways).
      sent = pull_first_moments(server, moments, "silo-0", 2);
      EXPECT_TRUE(bitwise_equal(sent, average_first_moments({&ma, &mb}, {ta, tb})));
      EXPECT_GT(worst_difference(ma, mb), 1e-3);  // the silos' moments differ
    }
    EXPECT_EQ(a.poll_once(), pb::TASK_TRAIN);
    EXPECT_EQ(b.poll_once(), pb::TASK_TRAIN);
    const Weights after = a.trainer().first_moments(moments);
    EXPECT_TRUE(server.end_round().aggregated);
    const auto m2 = read_jsonl(cfg.server.dir / "metrics.jsonl");
    uint64_t moment_bytes = 0;
    for (const auto& s : moments) moment_bytes += 4 * static_cast<uint64_t>(shape_numel(s.shape));
    const auto ckpt = cfg.server.dir / "checkpoints";
    return std::tuple{sent,
                      after,
                      m2,
                      moment_bytes,
                      read_model(ckpt / "step-00000001"),
                      read_model(ckpt / "step-00000002")};
  };
  const auto [sent, shared, m_shared, bytes, g1_shared, g2_shared] = run("shared", "token_rows");
  const auto [none, own, m_own, bytes_own, g1_own, g2_own] = run("own", "none");
  EXPECT_TRUE(none.empty());
  // Round 1 trains from the clients' own moments: the moments sent beside the update do not
  // enter the model. Round 2 starts from the average, so its model is another.
  EXPECT_TRUE(bitwise_equal(g1_shared, g1_own));
  EXPECT_GT(worst_difference(g2_shared, g2_own), 1e-5);
  // Client a trained round 2 from the average, not from its own moments.
  EXPECT_GT(worst_difference(shared, own), 1e-4);
  // Both rounds' updates carry the moments, round 2's download too, each counted.
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(m_shared[r]["bytes_received"].get<uint64_t>(),
              m_own[r]["bytes_received"].get<uint64_t>() + 2 * bytes)
        << "round " << r + 1;
  }
  EXPECT_EQ(m_shared[0]["bytes_sent"], m_own[0]["bytes_sent"]);
  EXPECT_EQ(m_shared[1]["bytes_sent"].get<uint64_t>(),
            m_own[1]["bytes_sent"].get<uint64_t>() + 2 * bytes);
  fs::remove_all(dir);
}

TEST(FirstMoments, ARetriedRoundKeepsTheLastAggregatedRoundsAverage) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("first_moments_retry");
  auto cfg = sharing_output(dir, 3);
  cfg.server.strategy.min_clients = 2;
  Coordinator server(cfg.server, false);
  LocalTransport to_a(server), to_b(server);
  Client a(cfg.clients[0], to_a), b(cfg.clients[1], to_b);
  a.join(), b.join();
  const ParamSpecs moments = first_moment_specs(server.specs(), "output");
  EXPECT_TRUE(server.begin_round());
  EXPECT_EQ(a.poll_once(), pb::TASK_TRAIN);
  EXPECT_EQ(b.poll_once(), pb::TASK_TRAIN);
  EXPECT_TRUE(server.end_round().aggregated);
  EXPECT_TRUE(server.begin_round());
  const Weights round1 = pull_first_moments(server, moments, "silo-0", 2);
  // Round 2 gets one update of the two it needs: nothing of it is averaged.
  EXPECT_EQ(a.poll_once(), pb::TASK_TRAIN);
  EXPECT_FALSE(server.end_round().aggregated);
  EXPECT_TRUE(server.begin_round());
  EXPECT_TRUE(bitwise_equal(pull_first_moments(server, moments, "silo-1", 2), round1));
  fs::remove_all(dir);
}

TEST(FirstMoments, ARestartedServerHandsOutTheAverageItHeldInInt8) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("first_moments_restart");
  auto cfg = sharing_output(dir, 3);
  cfg.server.compression.codec = Codec::int8;
  cfg.server.server_codec = Codec::int8;
  Weights before;
  ParamSpecs moments;
  {
    Coordinator server(cfg.server, false);
    LocalTransport to_a(server), to_b(server);
    Client a(cfg.clients[0], to_a), b(cfg.clients[1], to_b);
    a.join(), b.join();
    moments = first_moment_specs(server.specs(), "output");
    EXPECT_TRUE(server.begin_round());
    EXPECT_EQ(a.poll_once(), pb::TASK_TRAIN);
    // What the client sent: its estimate in int8, within half a step of its block's scale.
    const Weights ma = a.trainer().first_moments(moments);
    EXPECT_EQ(b.poll_once(), pb::TASK_TRAIN);
    EXPECT_TRUE(server.end_round().aggregated);
    EXPECT_TRUE(server.begin_round());
    before = pull_first_moments(server, moments, "silo-0", 2);
    double largest = 0;
    for (int64_t j = 0; j < ma[0].numel(); ++j)
      largest = std::max(largest, std::abs(static_cast<double>(ma[0].data<float>()[j])));
    EXPECT_GT(largest, 0.0);
  }
  Coordinator resumed(cfg.server, true);
  ASSERT_TRUE(resumed.join(tiny_join("silo-0"), "").accepted());
  ASSERT_TRUE(resumed.begin_round());
  const auto set = [&] {
    pb::PullRequest r;
    r.set_client_id("silo-0");
    r.set_round(2);
    r.set_first_moments(true);
    return resumed.pull(r, "");
  }();
  pb::TaskRequest ask;
  ask.set_client_id("silo-0");
  const pb::TaskReply task = resumed.task(ask, "");
  EXPECT_EQ(task.first_moments(), "output");
  EXPECT_TRUE(task.pull_first_moments());
  EXPECT_EQ(set->header.codec(), "int8");
  EXPECT_TRUE(bitwise_equal(decode_set(set->header, set->bytes, moments, "pull"), before));
  fs::remove_all(dir);
}

TEST(FirstMoments, MissingOrBadMomentsAndUnprotectedCombinationsAreRefused) {
  Quiet q;
  const auto dir = temp_dir("first_moments_refused");
  ServerConfig sc = sim_config(dir, {}, "fedavg", 2, 1).server;
  sc.strategy.first_moments = "output";
  Coordinator server(sc, false);
  ASSERT_TRUE(server.join(tiny_join("a"), "").accepted());
  ASSERT_TRUE(server.begin_round());
  // Before a round has averaged there is nothing to pull.
  pb::PullRequest early;
  early.set_client_id("a");
  early.set_round(1);
  early.set_first_moments(true);
  try {
    server.pull(early, "");
    ADD_FAILURE() << "first moments pulled before any round averaged them";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no round has averaged yet"), std::string::npos)
        << e.what();
  }
  const ParamSpecs moments = first_moment_specs(server.specs(), "output");
  ParamSpecs with = server.specs();
  with.insert(with.end(), moments.begin(), moments.end());
  Weights zeros;
  for (const auto& s : with) zeros.push_back(Tensor::zeros(s.shape, DType::f32));
  auto push_error = [&](const pb::TensorSetHeader& header) -> std::string {
    pb::UpdateInfo info;
    info.set_client_id("a");
    info.set_round(1);
    info.set_tokens(10);
    try {
      server.push_begin(info, header, "");
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  // An update without the moments, or with them under another name, is refused before its bytes.
  const EncodedSet plain =
      encode_weights(server.specs(), Weights(zeros.begin(), zeros.end() - 1), CompressOptions{});
  EXPECT_NE(push_error(plain.header).find("tensors, the model has"), std::string::npos);
  ParamSpecs renamed = with;
  renamed.back().name = "lm_head.weight.exp_avg_sq";
  EXPECT_NE(push_error(encode_weights(renamed, zeros, CompressOptions{}).header)
                .find("expected 'lm_head.weight.exp_avg'"),
            std::string::npos);
  // A moment that is not finite, or too large for an average that stays finite, is refused
  // when the stream is decoded.
  auto finish_error = [&](float bad) -> std::string {
    Weights values = clone_weights(zeros);
    values.back().data<float>()[3] = bad;
    const EncodedSet set = encode_weights(with, values, CompressOptions{});
    EXPECT_EQ(push_error(set.header), "");
    pb::UpdateInfo info;
    info.set_client_id("a");
    info.set_round(1);
    info.set_tokens(10);
    auto push = server.push_begin(info, set.header, "");
    for_each_chunk(set.bytes, kMaxChunkBytes, [&](const pb::Chunk& c) { push.chunks->add(c); });
    try {
      server.push_finish(push);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(finish_error(std::numeric_limits<float>::quiet_NaN()), "");
  EXPECT_NE(finish_error(3e38f).find("'lm_head.weight.exp_avg'[3] is 3e+38"), std::string::npos);
  EXPECT_NE(finish_error(-2e6f).find("beyond +-1e+06"), std::string::npos);

  // A federation that does not share them refuses both the pull and an update carrying them.
  ServerConfig plain_config = sim_config(dir / "none", {}, "fedavg", 2, 1).server;
  Coordinator none(plain_config, false);
  ASSERT_TRUE(none.join(tiny_join("a"), "").accepted());
  ASSERT_TRUE(none.begin_round());
  try {
    none.pull(early, "");
    ADD_FAILURE() << "first moments pulled from a federation that does not share them";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not share"), std::string::npos) << e.what();
  }
  pb::UpdateInfo info;
  info.set_client_id("a");
  info.set_round(1);
  info.set_tokens(10);
  EXPECT_THROW(none.push_begin(info, encode_weights(with, zeros, CompressOptions{}).header, ""),
               Error);

  // The moments travel in the clear and without error feedback, and only beside the second ones.
  const std::string strategy = "[strategy]\nfirst_moments = 'token_rows'\n";
  const std::string base =
      "[server]\ndir = 'x'\n" + kTinyModelToml + strategy + "second_moments = 'factored'\n";
  write_file_atomic(dir / "ok.toml", base);
  EXPECT_EQ(load_server_config(dir / "ok.toml").strategy.first_moments, "token_rows");
  const std::string alone =
      server_config_error(dir / "alone.toml", "[server]\ndir = 'x'\n" + kTinyModelToml + strategy);
  EXPECT_NE(alone.find("strategy.second_moments = 'factored'"), std::string::npos) << alone;
  for (const std::string& other :
       {"[secure_aggregation]\nenabled = true\n", "[privacy]\nnoise_multiplier = 1.0\nclip = 1.0\n",
        "[compression]\ncodec = 'topk'\ntopk = 4\n", "[compression]\nserver_codec = 'sign'\n",
        "[compression]\ncodec = 'nf2'\nblock = 64\n",
        "[compression]\nserver_codec = 'nf2'\nblock = 24\n"}) {
    const std::string error = server_config_error(dir / "other.toml", base + other);
    EXPECT_NE(error.find("first_moments"), std::string::npos) << other << ": " << error;
  }
  // nf3 has no zero level either; the message names the codec that has none.
  for (const std::string& zeroless : {"[compression]\ncodec = 'nf3'\nblock = 64\n",
                                      "[compression]\ncodec = 'int4'\nserver_codec = 'nf3'\n"
                                      "block = 48\n"}) {
    const std::string error = server_config_error(dir / "nf3.toml", base + zeroless);
    EXPECT_NE(error.find("sends with nf3, which has no zero level"), std::string::npos)
        << zeroless << ": " << error;
  }
  const std::string mix =
      server_config_error(dir / "mix.toml", base + "[compression]\nserver_codec = 'mix'\n");
  EXPECT_NE(mix.find("sends with mix, whose nf2 and nf3 blocks have no zero level"),
            std::string::npos)
      << mix;
  // nf2 and nf3 in blocks within a token row (hidden_size 32) pass; int8 in any block does.
  for (const std::string& fine : {"[compression]\ncodec = 'nf2'\nblock = 32\n",
                                  "[compression]\ncodec = 'nf3'\nserver_codec = 'int4'\n"
                                  "block = 32\n",
                                  "[compression]\nserver_codec = 'nf2'\nblock = 16\n",
                                  "[compression]\ncodec = 'int8'\nblock = 256\n"}) {
    write_file_atomic(dir / "fine.toml", base + fine);
    EXPECT_NO_THROW(load_server_config(dir / "fine.toml")) << fine;
  }
  write_file_atomic(dir / "median.toml",
                    "[server]\ndir = 'x'\n" + kTinyModelToml +
                        "[strategy]\nfirst_moments = 'output'\naggregation = 'median'\n");
  EXPECT_THROW(load_server_config(dir / "median.toml"), Error);
  const std::string bad =
      server_config_error(dir / "bad.toml", "[server]\ndir = 'x'\n" + kTinyModelToml +
                                                "[strategy]\nfirst_moments = 'all'\n");
  EXPECT_NE(bad.find("none, output or token_rows"), std::string::npos) << bad;
  fs::remove_all(dir);
}
