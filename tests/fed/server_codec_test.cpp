// Compression of what the server sends: clients train from the view (fed/model_view.h) and take
// their pseudo-gradients against it, while the server keeps its own weights exact.
#include <gtest/gtest.h>

#include <map>

#include "base/thread_pool.h"
#include "fed/client.h"
#include "fed/coordinator.h"
#include "fed/fixtures.h"
#include "fed/run.h"
#include "fed/second_moments.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "model/llama.h"

using namespace pollen;
using namespace pollen::fed;
using namespace pollen::fed::testing;

namespace {

// decode(encode(w)) with the codec, tensor by tensor.
Weights round_trip(const Weights& w, const CompressOptions& codec) {
  Weights out;
  for (const auto& t : w) {
    std::string bytes;
    encode(t.data<float>(), t.numel(), codec, bytes);
    Tensor d = Tensor::empty(t.shape(), DType::f32);
    decode(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), t.numel(), codec,
           d.data<float>(), "test");
    out.push_back(std::move(d));
  }
  return out;
}

// x - (v - x_local) per value, as FedAvg (lr 1) applies one client's pseudo-gradient.
Weights fedavg_step(const Weights& x, const Weights& v, const Weights& x_local) {
  Weights out;
  for (size_t i = 0; i < x.size(); ++i) {
    Tensor e = Tensor::empty(x[i].shape(), DType::f32);
    for (int64_t j = 0; j < e.numel(); ++j) {
      const float delta = v[i].data<float>()[j] - x_local[i].data<float>()[j];
      e.data<float>()[j] = static_cast<float>(static_cast<double>(x[i].data<float>()[j]) - delta);
    }
    out.push_back(std::move(e));
  }
  return out;
}

Weights read_tensors(const fs::path& file) {
  Weights w;
  for (auto& [n, t] : io::read_safetensors(file).tensors) w.push_back(t);
  return w;
}

// A client's connection to whichever server is up now.
class Relay : public Transport {
 public:
  void connect(Coordinator& server) { to_ = std::make_unique<LocalTransport>(server); }
  pb::JoinReply join(const pb::JoinRequest& r) override { return to_->join(r); }
  pb::TaskReply task(const pb::TaskRequest& r) override { return to_->task(r); }
  void pull(const pb::PullRequest& r,
            const std::function<void(const pb::TensorStream&)>& on_message) override {
    to_->pull(r, on_message);
  }
  pb::PushReply push(const std::function<bool(pb::TensorStream&)>& next) override {
    return to_->push(next);
  }
  pb::SecAggReply secagg(const pb::SecAggRequest& r) override { return to_->secagg(r); }

 private:
  std::unique_ptr<LocalTransport> to_;
};

}  // namespace

TEST(ServerCodec, ResumedServerGoesOnSendingDeltas) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("server_codec_resume");
  const auto silo = make_silo(dir / "a", 1);
  // Three rounds; with `restart`, the server is stopped after round 2 and resumed from its
  // checkpoint while the client stays up. The shared second moments resume with it too.
  auto run = [&](const std::string& name, bool restart) {
    auto cfg = sim_config(dir / name, {silo}, "diloco", 3, 3);
    cfg.server.server_codec = Codec::int8;
    cfg.server.strategy.second_moments = "factored";
    cfg.server.compression.block = 32;
    Relay relay;
    auto server = std::make_unique<Coordinator>(cfg.server, false);
    relay.connect(*server);
    Client client(cfg.clients[0], relay);
    client.join();
    for (int round = 1; round <= 3; ++round) {
      if (restart && round == 3) {
        server.reset();
        server = std::make_unique<Coordinator>(cfg.server, true);
        relay.connect(*server);
        client.join();
      }
      EXPECT_TRUE(server->begin_round());
      EXPECT_EQ(client.poll_once(), pb::TASK_TRAIN);
      EXPECT_TRUE(server->end_round().aggregated);
    }
    return std::pair{server->global_weights(), read_jsonl(cfg.server.dir / "metrics.jsonl")};
  };
  const auto [uninterrupted, m0] = run("run0", false);
  const auto [resumed, m1] = run("run1", true);
  EXPECT_TRUE(bitwise_equal(uninterrupted, resumed));
  // Round 3 came as the same int8 delta: the resumed server sent from the view it checkpointed.
  ASSERT_EQ(m1.size(), 3u);
  EXPECT_EQ(m1[2]["bytes_sent"], m0[2]["bytes_sent"]);
  // Round 1 sent the whole model; round 3 an int8 delta and the factored moments (a byte a
  // value, 8 bytes a segment).
  const ParamSpecs specs = param_specs(model::Llama(tiny_model(), 0));
  uint64_t moments = static_cast<uint64_t>(factored_size(specs));
  for (const auto& s : specs) moments += 8 * (s.shape.size() == 2 ? 2 : 1);
  EXPECT_LT(m1[2]["bytes_sent"].get<uint64_t>() - moments, m1[0]["bytes_sent"].get<uint64_t>() / 3);
  fs::remove_all(dir);
}

