// Protected federation in simulation. One of four silos sends its pseudo-gradient sign-flipped
// and scaled by 10 every round: plain averaging is wrecked by it, while the median, the trimmed
// mean, Krum and norm bounding keep the validation loss within 5% of the clean run's. Central DP
// writes epsilon to every round's metrics and stops at the budget; local DP clips and noises
// on the silo.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "base/files.h"
#include "base/log.h"
#include "base/rng.h"
#include "base/thread_pool.h"
#include "data/shards.h"
#include "fed/client.h"
#include "fed/coordinator.h"
#include "fed/run.h"

namespace fs = std::filesystem;
using namespace pollen;
using namespace pollen::fed;

namespace {

constexpr double kRandomShare = 0.3;  // tokens drawn at random instead of from the bigram rule
constexpr int64_t kRounds = 8, kLocalSteps = 12;
constexpr double kLocalLr = 7e-3;
constexpr double kNormBound = 3;  // honest updates' norms are 1 to 2.5 in these runs

fs::path temp_dir(const std::string& name) {
  fs::path p =
      fs::temp_directory_path() / ("pollen_fed_attack_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

// Four silos with the same kind of data: documents of 24 tokens from one bigram rule
// (next = (7 prev + 3) mod 60 + 1), with kRandomShare of the tokens drawn at random instead, so
// that the loss levels off above zero; each silo has its own documents, so honest updates point
// the same way.
fs::path make_silo(const fs::path& dir, int silo) {
  fs::create_directories(dir);
  std::vector<data::ShardInfo> shards;
  Rng rng(static_cast<uint64_t>(silo) + 1);
  for (const char* split : {"train", "validation"}) {
    data::ShardWriter w(dir, "silo", split, data::TokenDType::u16, 1 << 20);
    const bool train = std::string(split) == "train";
    for (int d = 0; d < (train ? 200 : 30); ++d) {
      std::vector<uint32_t> ids(24);
      ids[0] = static_cast<uint32_t>(1 + rng.below(60));
      for (size_t p = 1; p < ids.size(); ++p) {
        ids[p] = rng.uniform() < kRandomShare ? static_cast<uint32_t>(1 + rng.below(60))
                                              : 1 + (ids[p - 1] * 7 + 3) % 60;
      }
      w.add_document(ids);
    }
    auto s = w.finish();
    shards.insert(shards.end(), s.begin(), s.end());
  }
  nlohmann::json m{{"format", "pollen-shards-v1"}, {"token_dtype", "u16"}, {"vocab_size", 64}};
  m["shards"] = nlohmann::json::array();
  for (const auto& s : shards) m["shards"].push_back(s.to_json());
  write_file_atomic(dir / "manifest.json", data::manifest_text(m));
  return dir / "manifest.json";
}

SimConfig four_silos(const fs::path& dir, const std::vector<fs::path>& manifests) {
  SimConfig c;
  c.threads = 1;
  c.server.dir = dir / "server";
  c.server.seed = 5;
  auto& m = c.server.model;
  m.vocab_size = 64, m.hidden_size = 32, m.intermediate_size = 64, m.num_hidden_layers = 2;
  m.num_attention_heads = 2, m.num_key_value_heads = 2, m.max_position_embeddings = 64;
  m.validate();
  c.server.tokenizer_fingerprint = "test-tokenizer";
  c.server.rounds = kRounds;
  c.server.local_steps = kLocalSteps;
  c.server.eval_every = 0;
  c.server.strategy.name = "fedavg";
  c.server.strategy.min_clients = static_cast<int64_t>(manifests.size());
  for (size_t i = 0; i < manifests.size(); ++i) {
    ClientConfig cc;
    cc.id = "silo-" + std::to_string(i);
    cc.seed = 100 + i;
    cc.threads = 1;
    cc.model = m;
    cc.tokenizer_fingerprint = c.server.tokenizer_fingerprint;
    cc.manifests = {manifests[i].string()};
    cc.train.micro_batch = 4, cc.train.seq = 16, cc.train.optimizer.lr = kLocalLr;
    cc.train.optimizer.weight_decay = 0, cc.train.eval_batches = 2;
    c.clients.push_back(cc);
  }
  return c;
}

// The in-process transport, except that `attacker`'s pushes carry scale * its update.
class HostileTransport : public Transport {
 public:
  HostileTransport(Coordinator& c, std::string attacker, float scale)
      : inner_(c), specs_(c.specs()), attacker_(std::move(attacker)), scale_(scale) {}
  pb::JoinReply join(const pb::JoinRequest& r) override { return inner_.join(r); }
  pb::TaskReply task(const pb::TaskRequest& r) override { return inner_.task(r); }
  void pull(const pb::PullRequest& r,
            const std::function<void(const pb::TensorStream&)>& on_message) override {
    inner_.pull(r, on_message);
  }
  pb::SecAggReply secagg(const pb::SecAggRequest& r) override { return inner_.secagg(r); }
  pb::PushReply push(const std::function<bool(pb::TensorStream&)>& next) override {
    std::vector<pb::TensorStream> msgs;
    for (pb::TensorStream m; next(m); m.Clear()) msgs.push_back(m);
    if (msgs.at(0).update().client_id() == attacker_) {
      std::string bytes;
      for (size_t i = 2; i < msgs.size(); ++i) bytes += msgs[i].chunk().data();
      Weights w = decode_set(msgs[1].header(), bytes, specs_, "attack");
      for (Tensor& t : w) {
        for (int64_t j = 0; j < t.numel(); ++j) t.data<float>()[j] *= scale_;
      }
      const EncodedSet enc = encode_weights(specs_, w, CompressOptions{});
      msgs.resize(1);
      msgs.emplace_back();
      *msgs.back().mutable_header() = enc.header;
      for_each_chunk(enc.bytes, kMaxChunkBytes, [&](const pb::Chunk& c) {
        msgs.emplace_back();
        *msgs.back().mutable_chunk() = c;
      });
    }
    size_t k = 0;
    return inner_.push([&](pb::TensorStream& m) {
      if (k == msgs.size()) return false;
      m = msgs[k++];
      return true;
    });
  }

 private:
  LocalTransport inner_;
  ParamSpecs specs_;
  std::string attacker_;
  float scale_;
};

// The simulation's loop with the hostile transport; the mean validation loss of the final
// global model over the silos (non-finite when training diverged).
double run_with_attacker(const SimConfig& cfg, const std::string& attacker, float scale) {
  set_num_threads(cfg.threads);
  Coordinator coordinator(cfg.server, false);
  HostileTransport transport(coordinator, attacker, scale);
  std::vector<std::unique_ptr<Client>> clients;
  for (const auto& cc : cfg.clients) {
    clients.push_back(std::make_unique<Client>(cc, transport));
    clients.back()->join();
  }
  while (coordinator.begin_round()) {
    for (auto& c : clients) c->poll_once();
    coordinator.end_round();
  }
  const Weights global = coordinator.global_weights();
  double loss = 0;
  for (auto& c : clients) {
    set_model_weights(c->trainer().model(), global);
    int64_t tokens = 0;
    loss += c->trainer().evaluate(&tokens) / static_cast<double>(clients.size());
  }
  return loss;
}

std::vector<nlohmann::json> read_jsonl(const fs::path& p) {
  std::vector<nlohmann::json> out;
  std::ifstream in(p);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

struct Quiet {
  Quiet() { log::set_level(log::Level::error); }
  ~Quiet() { log::set_level(log::Level::info); }
};

}  // namespace

TEST(Attack, SignFlippedScaledUpdateBreaksTheMeanNotTheRobustRules) {
  Quiet quiet;
  const auto dir = temp_dir("flip");
  std::vector<fs::path> silos;
  for (int i = 0; i < 4; ++i) silos.push_back(make_silo(dir / ("silo" + std::to_string(i)), i));
  auto run = [&](const std::string& name, RobustOptions rule, const std::string& attacker) {
    SimConfig cfg = four_silos(dir / name, silos);
    cfg.server.strategy.robust = rule;
    return run_with_attacker(cfg, attacker, -10.0f);
  };
  const double clean = run("clean", {}, "");
  RobustOptions mean, median, trimmed, krum, multi_krum, bounded;
  median.aggregation = "median";
  trimmed.aggregation = "trimmed_mean", trimmed.trim_fraction = 0.25;
  // Four clients: Blanchard's n > 2f + 2 allows f = 0 only; its score over the n - 2 nearest
  // still leaves the far-off update out.
  krum.aggregation = "krum", krum.byzantine = 0;
  multi_krum.aggregation = "multi_krum", multi_krum.byzantine = 0, multi_krum.multi_krum = 3;
  bounded.norm_bound = kNormBound;
  const double attacked = run("mean", mean, "silo-3");
  EXPECT_TRUE(!std::isfinite(attacked) || attacked > 1.5 * clean)
      << "plain averaging: clean " << clean << ", attacked " << attacked;
  for (const auto& [name, rule] :
       std::vector<std::pair<std::string, RobustOptions>>{{"median", median},
                                                          {"trimmed", trimmed},
                                                          {"krum", krum},
                                                          {"multi_krum", multi_krum},
                                                          {"bounded", bounded}}) {
    const double loss = run(name, rule, "silo-3");
    EXPECT_LT(std::abs(loss - clean), 0.05 * clean)
        << name << ": clean " << clean << ", attacked " << loss;
  }
  // Every clipped or rejected update is reported per client.
  const auto krum_metrics = read_jsonl(dir / "krum/server/metrics.jsonl");
  for (const auto& m : krum_metrics) {
    EXPECT_TRUE(m["clients"]["silo-3"]["rejected"].get<bool>());
    EXPECT_EQ(m["rejected"], 3);
  }
  const auto bounded_metrics = read_jsonl(dir / "bounded/server/metrics.jsonl");
  for (const auto& m : bounded_metrics) {
    EXPECT_TRUE(m["clients"]["silo-3"]["clipped"].get<bool>());
    EXPECT_GT(m["clients"]["silo-3"]["update_norm"].get<double>(), kNormBound);
  }
  fs::remove_all(dir);
}

TEST(Attack, CentralDpReportsEpsilonEachRoundAndStopsAtTheBudget) {
  Quiet quiet;
  const auto dir = temp_dir("dp");
  std::vector<fs::path> silos;
  for (int i = 0; i < 4; ++i) silos.push_back(make_silo(dir / ("silo" + std::to_string(i)), i));
  SimConfig cfg = four_silos(dir / "run", silos);
  cfg.server.rounds = 5;
  cfg.server.local_steps = 2;
  cfg.server.strategy.fraction_fit = 0.5;
  cfg.server.strategy.min_clients = 2;
  cfg.server.privacy = PrivacyOptions{};
  auto& p = cfg.server.privacy;
  p.enabled = true, p.noise_multiplier = 1.0, p.clip = 0.05, p.noise_seed = 1;
  // 2 of 4 drawn without replacement a round: the tighter of sampling (rate 0.5, multiplier
  // z / 2) and the Gaussian of multiplier z given the sample, the Gaussian at every order here.
  PrivacyAccountant three;
  three.add(1.0, 1.0, 3);
  p.epsilon_budget = three.epsilon(p.delta).epsilon * 1.0001;
  const auto r = run_simulation(cfg, false);
  EXPECT_EQ(r.rounds, 3);
  const auto metrics = read_jsonl(cfg.server.dir / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 4u);
  PrivacyAccountant a;
  for (int i = 0; i < 3; ++i) {
    a.add(1.0, 1.0);
    EXPECT_EQ(metrics[i]["aggregation"], "dp_mean");
    EXPECT_DOUBLE_EQ(metrics[i]["privacy"]["epsilon"].get<double>(), a.epsilon(p.delta).epsilon);
    EXPECT_EQ(metrics[i]["selected"], 2);
  }
  EXPECT_EQ(metrics[3]["status"], "refused");
  EXPECT_NE(metrics[3]["reason"].get<std::string>().find("privacy.epsilon_budget"),
            std::string::npos);
  // Epsilon is a TensorBoard scalar of every round too (the tag is stored as plain bytes).
  std::string events;
  for (const auto& f : fs::directory_iterator(cfg.server.dir / "tensorboard"))
    events += read_file(f.path());
  EXPECT_NE(events.find("privacy/epsilon"), std::string::npos);
  fs::remove_all(dir);
}

// Under central DP a fixed-size sample is drawn like the noise, from the OS's generator: two
// runs with the same server seed pick different clients (2 of 4 in 8 rounds: alike with
// probability 6^-8), unless noise_seed makes both repeatable.
TEST(Attack, CentralDpsFixedSampleIsSecretUnlessNoiseSeeded) {
  Quiet quiet;
  const auto dir = temp_dir("dp_sample");
  std::vector<fs::path> silos;
  for (int i = 0; i < 4; ++i) silos.push_back(make_silo(dir / ("silo" + std::to_string(i)), i));
  auto samples = [&](const std::string& name, int64_t noise_seed) {
    SimConfig cfg = four_silos(dir / name, silos);
    cfg.server.rounds = 8;
    cfg.server.local_steps = 1;
    cfg.server.strategy.fraction_fit = 0.5;
    cfg.server.strategy.min_clients = 2;
    cfg.server.privacy = PrivacyOptions{};
    auto& p = cfg.server.privacy;
    p.enabled = true, p.noise_multiplier = 0.1, p.clip = 0.05, p.noise_seed = noise_seed;
    run_simulation(cfg, false);
    std::vector<std::vector<std::string>> out;
    for (const auto& m : read_jsonl(cfg.server.dir / "metrics.jsonl")) {
      out.emplace_back();
      for (const auto& [id, c] : m["clients"].items()) out.back().push_back(id);
    }
    EXPECT_EQ(out.size(), 8u) << name;
    return out;
  };
  EXPECT_NE(samples("secret-a", -1), samples("secret-b", -1));
  EXPECT_EQ(samples("seeded-a", 3), samples("seeded-b", 3));
  fs::remove_all(dir);
}

TEST(Attack, LocalDpClipsAndNoisesBeforeTheUpdateLeavesTheSilo) {
  Quiet quiet;
  const auto dir = temp_dir("local");
  std::vector<fs::path> silos;
  for (int i = 0; i < 2; ++i) silos.push_back(make_silo(dir / ("silo" + std::to_string(i)), i));
  auto norms = [&](const std::string& name, double noise) {
    SimConfig cfg = four_silos(dir / name, silos);
    cfg.server.rounds = 2;
    cfg.server.local_steps = 2;
    for (auto& c : cfg.clients) {
      c.local_dp.enabled = true, c.local_dp.clip = 0.05, c.local_dp.noise_multiplier = noise;
      c.local_dp.noise_seed = 9;
    }
    run_simulation(cfg, false);
    std::vector<double> out;
    for (const auto& m : read_jsonl(cfg.server.dir / "metrics.jsonl")) {
      for (const auto& [id, c] : m["clients"].items()) out.push_back(c["update_norm"]);
    }
    return out;
  };
  // What the server receives is clipped to 0.05 on the silo (float32 rounding aside) ...
  for (double n : norms("clip", 0.0)) EXPECT_NEAR(n, 0.05, 1e-6);
  // ... and with noise multiplier 1 it carries N(0, 0.05^2) per value: norm ~ 0.05 sqrt(P).
  const double p = 64 * 32 * 2 + 2 * (4 * 32 * 32 + 3 * 32 * 64 + 2 * 32) + 32;
  for (double n : norms("noise", 1.0))
    EXPECT_NEAR(n, 0.05 * std::sqrt(p), 0.05 * 0.05 * std::sqrt(p));
  fs::remove_all(dir);
}
