// Compression of what the server sends: clients train from the decoded model and take their
// pseudo-gradients against it, while the server keeps its own weights exact.
#include <gtest/gtest.h>

#include "base/thread_pool.h"
#include "fed/client.h"
#include "fed/coordinator.h"
#include "fed/fixtures.h"
#include "fed/run.h"
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

double worst_difference(const Weights& a, const Weights& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    for (int64_t j = 0; j < a[i].numel(); ++j) {
      worst = std::max(worst, std::fabs(static_cast<double>(a[i].data<float>()[j]) -
                                        static_cast<double>(b[i].data<float>()[j])));
    }
  }
  return worst;
}

}  // namespace

TEST(ServerCodec, ClientTrainsFromTheDecodedModelAndTheServerKeepsItsWeightsExact) {
  Quiet q;
  const auto dir = temp_dir("server_codec");
  const auto silo = make_silo(dir / "a", 1);
  auto cfg = sim_config(dir, {silo}, "fedavg", 1, 4);
  cfg.server.server_codec = Codec::int8;
  cfg.server.compression.block = 32;
  const auto r = run_simulation(cfg, false);

  // By hand: x the initial model, xq = decode(encode(x)), the client trains 4 steps from xq to
  // x_local and sends delta = xq - x_local; FedAvg (lr 1) on the exact x: x - delta.
  set_num_threads(1);
  model::Llama init(cfg.server.model, cfg.server.seed);
  const Weights x = model_weights(init);
  const CompressOptions int8{Codec::int8, 32};
  const Weights xq = round_trip(x, int8);
  LocalTrainer alone(cfg.clients[0]);
  set_model_weights(alone.model(), xq);
  alone.train(4);
  const Weights x_local = model_weights(alone.model());
  Weights expected;
  for (size_t i = 0; i < x.size(); ++i) {
    Tensor e = Tensor::empty(x[i].shape(), DType::f32);
    for (int64_t j = 0; j < e.numel(); ++j) {
      const float delta = xq[i].data<float>()[j] - x_local[i].data<float>()[j];
      e.data<float>()[j] = static_cast<float>(static_cast<double>(x[i].data<float>()[j]) - delta);
    }
    expected.push_back(std::move(e));
  }
  EXPECT_LT(worst_difference(r.global, expected), 1e-6);
  // Had the server applied the update to xq (or the client trained from x), the result would be
  // the local model, which differs by the int8 rounding of x.
  EXPECT_GT(worst_difference(r.global, x_local), 1e-4);

  // The model went out as int8: block scales plus one byte per value.
  const auto m = read_jsonl(cfg.server.dir / "metrics.jsonl");
  uint64_t want = 0;
  for (const auto& t : x) want += encoded_bytes(Codec::int8, t.numel(), 32);
  EXPECT_EQ(m[0]["bytes_sent"].get<uint64_t>(), want);
  fs::remove_all(dir);
}

TEST(ServerCodec, ConfigKeyIsReadAndBadNamesAreRefused) {
  const auto dir = temp_dir("server_codec_config");
  const std::string base =
      "[server]\ndir = 'x'\n[model]\nvocab_size = 64\nhidden_size = 32\nintermediate_size = 64\n"
      "num_hidden_layers = 2\nnum_attention_heads = 2\nnum_key_value_heads = 2\n"
      "max_position_embeddings = 64\n[tokenizer]\nfingerprint = 't'\n[compression]\n";
  write_file_atomic(dir / "ok.toml", base + "codec = 'int8'\nserver_codec = 'int4'\nblock = 16\n");
  const auto c = load_server_config(dir / "ok.toml");
  EXPECT_EQ(c.server_codec, Codec::int4);
  EXPECT_EQ(c.compression.codec, Codec::int8);
  EXPECT_EQ(c.compression.block, 16);
  write_file_atomic(dir / "bad.toml", base + "server_codec = 'int3'\n");
  try {
    load_server_config(dir / "bad.toml");
    ADD_FAILURE() << "an unknown codec was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("server_codec"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}
