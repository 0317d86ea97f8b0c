// The wire's checks, agreement, TLS, and federated runs: simulation, dropped clients, resume,
// one client matching pollen train, and simulated == deployed (loopback processes) bitwise.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <condition_variable>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <thread>

#include "base/files.h"
#include "base/folder_lock.h"
#include "base/log.h"
#include "base/thread_pool.h"
#include "data/shards.h"
#include "fed/client.h"
#include "fed/coordinator.h"
#include "fed/fixtures.h"
#include "fed/grpc.h"
#include "fed/held_out_table.h"
#include "fed/run.h"
#include "io/checkpoint.h"
#include "io/model_source.h"
#include "io/safetensors.h"
#include "pollen_fed.grpc.pb.h"
#include "support/errors.h"
#include "train/trainer.h"

namespace fs = std::filesystem;
using namespace pollen;
using namespace pollen::fed;
using namespace pollen::fed::testing;

// ---- the wire ---------------------------------------------------------------------------------

TEST(Wire, HeaderChecksNamesShapesSizesAndCodec) {
  ParamSpecs specs{{"a", {2, 3}}, {"b", {5}}};
  Weights w{Tensor::zeros({2, 3}, DType::f32), Tensor::full({5}, 1.5, DType::f32)};
  CompressOptions none, int8;
  int8.codec = Codec::int8;
  const auto enc = encode_weights(specs, w, none);
  EXPECT_NO_THROW(validate_header(enc.header, specs, none, "t"));
  auto expect_refused = [&](pb::TensorSetHeader h, const std::string& needle) {
    try {
      validate_header(h, specs, none, "t");
      ADD_FAILURE() << "accepted; expected: " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto h = enc.header;
  h.mutable_tensors(0)->set_name("evil");
  expect_refused(h, "expected 'a'");
  h = enc.header;
  h.mutable_tensors(1)->set_shape(0, 6);
  expect_refused(h, "shape (6,)");
  h = enc.header;
  h.mutable_tensors(1)->set_bytes(1u << 31);
  expect_refused(h, "needs 20");
  h = enc.header;
  h.set_codec("int8");
  expect_refused(h, "codec 'int8'");
  h = enc.header;
  h.set_codec_scale("bf16");
  expect_refused(h, "codec scale 'bf16', expected 'float32'");
  h.set_codec_scale("fp8");
  expect_refused(h, "scale format 'fp8'");
  h = enc.header;
  h.add_tensors()->set_name("extra");
  expect_refused(h, "3 tensors");
  EXPECT_THROW(validate_header(enc.header, specs, int8, "t"), Error);
}

TEST(Wire, ChunksAreOrderedBoundedAndChecksummed) {
  ParamSpecs specs{{"x", {300000}}};
  Weights w{Tensor::full({300000}, 0.25, DType::f32)};
  CompressOptions none;
  const auto enc = encode_weights(specs, w, none);
  std::vector<pb::Chunk> chunks;
  for_each_chunk(enc.bytes, 500000, [&](const pb::Chunk& c) { chunks.push_back(c); });
  ASSERT_EQ(chunks.size(), 3u);
  {
    ChunkAssembler a(enc.header, "t");
    for (const auto& c : chunks) a.add(c);
    const auto bytes = a.finish();
    const auto back = decode_set(enc.header, bytes, specs, "t");
    EXPECT_TRUE(bitwise_equal(back, w));
  }
  {
    ChunkAssembler a(enc.header, "t");
    EXPECT_THROW(a.add(chunks[1]), Error);  // out of order
  }
  {
    ChunkAssembler a(enc.header, "t");
    a.add(chunks[0]);
    EXPECT_THROW(a.finish(), Error);  // short
  }
  {
    auto bad = chunks;
    bad[2].mutable_data()->at(7) ^= 1;
    ChunkAssembler a(enc.header, "t");
    for (const auto& c : bad) a.add(c);
    try {
      a.finish();
      FAIL();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("SHA-256"), std::string::npos);
    }
  }
  {
    pb::Chunk big;
    big.set_offset(0);
    big.set_data(std::string(kMaxChunkBytes + 1, 'x'));
    ChunkAssembler a(enc.header, "t");
    EXPECT_THROW(a.add(big), Error);
  }
}

TEST(Wire, AgreementSaysWhatDiffers) {
  auto m = tiny_model();
  const std::string server = model_config_json(m);
  pb::JoinRequest r;
  r.set_protocol_version(kProtocolVersion);
  r.set_model_config(server);
  r.set_tokenizer_fingerprint("tok");
  EXPECT_EQ(agreement_differences(r, kProtocolVersion, server, "tok"), "");
  m.hidden_size = 64;
  r.set_model_config(model_config_json(m));
  r.set_tokenizer_fingerprint("other");
  r.set_protocol_version(99);
  const auto d = agreement_differences(r, kProtocolVersion, server, "tok");
  EXPECT_NE(d.find(cat("protocol version: server ", kProtocolVersion, ", client 99")),
            std::string::npos)
      << d;
  EXPECT_NE(d.find("model.hidden_size: server 32, client 64"), std::string::npos) << d;
  EXPECT_NE(d.find("tokenizer fingerprint"), std::string::npos) << d;
  r.set_model_config("{not json");
  EXPECT_NE(agreement_differences(r, kProtocolVersion, server, "tok").find("not valid JSON"),
            std::string::npos);
  // What changes the model's output beside its shapes: the attention window and rope scaling.
  r.set_tokenizer_fingerprint("tok");
  r.set_protocol_version(kProtocolVersion);
  auto windowed = tiny_model();
  windowed.sliding_window = 16;
  r.set_model_config(model_config_json(windowed));
  EXPECT_EQ(agreement_differences(r, kProtocolVersion, server, "tok"),
            "model.sliding_window: server 0, client 16");
  auto scaled = tiny_model();
  scaled.rope_scaling.kind = ops::RopeScaling::Kind::linear;
  scaled.rope_scaling.factor = 4;
  r.set_model_config(model_config_json(scaled));
  EXPECT_NE(agreement_differences(r, kProtocolVersion, server, "tok").find("model.rope_scaling"),
            std::string::npos);
  auto rescaled = scaled;
  rescaled.rope_scaling.factor = 2;
  EXPECT_NE(agreement_differences(r, kProtocolVersion, model_config_json(rescaled), "tok")
                .find("\"factor\":4.0"),
            std::string::npos);
}

// ---- federated runs in one process
// ----------------------------------------------------------------

TEST(Simulation, LossFallsAndMetricsAndLineageAreWritten) {
  Quiet q;
  const auto dir = temp_dir("sim");
  auto cfg =
      sim_config(dir, {make_silo(dir / "a", 1), make_silo(dir / "b", 3), make_silo(dir / "c", 5)},
                 "diloco", 4, 8);
  cfg.server.compression.codec = Codec::int8;
  const auto r = run_simulation(cfg, false);
  EXPECT_EQ(r.rounds, 4);
  const auto metrics = read_jsonl(cfg.server.dir / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 4u);
  const double first = metrics.front()["eval_loss"], last_eval = metrics.back()["eval_loss"];
  EXPECT_LT(last_eval, first - 0.3) << "evaluation loss of the global model did not fall";
  double mean_final = 0;
  for (double l : r.eval_loss) mean_final += l / static_cast<double>(r.eval_loss.size());
  EXPECT_LT(mean_final, first - 0.5);
  for (const auto& m : metrics) {
    EXPECT_EQ(m["participants"].size(), 3u);
    EXPECT_GT(m["bytes_received"].get<double>(), 0);
    EXPECT_GT(m["bytes_sent"].get<double>(), 3.5 * m["bytes_received"].get<double>() / 3 * 0.9);
  }
  // lineage: every round, every client, its data's manifest hash, tokens
  const auto lineage = read_jsonl(cfg.server.dir / "lineage.jsonl");
  ASSERT_EQ(lineage.size(), 4u);
  EXPECT_EQ(lineage[0]["clients"][1]["data_manifest_hash"],
            data::dataset_version(cfg.clients[1].manifests[0]));
  // scored tokens: 8 steps of 4 x 16 targets, less those at document starts (not scored)
  EXPECT_GT(lineage[0]["clients"][1]["tokens"].get<int>(), 400);
  EXPECT_LE(lineage[0]["clients"][1]["tokens"].get<int>(), 8 * 4 * 16);
  const auto ckpts = io::list_checkpoints(cfg.server.dir / "checkpoints");
  ASSERT_FALSE(ckpts.empty());
  const auto state = nlohmann::json::parse(read_file(ckpts.back() / "state.json"));
  EXPECT_EQ(state["round"], 4);
  EXPECT_EQ(state["lineage"].size(), 4u);
  // The checkpoint is a model folder (config.toml's [model]): generate, eval, serve and export
  // take it as --model, and it holds the global model of the last round.
  const io::ModelSource source = io::resolve_model(ckpts.back().string());
  EXPECT_EQ(source.kind, io::ModelSource::Kind::checkpoint);
  EXPECT_EQ(model::architecture_differences(cfg.server.model, source.config),
            std::vector<std::string>{});
  const model::Llama loaded = io::load_model(source);
  const auto saved = io::read_safetensors(ckpts.back() / "model.safetensors");
  for (const auto& [name, var] : loaded.named_parameters()) {
    const Tensor* t = saved.find(name);
    ASSERT_NE(t, nullptr) << name;
    const Tensor expected = t->to(DType::f32);
    const Tensor got = var.value().to(DType::f32);
    ASSERT_EQ(got.numel(), expected.numel()) << name;
    for (int64_t i = 0; i < got.numel(); ++i)
      ASSERT_EQ(got.data<float>()[i], expected.data<float>()[i]) << name << " at " << i;
  }
}

// The configs' fingerprints agree, but one silo's data was tokenised with another tokenizer: the
// ids would mean other pieces. Its client refuses the data, naming both tokenizers.
TEST(Simulation, DataTokenisedWithAnotherTokenizerIsRefused) {
  Quiet q;
  const auto dir = temp_dir("sim_other_tokenizer");
  const fs::path other = make_silo(dir / "b", 3);
  nlohmann::json m = nlohmann::json::parse(read_file(other));
  m["tokenizer"] = {{"fingerprint", "another-tokenizer"}, {"file", "tokenizer.json"}};
  write_file_atomic(other, data::manifest_text(m));
  const auto cfg = sim_config(dir, {make_silo(dir / "a", 1), other}, "fedavg", 1, 2);
  try {
    run_simulation(cfg, false);
    ADD_FAILURE() << "data of another tokenizer was trained on";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("tokenised with tokenizer another-tokenizer"), std::string::npos) << what;
    EXPECT_NE(what.find("test-tokenizer"), std::string::npos) << what;
  }
  fs::remove_all(dir);
}

