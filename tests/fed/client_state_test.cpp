// Client-side state across restarts: a client stopped after a round (or killed mid-round, as a
// process) and started again from its state folder continues exactly as if it had never
// stopped.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <functional>
#include <thread>

#include "base/thread_pool.h"
#include "fed/client.h"
#include "fed/coordinator.h"
#include "fed/fixtures.h"
#include "fed/run.h"
#include "io/checkpoint.h"
#include "model/llama.h"
#include "support/errors.h"

using namespace pollen;
using namespace pollen::fed;
using namespace pollen::fed::testing;

namespace {

// Three rounds of the one client of `cfg`, rebuilt (as a new process would be) after round
// `restart_after` with the config `before_restart` leaves (it may also touch the state folder);
// the rebuilt client must say it resumed round `resumed_round`. Returns the final global model.
Weights three_rounds(SimConfig cfg, int restart_after,
                     const std::function<void(ClientConfig&)>& before_restart, int resumed_round) {
  Coordinator server(cfg.server, false);
  LocalTransport transport(server);
  auto client = std::make_unique<Client>(cfg.clients[0], transport);
  client->join();
  for (int round = 1; round <= 3; ++round) {
    if (round == restart_after + 1) {
      client.reset();  // the silo is killed between rounds
      before_restart(cfg.clients[0]);
      client = std::make_unique<Client>(cfg.clients[0], transport);
      EXPECT_EQ(client->last_round(), resumed_round);
      client->join();
    }
    EXPECT_TRUE(server.begin_round());
    EXPECT_EQ(client->poll_once(), pb::TASK_TRAIN);
    EXPECT_TRUE(server.end_round().aggregated);
  }
  return server.global_weights();
}

// The same with or without the client's state folder at the restart.
// Three rounds of H = 3 of one client with its state folder, int4 both ways.
SimConfig int4_config(const fs::path& dir, const fs::path& silo) {
  auto cfg = sim_config(dir, {silo}, "diloco", 3, 3);
  cfg.server.compression.codec = Codec::int4;  // so that the error-feedback residual matters
  // and a compressed download: the restarted client must still hold the model it pulled, or the
  // server sends it the whole view instead of a delta (ClientState.RestartedClient...Delta)
  cfg.server.server_codec = Codec::int4;
  cfg.clients[0].state_dir = dir / "client-state";
  return cfg;
}

Weights three_rounds(const fs::path& dir, const fs::path& silo, int restart_after,
                     bool keep_state) {
  SimConfig cfg = int4_config(dir, silo);
  return three_rounds(
      cfg, restart_after,
      [&](ClientConfig& c) {
        if (!keep_state) fs::remove_all(c.state_dir);
      },
      keep_state ? restart_after : 0);
}

}  // namespace

// What the server sent in `round` (metrics.jsonl's bytes_sent).
static uint64_t bytes_sent(const fs::path& server_dir, int round) {
  return read_jsonl(server_dir / "metrics.jsonl").at(static_cast<size_t>(round - 1))["bytes_sent"];
}

TEST(ClientState, RestartedClientContinuesWithItsState) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("client_state");
  const auto silo = make_silo(dir / "a", 3);
  const Weights uninterrupted = three_rounds(dir / "run0", silo, 3, true);
  const Weights resumed = three_rounds(dir / "run1", silo, 1, true);
  EXPECT_TRUE(bitwise_equal(uninterrupted, resumed))
      << "a client restarted from its state should continue bitwise";
  // Without its state (fresh AdamW, loader from the start, no residual) the run differs: the
  // comparison above can tell.
  const Weights afresh = three_rounds(dir / "run2", silo, 1, false);
  EXPECT_FALSE(bitwise_equal(uninterrupted, afresh));
  // Round 2's download: the restarted client still held the model it pulled, so it got the int4
  // delta as the uninterrupted one did; without its state it got the whole model in float32.
  uint64_t numel = 0;
  for (const auto& w : model_weights(model::Llama(tiny_model(), 0)))
    numel += static_cast<uint64_t>(w.numel());
  EXPECT_LT(bytes_sent(dir / "run1" / "server", 2), numel);
  EXPECT_EQ(bytes_sent(dir / "run1" / "server", 2), bytes_sent(dir / "run0" / "server", 2));
  EXPECT_EQ(bytes_sent(dir / "run2" / "server", 2), 4 * numel);
  fs::remove_all(dir);
}

