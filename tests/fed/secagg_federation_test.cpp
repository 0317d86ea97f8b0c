// Secure aggregation inside federated runs: the same weights as plain aggregation up to the
// quantisation bound, dropouts after the masked input, a failed round that applies nothing, the
// server's state holding only masked data, hostile messages, the config, distributed DP (the
// clients' clipping, weights and noise shares), and the protocol over gRPC between processes
// giving the simulation's model bitwise.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "base/config.h"
#include "base/files.h"
#include "base/log.h"
#include "base/thread_pool.h"
#include "data/shards.h"
#include "fed/client.h"
#include "fed/client_state.h"
#include "fed/config.h"
#include "fed/coordinator.h"
#include "fed/fixtures.h"
#include "fed/run.h"
#include "fed/secagg/private_quantize.h"
#include "fed/secagg/quantize.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "model/llama.h"

namespace fs = std::filesystem;
using namespace pollen;
using namespace pollen::fed;
using namespace pollen::fed::testing;

namespace {

std::vector<fs::path> make_silos(const fs::path& dir, int n) {
  std::vector<fs::path> out;
  for (int i = 0; i < n; ++i) out.push_back(make_silo(dir / cat("silo", i), 1 + 2 * i, 200, 20));
  return out;
}

// fixtures' simulation with rounds of 2 local steps and no federated evaluation, its sums masked
// or plain.
SimConfig secure_sim_config(const fs::path& dir, const std::vector<fs::path>& manifests,
                            const std::string& strategy, int64_t rounds, bool secure) {
  SimConfig c = sim_config(dir, manifests, strategy, rounds, 2);
  c.server.eval_every = 0;
  c.server.secure_aggregation.enabled = secure;
  return c;
}

// Every client keeps its state under dir/state<i> (what a restart or a rewind reads).
void keep_client_states(SimConfig& cfg, const fs::path& dir) {
  for (size_t i = 0; i < cfg.clients.size(); ++i) cfg.clients[i].state_dir = dir / cat("state", i);
}

double max_abs_diff(const Weights& a, const Weights& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    for (int64_t j = 0; j < a[i].numel(); ++j) {
      worst = std::max(
          worst, std::fabs(static_cast<double>(a[i].data<float>()[j]) - b[i].data<float>()[j]));
    }
  }
  return worst;
}

double byte_chi_square(const std::vector<uint64_t>& words) {
  std::array<double, 256> count{};
  for (uint64_t w : words) {
    for (int b = 0; b < 8; ++b) count[(w >> (8 * b)) & 0xff] += 1;
  }
  const double expected = static_cast<double>(words.size()) * 8 / 256;
  double chi = 0;
  for (double c : count) chi += (c - expected) * (c - expected) / expected;
  return chi;
}

// The in-process transport, keeping what an honest-but-curious server sees of an attempt: the
// masked inputs, the revealed shares and the roster. A reveal from `withhold_reveal_of` is kept
// but lost on the way (the client sees an error), so that an unmask can be made to fail after
// reveals.
struct SpyTransport : LocalTransport {
  std::map<std::string, std::string> inputs;  // masked words, by client
  std::map<std::string, pb::SecAggReveal> reveals;
  pb::SecAggRoster roster;
  std::string withhold_reveal_of;
  using LocalTransport::LocalTransport;
  void clear() {
    inputs.clear();
    reveals.clear();
  }
  pb::SecAggReply secagg(const pb::SecAggRequest& r) override {
    if (r.has_reveal()) reveals[r.client_id()] = r.reveal();
    if (r.has_reveal() && r.client_id() == withhold_reveal_of)
      throw Error(cat("reveal of '", r.client_id(), "' lost (test)"));
    pb::SecAggReply reply = LocalTransport::secagg(r);
    if (reply.has_roster()) roster = reply.roster();
    return reply;
  }
  pb::PushReply push(const std::function<bool(pb::TensorStream&)>& next) override {
    std::string id, words;
    pb::PushReply reply = LocalTransport::push([&](pb::TensorStream& m) {
      if (!next(m)) return false;
      if (m.has_update()) id = m.update().client_id();
      if (m.has_chunk()) words += m.chunk().data();
      return true;
    });
    inputs[id] = words;
    return reply;
  }
  // What the server could unmask from them: the inputs' sum less every sender's self mask,
  // rebuilt from all its revealed shares (everyone who shared sent an input, so the pairwise
  // masks cancel).
  std::vector<uint64_t> unmasked_sum(int64_t round) const {
    const int bits = static_cast<int>(roster.params().ring_bits());
    const size_t word = static_cast<size_t>(bits) / 8;
    std::vector<uint64_t> sum(inputs.begin()->second.size() / word, 0);
    for (const auto& [id, words] : inputs) {
      for (size_t j = 0; j < sum.size(); ++j) {
        uint64_t w = 0;
        std::memcpy(&w, words.data() + j * word, word);
        sum[j] = (sum[j] + w) & secagg::ring_mask(bits);
      }
    }
    std::map<std::string, std::vector<secagg::Share>> shares;  // by owner
    for (const auto& [holder, r] : reveals) {
      uint32_t x = 1;  // the holder's place in the roster, from 1
      while (roster.clients(static_cast<int>(x - 1)).client_id() != holder) ++x;
      for (const auto& s : r.self_mask_shares())
        shares[s.owner()].push_back(secagg::share_from(x, s.share(), "test"));
    }
    for (const auto& [owner, s] : shares) {
      const secagg::Key32 b = secagg::reconstruct_secret(s, s.size(), owner);
      secagg::add_mask(secagg::self_mask_seed(b, round, owner), -1, bits, sum.data(), sum.size());
    }
    return sum;
  }
};

// Clients in one process around one coordinator, driven phase by phase.
struct Federation {
  Coordinator server;
  SpyTransport transport{server};
  std::vector<std::unique_ptr<Client>> clients;
  explicit Federation(const SimConfig& c, bool resume = false) : server(c.server, resume) {
    for (const auto& cc : c.clients) {
      clients.push_back(std::make_unique<Client>(cc, transport));
      clients.back()->join();
    }
  }
  // Every client in `who` polls once; true when one had work.
  bool pass(const std::vector<size_t>& who) {
    bool worked = false;
    for (size_t i : who) worked = clients[i]->poll_once() != pb::TASK_WAIT || worked;
    return worked;
  }
  secagg::ServerSession::Phase phase() const { return server.secagg_session()->phase(); }
};

}  // namespace