// One server at a time writes a run folder: a second (a restart while the first still runs) is
// refused before it touches the folder.
TEST(Simulation, ASecondServerOnTheRunFolderIsRefused) {
  Quiet q;
  const auto dir = temp_dir("sim_locked");
  const auto cfg = sim_config(dir, {make_silo(dir / "a", 1)}, "fedavg", 1, 2);
  const FolderLock first(cfg.server.dir, "server.dir");
  try {
    run_simulation(cfg, false);
    ADD_FAILURE() << "two servers ran on one folder";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("server.dir '" + cfg.server.dir.string() +
                                         "' is in use by another process"),
              std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(fs::exists(cfg.server.dir / "metrics.jsonl"));
  fs::remove_all(dir);
}

// A silo without held-out data has no final loss: NaN (the table's "-"), not 0, which would read
// as a perfect model.
TEST(Simulation, ASiloWithoutHeldOutDataHasNoFinalLoss) {
  Quiet q;
  const auto dir = temp_dir("no_held_out");
  const auto cfg = sim_config(
      dir, {make_silo(dir / "a", 1), make_silo(dir / "b", 3, 300, /*validation_docs=*/0)}, "fedavg",
      1, 2);
  const auto r = run_simulation(cfg, false);
  ASSERT_EQ(r.eval_loss.size(), 2u);
  EXPECT_TRUE(std::isfinite(r.eval_loss[0]) && r.eval_loss[0] > 0) << r.eval_loss[0];
  EXPECT_TRUE(std::isnan(r.eval_loss[1])) << r.eval_loss[1];
  EXPECT_NE(held_out_table(r, "loss").find("-: the silo has no held-out data"), std::string::npos);
  // A silo without training data is named, among many.
  const auto empty = sim_config(
      dir / "empty", {make_silo(dir / "a", 1), make_silo(dir / "c", 5, /*train_docs=*/0)}, "fedavg",
      1, 2);
  const std::string e = pollen::testing::error_of([&] { run_simulation(empty, false); });
  EXPECT_NE(e.find("client '"), std::string::npos) << e;
  EXPECT_NE(e.find("': the train split of data.manifests: "), std::string::npos) << e;
  fs::remove_all(dir);
}

TEST(Simulation, ClientsThatTrainedFirstStayInLaterRounds) {
  Quiet q;
  const auto dir = temp_dir("timeout");
  auto cfg = sim_config(dir, {make_silo(dir / "a", 1), make_silo(dir / "b", 3)}, "fedavg", 3, 8);
  // Shorter than a round: client a is last heard from when it asks for its task, before b trains.
  cfg.server.client_timeout_s = 0.02;
  const auto r = run_simulation(cfg, false);
  EXPECT_EQ(r.rounds, 3);
  for (const auto& m : read_jsonl(cfg.server.dir / "metrics.jsonl")) {
    EXPECT_EQ(m["participants"].size(), 2u) << "round " << m["round"] << " left a client out";
  }
}

// A client is heard from whenever it calls, its pull and push included: one whose local steps
// outlast client_timeout_s is alive once it pushed (deployed, it asks for its next task only after
// saving its state, and the next round may open before that).
TEST(Simulation, APushCountsAsHearingFromTheClient) {
  Quiet q;
  const auto dir = temp_dir("push_seen");
  auto cfg = sim_config(dir, {make_silo(dir / "a", 1)}, "fedavg", 2, 30);
  cfg.server.client_timeout_s = 0.005;  // shorter than 30 local steps
  Coordinator coordinator(cfg.server, false);
  LocalTransport transport(coordinator);
  Client client(cfg.clients[0], transport);
  client.join();
  ASSERT_TRUE(coordinator.begin_round());
  EXPECT_EQ(client.poll_once(), pb::TASK_TRAIN);  // the task, then pull, train and push
  EXPECT_EQ(coordinator.alive_clients(), 1u);
}

// One client under FedAvg (server lr 1) is `pollen train` on its data: the same batches, the
// same schedule across rounds, the same AdamW with the same groups spared weight decay (the
// defaults of both: norms, biases and embeddings; a client that decayed its embeddings, or
// restarted its schedule each round, would end elsewhere).
TEST(Simulation, OneClientFedAvgIsPollenTrain) {
  Quiet q;
  const auto dir = temp_dir("one");
  const auto silo = make_silo(dir / "a", 1);
  auto cfg = sim_config(dir, {silo}, "fedavg", 3, 5);
  ClientConfig& c = cfg.clients[0];
  c.seed = cfg.server.seed;  // pollen train draws the model and the data order from one seed
  c.train.optimizer = train::OptimizerSettings{};
  c.train.optimizer.lr = 3e-3;
  c.train.optimizer.weight_decay = 0.5;  // large enough that decaying a spared group shows
  c.train.min_lr = 3e-4;
  c.train.schedule = "cosine";
  c.train.warmup_steps = 3;
  c.train.total_steps = 15;
  const auto r = run_simulation(cfg, false);

  const std::string toml =
      cat("[run]\ndir = '", (dir / "train").string(), "'\nseed = ", cfg.server.seed,
          "\nthreads = 1\n[model]\nvocab_size = 64\nhidden_size = 32\nintermediate_size = 64\n"
          "num_hidden_layers = 2\nnum_attention_heads = 2\nnum_key_value_heads = 2\n"
          "max_position_embeddings = 64\n[data]\nmanifests = ['",
          silo.string(),
          "']\n[train]\nsteps = 15\nmicro_batch = 4\nseq = 16\nbatch_tokens = 64\n"
          "[optimizer]\nlr = 3e-3\nweight_decay = 0.5\n[schedule]\nkind = 'cosine'\n"
          "warmup_steps = 3\nmin_lr = 3e-4\n[metrics]\npeak_flops = 1e11\n");
  train::TrainOptions o;
  o.quiet = true;
  o.handle_signals = false;
  const auto t = train::run_training(train::parse_train_config(toml, "train.toml", {}), o);
  ASSERT_EQ(t.status, train::RunStatus::finished) << t.message;
  const Weights trained = read_model(t.last_checkpoint);
  ASSERT_EQ(trained.size(), r.global.size());
  double worst = 0;
  for (size_t i = 0; i < trained.size(); ++i) {
    const float* a = trained[i].data<float>();
    const float* b = r.global[i].data<float>();
    for (int64_t j = 0; j < trained[i].numel(); ++j)
      worst = std::max(worst, static_cast<double>(std::fabs(a[j] - b[j])));
  }
  EXPECT_LT(worst, 1e-6) << "FedAvg (lr 1) of one client should be pollen train on its data";
}

// The server of `cfg` and its first two clients on the in-process transport, both joined.
struct TwoClients {
  explicit TwoClients(const SimConfig& cfg)
      : server(cfg.server, false),
        transport(server),
        first(cfg.clients[0], transport),
        second(cfg.clients[1], transport) {
    first.join();
    second.join();
  }
  Coordinator server;
  LocalTransport transport;
  Client first, second;
};

TEST(Simulation, DroppedClientLeavesTheRoundToTheRest) {
  Quiet q;
  const auto dir = temp_dir("drop");
  auto cfg = sim_config(dir, {make_silo(dir / "a", 1), make_silo(dir / "b", 3)}, "fedavg", 2, 2);
  set_num_threads(1);
  TwoClients f(cfg);
  Coordinator& server = f.server;
  Client &a = f.first, &b = f.second;
  ASSERT_TRUE(server.begin_round());
  EXPECT_EQ(a.poll_once(), pb::TASK_TRAIN);  // b never answers: killed mid-round
  auto s = server.end_round();
  EXPECT_TRUE(s.aggregated);
  EXPECT_EQ(s.participants, std::vector<std::string>{"silo-0"});
  EXPECT_EQ(s.dropped, std::vector<std::string>{"silo-1"});
  // b comes back: its late update for round 1 is refused, and it trains in round 2.
  ASSERT_TRUE(server.begin_round());
  EXPECT_EQ(b.poll_once(), pb::TASK_TRAIN);
  EXPECT_EQ(a.poll_once(), pb::TASK_TRAIN);
  s = server.end_round();
  EXPECT_EQ(s.participants.size(), 2u);
  EXPECT_FALSE(server.begin_round());  // 2 rounds done
  EXPECT_EQ(a.poll_once(), pb::TASK_DONE);
}

// The in-process transport of a client that is always late: its round closes (the deadline)
// while its update is on the way.
class LateTransport : public LocalTransport {
 public:
  explicit LateTransport(Coordinator& c) : LocalTransport(c), c_(c) {}
  pb::PushReply push(const std::function<bool(pb::TensorStream&)>& next) override {
    c_.end_round();
    return LocalTransport::push(next);
  }

 private:
  Coordinator& c_;
};

// A client none of whose updates was aggregated fails at the run's end saying so, instead of
// ending as though its silo had taken part; the client whose update counted ends as usual.
TEST(Simulation, AClientNoneOfWhoseUpdatesCountedFailsSayingSo) {
  Quiet q;
  const auto dir = temp_dir("never_counted");
  auto cfg = sim_config(dir, {make_silo(dir / "a", 1), make_silo(dir / "b", 3)}, "fedavg", 1, 2);
  set_num_threads(1);
  Coordinator server(cfg.server, false);
  LocalTransport on_time(server);
  LateTransport late(server);
  Client a(cfg.clients[0], on_time), b(cfg.clients[1], late);
  a.join();
  b.join();
  ASSERT_TRUE(server.begin_round());
  EXPECT_EQ(a.poll_once(), pb::TASK_TRAIN);
  // The round closes with a's update alone; b's is refused.
  EXPECT_NE(pollen::testing::error_of([&] { b.poll_once(); }).find("round 1 is not open"),
            std::string::npos);
  EXPECT_FALSE(server.begin_round());  // 1 round done
  // pollen fed server keeps its port open until every live client has heard the run is over.
  EXPECT_EQ(server.clients_not_told_done(), 2u);
  EXPECT_NO_THROW(a.run());
  EXPECT_EQ(server.clients_not_told_done(), 1u);
  const std::string error = pollen::testing::error_of([&] { b.run(); });
  EXPECT_EQ(server.clients_not_told_done(), 0u);
  EXPECT_NE(
      error.find("aggregated none of this silo's updates (this process pushed 1, from round 1)"),
      std::string::npos)
      << error;
}

// shape, for tests that push by hand.
struct OneSiloRound {
  explicit OneSiloRound(const std::string& name)
      : dir(temp_dir(name)),
        cfg(sim_config(dir, {make_silo(dir / "a", 1)}, "fedavg", 1, 1)),
        server(cfg.server, false),
        transport(server),
        client(cfg.clients[0], transport) {
    client.join();
    EXPECT_TRUE(server.begin_round());
    for (const auto& s : server.specs()) zeros.push_back(Tensor::zeros(s.shape, DType::f32));
  }
  fs::path dir;
  SimConfig cfg;
  Coordinator server;
  LocalTransport transport;
  Client client;
  Weights zeros;
};

TEST(Simulation, MalformedPushesAreRefusedAndTheServerGoesOn) {
  Quiet q;
  set_num_threads(1);
  OneSiloRound round("bad");
  Coordinator& server = round.server;
  Client& a = round.client;
  const Weights& zeros = round.zeros;
  auto push = [&](std::vector<pb::TensorStream> msgs) {
    size_t i = 0;
    return serve_push(server, "", [&](pb::TensorStream& m) {
      if (i == msgs.size()) return false;
      m = msgs[i++];
      return true;
    });
  };
  pb::TensorStream info, header, chunk;
  info.mutable_update()->set_client_id("silo-0");
  info.mutable_update()->set_round(1);
  info.mutable_update()->set_tokens(10);
  info.mutable_update()->set_data_manifest_hash(a.round_trainer().manifest_hash());
  const auto enc = encode_weights(server.specs(), zeros, {});
  *header.mutable_header() = enc.header;
  EXPECT_THROW(push({header}), Error);      // no update info
  EXPECT_THROW(push({info, info}), Error);  // no header
  auto wrong_round = info;
  wrong_round.mutable_update()->set_round(7);
  EXPECT_THROW(push({wrong_round, header}), Error);
  auto stranger = info;
  stranger.mutable_update()->set_client_id("mallory");
  EXPECT_THROW(push({stranger, header}), Error);
  auto bad_id = info;
  bad_id.mutable_update()->set_client_id("../../etc");
  EXPECT_THROW(push({bad_id, header}), Error);
  auto nan_loss = info;
  nan_loss.mutable_update()->set_train_loss(NAN);
  EXPECT_THROW(push({nan_loss, header}), Error);
  auto refusal = [&](std::vector<pb::TensorStream> msgs) {
    try {
      push(std::move(msgs));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  auto far_negative_loss = info;  // a post-training loss may be negative, but not this far
  far_negative_loss.mutable_update()->set_eval_loss(-1e300);
  EXPECT_NE(refusal({far_negative_loss, header}).find("eval_loss -1e+300 is outside"),
            std::string::npos);
  auto negative_loss = info;  // pre-training's losses are cross-entropies, never negative
  negative_loss.mutable_update()->set_train_loss(-1);
  EXPECT_NE(refusal({negative_loss, header}).find("train_loss -1 is negative"), std::string::npos);
  // A post-training objective's metrics: named plainly, finite, at most 16.
  auto metric = [&](const std::map<std::string, double>& m) {
    auto bad = info;
    for (const auto& [name, value] : m)
      (*bad.mutable_update()->mutable_objective_metrics())[name] = value;
    return refusal({bad, header});
  };
  EXPECT_NE(metric({{"re ward", 1}}).find("objective metric names"), std::string::npos);
  EXPECT_NE(metric({{"reward", NAN}}).find("objective metric 'reward'"), std::string::npos);
  std::map<std::string, double> many;
  for (int i = 0; i < 17; ++i) many[cat("m", i)] = 0;
  EXPECT_NE(metric(many).find("more than 16"), std::string::npos);
  auto huge_loss = info;
  huge_loss.mutable_update()->set_train_loss(1e300);
  EXPECT_NE(refusal({huge_loss, header}).find("train_loss"), std::string::npos);
  auto eval_tokens = info;  // two of these would overflow the server's int64 sum
  eval_tokens.mutable_update()->set_eval_tokens(INT64_MAX);
  EXPECT_NE(refusal({eval_tokens, header}).find("eval_tokens"), std::string::npos);
  chunk.mutable_chunk()->set_offset(0);
  chunk.mutable_chunk()->set_data(enc.bytes.substr(0, 100));
  EXPECT_THROW(push({info, header, chunk}), Error);  // short stream
  // A finite value far beyond any training step (with Nesterov it would reach infinity in the
  // global model).
  Weights huge = clone_weights(zeros);
  huge[1].data<float>()[3] = 3.4e38f;
  const auto huge_enc = encode_weights(server.specs(), huge, {});
  pb::TensorStream huge_header, huge_chunk;
  *huge_header.mutable_header() = huge_enc.header;
  huge_chunk.mutable_chunk()->set_offset(0);
  huge_chunk.mutable_chunk()->set_data(huge_enc.bytes);
  const std::string why = refusal({info, huge_header, huge_chunk});
  EXPECT_NE(why.find(cat("'", server.specs()[1].name, "'[3] is 3.4e+38, beyond +-1e+06")),
            std::string::npos)
      << why;
  // and a proper update is still taken
  EXPECT_EQ(a.poll_once(), pb::TASK_TRAIN);
  EXPECT_TRUE(server.round_complete());
  EXPECT_TRUE(server.end_round().aggregated);
}

// While a client's push is still arriving (its connection may have failed while the server takes
// it in), its task waits rather than give it the round again (which would make it restore the
// error feedback it sent and train the round twice); update_round then says the push was held.
TEST(Simulation, ARoundIsNotGivenAgainWhileItsPushIsArriving) {
  Quiet q;
  set_num_threads(1);
  OneSiloRound round("arriving");
  Coordinator& server = round.server;
  std::vector<pb::TensorStream> msgs(2);
  msgs[0].mutable_update()->set_client_id("silo-0");
  msgs[0].mutable_update()->set_round(1);
  msgs[0].mutable_update()->set_tokens(10);
  msgs[0].mutable_update()->set_data_manifest_hash(round.client.round_trainer().manifest_hash());
  const auto enc = encode_weights(server.specs(), round.zeros, {});
  *msgs[1].mutable_header() = enc.header;
  for_each_chunk(enc.bytes, kMaxChunkBytes, [&](const pb::Chunk& c) {
    msgs.emplace_back();
    *msgs.back().mutable_chunk() = c;
  });
  std::mutex m;
  std::condition_variable cv;
  bool begun = false, release = false;
  std::thread push([&] {
    size_t i = 0;
    serve_push(server, "", [&](pb::TensorStream& out) {
      if (i == 2) {  // the header is in: the push has begun, its chunks are still to come
        std::unique_lock lock(m);
        begun = true;
        cv.notify_all();
        cv.wait(lock, [&] { return release; });
      }
      if (i == msgs.size()) return false;
      out = msgs[i++];
      return true;
    });
  });
  pb::TaskRequest r;
  r.set_client_id("silo-0");
  {
    std::unique_lock lock(m);
    cv.wait(lock, [&] { return begun; });
  }
  pb::TaskReply t = server.task(r, "");
  EXPECT_EQ(t.kind(), pb::TASK_WAIT);
  EXPECT_EQ(t.update_round(), 0);
  {
    std::lock_guard lock(m);
    release = true;
  }
  cv.notify_all();
  push.join();
  t = server.task(r, "");
  EXPECT_EQ(t.kind(), pb::TASK_WAIT);
  EXPECT_EQ(t.update_round(), 1);
  EXPECT_TRUE(server.end_round().aggregated);
  EXPECT_EQ(server.task(r, "").update_round(), 1);
}

// A push that began in an attempt of a round that then closed (too few updates by its deadline)
// is refused when it ends in the retried attempt: it would count as one of the new attempt's
// updates and close it early.
TEST(Simulation, APushFromAClosedAttemptIsRefused) {
  Quiet q;
  set_num_threads(1);
  OneSiloRound round("stale_push");
  Coordinator& server = round.server;
  pb::UpdateInfo info;
  info.set_client_id("silo-0");
  info.set_round(1);
  info.set_tokens(10);
  info.set_data_manifest_hash(round.client.round_trainer().manifest_hash());
  const auto enc = encode_weights(server.specs(), round.zeros, {});
  auto stale = server.push_begin(info, enc.header, "");
  pb::Chunk chunk;
  chunk.set_offset(0);
  chunk.set_data(enc.bytes);
  stale.chunks->add(chunk);
  EXPECT_FALSE(server.end_round().aggregated);  // the deadline: no update yet, so retried
  ASSERT_TRUE(server.begin_round());
  try {
    server.push_finish(stale);
    ADD_FAILURE() << "a push of a closed attempt was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("closed while the update was arriving"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(server.round_complete());
  // A push begun in this attempt is taken (the stale one, still open, does not stop it); a
  // second one at the same time is not, so that a client holds one stream's buffer at most.
  auto fresh = server.push_begin(info, enc.header, "");
  EXPECT_NE(pollen::testing::error_of([&] {
              server.push_begin(info, enc.header, "");
            }).find("another push from this client is still arriving for round 1"),
            std::string::npos);
  fresh.chunks->add(chunk);
  EXPECT_TRUE(server.push_finish(fresh).accepted());
  EXPECT_TRUE(server.round_complete());
  EXPECT_TRUE(server.end_round().aggregated);
}

// The round's federated eval_loss takes only evaluations the round asked for (one client's loss
// of 1e9 would set it), and the lineage only the data each client joined with: an update saying
// otherwise is refused, and the client's own updates are taken.
TEST(Simulation, AnUnaskedEvaluationOrAnotherDatasetIsRefused) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("unasked");
  auto cfg = sim_config(dir, {make_silo(dir / "a", 1)}, "fedavg", 2, 1);
  cfg.server.eval_every = 2;  // round 1 asks for an evaluation, round 2 for none
  Coordinator server(cfg.server, false);
  LocalTransport transport(server);
  Client client(cfg.clients[0], transport);
  client.join();
  const std::string manifest = client.round_trainer().manifest_hash();
  ASSERT_FALSE(manifest.empty());
  Weights zeros;
  for (const auto& s : server.specs()) zeros.push_back(Tensor::zeros(s.shape, DType::f32));
  const auto enc = encode_weights(server.specs(), zeros, {});
  pb::UpdateInfo info;
  info.set_client_id("silo-0");
  info.set_round(2);
  info.set_tokens(10);
  info.set_data_manifest_hash(manifest);
  auto push_error = [&](const pb::UpdateInfo& i) {
    return pollen::testing::error_of([&] { server.push_begin(i, enc.header, ""); });
  };
  for (int64_t round = 1; round <= 2; ++round) {
    ASSERT_TRUE(server.begin_round());
    if (round == 2) {
      auto evaluated = info;
      evaluated.set_eval_tokens(100);
      evaluated.set_eval_loss(1e9);
      std::string e = push_error(evaluated);
      EXPECT_NE(e.find("for round 2, whose task asked for none (server.eval_every 2)"),
                std::string::npos)
          << e;
      auto other = info;
      other.set_data_manifest_hash(std::string(64, 'f'));
      e = push_error(other);
      EXPECT_NE(e.find("not the data it joined with"), std::string::npos) << e;
    }
    EXPECT_EQ(client.poll_once(), pb::TASK_TRAIN);
    ASSERT_TRUE(server.round_complete());
    const auto s = server.end_round();
    ASSERT_TRUE(s.aggregated);
    EXPECT_EQ(std::isnan(s.eval_loss), round == 2) << "round " << round;
  }
  const auto lineage = read_jsonl(cfg.server.dir / "lineage.jsonl");
  ASSERT_EQ(lineage.size(), 2u);
  for (const auto& line : lineage)
    EXPECT_EQ(line["clients"][0]["data_manifest_hash"], manifest) << line;
}

// The global model of `cfg` run from the start without a stop, in a folder of its own (the
// clients' states too).
Weights uninterrupted_global(SimConfig cfg, const fs::path& dir) {
  cfg.server.dir = dir;
  for (auto& cc : cfg.clients) cc.state_dir.clear();
  return run_simulation(cfg, false).global;
}

TEST(Simulation, ServerResumesAtTheLastRound) {
  Quiet q;
  const auto dir = temp_dir("resume");
  auto cfg = sim_config(dir, {make_silo(dir / "a", 1), make_silo(dir / "b", 3)}, "fedadam", 2, 2);
  run_simulation(cfg, false);
  EXPECT_THROW(run_simulation(cfg, false), Error);  // would overwrite the run
  cfg.server.rounds = 4;
  const auto r = run_simulation(cfg, true);
  EXPECT_EQ(r.rounds, 4);
  const auto metrics = read_jsonl(cfg.server.dir / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(metrics[static_cast<size_t>(i)]["round"], i + 1);
  const auto state = nlohmann::json::parse(
      read_file(io::list_checkpoints(cfg.server.dir / "checkpoints").back() / "state.json"));
  EXPECT_EQ(state["lineage"].size(), 4u);

  // The clients kept their states too: the resumed run is the uninterrupted one, bit for bit.
  EXPECT_TRUE(bitwise_equal(uninterrupted_global(cfg, dir / "whole"), r.global));
}

// A server that stopped after its clients had trained a round but before its checkpoint of it
// (here: the newest checkpoint removed) resumes at that round; each client goes back to its
// state before the round and trains it again on the same data, so no step counts twice.
TEST(Simulation, ClientsTrainARoundWhoseUpdateWasLostAgainFromTheirStateBeforeIt) {
  Quiet q;
  const auto dir = temp_dir("lost_round");
  auto cfg = sim_config(dir, {make_silo(dir / "a", 1), make_silo(dir / "b", 3)}, "fedavg", 3, 2);
  run_simulation(cfg, false);
  fs::remove_all(io::list_checkpoints(cfg.server.dir / "checkpoints").back());
  cfg.server.rounds = 4;
  const auto resumed = run_simulation(cfg, true);
  EXPECT_EQ(resumed.rounds, 4);
  EXPECT_TRUE(bitwise_equal(uninterrupted_global(cfg, dir / "whole"), resumed.global));
}

// A round retried (too few updates by its deadline) after a client had pushed: with a state
// folder that client goes back to its state before the round (for round 1, the state it
// started from) and trains it again on the same data, so the federation of two rounds is the
// one where the first attempt never happened.
void expect_a_retried_round_trained_again(const std::string& name, int64_t retried) {
  Quiet q;
  const auto dir = temp_dir(name);
  auto cfg = sim_config(dir, {make_silo(dir / "a", 1), make_silo(dir / "b", 3)}, "fedavg", 2, 2);
  cfg.server.strategy.min_clients = 2;
  for (auto& cc : cfg.clients) cc.state_dir = dir / "states" / cc.id;
  set_num_threads(1);
  TwoClients f(cfg);
  Coordinator& server = f.server;
  Client &first = f.first, &second = f.second;
  for (int64_t round = 1; round <= 2; ++round) {
    ASSERT_TRUE(server.begin_round());
    if (round == retried) {
      EXPECT_EQ(first.poll_once(), pb::TASK_TRAIN);  // trains and pushes; the other does not
      EXPECT_FALSE(server.end_round().aggregated);   // one update of two: retried
      ASSERT_TRUE(server.begin_round());
    }
    first.poll_once();
    second.poll_once();
    ASSERT_TRUE(server.end_round().aggregated);
  }
  EXPECT_EQ(first.trainer().steps_taken(), 4) << "the lost attempt's steps were counted";
  EXPECT_TRUE(bitwise_equal(uninterrupted_global(cfg, dir / "whole"), server.global_weights()));
}

TEST(Simulation, AClientRetrainsARetriedRoundFromItsStateBeforeIt) {
  expect_a_retried_round_trained_again("retried_round", 2);
}

TEST(Simulation, AClientRetrainsARetriedFirstRoundFromItsStartingState) {
  expect_a_retried_round_trained_again("retried_first_round", 1);
}

// A server that gives up (here: fewer than min_clients in time) tells its clients why, and they
// fail with that reason instead of ending as after a finished run.
TEST(Simulation, ClientsOfARunTheServerGaveUpFailNamingWhy) {
  Quiet q;
  const auto dir = temp_dir("gave_up");
  auto cfg = sim_config(dir, {make_silo(dir / "a", 1)}, "fedavg", 3, 2);
  cfg.server.strategy.min_clients = 2;
  cfg.server.wait_for_clients_s = 0.1;
  Coordinator server(cfg.server, false);
  LocalTransport transport(server);
  Client client(cfg.clients[0], transport);
  client.join();
  server.run();
  EXPECT_EQ(server.rounds_done(), 0);
  try {
    client.run();
    ADD_FAILURE() << "the client ended as after a finished run";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("strategy.min_clients"), std::string::npos) << e.what();
  }
}

namespace {

// sim.toml for `pollen fed simulate` of two tiny silos under dir (server under dir/server).
fs::path write_two_silo_sim(const fs::path& dir, int rounds, const std::string& strategy,
                            const std::string& sim) {
  const fs::path a = make_silo(dir / "a", 1), b = make_silo(dir / "b", 3);
  write_file_atomic(
      dir / "sim.toml",
      cat("[server]\ndir = '", (dir / "server").string(), "'\nrounds = ", rounds,
          "\nlocal_steps = 2\n[strategy]\n", strategy,
          "[model]\nvocab_size = 64\nhidden_size = 32\nintermediate_size = 64\n"
          "num_hidden_layers = 2\nnum_attention_heads = 2\nnum_key_value_heads = 2\n"
          "max_position_embeddings = 64\n[tokenizer]\nfingerprint = 'test-tokenizer'\n"
          "[train]\nmicro_batch = 4\nseq = 16\n[sim]\nthreads = 1\nclients = ['a', 'b']\n",
          sim, "manifests = ['", a.string(), "', '", b.string(), "']\n"));
  return dir / "sim.toml";
}

}  // namespace

// `pollen fed simulate` whose run stops before its last round fails, naming why.
TEST(Simulation, ACommandWhoseRunStoppedEarlyFailsNamingWhy) {
  const auto dir = temp_dir("sim_cli_stop");
  write_two_silo_sim(dir, 2, "min_clients = 3\n", "");
  int status = 0;
  const std::string out = run_capture(
      cat(POLLEN_BINARY, " fed simulate --config ", (dir / "sim.toml").string()), &status);
  EXPECT_NE(status, 0) << out;
  EXPECT_NE(out.find("stopped after 0 of 2 rounds: 2 clients, fewer than strategy.min_clients 3"),
            std::string::npos)
      << out;
}

// SIGINT stops `pollen fed simulate` after the round in progress, checkpointed, and the command
// fails saying how to go on; --resume then runs the rest, every round once.
TEST(Simulation, SigintStopsAfterTheRoundInProgressAndResumeGoesOn) {
  const auto dir = temp_dir("sim_sigint");
  const std::string config = write_two_silo_sim(dir, 100000, "", "").string();
  const pid_t pid = spawn_pollen({"fed", "simulate", "--config", config}, dir / "run-1.log");
  auto checkpointed = [&] {
    const auto c = io::list_checkpoints(dir / "server/checkpoints");
    return c.empty() ? int64_t{0} : io::checkpoint_step(c.back());
  };
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (checkpointed() < 1 && std::chrono::steady_clock::now() < give_up)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ::kill(pid, SIGINT);
  int status = 0;
  waitpid(pid, &status, 0);
  const std::string log = read_file(dir / "run-1.log");
  ASSERT_TRUE(WIFEXITED(status)) << log;  // it stopped itself, not the signal
  EXPECT_EQ(WEXITSTATUS(status), 1) << log;
  const int64_t done = checkpointed();
  ASSERT_GE(done, 1) << log;
  EXPECT_NE(log.find(cat("stopped after ", done,
                         " of 100000 rounds: signal 2; --resume continues "
                         "from round ",
                         done + 1)),
            std::string::npos)
      << log;
  write_two_silo_sim(dir, static_cast<int>(done) + 1, "", "");
  const std::string out =
      run_capture(cat(POLLEN_BINARY, " fed simulate --config ", config, " --resume"), &status);
  ASSERT_EQ(status, 0) << out;
  std::vector<int> rounds;
  for (const auto& m : read_jsonl(dir / "server/metrics.jsonl"))
    if (m["status"] == "aggregated") rounds.push_back(m["round"].get<int>());
  std::vector<int> expected(static_cast<size_t>(done) + 1);
  std::iota(expected.begin(), expected.end(), 1);
  EXPECT_EQ(rounds, expected);
  fs::remove_all(dir);
}

// A silo whose validation split holds fewer windows than a micro-batch evaluates on all of them,
// as pollen train does, instead of stopping the federation.
TEST(Simulation, AValidationSplitSmallerThanAMicroBatchIsScoredWhole) {
  Quiet q;
  const auto dir = temp_dir("sim_small_validation");
  auto cfg =
      sim_config(dir, {make_silo(dir / "a", 1), make_silo(dir / "b", 3, 300, 1)}, "fedavg", 1, 2);
  run_simulation(cfg, false);
  const auto metrics = read_jsonl(cfg.server.dir / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 1u);
  EXPECT_TRUE(metrics[0]["clients"]["silo-1"].contains("eval_loss")) << metrics[0];
  fs::remove_all(dir);
}

// sim.client_states = false: no client states on disk; a resumed run says its clients start
// afresh.
TEST(Simulation, ClientStatesCanBeTurnedOffAndAResumeSaysWhatThatCosts) {
  const auto dir = temp_dir("sim_no_states");
  const std::string sim =
      cat(POLLEN_BINARY, " fed simulate --config ", (dir / "sim.toml").string());
  write_two_silo_sim(dir, 1, "", "client_states = false\n");
  int status = 0;
  std::string out = run_capture(sim, &status);
  ASSERT_EQ(status, 0) << out;
  EXPECT_FALSE(fs::exists(dir / "server" / "clients")) << out;
  write_two_silo_sim(dir, 2, "", "client_states = false\n");
  out = run_capture(sim + " --resume", &status);
  ASSERT_EQ(status, 0) << out;
  EXPECT_NE(out.find("client 'a' resumes at round 2 with a fresh optimizer"), std::string::npos)
      << out;
  EXPECT_FALSE(fs::exists(dir / "server" / "clients")) << out;

  write_two_silo_sim(dir / "kept", 1, "", "");
  const std::string kept =
      cat(POLLEN_BINARY, " fed simulate --config ", (dir / "kept" / "sim.toml").string());
  out = run_capture(kept, &status);
  ASSERT_EQ(status, 0) << out;
  EXPECT_TRUE(fs::is_directory(dir / "kept" / "server" / "clients" / "a")) << out;
  // A run stopped before its first checkpoint (here: its checkpoints removed) starts again, fresh
  // or resumed: its clients' states, and the run id they hold, are of the run that stopped.
  for (const std::string again : {kept, kept + " --resume"}) {
    fs::remove_all(dir / "kept" / "server" / "checkpoints");
    out = run_capture(again, &status);
    EXPECT_EQ(status, 0) << again << "\n" << out;
  }
}

// ---- over gRPC
// --------------------------------------------------------------------------------------

// A server that cannot be reached is not a refusal: the error names the address and what to
// check.
TEST(Grpc, AServerThatCannotBeReachedIsNamedWithWhatToCheck) {
  Quiet q;
  const std::string address = loopback_address();  // nothing listens there
  GrpcTransport transport(address, TlsFiles{}, 0.3, 60);
  try {
    transport.join(tiny_join("silo-0"));
    ADD_FAILURE() << "a join without a server succeeded";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("could not reach the federation server at " + address), std::string::npos)
        << what;
    EXPECT_NE(what.find("without TLS"), std::string::npos) << what;
  }
}

namespace {

// A federation service that answers a task only after `delay`, as a server does whose lock is
// held while it saves a large model.
class SlowService final : public pb::Federation::Service {
 public:
  explicit SlowService(std::chrono::milliseconds delay) : delay_(delay) {}
  grpc::Status GetTask(grpc::ServerContext*, const pb::TaskRequest*,
                       pb::TaskReply* reply) override {
    std::this_thread::sleep_for(delay_);
    reply->set_kind(pb::TASK_DONE);
    return grpc::Status::OK;
  }

 private:
  std::chrono::milliseconds delay_;
};

}  // namespace

namespace {

// A federation service whose streams stand still once opened (a server hung with its connection
// open): a pull sends nothing, a push takes the update and never answers. Each waits until the
// client cancels.
class StallingService final : public pb::Federation::Service {
 public:
  grpc::Status PullModel(grpc::ServerContext* ctx, const pb::PullRequest*,
                         grpc::ServerWriter<pb::TensorStream>*) override {
    return wait_for_cancel(ctx);
  }
  grpc::Status PushUpdate(grpc::ServerContext* ctx, grpc::ServerReader<pb::TensorStream>* reader,
                          pb::PushReply*) override {
    pb::TensorStream m;
    while (reader->Read(&m)) {
    }
    return wait_for_cancel(ctx);
  }

 private:
  static grpc::Status wait_for_cancel(grpc::ServerContext* ctx) {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!ctx->IsCancelled() && std::chrono::steady_clock::now() < give_up)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return grpc::Status::CANCELLED;
  }
};

}  // namespace

// A pull or push that moves nothing for client.busy_timeout_s ends with an error naming the
// stall, instead of blocking the client for good.
TEST(Grpc, AStreamThatStandsStillIsCancelledAfterTheBusyTimeout) {
  Quiet q;
  StallingService stalling;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&stalling);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_GT(port, 0);
  GrpcTransport transport("127.0.0.1:" + std::to_string(port), TlsFiles{}, 5, 0.5);
  const auto expect_stall = [](const std::function<void()>& call, const char* what) {
    const auto start = std::chrono::steady_clock::now();
    try {
      call();
      ADD_FAILURE() << what << " on a stalled server returned";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(
                    cat("moved nothing for 0.5 s during ", what, " (client.busy_timeout_s)")),
                std::string::npos)
          << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20)) << what;
  };
  pb::PullRequest pull;
  pull.set_client_id("silo-0");
  pull.set_round(1);
  expect_stall([&] { transport.pull(pull, [](const pb::TensorStream&) {}); }, "pull");
  int sent = 0;
  expect_stall(
      [&] {
        transport.push([&](pb::TensorStream& m) {
          m.mutable_update()->set_client_id("silo-0");
          return sent++ < 3;
        });
      },
      "push");
  server->Shutdown();
}