TEST(ClientState, RestartedClientKeepsItsDriftAnchor) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("client_state_drift");
  const auto silo = make_silo(dir / "a", 3);
  // Under DiLoCo G - d is not zero, so rounds 2 and 3 are corrected (fed/drift_correction.h).
  // Round 1 is never corrected, so a client that ran it with beta 0 holds the same state but no
  // anchor: restarted with beta 1 after it, it trains round 2 uncorrected.
  auto run = [&](const std::string& name, int restart_after, double beta_before_restart) {
    SimConfig cfg = sim_config(dir / name, {silo}, "diloco", 3, 5);
    cfg.clients[0].train.drift_correction = beta_before_restart;
    cfg.clients[0].state_dir = dir / name / "state";
    return three_rounds(
        cfg, restart_after, [](ClientConfig& c) { c.train.drift_correction = 1; }, restart_after);
  };
  const Weights uninterrupted = run("run0", 3, 1);
  EXPECT_TRUE(bitwise_equal(run("run1", 1, 1), uninterrupted))
      << "a client restarted from its state should continue bitwise, its correction included";
  // Without the anchor round 2 goes uncorrected: the comparison above can tell.
  EXPECT_FALSE(bitwise_equal(run("run2", 1, 0), uninterrupted));
  fs::remove_all(dir);
}

TEST(ClientState, StateOfAnotherClientOrDatasetIsRefused) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("client_state_refused");
  auto cfg = sim_config(dir, {make_silo(dir / "a", 1), make_silo(dir / "b", 3)}, "fedavg", 1, 1);
  cfg.clients[0].state_dir = dir / "state";
  {
    Coordinator server(cfg.server, false);
    LocalTransport transport(server);
    Client a(cfg.clients[0], transport);
    a.join();
    ASSERT_TRUE(server.begin_round());
    a.poll_once();
    server.end_round();
  }
  Coordinator server(cfg.server, true);
  LocalTransport transport(server);
  auto other = cfg.clients[1];
  other.state_dir = dir / "state";  // silo-1 pointed at silo-0's state
  try {
    Client b(other, transport);
    ADD_FAILURE() << "another client's state was resumed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("belongs to client 'silo-0'"), std::string::npos)
        << e.what();
  }
  auto moved = cfg.clients[0];
  moved.manifests = cfg.clients[1].manifests;  // silo-0 now with other data
  try {
    Client a(moved, transport);
    ADD_FAILURE() << "a state trained on other data was resumed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("was trained on data"), std::string::npos) << e.what();
  }
  // The resumed server is the same run: silo-0 joins it with its state. A new federation (a
  // fresh server in another folder) is another run: the state is refused at the join, before
  // its optimizer, data position and error feedback go into that run.
  {
    Client a(cfg.clients[0], transport);
    EXPECT_NO_THROW(a.join());
  }
  ServerConfig fresh = cfg.server;
  fresh.dir = dir / "new-federation";
  Coordinator other_run(fresh, false);
  LocalTransport other_transport(other_run);
  Client a(cfg.clients[0], other_transport);
  const std::string e = pollen::testing::error_of([&] { a.join(); });
  EXPECT_NE(e.find("client.state_dir '" + (dir / "state").string() +
                   "' holds the state of another federation run"),
            std::string::npos)
      << e;
  fs::remove_all(dir);
}

// A client the server refuses at the join (another model here) saves no state: its corrected
// config then starts as a fresh client, not from the refused one's weights.
TEST(ClientState, AClientRefusedAtTheJoinLeavesNoState) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("client_state_refused_join");
  auto cfg = sim_config(dir, {make_silo(dir / "a", 1)}, "fedavg", 1, 1);
  cfg.clients[0].state_dir = dir / "state";
  Coordinator server(cfg.server, false);
  LocalTransport transport(server);
  auto wider = cfg.clients[0];
  wider.model.intermediate_size *= 2;
  {
    Client refused(wider, transport);
    EXPECT_NE(pollen::testing::error_of([&] { refused.join(); }).find("intermediate_size"),
              std::string::npos);
  }
  EXPECT_FALSE(fs::exists(dir / "state" / "checkpoints"));
  Client a(cfg.clients[0], transport);
  EXPECT_NO_THROW(a.join());
  EXPECT_TRUE(fs::exists(dir / "state" / "checkpoints"));
  fs::remove_all(dir);
}

