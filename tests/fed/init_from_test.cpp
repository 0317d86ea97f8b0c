// model.init_from of `pollen fed server` and `pollen fed simulate`: round 1's global model is
// exactly a `pollen train` checkpoint's weights, the lineage cites them, and a checkpoint of
// another architecture is refused naming what differs. A client that starts from the same
// weights gets round 1's compressed model as a delta.
#include <gtest/gtest.h>

#include <fstream>

#include "base/files.h"
#include "base/hash.h"
#include "base/thread_pool.h"
#include "fed/client.h"
#include "fed/coordinator.h"
#include "fed/fixtures.h"
#include "fed/run.h"
#include "io/checkpoint.h"
#include "model/llama.h"
#include "train/config.h"
#include "train/trainer.h"

namespace fs = std::filesystem;
using namespace pollen;
using namespace pollen::fed;
using namespace pollen::fed::testing;

namespace {

// A `pollen train` run of fixtures.h's tiny model on `manifest`; its step-4 checkpoint.
fs::path pretrained(const fs::path& run, const fs::path& manifest) {
  const std::string toml = "[run]\ndir = \"" + run.string() +
                           "\"\nseed = 3\nthreads = 1\n"
                           "[model]\nvocab_size = 64\nhidden_size = 32\nintermediate_size = 64\n"
                           "num_hidden_layers = 2\nnum_attention_heads = 2\n"
                           "num_key_value_heads = 2\nmax_position_embeddings = 64\n"
                           "[data]\nmanifests = [\"" +
                           manifest.string() +
                           "\"]\n"
                           "[train]\nsteps = 4\nmicro_batch = 4\nseq = 16\nbatch_tokens = 64\n"
                           "[optimizer]\nlr = 3e-3\n[checkpoint]\ninterval = 4\n";
  train::TrainOptions o;
  o.quiet = true;
  o.handle_signals = false;
  const auto r = train::run_training(train::parse_train_config(toml, "pretrain.toml"), o);
  EXPECT_EQ(r.status, train::RunStatus::finished) << r.message;
  return run / "checkpoints" / io::checkpoint_name(4);
}

// A checkpoint's weights in the model's parameter order (the server's).
Weights in_model_order(const Coordinator& c, const fs::path& ckpt) {
  const auto file = io::read_safetensors(ckpt / "model.safetensors");
  Weights out;
  for (const auto& spec : c.specs()) {
    const Tensor* t = file.find(spec.name);
    EXPECT_NE(t, nullptr) << spec.name;
    out.push_back(t ? *t : Tensor());
  }
  return out;
}

}  // namespace

TEST(InitFrom, ServerStartsFromTheCheckpointAndTheLineageCitesIt) {
  Quiet q;
  const auto dir = temp_dir("init_from");
  const auto silo_a = make_silo(dir / "a", 1), silo_b = make_silo(dir / "b", 3);
  const fs::path ckpt = pretrained(dir / "pretrain", silo_a);

  auto cfg = sim_config(dir, {silo_a, silo_b}, "fedavg", 2, 3);
  cfg.server.init_from = ckpt.string();
  Weights start;
  {
    const Coordinator c(cfg.server, false);
    start = in_model_order(c, ckpt);
    EXPECT_TRUE(bitwise_equal(c.global_weights(), start));
    // Not what server.seed would draw.
    const Coordinator seeded(
        [&] {
          auto s = cfg.server;
          s.init_from.clear();
          s.dir = dir / "seeded";
          return s;
        }(),
        false);
    EXPECT_FALSE(bitwise_equal(seeded.global_weights(), start));
  }
  fs::remove_all(cfg.server.dir);

  const auto r = run_simulation(cfg, false);
  ASSERT_EQ(r.rounds, 2);
  // Round 0 of the lineage: where the run started and a digest of those weights.
  Sha256 digest;
  for (const auto& w : start) digest.update(w.raw(), w.nbytes());
  const auto lineage = read_jsonl(cfg.server.dir / "lineage.jsonl");
  ASSERT_EQ(lineage.size(), 3u);
  EXPECT_EQ(lineage[0]["round"], 0);
  EXPECT_EQ(lineage[0]["init_from"], ckpt.string());
  EXPECT_EQ(lineage[0]["source"], "pollen checkpoint");
  EXPECT_EQ(lineage[0]["weights_sha256"], digest.hex_digest());
  EXPECT_EQ(lineage[1]["round"], 1);
  const auto state = nlohmann::json::parse(
      read_file(cfg.server.dir / "checkpoints" / io::checkpoint_name(2) / "state.json"));
  EXPECT_EQ(state["lineage"][0], lineage[0]);
  fs::remove_all(dir);
}