// A server that is connected but answers after the client's timeout is busy (ServerBusy, which a
// client waits out), not gone (an Error that ends a client that cannot join again).
TEST(Grpc, AConnectedServerThatAnswersLateIsBusyNotGone) {
  Quiet q;
  SlowService slow(std::chrono::milliseconds(1500));
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&slow);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_GT(port, 0);
  GrpcTransport transport("127.0.0.1:" + std::to_string(port), TlsFiles{}, 0.5, 60);
  pb::TaskRequest r;
  r.set_client_id("silo-0");
  EXPECT_THROW(transport.task(r), ServerBusy);
  server->Shutdown();
  try {
    transport.task(r);
    ADD_FAILURE() << "a task without a server succeeded";
  } catch (const ServerBusy& e) {
    ADD_FAILURE() << "a server that is gone was taken as busy: " << e.what();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("could not reach the federation server"),
              std::string::npos)
        << e.what();
  }
}

namespace {

// A server with mutual TLS on a free port: the CA, server certificate and CRL of dir/certs.
struct TlsServer {
  static ServerConfig config_in(const fs::path& dir) {
    ServerConfig sc = sim_config(dir, {}, "fedavg", 1, 1).server;
    sc.tls = {(dir / "certs/ca.pem").string(), (dir / "certs/server.pem").string(),
              (dir / "certs/server.key").string(), (dir / "certs/crl.pem").string(), ""};
    return sc;
  }
  explicit TlsServer(const fs::path& dir)
      : config(config_in(dir)),
        coordinator(config, false),
        grpc(coordinator, "127.0.0.1:0", config.tls),
        address("127.0.0.1:" + std::to_string(grpc.port())) {}