TEST(SecureSimulation, SameWeightsAsPlainUpToTheQuantisationBound) {
  Quiet q;
  const auto dir = temp_dir("same");
  const auto silos = make_silos(dir, 3);
  set_num_threads(1);
  for (const std::string strategy : {"fedavg", "diloco"}) {
    const int64_t rounds = strategy == "fedavg" ? 1 : 3;
    auto plain_cfg = secure_sim_config(dir / ("plain-" + strategy), silos, strategy, rounds, false);
    auto secure_cfg =
        secure_sim_config(dir / ("secure-" + strategy), silos, strategy, rounds, true);
    const auto plain = run_simulation(plain_cfg, false);
    const auto secure = run_simulation(secure_cfg, false);
    ASSERT_EQ(secure.rounds, rounds);
    const double diff = max_abs_diff(plain.global, secure.global);
    const double bound = secure_cfg.server.secure_aggregation.error_bound();
    if (strategy == "fedavg") {
      // One round, lr 1: x - Delta, so the weights differ by Delta's error: at most the bound
      // plus float32 roundings of the weights (|x| < 2: 2^-23 each).
      EXPECT_LE(diff, bound + 0x1p-22) << strategy;
    } else {
      // Three DiLoCo rounds: each round's error enters through lr (1 + mu) and compounds
      // through local training of slightly different models; still tiny against the update.
      EXPECT_LT(diff, 1e-4) << strategy;
    }
    const model::Llama initial(plain_cfg.server.model, plain_cfg.server.seed);
    EXPECT_GT(max_abs_diff(plain.global, model_weights(initial)), 1e-3)
        << "training must have moved the weights for the comparison to mean anything";
    const auto metrics = read_jsonl(secure_cfg.server.dir / "metrics.jsonl");
    ASSERT_EQ(metrics.size(), static_cast<size_t>(rounds));
    EXPECT_EQ(metrics[0]["status"], "aggregated");
    EXPECT_GT(metrics[0]["secagg_bytes_received"].get<int64_t>(), 0);
    // 8 bytes per parameter (ring64) per client.
    int64_t numel = 0;
    for (const auto& t : secure.global) numel += t.numel();
    EXPECT_EQ(metrics[0]["bytes_received"].get<int64_t>(), 3 * 8 * numel);
  }
}

TEST(SecureRound, ServerHoldsOnlyMaskedDataAndDropoutsAfterInputAreUnmasked) {
  Quiet q;
  const auto dir = temp_dir("drop");
  const auto silos = make_silos(dir, 4);
  set_num_threads(1);
  // The plain reference: all four clients' updates.
  const auto plain =
      run_simulation(secure_sim_config(dir / "plain", silos, "fedavg", 1, false), false);
  const auto cfg = secure_sim_config(dir / "secure", silos, "fedavg", 1, true);  // threshold 3 of 4
  Federation f(cfg);
  ASSERT_TRUE(f.server.begin_round());
  ASSERT_TRUE(f.pass({0, 1, 2, 3}));  // keys
  ASSERT_TRUE(f.pass({0, 1, 2, 3}));  // shares
  ASSERT_EQ(f.phase(), secagg::ServerSession::Phase::input);
  ASSERT_TRUE(f.pass({0}));  // one masked update arrived: the server's state is that alone
  const auto& held = f.server.secagg_session()->masked_sum();
  EXPECT_LT(byte_chi_square(held), 370) << "the server's state must look uniform";
  ASSERT_TRUE(f.pass({1, 2, 3}));
  ASSERT_EQ(f.phase(), secagg::ServerSession::Phase::unmask);
  // silo-2 vanishes after sending its masked update; the deadline closes the phase.
  ASSERT_TRUE(f.pass({0, 1, 3}));
  EXPECT_FALSE(f.server.round_complete());
  EXPECT_TRUE(f.server.close_phase());
  ASSERT_TRUE(f.server.round_complete());
  const auto s = f.server.end_round();
  ASSERT_TRUE(s.aggregated);
  EXPECT_EQ(s.participants.size(), 4u) << "silo-2's input was sent and counts";
  EXPECT_LE(max_abs_diff(plain.global, f.server.global_weights()),
            cfg.server.secure_aggregation.error_bound() + 0x1p-22);
}

TEST(SecureRound, BelowTheThresholdTheRoundFailsAndNothingIsApplied) {
  Quiet q;
  const auto dir = temp_dir("fail");
  auto cfg = secure_sim_config(dir, make_silos(dir, 4), "fedavg", 1, true);
  cfg.server.max_round_retries = 0;
  set_num_threads(1);
  Federation f(cfg);
  const Weights before = f.server.global_weights();
  ASSERT_TRUE(f.server.begin_round());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(f.pass({0, 1, 2, 3}));  // keys, shares, inputs
  ASSERT_TRUE(f.pass({0, 1}));  // two of four reveal; the threshold is 3
  EXPECT_TRUE(f.server.close_phase());
  const auto s = f.server.end_round();
  EXPECT_FALSE(s.aggregated);
  EXPECT_TRUE(bitwise_equal(before, f.server.global_weights())) << "nothing may be applied";
  EXPECT_EQ(f.server.rounds_done(), 0);
  for (const auto& saved : io::list_checkpoints(cfg.server.dir / "checkpoints"))
    EXPECT_EQ(io::checkpoint_step(saved), 0) << "no round may be saved as done";
  const auto metrics = read_jsonl(cfg.server.dir / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 1u);
  EXPECT_EQ(metrics[0]["status"], "retry");
  const std::string why = metrics[0]["secagg_error"];
  EXPECT_NE(why.find("fewer than the threshold 3"), std::string::npos) << why;
}

// A ring too small for a client's tokens fails every attempt alike: the client stops, naming
// the keys to change, instead of training the round again and again.
TEST(SecureRound, AClientWhoseTokensTheRingCannotHoldStops) {
  Quiet q;
  const auto dir = temp_dir("ring_too_small");
  auto cfg = secure_sim_config(dir, make_silos(dir, 3), "fedavg", 1, true);
  // 2^31 / 2^24 levels: below 128 tokens; a client scores about 240 in 4 steps.
  cfg.server.secure_aggregation.ring_bits = 32;
  cfg.server.local_steps = 4;
  cfg.server.round_timeout_s = 30;
  set_num_threads(1);
  Coordinator server(cfg.server, false);
  LocalTransport transport(server);
  std::vector<std::unique_ptr<Client>> clients;
  for (const auto& cc : cfg.clients) {
    clients.push_back(std::make_unique<Client>(cc, transport));
    clients.back()->join();
  }
  std::thread rounds([&] { server.run(); });
  // Each client stops: on its own update, or on the server's stop once the others have left.
  std::vector<std::string> stops(clients.size());
  std::vector<std::thread> silos;
  for (size_t i = 0; i < clients.size(); ++i) {
    silos.emplace_back([&, i] {
      try {
        clients[i]->run();
      } catch (const RoundCannotSucceed& e) {
        stops[i] = cat("own update: ", e.what());
      } catch (const Error& e) {
        stops[i] = cat("server: ", e.what());
      }
    });
  }
  for (auto& t : silos) t.join();
  server.stop();
  rounds.join();
  int own = 0;
  for (const std::string& e : stops) {
    EXPECT_FALSE(e.empty()) << "a client ended as after a finished run";
    if (e.starts_with("own update: ")) {
      ++own;
      EXPECT_NE(e.find("ring_bits 64"), std::string::npos) << e;
    }
  }
  EXPECT_GE(own, 1);
  EXPECT_EQ(server.rounds_done(), 0);
}