// A restarted client's [local_dp] accountant counts the rounds before the restart, so the epsilon
// it reports is that of every update it released; a state of rounds released without [local_dp]
// is not resumed under it, since no epsilon can be claimed for them.
TEST(ClientState, RestartedClientKeepsItsPrivacyAccount) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("client_state_dp");
  const auto silo = make_silo(dir / "a", 3);
  auto cfg = sim_config(dir / "run0", {silo}, "fedavg", 3, 2);
  auto with_dp = [](ClientConfig& c) {
    c.local_dp.enabled = true;
    c.local_dp.clip = 0.05;
    c.local_dp.noise_multiplier = 1.0;
    c.local_dp.noise_seed = 9;
  };
  with_dp(cfg.clients[0]);
  cfg.clients[0].state_dir = dir / "run0" / "state";
  three_rounds(
      cfg, 2, [](ClientConfig&) {}, 2);
  const auto state = nlohmann::json::parse(read_file(
      io::list_checkpoints(dir / "run0" / "state" / "checkpoints").back() / "state.json"));
  EXPECT_EQ(state["round"], 3);
  EXPECT_EQ(state["local_dp"]["steps"], 3) << "the accountant forgot the rounds before the restart";
  // Going back to an earlier state (a lost update: the states of later rounds are removed) never
  // takes the account back: a client restarted after that still counts every release.
  const auto states = io::list_checkpoints(dir / "run0" / "state" / "checkpoints");
  ASSERT_GE(states.size(), 2u);
  for (size_t i = 1; i < states.size(); ++i) fs::remove_all(states[i]);
  {
    Coordinator server(cfg.server, true);
    LocalTransport transport(server);
    const Client restarted(cfg.clients[0], transport);
    EXPECT_LT(restarted.last_round(), 3);
    ASSERT_NE(restarted.local_dp(), nullptr);
    EXPECT_EQ(restarted.local_dp()->releases(), 3);
  }

  auto plain = sim_config(dir / "run1", {silo}, "fedavg", 3, 2);
  plain.clients[0].state_dir = dir / "run1" / "state";
  try {
    three_rounds(plain, 1, with_dp, 1);
    ADD_FAILURE() << "rounds released without [local_dp] were resumed under it";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("holds no [local_dp] privacy account"), std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
}

// A client whose newest saved state does not verify resumes the one before and moves the bad one
// aside (retention would otherwise delete each new state in its favour); with none that verifies
// it refuses to start rather than train afresh beside them.
TEST(ClientState, CorruptStatesAreSetAsideOrRefused) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("client_state_corrupt");
  auto cfg = sim_config(dir, {make_silo(dir / "a", 3)}, "fedavg", 3, 2);
  cfg.clients[0].state_dir = dir / "state";
  const fs::path states = dir / "state" / "checkpoints";
  three_rounds(
      cfg, 2,
      [&](ClientConfig&) { flip_a_byte(io::list_checkpoints(states).back() / "state.json"); }, 1);
  EXPECT_TRUE(fs::exists(states / ".corrupt-step-00000004" / "manifest.json"));
  const auto kept = io::list_checkpoints(states);
  ASSERT_EQ(kept.size(), 2u);  // keep_checkpoints: the states of rounds 1 and 3
  for (const auto& s : kept) EXPECT_FALSE(io::verify_checkpoint(s)) << s;

  for (const auto& s : kept) flip_a_byte(s / "state.json");
  Coordinator server(cfg.server, true);
  LocalTransport transport(server);
  try {
    Client client(cfg.clients[0], transport);
    ADD_FAILURE() << "a client started beside saved states that do not verify";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no saved state under"), std::string::npos) << e.what();
  }
  EXPECT_EQ(io::list_checkpoints(states), kept);
  fs::remove_all(dir);
}

namespace {

struct Killed {};

// The client's process dies right after the server took its push, before the push returned.
class DiesAfterPush : public LocalTransport {
 public:
  using LocalTransport::LocalTransport;
  pb::PushReply push(const std::function<bool(pb::TensorStream&)>& next) override {
    LocalTransport::push(next);
    throw Killed{};
  }
};

}  // namespace