  ServerConfig config;
  Coordinator coordinator;
  GrpcServer grpc;
  std::string address;
};

}  // namespace

// A selected client whose certificate is revoked mid-round can send nothing more: the round stops
// waiting for it (instead of running to its deadline), and the next round does not select it.
TEST(Coordinator, ARoundNoLongerWaitsForAClientRevokedInIt) {
  Quiet q;
  const auto dir = temp_dir("revoked_mid_round");
  auto cfg = sim_config(dir, {make_silo(dir / "a", 1), make_silo(dir / "b", 3)}, "fedavg", 1, 2);
  cfg.server.strategy.min_clients = 1;
  Coordinator server(cfg.server, false);
  LocalTransport transport(server);
  Client a(cfg.clients[0], transport), b(cfg.clients[1], transport);
  a.join();
  b.join();
  ASSERT_TRUE(server.begin_round());
  EXPECT_EQ(a.poll_once(), pb::TASK_TRAIN);
  EXPECT_FALSE(server.round_complete()) << "silo-1 has not sent its update";
  server.client_revoked("silo-1");
  EXPECT_TRUE(server.round_complete());
  const RoundSummary s = server.end_round();
  EXPECT_TRUE(s.aggregated);
  EXPECT_EQ(s.participants, std::vector<std::string>{"silo-0"});
  EXPECT_EQ(server.status().clients_joined, 1u) << "a later round could select silo-1";
  fs::remove_all(dir);
}