// A client restarted during a secure round holds none of the secrets it advertised: asked for its
// shares, its masked update or its revealed shares, it drops out of the phase, training nothing,
// and the phase closes without waiting for its deadline; it takes part again from the next round.
TEST(SecureRound, AClientRestartedMidRoundDropsOutWithoutTraining) {
  Quiet q;
  const auto dir = temp_dir("restart");
  auto cfg = secure_sim_config(dir, make_silos(dir, 4), "fedavg", 3, true);  // threshold 3 of 4
  keep_client_states(cfg, dir);
  set_num_threads(1);
  Federation f(cfg);
  using Phase = secagg::ServerSession::Phase;
  auto restart = [&](size_t i) {
    f.clients[i] = std::make_unique<Client>(cfg.clients[i], f.transport);
    f.clients[i]->join();
  };
  // As Client::run: a task that fails is asked for again.
  auto polls = [&](size_t i) {
    for (int attempt = 0; attempt < 3; ++attempt) {
      try {
        f.clients[i]->poll_once();
      } catch (const Error&) {
      }
    }
  };
  auto end = [&](int64_t round, size_t participants) {
    ASSERT_TRUE(f.server.round_complete()) << "round " << round << " waits for a deadline";
    const auto s = f.server.end_round();
    ASSERT_TRUE(s.aggregated) << "round " << round;
    EXPECT_EQ(s.participants.size(), participants) << "round " << round;
  };
  // Round 1: silo-3 restarts after its shares and is asked for its masked update.
  ASSERT_TRUE(f.server.begin_round());
  ASSERT_TRUE(f.pass({0, 1, 2, 3}));  // keys
  ASSERT_TRUE(f.pass({0, 1, 2, 3}));  // shares
  restart(3);
  polls(3);
  EXPECT_EQ(f.clients[3]->trainer().steps_taken(), 0) << "it trained for an update it cannot mask";
  EXPECT_EQ(f.phase(), Phase::input);
  ASSERT_TRUE(f.pass({0, 1, 2}));  // inputs: nobody else is waited for
  ASSERT_EQ(f.phase(), Phase::unmask);
  ASSERT_TRUE(f.pass({0, 1, 2}));  // reveals
  end(1, 3);
  // Round 2: silo-2 restarts after its keys and is asked for its shares.
  ASSERT_TRUE(f.server.begin_round());
  ASSERT_TRUE(f.pass({0, 1, 2, 3}));  // keys
  restart(2);
  polls(2);
  ASSERT_TRUE(f.pass({0, 1, 3}));  // shares
  ASSERT_EQ(f.phase(), Phase::input);
  ASSERT_TRUE(f.pass({0, 1, 3}));  // inputs
  ASSERT_TRUE(f.pass({0, 1, 3}));  // reveals
  end(2, 3);
  // Round 3: silo-1 restarts after its masked update and is asked for its revealed shares.
  ASSERT_TRUE(f.server.begin_round());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(f.pass({0, 1, 2, 3}));  // keys, shares, inputs
  restart(1);
  polls(1);
  ASSERT_TRUE(f.pass({0, 2, 3}));  // reveals
  end(3, 4);                       // silo-1's masked update was sent: it is in the sum
  // Two local steps for each round a client trained, none for the one it dropped out of.
  const int64_t trained[] = {3, 3, 2, 2};
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(f.clients[i]->trainer().steps_taken(), 2 * trained[i]) << "silo-" << i;
    const auto saved = io::list_checkpoints(cfg.clients[i].state_dir / "checkpoints");
    ASSERT_FALSE(saved.empty());
    EXPECT_EQ(io::checkpoint_step(saved.back()), 2 * trained[i]) << "silo-" << i;
  }
}

namespace {

// The in-process transport, but the first time the client `late` asks for its inbox the secure
// round's input phase closes (its deadline): it trained, and its masked update cannot be sent.
struct LateInputTransport : LocalTransport {
  Coordinator& server;
  std::string late;
  bool armed = true;
  LateInputTransport(Coordinator& c, std::string id)
      : LocalTransport(c), server(c), late(std::move(id)) {}
  pb::SecAggReply secagg(const pb::SecAggRequest& r) override {
    if (armed && r.client_id() == late && r.has_get_inbox()) {
      armed = false;
      server.close_phase();
    }
    return LocalTransport::secagg(r);
  }
};

}  // namespace

// A round attempt that took local steps and failed before the client saved its state leaves no
// trace: the client's next round starts from its state before that attempt.
TEST(SecureRound, AFailedAttemptsLocalStepsAreRewound) {
  Quiet q;
  const auto dir = temp_dir("rewind");
  auto cfg = secure_sim_config(dir, make_silos(dir, 4), "fedavg", 2, true);  // threshold 3 of 4
  keep_client_states(cfg, dir);
  set_num_threads(1);
  Federation f(cfg);
  LateInputTransport late(f.server, "silo-3");
  f.clients[3] = std::make_unique<Client>(cfg.clients[3], late);
  f.clients[3]->join();
  ASSERT_TRUE(f.server.begin_round());
  ASSERT_TRUE(f.pass({0, 1, 2, 3}));  // keys
  ASSERT_TRUE(f.pass({0, 1, 2, 3}));  // shares
  ASSERT_TRUE(f.pass({0, 1, 2}));     // inputs
  EXPECT_THROW(f.clients[3]->poll_once(), Error) << "its input phase closed while it trained";
  EXPECT_EQ(f.clients[3]->trainer().steps_taken(), 2);
  ASSERT_TRUE(f.pass({0, 1, 2}));  // reveals
  ASSERT_TRUE(f.server.end_round().aggregated);
  ASSERT_TRUE(f.server.begin_round());
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(f.pass({0, 1, 2, 3}));  // keys, shares, inputs, reveals
  ASSERT_TRUE(f.server.end_round().aggregated);
  EXPECT_EQ(f.clients[3]->trainer().steps_taken(), 2) << "round 1's unsent steps were kept";
  EXPECT_EQ(f.clients[0]->trainer().steps_taken(), 4);
}