TEST(ServerCodec, ClientTrainsFromTheViewAndTheServerKeepsItsWeightsExact) {
  Quiet q;
  const auto dir = temp_dir("server_codec");
  const auto silo = make_silo(dir / "a", 1);
  auto cfg = sim_config(dir, {silo}, "fedavg", 2, 4);
  cfg.server.server_codec = Codec::int8;
  cfg.server.compression.block = 32;
  const auto r = run_simulation(cfg, false);
  const auto ckpts = io::list_checkpoints(cfg.server.dir / "checkpoints");
  ASSERT_EQ(ckpts.size(), 2u);
  const Weights x1 = read_model(ckpts[0]), v2 = read_tensors(ckpts[1] / "view.safetensors");

  // By hand. Round 1: the client built another initial model (its own seed), so it gets the
  // server's x0 whole and exact, trains 4 steps to xl1, and FedAvg makes x1 from it.
  set_num_threads(1);
  model::Llama init(cfg.server.model, cfg.server.seed);
  const Weights x0 = model_weights(init);
  LocalTrainer alone(cfg.clients[0]);
  set_model_weights(alone.model(), x0);
  alone.train(4);
  EXPECT_LT(worst_difference(x1, fedavg_step(x0, x0, model_weights(alone.model()))), 1e-6);
  // Round 2: it holds x0, so it gets int8(x1 - x0) and trains from v2 = x0 + decoded, the view
  // the server checkpointed, bitwise.
  const CompressOptions int8{Codec::int8, 32};
  const Weights moved = round_trip(weights_minus(x1, x0), int8);
  EXPECT_TRUE(bitwise_equal(v2, plus(x0, moved)));
  // The view misses x1 by the int8 rounding of one round's move, far less than int8 of x1's
  // own values would.
  EXPECT_GT(worst_difference(v2, x1), 0);
  EXPECT_LT(worst_difference(v2, x1), worst_difference(round_trip(x1, int8), x1) / 10);
  set_model_weights(alone.model(), v2);
  alone.train(4);
  const Weights xl2 = model_weights(alone.model());
  // The server applies the update to its exact x1, not to v2.
  EXPECT_LT(worst_difference(r.global, fedavg_step(x1, v2, xl2)), 1e-6);
  EXPECT_GT(worst_difference(r.global, xl2), 1e-7);

  // Bytes: the whole model in float32, then a delta in int8 (block scales plus a byte a value).
  const auto m = read_jsonl(cfg.server.dir / "metrics.jsonl");
  uint64_t whole = 0, delta = 0;
  for (const auto& t : x0) whole += 4 * static_cast<uint64_t>(t.numel());
  for (const auto& t : x0) delta += encoded_bytes(int8, t.numel());
  EXPECT_EQ(m[0]["bytes_sent"].get<uint64_t>(), whole);
  EXPECT_EQ(m[1]["bytes_sent"].get<uint64_t>(), delta);
  fs::remove_all(dir);
}