TEST(Grpc, ARevocationReachesARunningServerAtTheClientsNextCall) {
  Quiet q;
  const auto dir = temp_dir("tls_reload");
  make_dev_certs(dir / "certs", {"alice", "bob", "carol"}, {"localhost", "127.0.0.1"}, 1);
  revoke_client_cert(dir / "certs", "carol");
  TlsServer server(dir);
  const std::string& address = server.address;
  auto joins = [&](const std::string& id) {
    TlsFiles t{(dir / "certs/ca.pem").string(), (dir / cat("certs/client-", id, ".pem")).string(),
               (dir / cat("certs/client-", id, ".key")).string(), "", ""};
    GrpcTransport tr(address, t, 3, 60);
    try {
      return tr.join(tiny_join(id)).accepted();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("revoked"), std::string::npos) << e.what();
      return false;
    }
  };
  EXPECT_TRUE(joins("alice"));
  EXPECT_TRUE(joins("bob"));
  EXPECT_FALSE(joins("carol"));
  // Revoked while the server runs: refused from the next call on, the others not.
  revoke_client_cert(dir / "certs", "bob");
  EXPECT_FALSE(joins("bob"));
  EXPECT_TRUE(joins("alice"));
  // A damaged list does not lift a revocation: the last good one stays.
  write_file_atomic(dir / "certs/crl.pem", "-----BEGIN X509 CRL-----\nnot a list\n");
  EXPECT_FALSE(joins("bob"));
  EXPECT_FALSE(joins("carol"));
  EXPECT_TRUE(joins("alice"));
  server.grpc.shutdown();
  fs::remove_all(dir);
}