// A sum the ring cannot hold fails the attempt when the input phase closes, before anyone is
// asked to reveal: refused after the reveals, the server could unmask it, and the retry's sum
// over other clients would differ from it by a client's input.
TEST(SecureRound, ASumTheRingCannotHoldFailsBeforeAnyReveal) {
  Quiet q;
  const auto dir = temp_dir("ring_fits");
  const auto silos = make_silos(dir, 4);
  set_num_threads(1);
  // The clients' tokens, from a plain round.
  run_simulation(secure_sim_config(dir / "plain", silos, "fedavg", 1, false), false);
  const auto plain = read_jsonl(dir / "plain" / "server" / "metrics.jsonl");
  ASSERT_EQ(plain.size(), 1u);
  std::vector<int64_t> tokens;
  for (int i = 0; i < 4; ++i)
    tokens.push_back(plain[0]["clients"][cat("silo-", i)]["tokens"].get<int64_t>());
  // A 32-bit ring and a step with which any three clients' tokens fit and all four do not.
  const int64_t all = tokens[0] + tokens[1] + tokens[2] + tokens[3];
  const int64_t most_three = all - *std::min_element(tokens.begin(), tokens.end());
  auto cfg = secure_sim_config(dir / "secure", silos, "fedavg", 1, true);  // threshold 3 of 4
  keep_client_states(cfg, dir);
  auto& o = cfg.server.secure_aggregation;
  o.ring_bits = 32;
  o.step = 1.0 / std::floor((0x1p31 - 1) / static_cast<double>(most_three));
  const auto levels = static_cast<double>(o.max_level());
  ASSERT_LT(static_cast<double>(most_three) * levels, 0x1p31);
  ASSERT_GE(static_cast<double>(all) * levels, 0x1p31);
  Federation f(cfg);
  // Attempt 1: all four send their inputs; the sum could wrap, and nobody is asked to reveal.
  ASSERT_TRUE(f.server.begin_round());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(f.pass({0, 1, 2, 3}));  // keys, shares, inputs
  EXPECT_EQ(f.phase(), secagg::ServerSession::Phase::failed);
  EXPECT_FALSE(f.pass({0, 1, 2, 3})) << "no client may be asked for its shares";
  EXPECT_TRUE(f.transport.reveals.empty()) << "a share was revealed";
  EXPECT_FALSE(f.server.secagg_session()->revealed());
  ASSERT_TRUE(f.server.round_complete());
  EXPECT_FALSE(f.server.end_round().aggregated);
  const auto metrics = read_jsonl(cfg.server.dir / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 1u);
  const std::string why = metrics[0]["secagg_error"];
  EXPECT_NE(why.find(cat(all, " tokens")), std::string::npos) << why;
  EXPECT_NE(why.find("32-bit ring"), std::string::npos) << why;
  EXPECT_NE(why.find("nothing was revealed"), std::string::npos) << why;
  // Attempt 2: silo-3 misses the key phase; the three others fit and the round is applied. They
  // revealed nothing for round 1, so they go back to their state before it.
  ASSERT_TRUE(f.server.begin_round());
  ASSERT_TRUE(f.pass({0, 1, 2}));
  EXPECT_TRUE(f.server.close_phase());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(f.pass({0, 1, 2}));  // shares, inputs, reveals
  const auto s = f.server.end_round();
  EXPECT_TRUE(s.aggregated);
  EXPECT_EQ(s.participants.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(f.clients[i]->trainer().steps_taken(), 2) << i;
}

// A round that fails after the clients revealed their shares is retried; the clients must not
// send the same inputs again (a rewind to their state before the round would, bitwise), or two
// unmasked sums over different clients would give away the difference: one client's update.
TEST(SecureRound, ARoundRetriedAfterRevealsGetsNewInputs) {
  Quiet q;
  const auto dir = temp_dir("retry_reveals");
  auto cfg = secure_sim_config(dir, make_silos(dir, 4), "fedavg", 1, true);
  cfg.server.secure_aggregation.threshold = 4;  // every reveal is needed
  keep_client_states(cfg, dir);
  set_num_threads(1);
  Federation f(cfg);
  // Attempt 1: silo-3's reveal is lost; the unmask fails with every other share revealed.
  f.transport.withhold_reveal_of = "silo-3";
  ASSERT_TRUE(f.server.begin_round());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(f.pass({0, 1, 2, 3}));  // keys, shares, inputs
  ASSERT_TRUE(f.pass({0, 1, 2}));
  EXPECT_THROW(f.clients[3]->poll_once(), Error);
  EXPECT_TRUE(f.server.close_phase());
  ASSERT_FALSE(f.server.end_round().aggregated);
  const std::vector<uint64_t> first = f.transport.unmasked_sum(1);
  // Attempt 2: everyone, again for round 1.
  f.transport.clear();
  f.transport.withhold_reveal_of.clear();
  ASSERT_TRUE(f.server.begin_round());
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(f.pass({0, 1, 2, 3}));
  ASSERT_TRUE(f.server.end_round().aggregated);
  const std::vector<uint64_t> second = f.transport.unmasked_sum(1);
  ASSERT_EQ(first.size(), second.size());
  size_t same = 0;
  for (size_t j = 0; j < first.size(); ++j) same += first[j] == second[j];
  EXPECT_LT(same, first.size() / 10) << "the retry's inputs repeat the first attempt's";
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(f.clients[i]->trainer().steps_taken(), 4) << "silo-" << i << " went back";
    // A restarted client reads it there.
    EXPECT_EQ(load_revealed_round(cfg.clients[i].state_dir, cat("silo-", i)), 1) << i;
  }
}

namespace {

// The in-process transport, but the first push is lost once its whole stream was sent (the
// connection broke before the server took it).
struct LostPushTransport : LocalTransport {
  std::vector<std::string> pushed;  // each push's stream: info, header and chunks
  using LocalTransport::LocalTransport;
  pb::PushReply push(const std::function<bool(pb::TensorStream&)>& next) override {
    std::string stream;
    auto record = [&](pb::TensorStream& m) {
      if (!next(m)) return false;
      stream += m.SerializeAsString();
      return true;
    };
    if (pushed.empty()) {
      for (pb::TensorStream m; record(m); m.Clear()) {
      }
      pushed.push_back(stream);
      throw Error("push: connection reset (test)");
    }
    pb::PushReply reply = LocalTransport::push(record);
    pushed.push_back(stream);
    return reply;
  }
};

}  // namespace