// The state is saved before the push: a client killed once the server has its update restarts
// after that round, not before it (which would train the round's data again, and send its
// error-feedback residual again).
TEST(ClientState, AClientKilledAfterItsPushRestartsAfterThatRound) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("killed_after_push");
  auto cfg = sim_config(dir, {make_silo(dir / "a", 1)}, "fedavg", 2, 3);
  cfg.clients[0].state_dir = dir / "state";
  Coordinator server(cfg.server, false);
  {
    DiesAfterPush dying(server);
    Client client(cfg.clients[0], dying);
    client.join();
    ASSERT_TRUE(server.begin_round());
    EXPECT_THROW(client.poll_once(), Killed);
  }
  ASSERT_TRUE(server.round_complete());  // the server has the update
  EXPECT_TRUE(server.end_round().aggregated);
  LocalTransport transport(server);
  Client restarted(cfg.clients[0], transport);
  restarted.join();
  ASSERT_TRUE(server.begin_round());
  EXPECT_EQ(restarted.poll_once(), pb::TASK_TRAIN);
  EXPECT_EQ(restarted.trainer().steps_taken(), 6);  // round 1's 3 steps once, then round 2's
  fs::remove_all(dir);
}

namespace {

// The connection fails after the server took the first push, before its answer came back.
class LosesFirstPushAnswer : public LocalTransport {
 public:
  using LocalTransport::LocalTransport;
  pb::PushReply push(const std::function<bool(pb::TensorStream&)>& next) override {
    pb::PushReply reply = LocalTransport::push(next);
    if (lost_++ == 0) throw Error("the connection to the federation server failed during push");
    return reply;
  }

 private:
  int lost_ = 0;
};

}  // namespace

// Whether a push whose answer was lost arrived is settled by the next task's update_round: the
// update arrived, so the error feedback it carried stays sent (restoring the residual held
// before it would send that part twice), and the run ends where an uninterrupted one does.
TEST(ClientState, APushWhoseAnswerWasLostCountsOnceWhenItArrived) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("lost_push_answer");
  const auto silo = make_silo(dir / "a", 3);
  const Weights uninterrupted = three_rounds(dir / "run0", silo, 3, true);
  const SimConfig cfg = int4_config(dir / "run1", silo);
  Coordinator server(cfg.server, false);
  LosesFirstPushAnswer transport(server);
  Client client(cfg.clients[0], transport);
  client.join();
  for (int round = 1; round <= 3; ++round) {
    ASSERT_TRUE(server.begin_round());
    if (round == 1) {
      EXPECT_THROW(client.poll_once(), Error);
    } else {
      EXPECT_EQ(client.poll_once(), pb::TASK_TRAIN);
    }
    ASSERT_TRUE(server.end_round().aggregated);
  }
  EXPECT_TRUE(bitwise_equal(uninterrupted, server.global_weights()))
      << "the lost answer's update counted differently from a delivered one";
  fs::remove_all(dir);
}

namespace {

// Round `lost_round`'s push never reaches the server: the connection fails first, or the client's
// process dies (Killed) after saving its state for the push.
class LosesAPush : public LocalTransport {
 public:
  LosesAPush(Coordinator& server, int lost_round, bool dies)
      : LocalTransport(server), lost_round_(lost_round), dies_(dies) {}
  pb::PushReply push(const std::function<bool(pb::TensorStream&)>& next) override {
    if (++pushes_ == lost_round_) {
      if (dies_) throw Killed{};
      throw Error("the connection to the federation server failed before push");
    }
    return LocalTransport::push(next);
  }

 private:
  int pushes_ = 0, lost_round_, dies_;
};

}  // namespace