TEST(Grpc, MutualTlsAcceptsValidAndRefusesWrongOrRevokedCertificates) {
  Quiet q;
  const auto dir = temp_dir("tls");
  make_dev_certs(dir / "certs", {"alice", "bob"}, {"localhost", "127.0.0.1"}, 1);
  make_dev_certs(dir / "other", {"alice"}, {"localhost"}, 1);  // another CA
  revoke_client_cert(dir / "certs", "bob");
  TlsServer server(dir);
  const std::string& address = server.address;
  auto join = [&](const fs::path& certs, const std::string& cert_id, const std::string& claim) {
    TlsFiles t{(dir / "certs/ca.pem").string(), (certs / ("client-" + cert_id + ".pem")).string(),
               (certs / ("client-" + cert_id + ".key")).string(), "", ""};
    GrpcTransport tr(address, t, 3, 60);
    return tr.join(tiny_join(claim));
  };
  EXPECT_TRUE(join(dir / "certs", "alice", "alice").accepted());
  // claiming another id than the certificate's name
  const auto spoof = join(dir / "certs", "alice", "carol");
  EXPECT_FALSE(spoof.accepted());
  EXPECT_NE(spoof.reason().find("common name"), std::string::npos) << spoof.reason();
  // a revoked certificate
  try {
    join(dir / "certs", "bob", "bob");
    ADD_FAILURE() << "revoked certificate accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("revoked"), std::string::npos) << e.what();
  }
  // a certificate from another CA: the handshake fails (this side only warns: the server could
  // trust another CA for it), and the client says why, which gRPC reports as an unreachable
  // server; so do a server certificate this client's CA did not sign, or one of another name
  const auto failed = [&](const TlsFiles& t) {
    return pollen::testing::error_of([&] {
      GrpcTransport tr(address, t, 1, 60);
      tr.join(tiny_join("alice"));
    });
  };
  const std::string ours = (dir / "certs").string(), theirs = (dir / "other").string();
  const std::string untrusted = failed(
      {ours + "/ca.pem", theirs + "/client-alice.pem", theirs + "/client-alice.key", "", ""});
  EXPECT_NE(untrusted.find("refused this client's certificate tls.cert '" + theirs +
                           "/client-alice.pem'"),
            std::string::npos)
      << untrusted;
  const std::string other_ca = failed(
      {theirs + "/ca.pem", theirs + "/client-alice.pem", theirs + "/client-alice.key", "", ""});
  EXPECT_NE(other_ca.find("the server's certificate at " + address +
                          " does not verify against tls.ca '" + theirs + "/ca.pem'"),
            std::string::npos)
      << other_ca;
  const std::string misnamed = failed({ours + "/ca.pem", ours + "/client-alice.pem",
                                       ours + "/client-alice.key", "", "fed.example.org"});
  EXPECT_NE(misnamed.find("does not name 'fed.example.org' (tls.server_name)"), std::string::npos)
      << misnamed;
  // a key that is not the certificate's, a CA file that is no certificate
  const auto refused = [&](const TlsFiles& t) {
    return pollen::testing::error_of([&] { GrpcTransport tr(address, t, 3, 60); });
  };
  const std::string certs = (dir / "certs").string();
  const std::string key =
      refused({certs + "/ca.pem", certs + "/client-alice.pem", certs + "/client-bob.key", "", ""});
  EXPECT_NE(key.find("tls.key '" + certs + "/client-bob.key' is not the key of tls.cert"),
            std::string::npos)
      << key;
  // A key with a passphrase is refused, not asked for at the terminal.
  ASSERT_EQ(std::system(cat("openssl pkey -in ", certs, "/client-alice.key -aes256 -passout ",
                            "pass:secret -out ", certs, "/alice-encrypted.key 2>/dev/null")
                            .c_str()),
            0);
  const std::string encrypted = refused(
      {certs + "/ca.pem", certs + "/client-alice.pem", certs + "/alice-encrypted.key", "", ""});
  EXPECT_NE(encrypted.find("expected a PEM private key without a passphrase"), std::string::npos)
      << encrypted;
  const std::string ca = refused(
      {certs + "/ca.key", certs + "/client-alice.pem", certs + "/client-alice.key", "", ""});
  EXPECT_NE(ca.find("tls.ca '" + certs + "/ca.key': expected a PEM certificate"), std::string::npos)
      << ca;
  // The server checks its own files too (gRPC would only say that it cannot listen).
  const auto server_refused = [&](const std::string& cert, const std::string& key,
                                  const std::string& name) {
    ServerConfig config = TlsServer::config_in(dir);
    config.tls.cert = cert;
    config.tls.key = key;
    config.dir = dir / name;
    return pollen::testing::error_of([&] {
      Coordinator c(config, false);
      GrpcServer g(c, "127.0.0.1:0", config.tls);
    });
  };
  const std::string server_key =
      server_refused(certs + "/server.pem", certs + "/client-alice.key", "mismatched");
  EXPECT_NE(server_key.find("fed server: tls.key '" + certs +
                            "/client-alice.key' is not the key of tls.cert"),
            std::string::npos)
      << server_key;
  // A certificate meant for the other side is refused before any handshake, either way round.
  const std::string server_as_client =
      refused({certs + "/ca.pem", certs + "/server.pem", certs + "/server.key", "", ""});
  EXPECT_NE(server_as_client.find("tls.cert '" + certs +
                                  "/server.pem': its extended key usage does not allow a TLS "
                                  "client"),
            std::string::npos)
      << server_as_client;
  const std::string serving_client =
      server_refused(certs + "/client-alice.pem", certs + "/client-alice.key", "client_as_server");
  EXPECT_NE(serving_client.find("fed server: tls.cert '" + certs +
                                "/client-alice.pem': its extended key usage does not allow a TLS "
                                "server"),
            std::string::npos)
      << serving_client;
  // An expired CA fails every handshake of the side trusting it: refused, with its date.
  if (fs::exists(POLLEN_PEERS_PYTHON)) {
    write_file_atomic(dir / "old_ca.py", R"PY(
import datetime, sys
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
key = ec.generate_private_key(ec.SECP256R1())
name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "old CA")])
cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(1)
        .not_valid_before(datetime.datetime(2024, 1, 1))
        .not_valid_after(datetime.datetime(2024, 12, 31))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256()))