// A masked update whose push was lost is sent again byte for byte when the server asks for it
// again: trained and masked anew, the round's masks on another update would give away the
// difference of the two.
TEST(SecureRound, ALostMaskedPushIsSentAgainAsItWas) {
  Quiet q;
  const auto dir = temp_dir("lost_push");
  auto cfg = secure_sim_config(dir, make_silos(dir, 4), "fedavg", 1, true);
  keep_client_states(cfg, dir);
  set_num_threads(1);
  Federation f(cfg);
  LostPushTransport lossy(f.server);
  f.clients[0] = std::make_unique<Client>(cfg.clients[0], lossy);
  f.clients[0]->join();
  ASSERT_TRUE(f.server.begin_round());
  ASSERT_TRUE(f.pass({0, 1, 2, 3}));  // keys
  ASSERT_TRUE(f.pass({0, 1, 2, 3}));  // shares
  EXPECT_THROW(f.clients[0]->poll_once(), Error) << "the push must be lost";
  ASSERT_TRUE(f.pass({1, 2, 3}));  // inputs
  EXPECT_EQ(f.phase(), secagg::ServerSession::Phase::input) << "silo-0's input is awaited";
  ASSERT_TRUE(f.pass({0}));  // asked again
  ASSERT_EQ(lossy.pushed.size(), 2u);
  EXPECT_EQ(lossy.pushed[0], lossy.pushed[1]) << "the masked update was not sent as it was";
  EXPECT_EQ(f.clients[0]->trainer().steps_taken(), 2) << "it trained the round again";
  ASSERT_EQ(f.phase(), secagg::ServerSession::Phase::unmask);
  ASSERT_TRUE(f.pass({0, 1, 2, 3}));  // reveals
  const auto s = f.server.end_round();
  ASSERT_TRUE(s.aggregated);
  EXPECT_EQ(s.participants.size(), 4u);
}

TEST(SecureRound, HostileOrMisplacedMessagesAreRefused) {
  Quiet q;
  const auto dir = temp_dir("hostile");
  const auto silos = make_silos(dir, 2);
  set_num_threads(1);
  Federation f(secure_sim_config(dir, silos, "fedavg", 1, true));
  pb::SecAggRequest r;
  r.set_client_id("silo-0");
  r.set_round(1);
  r.set_get_roster(true);
  EXPECT_THROW(f.server.secagg(r, ""), Error);  // no round open
  ASSERT_TRUE(f.server.begin_round());
  EXPECT_THROW(f.server.secagg(r, ""), Error);  // wrong phase
  r.set_round(2);
  EXPECT_THROW(f.server.secagg(r, ""), Error);  // not the open round
  r.set_round(1);
  r.set_client_id("bad id!");
  EXPECT_THROW(f.server.secagg(r, ""), Error);
  r.set_client_id("silo-0");
  EXPECT_THROW(f.server.secagg(r, "silo-1"), Error);  // another certificate
  pb::SecAggRequest empty;
  empty.set_client_id("silo-0");
  empty.set_round(1);
  EXPECT_THROW(f.server.secagg(empty, ""), Error);
  ASSERT_TRUE(f.pass({0, 1}));
  ASSERT_TRUE(f.pass({0, 1}));
  ASSERT_EQ(f.phase(), secagg::ServerSession::Phase::input);
  // A plain float32 update where a masked one is due is refused.
  pb::UpdateInfo info;
  info.set_client_id("silo-0");
  info.set_round(1);
  info.set_tokens(10);
  const auto plain = encode_weights(f.server.specs(), f.server.global_weights(), CompressOptions{});
  EXPECT_THROW(f.server.push_begin(info, plain.header, ""), Error);
  // And a plain server refuses secure-aggregation messages.
  Federation p(secure_sim_config(dir / "plain", silos, "fedavg", 1, false));
  ASSERT_TRUE(p.server.begin_round());
  EXPECT_THROW(p.server.secagg(r, ""), Error);
}

namespace {

// One round of FedAvg (lr 1) over 3 silos under central DP (clip 0.05, weights min(1, t / 256)
// with 128 tokens each: 1/2), masked or not; `min_clients` 2.
SimConfig dp_sim_config(const fs::path& dir, const std::vector<fs::path>& silos, bool secure,
                        double z) {
  SimConfig c = secure_sim_config(dir, silos, "fedavg", 1, secure);
  c.server.strategy.min_clients = 2;
  c.server.privacy = central_dp(z, 0.05);
  c.server.privacy.weighting = "capped_tokens";
  c.server.privacy.token_cap = 256;
  return c;
}

}  // namespace

TEST(DistributedDp, WithoutNoiseTheClientsClipAndWeighAsTheCentralServerDoes) {
  Quiet q;
  const auto dir = temp_dir("dp-clip");
  const auto silos = make_silos(dir, 3);
  set_num_threads(1);
  const auto central_cfg = dp_sim_config(dir / "central", silos, false, 0);
  const auto secure_cfg = dp_sim_config(dir / "secure", silos, true, 0);
  const auto central = run_simulation(central_cfg, false);
  const auto secure = run_simulation(secure_cfg, false);
  // The central server clipped every update (so clipping on the clients is what is compared).
  const auto central_metrics = read_jsonl(central_cfg.server.dir / "metrics.jsonl");
  ASSERT_EQ(central_metrics.size(), 1u);
  EXPECT_EQ(central_metrics[0]["clipped"].get<int64_t>(), 3);
  // (sum_i w_i clip(delta_i)) / m either way: the weights differ by the quantisation's bound
  // plus float32 roundings of the weights.
  EXPECT_LE(max_abs_diff(central.global, secure.global),
            secure_cfg.server.secure_aggregation.error_bound() + 0x1p-22);
  const model::Llama initial(central_cfg.server.model, central_cfg.server.seed);
  // 3 clipped updates of norm 0.05, halved, over 3: a move of norm 0.025 at most.
  const double moved = max_abs_diff(central.global, model_weights(initial));
  EXPECT_GT(moved, 1e-4);
  EXPECT_LT(moved, 0.025 + 1e-6);
  const auto metrics = read_jsonl(secure_cfg.server.dir / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 1u);
  EXPECT_EQ(metrics[0]["aggregation"], "secure_dp_mean");
}