TEST(ServerCodec, Bf16ScalesTravelBothWaysAndAreCounted) {
  // nf2 and mix both ways with bf16 block scales: the client rebuilds the view the server
  // checkpointed bitwise (the initial model plus the codec's decoding of round 1's move), and each
  // direction moves the codec's bytes, 2 a block less than with float32 scales.
  for (Codec codec : {Codec::nf2, Codec::mix}) {
    SCOPED_TRACE(codec_name(codec));
    Quiet q;
    const auto dir = temp_dir(cat("server_codec_bf16_scales_", codec_name(codec)));
    const auto silo = make_silo(dir / "a", 1);
    auto cfg = sim_config(dir, {silo}, "fedavg", 2, 4);
    cfg.server.compression.codec = codec;
    cfg.server.server_codec = codec;
    cfg.server.compression.block = 32;
    cfg.server.compression.scale = ScaleFormat::bf16;
    const auto r = run_simulation(cfg, false);
    ASSERT_EQ(r.rounds, 2);
    const auto ckpts = io::list_checkpoints(cfg.server.dir / "checkpoints");
    ASSERT_EQ(ckpts.size(), 2u);
    const Weights x1 = read_model(ckpts[0]), v2 = read_tensors(ckpts[1] / "view.safetensors");
    set_num_threads(1);
    const Weights x0 = model_weights(model::Llama(cfg.server.model, cfg.server.seed));
    const CompressOptions coding{codec, 32, 0, ScaleFormat::bf16};
    const Weights moved = round_trip(weights_minus(x1, x0), coding);
    EXPECT_TRUE(bitwise_equal(v2, plus(x0, moved)));
    uint64_t whole = 0, coded = 0, coded_f32 = 0;
    for (const auto& t : x0) {
      whole += 4 * static_cast<uint64_t>(t.numel());
      coded += encoded_bytes(coding, t.numel());
      coded_f32 += encoded_bytes({codec, 32}, t.numel());
    }
    const auto m = read_jsonl(cfg.server.dir / "metrics.jsonl");
    EXPECT_EQ(m[0]["bytes_sent"].get<uint64_t>(), whole);
    EXPECT_EQ(m[1]["bytes_sent"].get<uint64_t>(), coded);
    for (const auto& round : m) EXPECT_EQ(round["bytes_received"].get<uint64_t>(), coded);
    EXPECT_LT(coded, coded_f32);
    fs::remove_all(dir);
  }
}

TEST(ServerCodec, AClientThatSatOutRoundsGetsTheDeltasItMissed) {
  // Two of four clients a round: a client selected again after sitting out rounds pulls the
  // chain of int4 deltas from the view it holds, one per round it missed, not the whole model.
  Quiet q;
  const auto dir = temp_dir("server_codec_chain");
  std::vector<fs::path> silos;
  for (int i = 0; i < 4; ++i) silos.push_back(make_silo(dir / cat("s", i), i + 1, 60));
  auto cfg = sim_config(dir, silos, "fedavg", 6, 2);
  cfg.server.strategy.fraction_fit = 0.5;
  cfg.server.strategy.min_clients = 2;
  cfg.server.server_codec = Codec::int4;
  cfg.server.compression.block = 32;
  const auto r = run_simulation(cfg, false);
  ASSERT_EQ(r.rounds, 6);

  const CompressOptions int4{Codec::int4, 32};
  uint64_t whole = 0, delta = 0;
  for (const auto& t : r.global) {
    whole += 4 * static_cast<uint64_t>(t.numel());
    delta += encoded_bytes(int4, t.numel());
  }
  std::map<std::string, int64_t> last;  // the round each client last pulled
  int64_t links = 0;
  const auto m = read_jsonl(cfg.server.dir / "metrics.jsonl");
  ASSERT_EQ(m.size(), 6u);
  for (int64_t round = 1; round <= 6; ++round) {
    uint64_t expected = 0;
    for (const auto& id : m[round - 1]["participants"]) {
      const std::string c = id.get<std::string>();
      // A new client holds its own initial model; the others the view of the round they last
      // took part in, round - last[c] deltas behind (the chain is kept while under the whole).
      const int64_t behind = last.count(c) ? round - last[c] : 0;
      expected += behind > 0 && static_cast<uint64_t>(behind) * delta < whole
                      ? static_cast<uint64_t>(behind) * delta
                      : whole;
      if (behind > 1) links += behind;
      last[c] = round;
    }
    EXPECT_EQ(m[round - 1]["bytes_sent"].get<uint64_t>(), expected) << "round " << round;
  }
  EXPECT_GT(links, 0) << "no client sat out a round: the test checks nothing";
  fs::remove_all(dir);
}