open(sys.argv[1], "wb").write(cert.public_bytes(serialization.Encoding.PEM))
)PY");
    ASSERT_EQ(std::system(cat(POLLEN_PEERS_PYTHON, " ", (dir / "old_ca.py").string(), " ",
                              (dir / "old_ca.pem").string())
                              .c_str()),
              0);
    const std::string expired = refused({(dir / "old_ca.pem").string(), certs + "/client-alice.pem",
                                         certs + "/client-alice.key", "", ""});
    EXPECT_NE(expired.find("tls.ca '" + (dir / "old_ca.pem").string() +
                           "': the CA certificate expired on Dec 31"),
              std::string::npos)
        << expired;
    // A bundle holding a retired root beside the federation's CA is taken as it is.
    write_file_atomic(dir / "bundle.pem",
                      read_file(dir / "old_ca.pem") + read_file(dir / "certs" / "ca.pem"));
    EXPECT_EQ(refused({(dir / "bundle.pem").string(), certs + "/client-alice.pem",
                       certs + "/client-alice.key", "", ""}),
              "");
  }
  // A certificate of the federation's CA without a common name: it must not pass as "no TLS",
  // where any claimed id would do (openssl's command line signs one with the CA's key).
  const fs::path nameless = dir / "certs";
  const std::string make_nameless = cat(
      "cd ", nameless.string(), " && openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256",
      " -nodes -keyout client-nameless.key -subj /O=pollen -out nameless.csr 2>/dev/null && ",
      "openssl x509 -req -in nameless.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1",
      " -extfile <(printf 'extendedKeyUsage=clientAuth') -out client-nameless.pem 2>/dev/null");
  ASSERT_EQ(std::system(cat("bash -c \"", make_nameless, "\"").c_str()), 0);
  try {
    EXPECT_FALSE(join(nameless, "nameless", "alice").accepted());
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no common name"), std::string::npos) << e.what();
  }
  // Ids longer than a common name holds get no certificate (it would have been issued nameless).
  EXPECT_THROW(make_dev_certs(dir / "long", {std::string(65, 'a')}, {"localhost"}, 1), Error);
  // Adding a client later keeps the server certificate (its names) unless names are given.
  const std::string server_pem = read_file(dir / "certs" / "server.pem");
  make_dev_certs(dir / "certs", {"carol"}, {"localhost"}, 1, /*replace_server=*/false);
  EXPECT_EQ(read_file(dir / "certs" / "server.pem"), server_pem);
  EXPECT_TRUE(fs::exists(dir / "certs" / "client-carol.pem"));
  // A client's certificate made again is refused (the old one would stay valid, out of --revoke's
  // reach) unless replaced, which revokes the old one.
  fs::create_directories(dir / "old");
  for (const char* ext : {".pem", ".key"})
    fs::copy_file(dir / "certs" / cat("client-carol", ext), dir / "old" / cat("client-carol", ext));
  const std::string again = pollen::testing::error_of(
      [&] { make_dev_certs(dir / "certs", {"carol"}, {"localhost"}, 1, false); });
  EXPECT_NE(again.find("'carol' has a certificate already"), std::string::npos) << again;
  EXPECT_EQ(read_file(dir / "certs" / "client-carol.pem"), read_file(dir / "old/client-carol.pem"));
  EXPECT_TRUE(join(dir / "old", "carol", "carol").accepted());
  make_dev_certs(dir / "certs", {"carol"}, {"localhost"}, 1, false, /*replace_clients=*/true);
  EXPECT_TRUE(join(dir / "certs", "carol", "carol").accepted());
  const std::string old = pollen::testing::error_of([&] { join(dir / "old", "carol", "carol"); });
  EXPECT_NE(old.find("revoked"), std::string::npos) << old;
  // An id given twice is refused, and a certificate revoked already is not listed again.
  EXPECT_NE(pollen::testing::error_of([&] {
              make_dev_certs(dir / "twice", {"dave", "dave"}, {"localhost"}, 1);
            }).find("'dave' is given twice"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(dir / "twice" / "client-dave.pem"));
  const std::string crl = read_file(dir / "certs" / "crl.pem");
  revoke_client_cert(dir / "certs", "bob");  // revoked above
  EXPECT_EQ(read_file(dir / "certs" / "crl.pem"), crl);
  make_dev_certs(dir / "certs", {}, {"fed.example.org"}, 1, /*replace_server=*/true);
  EXPECT_NE(read_file(dir / "certs" / "server.pem"), server_pem);
  // Half a CA (its key kept elsewhere), or certificates without their CA, are refused naming
  // the missing file: a new CA would invalidate every certificate issued, and overwrite the half.
  const std::string ca_pem = read_file(dir / "certs" / "ca.pem");
  fs::rename(dir / "certs" / "ca.key", dir / "ca.key");
  const std::string half = pollen::testing::error_of(
      [&] { make_dev_certs(dir / "certs", {"erin"}, {"localhost"}, 1, false); });
  EXPECT_NE(half.find((dir / "certs" / "ca.key").string() + " is not"), std::string::npos) << half;
  EXPECT_EQ(read_file(dir / "certs" / "ca.pem"), ca_pem);
  EXPECT_FALSE(fs::exists(dir / "certs" / "client-erin.pem"));
  fs::rename(dir / "certs" / "ca.pem", dir / "ca.pem");
  const std::string none = pollen::testing::error_of(
      [&] { make_dev_certs(dir / "certs", {"erin"}, {"localhost"}, 1, false); });
  EXPECT_NE(none.find("but no CA (ca.pem, ca.key)"), std::string::npos) << none;
  fs::copy_file(dir / "other" / "ca.key", dir / "certs" / "ca.key");  // another CA's key
  fs::copy_file(dir / "ca.pem", dir / "certs" / "ca.pem");
  const std::string wrong_key = pollen::testing::error_of(
      [&] { make_dev_certs(dir / "certs", {"erin"}, {"localhost"}, 1, false); });
  EXPECT_NE(wrong_key.find("is not the key of"), std::string::npos) << wrong_key;
  server.grpc.shutdown();
}