TEST(InitFrom, SimConfigReadsItAndAnotherArchitectureIsRefused) {
  Quiet q;
  const auto dir = temp_dir("init_from_refused");
  const auto silo = make_silo(dir / "a", 1);
  const fs::path ckpt = pretrained(dir / "pretrain", silo);
  const fs::path sim = dir / "sim.toml";
  auto write_sim = [&](const std::string& model_keys) {
    std::ofstream(sim)
        << "[sim]\nclients = [\"a\"]\nmanifests = [\"" << silo.string() << "\"]\n[server]\ndir = \""
        << (dir / "server").string()
        << "\"\n[train]\nseq = 32\n[tokenizer]\nfingerprint = \"t\"\n[model]\ninit_from = \""
        << ckpt.string() << "\"\n"
        << model_keys;
  };
  const std::string same =
      "vocab_size = 64\nhidden_size = 32\nintermediate_size = 64\nnum_hidden_layers = 2\n"
      "num_attention_heads = 2\nnum_key_value_heads = 2\nmax_position_embeddings = 64\n";
  write_sim(same);
  const SimConfig c = load_sim_config(sim);
  EXPECT_EQ(c.server.init_from, ckpt.string());
  EXPECT_EQ(c.clients.at(0).init_from, ckpt.string());  // the simulated silos start there too
  {
    const Coordinator server(c.server, false);
    EXPECT_TRUE(bitwise_equal(server.global_weights(), in_model_order(server, ckpt)));
  }
  fs::remove_all(dir / "server");

  // num_key_value_heads 1 (the checkpoint's 2) and rope_theta 5e5: both named.
  write_sim(
      "vocab_size = 64\nhidden_size = 32\nintermediate_size = 64\nnum_hidden_layers = 2\n"
      "num_attention_heads = 2\nnum_key_value_heads = 1\nmax_position_embeddings = 64\n"
      "rope_theta = 500000.0\n");
  std::string e;
  try {
    Coordinator(load_sim_config(sim).server, false);
  } catch (const std::exception& x) {
    e = x.what();
  }
  EXPECT_NE(e.find("model.init_from"), std::string::npos) << e;
  EXPECT_NE(e.find("num_key_value_heads: expected 1, got 2"), std::string::npos) << e;
  EXPECT_NE(e.find("rope_theta: expected 500000, got 10000"), std::string::npos) << e;
  EXPECT_EQ(e.find("hidden_size"), std::string::npos) << e;
  // A client may start from the same weights (so that round 1's compressed model is a delta).
  std::ofstream(dir / "client.toml")
      << "[client]\nid = \"a\"\n[data]\nmanifests = [\"" << silo.string()
      << "\"]\n[train]\nseq = 32\n[tokenizer]\nfingerprint = \"t\"\n"
      << "[model]\ninit_from = \"" << ckpt.string() << "\"\n"
      << same;
  EXPECT_EQ(load_client_config(dir / "client.toml").init_from, ckpt.string());
  fs::remove_all(dir);
}

TEST(InitFrom, ClientsThatStartFromItGetRoundOneAsADelta) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("init_from_delta");
  const auto silo_a = make_silo(dir / "a", 1), silo_b = make_silo(dir / "b", 3);
  const fs::path ckpt = pretrained(dir / "pretrain", silo_a);
  auto cfg = sim_config(dir, {silo_a, silo_b}, "fedavg", 1, 2);
  cfg.server.init_from = ckpt.string();
  cfg.server.server_codec = Codec::int8;
  cfg.clients[0].init_from = ckpt.string();  // silo-1 draws its own initial model
  {
    LocalTrainer a(cfg.clients[0]), b(cfg.clients[1]);
    const Coordinator server(cfg.server, false);
    EXPECT_TRUE(bitwise_equal(model_weights(a.model()), server.global_weights()));
    EXPECT_FALSE(bitwise_equal(model_weights(b.model()), server.global_weights()));
  }
  fs::remove_all(cfg.server.dir);
  run_simulation(cfg, false);
  uint64_t whole = 0, delta = 0;
  for (const auto& w : model_weights(model::Llama(cfg.server.model, 0))) {
    whole += 4 * static_cast<uint64_t>(w.numel());
    delta += encoded_bytes(CompressOptions{Codec::int8, 64}, w.numel());
  }
  EXPECT_EQ(read_jsonl(cfg.server.dir / "metrics.jsonl").at(0)["bytes_sent"], whole + delta);
  fs::remove_all(dir);
}