// An update that never reached the server voids the error feedback held back for it, also when
// the client learns so only after a restart from the state it saved before the push: silo-0's
// round 2 update is lost (round 2 ends with silo-1's alone), and the run ends the same whether
// silo-0 was killed before its push or kept running.
TEST(ClientState, APushThatNeverArrivedVoidsItsErrorFeedbackAlsoAfterARestart) {
  Quiet q;
  set_num_threads(1);
  const auto dir = temp_dir("push_never_arrived");
  const std::vector<fs::path> silos = {make_silo(dir / "a", 3), make_silo(dir / "b", 4)};
  auto run = [&](const std::string& name, bool killed) {
    SimConfig cfg = sim_config(dir / name, silos, "diloco", 3, 3);
    cfg.server.compression.codec = Codec::int4;  // so that the error-feedback residual matters
    for (ClientConfig& c : cfg.clients) c.state_dir = dir / name / ("state-" + c.id);
    Coordinator server(cfg.server, false);
    LocalTransport transport(server);
    LosesAPush lossy(server, 2, killed);
    auto first = std::make_unique<Client>(cfg.clients[0], lossy);
    Client second(cfg.clients[1], transport);
    first->join();
    second.join();
    for (int round = 1; round <= 3; ++round) {
      EXPECT_TRUE(server.begin_round());
      if (round != 2) {
        EXPECT_EQ(first->poll_once(), pb::TASK_TRAIN);
      } else if (killed) {
        EXPECT_THROW(first->poll_once(), Killed);
        first = std::make_unique<Client>(cfg.clients[0], transport);
        EXPECT_EQ(first->last_round(), 2);
        first->join();
      } else {
        EXPECT_THROW(first->poll_once(), Error);
      }
      EXPECT_EQ(second.poll_once(), pb::TASK_TRAIN);
      EXPECT_TRUE(server.end_round().aggregated);
    }
    return server.global_weights();
  };
  EXPECT_TRUE(bitwise_equal(run("kept-running", false), run("killed", true)))
      << "the client restarted after its lost push sent error feedback of an update that never "
         "arrived";
  fs::remove_all(dir);
}

TEST(ClientState, KilledClientProcessRestartsFromItsState) {
  const auto dir = temp_dir("client_killed");
  const auto silo = make_silo(dir / "a", 3);
  constexpr int kSteps = 200;  // long enough rounds that the kill lands inside round 2
  {
    Quiet q;
    auto cfg = sim_config(dir / "sim", {silo}, "diloco", 3, kSteps);
    cfg.server.compression.codec = Codec::int4;
    run_simulation(cfg, false);
  }
  const std::string address = loopback_address();
  write_file_atomic(dir / "fed.toml",
                    cat("[server]\ndir = '", (dir / "dep").string(), "'\naddress = '", address,
                        "'\nseed = 5\nrounds = 3\nlocal_steps = ", kSteps,
                        "\nround_timeout_s = 120\nwait_for_clients_s = 60\n"
                        "[strategy]\nname = 'diloco'\n[compression]\ncodec = 'int4'\n",
                        kTinyModelToml));
  write_file_atomic(dir / "client.toml", client_toml(address, dir / "state", silo));
  auto spawn = [&](const std::string& sub, const fs::path& config, const std::string& log) {
    return spawn_pollen({"fed", sub, "--config", config.string()}, dir / log);
  };
  const pid_t server = spawn("server", dir / "fed.toml", "server.log");
  pid_t client = spawn("client", dir / "client.toml", "client-1.log");
  // Kill the client once its state after round 1 is on disk (it is then training round 2).
  auto state_saved = [&] {
    const auto states = io::list_checkpoints(dir / "state/checkpoints");
    return !states.empty() && io::checkpoint_step(states.back()) >= kSteps;
  };
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!state_saved() && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (!state_saved()) {
    ::kill(client, SIGKILL);
    ::kill(server, SIGKILL);
    waitpid(client, nullptr, 0);
    waitpid(server, nullptr, 0);
    FAIL() << "no client state after round 1; see " << dir.string() << "/*.log";
  }
  ::kill(client, SIGKILL);
  waitpid(client, nullptr, 0);
  client = spawn("client", dir / "client.toml", "client-2.log");
  for (pid_t pid : {client, server}) {
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "a process failed; see " << dir.string() << "/*.log";
  }
  EXPECT_NE(read_file(dir / "client-2.log").find("resumed its state of round"), std::string::npos);
  const auto sim = io::list_checkpoints(dir / "sim/server/checkpoints");
  const auto dep = io::list_checkpoints(dir / "dep/checkpoints");
  ASSERT_FALSE(sim.empty());
  ASSERT_FALSE(dep.empty());
  EXPECT_EQ(io::checkpoint_step(dep.back()), 3);
  EXPECT_TRUE(bitwise_equal(read_model(sim.back()), read_model(dep.back())))
      << "the client killed mid-round and restarted from its state should give the "
         "uninterrupted run's global model";
  fs::remove_all(dir);
}