TEST(Grpc, ASecondServerOnTheSamePortIsRefused) {
  // Two servers sharing a port would each take some of the clients (SO_REUSEPORT): the second
  // must fail to start, saying where, while the first keeps serving.
  Quiet q;
  const auto dir = temp_dir("same_port");
  Coordinator first(sim_config(dir / "first", {}, "fedavg", 1, 1).server, false),
      second(sim_config(dir / "second", {}, "fedavg", 1, 1).server, false);
  GrpcServer server(first, "127.0.0.1:0", {});
  const std::string address = "127.0.0.1:" + std::to_string(server.port());
  try {
    GrpcServer again(second, address, {});
    ADD_FAILURE() << "a second server listened on " << address;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot listen on '" + address + "'"), std::string::npos)
        << e.what();
  }
  GrpcTransport tr(address, {}, 3, 60);
  EXPECT_TRUE(tr.join(tiny_join("alice")).accepted());
  server.shutdown();
}

// A push stream that sends nothing would hold one of the server's threads for good: the server
// closes a stream that moves nothing for server.client_timeout_s.
TEST(Grpc, TheServerClosesAStreamThatSendsNothing) {
  Quiet q;
  const auto dir = temp_dir("idle_stream");
  auto cfg = sim_config(dir, {}, "fedavg", 1, 1).server;
  cfg.client_timeout_s = 0.5;
  Coordinator coordinator(cfg, false);
  GrpcServer server(coordinator, "127.0.0.1:0", {});
  auto stub = pb::Federation::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(server.port()), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  pb::PushReply reply;
  const auto start = std::chrono::steady_clock::now();
  auto writer = stub->PushUpdate(&ctx, &reply);
  const grpc::Status s = writer->Finish();  // without WritesDone: the stream stays open, idle
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << "the server kept the stream";
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  server.shutdown();
  fs::remove_all(dir);
}

// One certificate may hold only a few calls open at once: more are refused before anything is
// read (RESOURCE_EXHAUSTED, which a client's join waits out as a busy server), so that a client
// cannot hold the server's threads and memory by the hundred; another client is not held back,
// and a call that ends makes room.
TEST(Grpc, AClientMayHoldOnlyAFewCallsOpen) {
  Quiet q;
  const auto dir = temp_dir("open_calls");
  make_dev_certs(dir / "certs", {"alice", "bob", "carol"}, {"localhost", "127.0.0.1"}, 1);
  revoke_client_cert(dir / "certs", "carol");  // the server's tls.crl
  TlsServer server(dir);
  const auto files = [&](const std::string& id) {
    return TlsFiles{(dir / "certs/ca.pem").string(),
                    (dir / "certs" / ("client-" + id + ".pem")).string(),
                    (dir / "certs" / ("client-" + id + ".key")).string(), "", ""};
  };
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = read_file(dir / "certs/ca.pem");
  o.pem_cert_chain = read_file(dir / "certs/client-alice.pem");
  o.pem_private_key = read_file(dir / "certs/client-alice.key");
  auto stub = pb::Federation::NewStub(grpc::CreateChannel(server.address, grpc::SslCredentials(o)));
  // Four pushes that send nothing, open until the server's client_timeout_s.
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientWriter<pb::TensorStream>>> idle;
  pb::PushReply reply;
  for (int i = 0; i < 4; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    idle.push_back(stub->PushUpdate(contexts.back().get(), &reply));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the server has them
  GrpcTransport alice(server.address, files("alice"), 3, 60);
  try {
    alice.join(tiny_join("alice"));
    ADD_FAILURE() << "a fifth call was taken";
  } catch (const ServerBusy& e) {
    EXPECT_NE(std::string(e.what()).find("client 'alice' has 4 calls open at once"),
              std::string::npos)
        << e.what();
  }
  GrpcTransport bob(server.address, files("bob"), 3, 60);
  EXPECT_TRUE(bob.join(tiny_join("bob")).accepted());
  contexts[0]->TryCancel();
  idle[0]->Finish();
  bool joined = false;
  for (int attempt = 0; attempt < 50 && !joined; ++attempt) {
    try {
      joined = alice.join(tiny_join("alice")).accepted();
    } catch (const ServerBusy&) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  EXPECT_TRUE(joined) << "a call that ended did not make room";
  for (size_t i = 1; i < idle.size(); ++i) {
    contexts[i]->TryCancel();
    idle[i]->Finish();
  }
  server.grpc.shutdown();
  fs::remove_all(dir);
}

TEST(Grpc, SimulatedEqualsDeployedBitwise) {
  const auto dir = temp_dir("deployed");
  const auto a = make_silo(dir / "a", 1), b = make_silo(dir / "b", 3);
  {
    Quiet q;
    auto cfg = sim_config(dir / "sim", {a, b}, "diloco", 2, 3);
    cfg.server.compression.codec = Codec::int4;
    run_simulation(cfg, false);
  }
  // The same run as three processes on loopback: pollen fed server and two pollen fed clients.
  const std::string model =
      "[model]\nvocab_size = 64\nhidden_size = 32\nintermediate_size = 64\n"
      "num_hidden_layers = 2\nnum_attention_heads = 2\nnum_key_value_heads = 2\n"
      "max_position_embeddings = 64\n[tokenizer]\nfingerprint = 'test-tokenizer'\n";
  const std::string address = loopback_address();
  write_file_atomic(dir / "fed.toml",
                    cat("[server]\ndir = '", (dir / "dep").string(), "'\naddress = '", address,
                        "'\nseed = 5\nrounds = 2\nlocal_steps = 3\nround_timeout_s = 120\n"
                        "wait_for_clients_s = 60\n[strategy]\nname = 'diloco'\nmin_clients = 2\n"
                        "[compression]\ncodec = 'int4'\n",
                        model));
  const std::string train =
      "[train]\nmicro_batch = 4\nseq = 16\nlr = 3e-3\nweight_decay = 0\neval_batches = 2\n";
  for (int i = 0; i < 2; ++i) {
    write_file_atomic(dir / cat("client", i, ".toml"),
                      cat("[client]\nid = 'silo-", i, "'\nserver = '", address,
                          "'\nseed = ", 100 + i, "\nthreads = 1\n[data]\nmanifests = ['",
                          (i == 0 ? a : b).string(), "']\n", train, model));
  }
  expect_deployment_equals_simulation(dir, 2, 2);
}