TEST(DistributedDp, TheClientsNoiseSharesAddUpToTheCentralMechanismsStd) {
  Quiet q;
  const auto dir = temp_dir("dp-noise");
  const auto silos = make_silos(dir, 3);
  set_num_threads(1);
  const double z = 1.0;
  const auto quiet_cfg = dp_sim_config(dir / "quiet", silos, true, 0);
  const auto noisy_cfg = dp_sim_config(dir / "noisy", silos, true, z);
  const auto quiet = run_simulation(quiet_cfg, false);
  const auto noisy = run_simulation(noisy_cfg, false);
  // Any unmasked sum holds at least k = the threshold, 2 of 3 holders, inputs, so each client
  // adds discrete Gaussian noise of variance (z C)^2 / 2 (in steps of 2^-24, rounded up, as good
  // as continuous at this scale); the 3 inputs' noise over m = 3 has std
  // z C sqrt(3 / 2) / 3 per value, which is what separates the two runs' weights.
  double s = 0, s2 = 0;
  int64_t n = 0;
  for (size_t i = 0; i < quiet.global.size(); ++i) {
    for (int64_t j = 0; j < quiet.global[i].numel(); ++j, ++n) {
      const double d =
          static_cast<double>(noisy.global[i].data<float>()[j]) - quiet.global[i].data<float>()[j];
      s += d;
      s2 += d * d;
    }
  }
  const double mean = s / static_cast<double>(n);
  const double std = std::sqrt(s2 / static_cast<double>(n) - mean * mean);
  const double want = z * 0.05 * std::sqrt(1.5) / 3;
  ASSERT_GT(n, 10000);
  EXPECT_NEAR(std, want, 0.03 * want) << n << " values";
  EXPECT_NEAR(mean, 0, 5 * want / std::sqrt(static_cast<double>(n)));
  const auto metrics = read_jsonl(noisy_cfg.server.dir / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 1u);
  const auto& privacy = metrics[0]["privacy"];
  EXPECT_DOUBLE_EQ(privacy["sum_noise_multiplier"].get<double>(), z * std::sqrt(1.5));
  EXPECT_DOUBLE_EQ(privacy["sampling_rate"].get<double>(), 1.0);
  // The discrete Gaussian's release costs a hair more than the Gaussian of multiplier z.
  const double gaussian = PrivacyAccountant().after(1.0, z).epsilon(1e-5).epsilon;
  EXPECT_GT(privacy["epsilon"].get<double>(), gaussian);
  EXPECT_NEAR(privacy["epsilon"].get<double>(), gaussian, 1e-4 * gaussian);
  EXPECT_EQ(privacy["noise"], "discrete_gaussian");
  // How far the rounding may grow the clip: D2 step / C for the model's values.
  const auto& options = noisy_cfg.server.secure_aggregation;
  const double growth = secagg::rounded_norm_bound(0.05, n, options) * options.step / 0.05;
  EXPECT_DOUBLE_EQ(privacy["rounded_norm_over_clip"].get<double>(), growth);
  EXPECT_GT(growth, 1);
  EXPECT_LT(growth, 1 + 1e-5);
}

TEST(DistributedDp, TheBudgetCheckChargesTheDiscreteGaussiansCost) {
  Quiet q;
  const auto dir = temp_dir("dp-budget");
  const auto silos = make_silos(dir, 3);
  set_num_threads(1);
  // A budget a tenth of a part in a million above one Gaussian round of multiplier z: the central
  // server's round costs exactly that and runs; the discrete Gaussian's costs a few parts in a
  // million more here (clip 0.05 is 838861 steps), so the secure server refuses it before any
  // client trains or adds noise.
  const double z = 1.0;
  const double gaussian = PrivacyAccountant().after(1.0, z).epsilon(1e-5).epsilon;
  auto budgeted = [&](const fs::path& at, bool secure) {
    SimConfig c = dp_sim_config(at, silos, secure, z);
    c.server.privacy.epsilon_budget = gaussian * (1 + 1e-7);
    return c;
  };
  const auto central_cfg = budgeted(dir / "central", false);
  const auto secure_cfg = budgeted(dir / "secure", true);
  EXPECT_EQ(run_simulation(central_cfg, false).rounds, 1);
  EXPECT_EQ(run_simulation(secure_cfg, false).rounds, 0);
  const auto metrics = read_jsonl(secure_cfg.server.dir / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 1u);
  EXPECT_EQ(metrics[0]["status"], "refused");
  EXPECT_NE(metrics[0]["reason"].get<std::string>().find("privacy.epsilon_budget"),
            std::string::npos)
      << metrics[0];
}

TEST(DistributedDp, AdaptiveClippingFollowsTheMaskedCountAsTheCentralServerDoes) {
  Quiet q;
  const auto dir = temp_dir("dp-adaptive");
  const auto silos = make_silos(dir, 3);
  set_num_threads(1);
  // No update noise and almost no count noise: the clients' masked indicators must move C as the
  // central server's count of the updates it clipped does, round after round.
  auto adaptive = [&](const fs::path& at, bool secure) {
    SimConfig c = dp_sim_config(at, silos, secure, 0);
    c.server.rounds = 2;
    c.server.privacy.adaptive_clip = true;
    c.server.privacy.clipped_count_stddev = 1e-9;
    return c;
  };
  const auto central_cfg = adaptive(dir / "central", false);
  const auto secure_cfg = adaptive(dir / "secure", true);
  const auto central = run_simulation(central_cfg, false);
  const auto secure = run_simulation(secure_cfg, false);
  const auto cm = read_jsonl(central_cfg.server.dir / "metrics.jsonl");
  const auto sm = read_jsonl(secure_cfg.server.dir / "metrics.jsonl");
  ASSERT_EQ(cm.size(), 2u);
  ASSERT_EQ(sm.size(), 2u);
  for (size_t r = 0; r < 2; ++r) {
    const auto& c = cm[r]["privacy"];
    const auto& s = sm[r]["privacy"];
    EXPECT_NEAR(s["noised_unclipped_fraction"].get<double>(),
                c["noised_unclipped_fraction"].get<double>(), 1e-6);
    // The count's discrete noise is at least one step (2^-24) of variance, so the clips agree
    // to its effect, not bitwise.
    EXPECT_NEAR(s["next_clip"].get<double>(), c["next_clip"].get<double>(), 1e-7);
    EXPECT_NEAR(s["clip"].get<double>(), c["clip"].get<double>(), 1e-7);
  }
  // Every update was clipped at 0.05 (fraction 0), so C grew by exp(0.2 * 0.5) after round 1.
  EXPECT_NEAR(sm[0]["privacy"]["noised_unclipped_fraction"].get<double>(), 0, 1e-6);
  EXPECT_NEAR(sm[0]["privacy"]["next_clip"].get<double>(), 0.05 * std::exp(0.1), 1e-7);
  EXPECT_LT(max_abs_diff(central.global, secure.global), 1e-5);
}