TEST(ServerCodec, APullForARoundOpenedAgainOrNamingNoModelIsRefused) {
  Quiet q;
  const auto dir = temp_dir("server_codec_retry");
  ServerConfig sc = sim_config(dir, {}, "fedavg", 2, 1).server;
  sc.server_codec = Codec::int8;
  Coordinator server(sc, false);
  ASSERT_TRUE(server.join(tiny_join("a"), "").accepted());
  pb::TaskRequest ask;
  ask.set_client_id("a");
  auto error_of = [&](const pb::PullRequest& r) -> std::string {
    try {
      server.pull(r, "");
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };

  // Round 1 by hand: an update that moves every weight, which int8 cannot carry exactly.
  ASSERT_TRUE(server.begin_round());
  ASSERT_EQ(server.task(ask, "").kind(), pb::TASK_TRAIN);
  Rng rng(3);
  Weights moved;
  for (const auto& s : server.specs()) {
    Tensor t = Tensor::empty(s.shape, DType::f32);
    for (int64_t j = 0; j < t.numel(); ++j) t.data<float>()[j] = 1e-2f * rng.normal();
    moved.push_back(std::move(t));
  }
  const EncodedSet update = encode_weights(server.specs(), moved, CompressOptions{});
  pb::UpdateInfo info;
  info.set_client_id("a");
  info.set_round(1);
  info.set_tokens(10);
  auto push = server.push_begin(info, update.header, "");
  for_each_chunk(update.bytes, kMaxChunkBytes, [&](const pb::Chunk& c) { push.chunks->add(c); });
  ASSERT_TRUE(server.push_finish(push).accepted());
  ASSERT_TRUE(server.end_round().aggregated);

  // Round 2 sends int8(x1 - x0); what it misses stays in x1 - v.
  ASSERT_TRUE(server.begin_round());
  const pb::TaskReply first = server.task(ask, "");
  ASSERT_EQ(first.kind(), pb::TASK_TRAIN);
  ASSERT_EQ(first.model_sha256().size(), 64u);
  pb::PullRequest pull;
  pull.set_client_id("a");
  pull.set_round(2);
  pull.set_want_model(first.model_sha256());
  EXPECT_EQ(error_of(pull), "");
  pb::PullRequest bad = pull;
  bad.set_held_model(std::string(65, 'f'));
  EXPECT_NE(error_of(bad).find("65 characters"), std::string::npos) << error_of(bad);

  // No update came: round 2 is retried, and the new attempt sends the rest of x1 - v, which
  // moves the view. The first attempt's task now names a model no pull can bring.
  EXPECT_FALSE(server.end_round().aggregated);
  ASSERT_TRUE(server.begin_round());
  const pb::TaskReply again = server.task(ask, "");
  ASSERT_EQ(again.round(), 2);
  EXPECT_NE(again.model_sha256(), first.model_sha256());
  EXPECT_NE(error_of(pull).find("ask for the task again"), std::string::npos) << error_of(pull);
  pull.set_want_model(again.model_sha256());
  EXPECT_EQ(error_of(pull), "");
  fs::remove_all(dir);
}

TEST(ServerCodec, ConfigKeyIsReadAndBadNamesAreRefused) {
  const auto dir = temp_dir("server_codec_config");
  const std::string base = "[server]\ndir = 'x'\n" + kTinyModelToml + "[compression]\n";
  write_file_atomic(dir / "ok.toml", base + "codec = 'int8'\nserver_codec = 'int4'\nblock = 16\n");
  const auto c = load_server_config(dir / "ok.toml");
  EXPECT_EQ(c.server_codec, Codec::int4);
  EXPECT_EQ(c.compression.codec, Codec::int8);
  EXPECT_EQ(c.compression.block, 16);
  write_file_atomic(dir / "topk.toml", base + "server_codec = 'topk'\nblock = 256\ntopk = 8\n");
  EXPECT_EQ(load_server_config(dir / "topk.toml").download().topk, 8);
  const fs::path bad = dir / "bad.toml";
  for (const std::string& keys : {"codec = 'int8'\ntopk = 8\n",  // topk without the codec
                                  "codec = 'topk'\nblock = 16\ntopk = 17\n"}) {
    EXPECT_NE(server_config_error(bad, base + keys).find("topk"), std::string::npos) << keys;
  }
  write_file_atomic(dir / "scale.toml", base + "codec = 'nf2'\nscale = 'bf16'\n");
  EXPECT_EQ(load_server_config(dir / "scale.toml").compression.scale, ScaleFormat::bf16);
  EXPECT_EQ(load_server_config(dir / "scale.toml").download().scale, ScaleFormat::bf16);
  EXPECT_EQ(c.compression.scale, ScaleFormat::f32);
  EXPECT_NE(
      server_config_error(bad, base + "codec = 'nf2'\nscale = 'fp8'\n").find("compression.scale"),
      std::string::npos);
  EXPECT_NE(server_config_error(bad, base + "server_codec = 'int3'\n").find("server_codec"),
            std::string::npos);
  fs::remove_all(dir);
}