TEST(DistributedDp, TooFewInputsRevealNothingAndAFailedUnmaskIsStillAccountedAndSaved) {
  Quiet q;
  const auto dir = temp_dir("dp-fail");
  auto cfg = secure_sim_config(dir, make_silos(dir, 4), "fedavg", 1, true);  // threshold 3 of 4
  cfg.server.strategy.min_clients = 3;
  cfg.server.privacy = central_dp(1.0, 0.05);
  set_num_threads(1);
  Federation f(cfg);
  const Weights before = f.server.global_weights();
  // Attempt 1: two of four masked inputs, fewer than min_clients: the session fails before the
  // unmask phase, nobody reveals a share, and no release happened to account.
  ASSERT_TRUE(f.server.begin_round());
  ASSERT_TRUE(f.pass({0, 1, 2, 3}));  // keys
  ASSERT_TRUE(f.pass({0, 1, 2, 3}));  // shares
  ASSERT_TRUE(f.pass({0, 1}));        // inputs
  EXPECT_TRUE(f.server.close_phase());
  EXPECT_EQ(f.phase(), secagg::ServerSession::Phase::failed);
  const auto first = f.server.end_round();
  EXPECT_FALSE(first.aggregated);
  // Attempt 2: every input, but two of four reveal (threshold 3): the unmask fails, yet the
  // server held revealed shares, so the release is accounted and saved with the old model.
  ASSERT_TRUE(f.server.begin_round());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(f.pass({0, 1, 2, 3}));  // keys, shares, inputs
  ASSERT_TRUE(f.pass({0, 1}));
  EXPECT_TRUE(f.server.close_phase());
  const auto second = f.server.end_round();
  EXPECT_FALSE(second.aggregated);
  EXPECT_TRUE(bitwise_equal(before, f.server.global_weights())) << "nothing may be applied";
  const auto metrics = read_jsonl(cfg.server.dir / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 2u);
  EXPECT_NE(metrics[0]["secagg_error"].get<std::string>().find(
                "2 masked inputs, fewer than min_clients 3; nothing is unmasked"),
            std::string::npos)
      << metrics[0];
  EXPECT_FALSE(metrics[0].contains("privacy"));
  EXPECT_EQ(metrics[1]["status"], "retry");
  ASSERT_TRUE(metrics[1].contains("privacy"));
  EXPECT_EQ(metrics[1]["privacy"]["private_rounds"].get<int64_t>(), 1);
  const auto saved = io::list_checkpoints(cfg.server.dir / "checkpoints");
  ASSERT_FALSE(saved.empty());
  EXPECT_EQ(io::checkpoint_step(saved.back()), 0);
  const auto state = nlohmann::json::parse(read_file(saved.back() / "state.json"));
  EXPECT_EQ(state["privacy"]["steps"].get<int64_t>(), 1) << "the accountant must be saved";
  // A resumed run goes on at attempt 3: attempt 2's client sample was released already.
  EXPECT_EQ(state["retries"].get<int64_t>(), 2);
  EXPECT_EQ(Coordinator(cfg.server, true).status().round_retries, 2);
  // Resuming that run without [privacy] would release rounds that no accountant counts.
  ServerConfig without = cfg.server;
  without.privacy = PrivacyOptions{};
  try {
    Coordinator resumed(without, true);
    ADD_FAILURE() << "a private run resumed without [privacy]";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("was written under [privacy]"), std::string::npos)
        << e.what();
  }
}

// A server stopped (SIGINT, SIGTERM) in the unmask phase after some shares were revealed may be
// able to unmask a sum: the round ends as a failed unmask does, its release accounted and saved,
// and the resumed run starts from that account.
TEST(DistributedDp, AServerStoppedAfterRevealsAccountsAndSavesTheRound) {
  Quiet q;
  const auto dir = temp_dir("dp-stop");
  auto cfg = secure_sim_config(dir, make_silos(dir, 4), "fedavg", 1, true);  // threshold 3 of 4
  cfg.server.strategy.min_clients = 3;
  cfg.server.max_round_retries = 0;
  cfg.server.privacy = central_dp(1.0, 0.05);
  set_num_threads(1);
  Federation f(cfg);
  std::thread rounds([&] { f.server.run(); });
  while (f.server.status().open_round == 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(f.pass({0, 1, 2, 3}));  // keys, shares, inputs
  ASSERT_TRUE(f.pass({0, 1}));  // two of four reveal; the threshold is 3
  f.server.stop();
  rounds.join();
  EXPECT_EQ(f.server.rounds_done(), 0);
  // A stop, not a failed run, though no retry was left (max_round_retries 0 below).
  EXPECT_EQ(f.server.stopped_reason(), "");
  const auto saved = io::list_checkpoints(cfg.server.dir / "checkpoints");
  ASSERT_FALSE(saved.empty()) << "the revealed round must be saved";
  EXPECT_EQ(io::checkpoint_step(saved.back()), 0);
  const auto state = nlohmann::json::parse(read_file(saved.back() / "state.json"));
  EXPECT_EQ(state["privacy"]["steps"].get<int64_t>(), 1) << "the accountant must hold the round";
  const auto metrics = read_jsonl(cfg.server.dir / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 1u);
  EXPECT_EQ(metrics[0]["status"], "retry");
  EXPECT_EQ(metrics[0]["privacy"]["private_rounds"].get<int64_t>(), 1);
  Coordinator resumed(cfg.server, true);
  EXPECT_EQ(resumed.status().private_rounds, 1);
  EXPECT_EQ(resumed.rounds_done(), 0);
  EXPECT_EQ(resumed.status().round_retries, 1);
}

// A server killed after shares were revealed, before the round's checkpoint, loses no charge: the
// release is written to privacy_charge.json before anyone is asked to reveal, and a resumed run
// takes it (and goes on at the round's next attempt); a checkpoint that holds it removes it.
TEST(DistributedDp, AServerKilledAfterRevealsKeepsTheChargeWrittenAhead) {
  Quiet q;
  const auto dir = temp_dir("dp-kill");
  auto cfg = secure_sim_config(dir, make_silos(dir, 4), "fedavg", 1, true);  // threshold 3 of 4
  cfg.server.strategy.min_clients = 3;
  cfg.server.privacy = central_dp(1.0, 0.05);
  set_num_threads(1);
  const fs::path charge = cfg.server.dir / "privacy_charge.json";
  {
    Federation f(cfg);
    ASSERT_TRUE(f.server.begin_round());
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(f.pass({0, 1, 2, 3}));  // keys, shares, inputs
    ASSERT_TRUE(fs::exists(charge)) << "written before any share is revealed";
    ASSERT_TRUE(f.pass({0, 1, 2}));  // reveals: the server can unmask the sum now
    // Killed here: no end_round, no checkpoint.
  }
  ASSERT_TRUE(io::list_checkpoints(cfg.server.dir / "checkpoints").empty());
  try {
    Coordinator fresh(cfg.server, false);
    ADD_FAILURE() << "a fresh run over an unsaved charge";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("resume the run (--resume) so that it is accounted"),
              std::string::npos)
        << e.what();
  }
  {
    Coordinator resumed(cfg.server, true);
    EXPECT_EQ(resumed.status().private_rounds, 1);
    EXPECT_EQ(resumed.rounds_done(), 0);
    EXPECT_EQ(resumed.status().round_retries, 1) << "the released attempt's sample is not redrawn";
  }
  // The resumed run's first round is saved with both releases accounted, and the file is gone.
  Federation f(cfg, true);
  ASSERT_TRUE(f.server.begin_round());
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(f.pass({0, 1, 2, 3}));
  EXPECT_TRUE(f.server.end_round().aggregated);
  EXPECT_FALSE(fs::exists(charge));
  const auto saved = io::list_checkpoints(cfg.server.dir / "checkpoints");
  ASSERT_FALSE(saved.empty());
  const auto state = nlohmann::json::parse(read_file(saved.back() / "state.json"));
  EXPECT_EQ(state["privacy"]["steps"].get<int64_t>(), 2);
}

TEST(DistributedDp, AClientStopsAtRepeatableNoiseUnlessItTakesIt) {
  Quiet q;
  const auto dir = temp_dir("dp-seeded");
  auto cfg = dp_sim_config(dir, make_silos(dir, 3), true, 1.0);  // noise_seed 7
  cfg.clients[0].allow_repeatable_noise = false;
  set_num_threads(1);
  Federation f(cfg);
  ASSERT_TRUE(f.server.begin_round());
  ASSERT_TRUE(f.pass({0, 1, 2}));  // keys
  try {
    f.clients[0]->poll_once();  // shares: the roster asks for repeatable noise
    ADD_FAILURE() << "a client took repeatable noise without client.allow_repeatable_noise";
  } catch (const RoundCannotSucceed& e) {
    EXPECT_NE(std::string(e.what()).find("client.allow_repeatable_noise"), std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(f.clients[1]->poll_once()) << "a client that takes it goes on";
}

TEST(SecureConfig, KeysAreReadCheckedAndCompressionMustBeNone) {
  const auto dir = temp_dir("config");
  auto load = [&](const std::string& extra) {
    write_file_atomic(dir / "fed.toml", cat("[server]\ndir = '", (dir / "run").string(), "'\n",
                                            kTinyModelToml, extra));
    return load_server_config(dir / "fed.toml");
  };
  const auto c = load(
      "[secure_aggregation]\nenabled = true\nthreshold = 3\nneighbours = 4\nring_bits = 32\n"
      "range = 0.5\nstep = 0.0001\nrounding = 'nearest'\nphase_timeout_s = 5\n");
  EXPECT_TRUE(c.secure_aggregation.enabled);
  EXPECT_EQ(c.secure_aggregation.threshold, 3);
  EXPECT_EQ(c.secure_aggregation.neighbours, 4);
  EXPECT_EQ(c.secure_aggregation.ring_bits, 32);
  EXPECT_FALSE(c.secure_aggregation.stochastic);
  auto refused = [&](const std::string& extra, const std::string& says) {
    try {
      load(extra);
      ADD_FAILURE() << "accepted: " << extra;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused("[secure_aggregation]\nenabled = true\nfoo = 1\n", "foo");
  refused("[secure_aggregation]\nring_bits = 16\n", "ring_bits");
  refused("[secure_aggregation]\nthreshold = 1\n", "threshold");
  refused("[secure_aggregation]\nrounding = 'up'\n", "rounding");
  refused("[secure_aggregation]\nphase_timeout_s = 1e30\n", "phase_timeout_s");
  refused("[secure_aggregation]\nring_bits = 32\nrange = 1\nstep = 1e-12\n", "ring_bits");
  refused("[secure_aggregation]\nenabled = true\n[compression]\ncodec = 'int8'\n",
          "compression.codec must be none");
  // Distributed DP: a fixed clip and a fixed-size sample.
  const std::string dp =
      "[secure_aggregation]\nenabled = true\n[privacy]\nnoise_multiplier = 1\n"
      "clip = 0.5\n";
  EXPECT_TRUE(load(dp).privacy.enabled);
  EXPECT_TRUE(load(dp + "adaptive_clip = true\nclipped_count_stddev = 2\n").privacy.adaptive_clip);
  refused(
      "[secure_aggregation]\nenabled = true\nrange = 0.25\nstep = 0.0001\n[privacy]\n"
      "noise_multiplier = 1\nclip = 0.5\nadaptive_clip = true\n",
      "secure_aggregation.range");
  refused(dp + "sampling = 'poisson'\n", "privacy.sampling");
}

TEST(SecureGrpc, DeployedOnLoopbackEqualsTheSimulationBitwise) {
  // Plain secure aggregation, and with distributed DP and adaptive clipping (its noise seeded, so
  // repeatable): the roster's DP parameters and the masked counts cross the wire too.
  for (const bool private_ : {false, true}) {
    const auto dir = temp_dir(private_ ? "grpc-dp" : "grpc");
    const auto silos = make_silos(dir, 3);
    {
      Quiet q;
      auto cfg = secure_sim_config(dir / "sim", silos, "diloco", 2, true);
      cfg.server.secure_aggregation.neighbours = 2;
      cfg.server.strategy.min_clients = 3;
      if (private_) {
        cfg.server.privacy = central_dp(0.5, 0.05);
        cfg.server.privacy.adaptive_clip = true;
        cfg.server.privacy.clipped_count_stddev = 1;
      }
      run_simulation(cfg, false);
    }
    const std::string address = loopback_address();
    const std::string privacy =
        private_ ? "[privacy]\nnoise_multiplier = 0.5\nclip = 0.05\nnoise_seed = 7\n"
                   "adaptive_clip = true\nclipped_count_stddev = 1\n"
                 : "";
    write_file_atomic(dir / "fed.toml",
                      cat("[server]\ndir = '", (dir / "dep").string(), "'\naddress = '", address,
                          "'\nseed = 5\nrounds = 2\nlocal_steps = 2\neval_every = 0\n"
                          "round_timeout_s = 120\nwait_for_clients_s = 60\n[strategy]\n"
                          "name = 'diloco'\nmin_clients = 3\n[secure_aggregation]\nenabled = "
                          "true\nneighbours = 2\n",
                          privacy, kTinyModelToml));
    // [client] takes the seeded noise: a test setting, refused unless asked for.
    const std::string repeatable = "allow_repeatable_noise = true\n";
    const std::string train = "[train]\nmicro_batch = 4\nseq = 16\nlr = 3e-3\nweight_decay = 0\n";
    for (int i = 0; i < 3; ++i) {
      write_file_atomic(
          dir / cat("client", i, ".toml"),
          cat("[client]\nid = 'silo-", i, "'\nserver = '", address, "'\nseed = ", 100 + i,
              "\nthreads = 1\n", private_ ? repeatable : "", "[data]\nmanifests = ['",
              silos[i].string(), "']\n", train, kTinyModelToml));
    }
    expect_deployment_equals_simulation(dir, 3, 2);
    if (private_) {
      const auto metrics = read_jsonl(dir / "dep/metrics.jsonl");
      ASSERT_FALSE(metrics.empty());
      EXPECT_EQ(metrics.back()["aggregation"], "secure_dp_mean");
      EXPECT_NE(metrics.back()["privacy"]["clip"].get<double>(), 0.05) << "C must have moved";
    }
  }
}
