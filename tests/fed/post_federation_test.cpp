// Post-training federations over the real server and client (`pollen fed server` and `pollen fed
// client` with [post]): LoRA adapters' B as the exchanged state. A 2-silo SFT federation, and a
// GRPO one, of processes on loopback give bitwise the adapters of `pollen fed post`'s simulation,
// and a GRPO silo of two ranks the same to float rounding; a DPO federation raises the held-out
// margin; a silo of another LoRA config or base is refused naming the difference; a restarted
// server (and restarted clients with their state) continue bitwise; hostile adapter updates are
// refused; [post] keys are checked.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <thread>

#include "base/hash.h"
#include "base/thread_pool.h"
#include "fed/client.h"
#include "fed/coordinator.h"
#include "fed/fixtures.h"
#include "fed/grpc.h"
#include "fed/post_lora.h"
#include "fed/run.h"
#include "io/safetensors.h"
#include "support/errors.h"
#include "train/grpo.h"
#include "train/post_config.h"
#include "train/post_fixtures.h"
#include "train/preference_synth.h"

using pollen::testing::error_of;

namespace fs = std::filesystem;
using namespace pollen;
using namespace pollen::fed;
using namespace pollen::fed::testing;

namespace {

const char* kLora =
    "\n[lora]\nrank = 4\nalpha = 8\ntarget_modules = [\"q_proj\", \"v_proj\", \"down_proj\", "
    "\"lm_head\"]\ntrain_a = false\nseed = 11\n";

struct Fixture {
  fs::path dir, tokenizer, model_file;
  fs::path sft[2], dpo[2], dpo_validation, grpo[2];
};

const Fixture& fixture() {
  static const Fixture f = [] {
    Fixture x;
    x.dir = test_support::post_temp_dir("fed-post-wire");
    x.tokenizer = test_support::make_chat_tokenizer(x.dir);
    x.model_file = test_support::make_tiny_model_file(x.dir);
    x.sft[0] = test_support::write_sft_data(x.dir / "arithmetic.jsonl", "arithmetic", 40, 1);
    x.sft[1] = test_support::write_sft_data(x.dir / "reverse.jsonl", "reverse", 40, 2);
    auto pairs = [&](const std::string& name, int64_t count, uint64_t seed) {
      train::PreferenceSynthOptions o;
      o.task = "case";
      o.count = count;
      o.seed = seed;
      train::write_preference_synth(o, x.dir / name);
      return x.dir / name;
    };
    x.dpo[0] = pairs("dpo-a.jsonl", 32, 1);
    x.dpo[1] = pairs("dpo-b.jsonl", 32, 2);
    x.dpo_validation = pairs("dpo-held-out.jsonl", 16, 3);
    for (int i = 0; i < 2; ++i) {
      x.grpo[i] = x.dir / cat("grpo-", i, ".jsonl");
      std::ofstream out(x.grpo[i]);
      for (const auto& e : train::synth_examples("arithmetic", 16, 5 + i))
        out << train::grpo_jsonl_line(e) << "\n";
    }
    return x;
  }();
  return f;
}

// A silos' run file in `dir`: the tiny base, [lora] and the objective's section (its data comes
// from each client's post.data), with `edits` (text, replacement) applied.
fs::path write_run_file(const fs::path& dir, const std::string& objective,
                        const std::vector<std::pair<std::string, std::string>>& edits = {}) {
  const auto& fx = fixture();
  fs::create_directories(dir);
  // GRPO: the untrained model never answers a sum, so the reward is a vowel anywhere in the
  // completion, which makes the groups' rewards differ.
  const std::string section =
      objective == "sft"   ? "[sft]\nseq = 64\nmicro_batch = 2\nvalidation_fraction = 0\n"
      : objective == "dpo" ? "[dpo]\nvalidation = \"" + fx.dpo_validation.string() +
                                 "\"\nbeta = 0.1\nbatch_pairs = 8\nmicro_batch_pairs = 4\n"
      : objective == "rm" ? "[rm]\nvalidation = \"" + fx.dpo_validation.string() +
                                "\"\nbatch_pairs = 8\nmicro_batch_pairs = 4\n"
                          : "[grpo]\neval_data = \"" + fx.grpo[0].string() +
                                "\"\ngroup_size = 2\nprompts_per_step = 2\nmicro_batch = 4\n"
                                "max_completion_tokens = 6\nbeta = 0.04\n\n[grpo.verifier]\n"
                                "kind = \"regex\"\npattern = \"[aeiou]\"\n";
  const fs::path file = dir / (objective + "-run.toml");
  std::string text =
      test_support::tiny_post_toml(dir / "silo-run", fx.model_file, fx.tokenizer, 100, section) +
      kLora;
  for (const auto& [from, to] : edits) {
    const size_t at = text.find(from);
    POLLEN_CHECK(at != std::string::npos, "no '", from, "' in the run file");
    text.replace(at, from.size(), to);
  }
  write_file_atomic(file, text);
  return file;
}

ServerConfig post_server(const fs::path& dir, const fs::path& run, const std::string& objective,
                         int64_t rounds, int64_t local_steps) {
  ServerConfig c;
  c.dir = dir / "server";
  c.rounds = rounds;
  c.local_steps = local_steps;
  c.eval_every = 1;
  c.strategy.min_clients = 2;
  c.post.run = run;
  c.post.objective = objective;
  return c;
}

ClientConfig post_client(int i, const fs::path& run, const std::string& objective,
                         const fs::path& data) {
  ClientConfig c;
  c.id = cat("silo-", i);
  c.threads = 1;
  c.post.run = run;
  c.post.objective = objective;
  c.post.data = data.string();
  return c;
}

// The rounds of a federation in one process, as `pollen fed simulate` drives them: the same
// Coordinator and Client, every message serialised through the in-process transport.
void drive(Coordinator& server, std::vector<std::unique_ptr<Client>>& clients) {
  for (;;) {
    for (auto& c : clients) c->poll_once();
    if (!server.begin_round()) return;
    while (!server.round_complete()) {
      bool worked = false;
      for (auto& c : clients) worked = c->poll_once() != pb::TASK_WAIT || worked;
      if (!worked) break;
    }
    server.end_round();
  }
}

// The B tensors of a PEFT adapter folder, in file order.
std::map<std::string, Tensor> adapter_b(const fs::path& dir) {
  std::map<std::string, Tensor> out;
  for (auto& [name, t] : io::read_safetensors(dir / "adapter_model.safetensors").tensors)
    if (name.find("lora_B") != std::string::npos) out.emplace(name, t);
  return out;
}

double held_out_margin(LoraSilo& silo, const Weights& b) {
  silo.set_exchanged_weights(b);
  ag::NoGrad no_grad;
  return silo.objective().evaluate(silo.model()).metrics["rewards/margins"].get<double>();
}

}  // namespace

namespace {

// `objective`'s federation of two silos over `data` run as three processes on loopback (`pollen
// fed server` and two `pollen fed client`) ends with the adapters of the same federation
// simulated in this process (from a `pollen fed post` file), bit for bit. `compression`: a
// [compression] table both sides get. With `silo0_ranks` > 1 the first silo runs as that many
// ranks (`pollen launch`), which sum their gradients in another order: the adapters then agree
// to float rounding, and what travels is the same.
void expect_deployed_equals_simulation(const std::string& objective, const fs::path (&data)[2],
                                       const std::string& compression = "", int silo0_ranks = 1) {
  const fs::path dir = temp_dir(cat("post_deployed_", objective, compression.empty() ? "" : "_c",
                                    silo0_ranks > 1 ? "_ranks" : ""));
  const fs::path run = write_run_file(dir, objective);
  set_num_threads(1);
  {
    Quiet q;
    write_file_atomic(dir / "sim.toml",
                      cat("[federation]\nrun = '", run.string(), "'\nobjective = '", objective,
                          "'\nsilos = ['silo-0', 'silo-1']\ndata = ['", data[0].string(), "', '",
                          data[1].string(), "']\nrounds = 2\nlocal_steps = 3\noutput = '",
                          (dir / "sim").string(), "'\n", compression));
    run_simulation(load_fed_post_config(dir / "sim.toml"), false);
    // Again without resuming: refused, naming the key of the folder that holds the run.
    const std::string again =
        error_of([&] { run_simulation(load_fed_post_config(dir / "sim.toml"), false); });
    EXPECT_NE(again.find("already holds checkpoints; resume the run (--resume) or choose another "
                         "federation.output"),
              std::string::npos)
        << again;
    if (objective == "sft" && compression.empty() && silo0_ranks == 1) {
      // Resumed after the run file's LoRA rank changed: its adapters have other shapes, and the
      // error names the key rather than a tensor.
      write_run_file(dir, objective, {{"rank = 4", "rank = 8"}});
      const std::string rank =
          error_of([&] { run_simulation(load_fed_post_config(dir / "sim.toml"), true); });
      EXPECT_NE(rank.find("another LoRA config than post.run's: lora.rank: checkpoint 4, "
                          "post.run 8"),
                std::string::npos)
          << rank;
      // Resumed after its optimizer.lr changed: warned of, as a changed federation key is.
      write_run_file(dir, objective, {{"lr = 3e-3", "lr = 5e-3"}});
      const log::Level level = log::level();
      log::set_level(log::Level::warn);
      ::testing::internal::CaptureStderr();
      run_simulation(load_fed_post_config(dir / "sim.toml"), true);
      const std::string lr = ::testing::internal::GetCapturedStderr();
      log::set_level(level);
      EXPECT_NE(lr.find("the config differs from that of checkpoint"), std::string::npos) << lr;
      EXPECT_NE(lr.find("run file: optimizer.lr ("), std::string::npos) << lr;
      write_run_file(dir, objective);
    }
  }
  // The same federation as three processes on loopback.
  const std::string address = loopback_address();
  write_file_atomic(dir / "fed.toml",
                    cat("[server]\ndir = '", (dir / "dep").string(), "'\naddress = '", address,
                        "'\nrounds = 2\nlocal_steps = 3\nround_timeout_s = 120\n"
                        "wait_for_clients_s = 60\n[strategy]\nmin_clients = 2\n[post]\nrun = '",
                        run.string(), "'\nobjective = '", objective, "'\n", compression));
  for (int i = 0; i < 2; ++i)
    write_file_atomic(
        dir / cat("client", i, ".toml"),
        cat("[client]\nid = 'silo-", i, "'\nserver = '", address, "'\nthreads = 1\n[post]\nrun = '",
            run.string(), "'\nobjective = '", objective, "'\ndata = '", data[i].string(), "'\n"));
  std::vector<pid_t> pids;
  for (const std::string name : {"fed", "client0", "client1"}) {
    std::vector<std::string> args{"fed", name == "fed" ? "server" : "client", "--config",
                                  (dir / (name + ".toml")).string()};
    if (name == "client0" && silo0_ranks > 1)
      args.insert(args.begin(), {"launch", "--nproc", std::to_string(silo0_ranks), "--"});
    pids.push_back(spawn_pollen(args, dir / (name + ".log")));
  }
  EXPECT_EQ(failed_children(pids), 0) << "a process failed; see " << dir.string() << "/*.log";
  const auto sim = adapter_b(dir / "sim/adapter"), dep = adapter_b(dir / "dep/adapter");
  ASSERT_EQ(sim.size(), 7u);  // 2 layers x 3 targets, the head
  ASSERT_EQ(dep.size(), sim.size());
  double largest = 0;
  int64_t b_values = 0;
  double worst = 0;  // the largest difference of a value
  for (const auto& [name, t] : sim) {
    const Tensor& d = dep.at(name);
    ASSERT_EQ(d.shape(), t.shape()) << name;
    if (silo0_ranks == 1) EXPECT_EQ(std::memcmp(d.raw(), t.raw(), t.nbytes()), 0) << name;
    const std::vector<double> tv = t.to_doubles(), dv = d.to_doubles();
    for (size_t i = 0; i < tv.size(); ++i) {
      largest = std::max(largest, std::fabs(tv[i]));
      worst = std::max(worst, std::fabs(tv[i] - dv[i]));
    }
    b_values += t.numel();
  }
  EXPECT_GT(largest, 1e-4);  // the silos did train B
  EXPECT_LE(worst, 1e-4 * largest) << "the deployed adapters differ";
  int64_t exchanged_values = b_values;
  if (objective == "rm") {
    // The score head travelled beside B and was averaged alike; both sides export the reward
    // model, the same to the last bit.
    const auto head = [](const fs::path& file) {
      return io::read_safetensors(file).find("score.weight")->clone();
    };
    const Tensor sim_head = head(dir / "sim/adapter/objective.safetensors");
    EXPECT_EQ(sim_head.shape(), (Shape{1, 32}));  // (1, hidden)
    EXPECT_TRUE(bitwise_equal({head(dir / "dep/adapter/objective.safetensors")}, {sim_head}));
    EXPECT_EQ(sha256_file(dir / "dep/reward_model/model.safetensors"),
              sha256_file(dir / "sim/reward_model/model.safetensors"));
    EXPECT_EQ(read_file(dir / "dep/reward_model/config.json"),
              read_file(dir / "sim/reward_model/config.json"));
    exchanged_values += sim_head.numel();
  }
  // Only B (and a reward model's head) travelled: each round, 2 silos x 4 bytes per value each
  // way (the updates compressed: as many bytes as the simulation's).
  const auto lines = read_jsonl(dir / "dep/metrics.jsonl");
  const auto sim_lines = read_jsonl(dir / "sim/metrics.jsonl");
  ASSERT_EQ(lines.size(), 2u);
  ASSERT_EQ(sim_lines.size(), 2u);
  for (size_t r = 0; r < lines.size(); ++r) {
    const auto received = lines[r]["bytes_received"].get<int64_t>();
    EXPECT_EQ(received, sim_lines[r]["bytes_received"].get<int64_t>());
    if (compression.empty()) {
      EXPECT_EQ(received, 2 * 4 * exchanged_values);
    } else {
      EXPECT_LT(received, 2 * 4 * exchanged_values / 3);
    }
    EXPECT_EQ(lines[r]["bytes_sent"].get<int64_t>(), 2 * 4 * exchanged_values);
    // GRPO's held-out loss is its negated mean reward: the server takes it, negative as it is.
    // The rewards the silos trained on come with the updates, as the simulation has them.
    if (objective == "grpo") {
      for (const auto& [id, c] : lines[r]["clients"].items()) {
        ASSERT_TRUE(c.contains("eval_loss")) << id;
        EXPECT_LE(c["eval_loss"].get<double>(), 0) << id;
        EXPECT_EQ(c["metrics"]["reward"], sim_lines[r]["clients"][id]["metrics"]["reward"]) << id;
      }
      EXPECT_DOUBLE_EQ(lines[r]["metrics"]["reward"].get<double>(),
                       sim_lines[r]["metrics"]["reward"].get<double>());
    }
  }
  // The simulation's curves are TensorBoard scalars too (tags stored as plain bytes), named as
  // the deployed server names them.
  std::string events;
  for (const auto& f : fs::directory_iterator(dir / "sim/tensorboard"))
    events += read_file(f.path());
  for (const std::string tag : {"fed/train_loss", "client/silo-1/train_loss", "fed/bytes_received"})
    EXPECT_NE(events.find(tag), std::string::npos) << tag;
  if (objective == "grpo") EXPECT_NE(events.find("fed/reward"), std::string::npos);
  // The lineage starts with the base.
  const auto lineage = read_jsonl(dir / "dep/lineage.jsonl");
  ASSERT_EQ(lineage.size(), 3u);
  EXPECT_EQ(lineage[0]["round"], 0);
  EXPECT_EQ(lineage[0]["base_sha256"].get<std::string>().size(), 64u);
}

}  // namespace

TEST(FedPostWire, DeployedSftEqualsTheSimulationBitwise) {
  expect_deployed_equals_simulation("sft", fixture().sft);
}

// int8 updates with error feedback: the simulation keeps each silo's residual where its client
// does, round after round.
TEST(FedPostWire, DeployedCompressedSftEqualsTheSimulationBitwise) {
  expect_deployed_equals_simulation("sft", fixture().sft, "[compression]\ncodec = 'int8'\n");
}

// GRPO's silos sample their rollouts with the generation engine and keep a KL reference (the
// base, loaded from the run file's model.base): deployed, as simulated.
TEST(FedPostWire, DeployedGrpoEqualsTheSimulationBitwise) {
  expect_deployed_equals_simulation("grpo", fixture().grpo);
}

// A GRPO silo of two ranks (`pollen launch --nproc 2 -- fed client`): they share the sampling of
// each step, train and push what one process does, and the federation ends where the simulation
// does.
TEST(FedPostWire, AGrpoSiloOfTwoRanksTrainsAsOneProcess) {
  expect_deployed_equals_simulation("grpo", fixture().grpo, "", 2);
}

// A reward model: the score head is the objective's own parameter, trained by every silo and
// averaged with B; the server and the simulation export the same reward model.
TEST(FedPostWire, DeployedRewardModelEqualsTheSimulationBitwise) {
  expect_deployed_equals_simulation("rm", fixture().dpo);
}

TEST(FedPostWire, DpoFederationOverGrpcRaisesTheHeldOutMargin) {
  const auto& fx = fixture();
  const fs::path dir = temp_dir("post_dpo");
  // Adapters on every projection of the layers (the head left out), which learn the preference
  // in a few steps.
  const fs::path run = write_run_file(
      dir, "dpo",
      {{"lr = 3e-3", "lr = 1e-2"},
       {"[\"q_proj\", \"v_proj\", \"down_proj\", \"lm_head\"]",
        "[\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\", \"gate_proj\", \"up_proj\", "
        "\"down_proj\"]"}});
  set_num_threads(1);
  Quiet q;
  ServerConfig sc = post_server(dir, run, "dpo", 3, 4);
  Coordinator coordinator(sc, false);
  GrpcServer server(coordinator, "127.0.0.1:0", {});
  const std::string address = cat("127.0.0.1:", server.port());
  std::vector<std::unique_ptr<GrpcTransport>> transports;
  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < 2; ++i) {
    transports.push_back(std::make_unique<GrpcTransport>(address, TlsFiles{}, 10, 60));
    clients.push_back(
        std::make_unique<Client>(post_client(i, run, "dpo", fx.dpo[i]), *transports.back()));
    clients.back()->join();
  }
  std::thread rounds([&] { coordinator.run(); });
  std::vector<std::thread> silos;
  for (auto& c : clients) silos.emplace_back([&c] { c->run(); });
  rounds.join();
  for (auto& t : silos) t.join();
  server.shutdown();
  ASSERT_EQ(coordinator.rounds_done(), 3);
  LoraSilo& silo = *clients[0]->lora_silo();
  Weights zero = coordinator.global_weights();
  for (auto& t : zero) t = Tensor::zeros(t.shape(), DType::f32);
  const double before = held_out_margin(silo, zero);
  const double after = held_out_margin(silo, coordinator.global_weights());
  std::printf("federated DPO, held-out margin: %.4f before, %.4f after 3 rounds\n", before, after);
  EXPECT_NEAR(before, 0.0, 1e-9);  // B = 0: the policy is the reference
  EXPECT_GT(after, 0.1);
}

TEST(FedPostWire, SiloWithAnotherLoraConfigOrBaseIsRefusedNamingIt) {
  const auto& fx = fixture();
  const fs::path dir = temp_dir("post_refused");
  Quiet q;
  Coordinator coordinator(post_server(dir, write_run_file(dir, "sft"), "sft", 1, 1), false);
  LocalTransport transport(coordinator);
  auto refusal = [&](const fs::path& run) {
    Client c(post_client(0, run, "sft", fx.sft[0]), transport);
    return error_of([&] { c.join(); });
  };
  // A twin of the server's run file (another folder) agrees.
  EXPECT_EQ(refusal(write_run_file(dir / "twin", "sft")), "");
  const std::string e = refusal(write_run_file(dir / "rank8", "sft", {{"rank = 4", "rank = 8"}}));
  EXPECT_NE(e.find("lora.rank: server 4, client 8"), std::string::npos) << e;
  // Another base: the model file's weights are drawn from run.seed, here another one.
  const std::string b = refusal(write_run_file(dir / "base", "sft", {{"seed = 3", "seed = 4"}}));
  EXPECT_NE(b.find("base weights (SHA-256): server "), std::string::npos) << b;
  EXPECT_EQ(b.find("lora."), std::string::npos) << b;
  // Another objective: a reward model's silo would send its score head beside B.
  {
    const fs::path rm_run = write_run_file(dir / "rm", "rm");
    Client c(post_client(0, rm_run, "rm", fx.dpo[0]), transport);
    const std::string o = error_of([&] { c.join(); });
    EXPECT_NE(o.find("post.objective: server sft, client rm"), std::string::npos) << o;
  }
  // A pre-training client: it proposes the whole model.
  pb::JoinRequest whole;
  whole.set_protocol_version(kProtocolVersion);
  whole.set_client_id("silo-w");
  whole.set_model_config(model_config_json(coordinator.config().model));
  whole.set_tokenizer_fingerprint(coordinator.config().tokenizer_fingerprint);
  const auto reply = coordinator.join(whole, "");
  EXPECT_FALSE(reply.accepted());
  EXPECT_NE(reply.reason().find("the server exchanges LoRA adapters"), std::string::npos)
      << reply.reason();
}

TEST(FedPostWire, RestartedServerAndClientsContinueBitwise) {
  const auto& fx = fixture();
  const fs::path dir = temp_dir("post_restart");
  const fs::path run = write_run_file(dir, "sft");
  set_num_threads(1);
  Quiet q;
  auto clients_for = [&](Transport& t, const std::string& state) {
    std::vector<std::unique_ptr<Client>> out;
    for (int i = 0; i < 2; ++i) {
      ClientConfig c = post_client(i, run, "sft", fx.sft[i]);
      c.state_dir = dir / state / c.id;
      out.push_back(std::make_unique<Client>(c, t));
      out.back()->join();
    }
    return out;
  };
  Weights uninterrupted;
  {
    Coordinator server(post_server(dir / "whole", run, "sft", 3, 2), false);
    LocalTransport t(server);
    auto clients = clients_for(t, "whole-state");
    drive(server, clients);
    ASSERT_EQ(server.rounds_done(), 3);
    uninterrupted = server.global_weights();
  }
  ServerConfig cut = post_server(dir / "cut", run, "sft", 1, 2);
  {
    Coordinator server(cut, false);  // stops after round 1, as a killed server would
    LocalTransport t(server);
    auto clients = clients_for(t, "cut-state");
    drive(server, clients);
    ASSERT_EQ(server.rounds_done(), 1);
  }
  cut.rounds = 3;
  // A checkpoint of another objective is refused saying so (a DPO federation's holds the same
  // tensors; a reward model's one more).
  ServerConfig other = cut;
  other.post = {write_run_file(dir / "dpo-run", "dpo"), "dpo", ""};
  const std::string o = error_of([&] { Coordinator refused(other, true); });
  EXPECT_NE(o.find("post.objective 'sft', the config says 'dpo'"), std::string::npos) << o;
  // Stopped between round 1's checkpoint and its adapters: the resume writes them.
  const fs::path adapters = cut.dir / "adapter" / "adapter_model.safetensors";
  const std::string round1 = read_file(adapters);
  fs::remove_all(cut.dir / "adapter");
  Coordinator server(cut, true);
  EXPECT_EQ(server.rounds_done(), 1);
  EXPECT_TRUE(fs::exists(adapters) && read_file(adapters) == round1);
  LocalTransport t(server);
  auto clients = clients_for(t, "cut-state");  // resumed from their state folders
  EXPECT_EQ(clients[0]->last_round(), 1);
  drive(server, clients);
  ASSERT_EQ(server.rounds_done(), 3);
  EXPECT_TRUE(bitwise_equal(server.global_weights(), uninterrupted))
      << "the resumed federation's adapters differ from the uninterrupted one's";
  const auto lineage = read_jsonl(dir / "cut/server/lineage.jsonl");
  ASSERT_EQ(lineage.size(), 4u);  // round 0 (the base), then 1, 2, 3 once each
  for (int r = 0; r < 4; ++r) EXPECT_EQ(lineage[r]["round"], r);
}

TEST(FedPostWire, HostileAdapterUpdatesAreRefused) {
  const auto& fx = fixture();
  const fs::path dir = temp_dir("post_hostile");
  Quiet q;
  ServerConfig sc = post_server(dir, write_run_file(dir, "sft"), "sft", 1, 1);
  sc.strategy.min_clients = 1;
  Coordinator coordinator(sc, false);
  LocalTransport transport(coordinator);
  Client client(post_client(0, sc.post.run, "sft", fx.sft[0]), transport);
  client.join();
  ASSERT_TRUE(coordinator.begin_round());
  const ParamSpecs specs = coordinator.specs();
  pb::UpdateInfo info;
  info.set_client_id("silo-0");
  info.set_round(1);
  info.set_tokens(100);
  info.set_data_manifest_hash(client.round_trainer().manifest_hash());  // the data it joined with
  auto push = [&](const EncodedSet& set) {
    return error_of([&] {
      int stage = 0;
      transport.push([&](pb::TensorStream& m) {
        if (stage == 0) *m.mutable_update() = info;
        if (stage == 1) *m.mutable_header() = set.header;
        if (stage == 2) {
          m.mutable_chunk()->set_offset(0);
          m.mutable_chunk()->set_data(set.bytes);
        }
        return stage++ < 3;
      });
    });
  };
  Weights good;
  for (const auto& s : specs) good.push_back(Tensor::zeros(s.shape, DType::f32));
  // A tensor of the wrong shape (B of rank 8 where the federation's is rank 4).
  ParamSpecs wide = specs;
  wide[0].shape.back() = 8;
  Weights wide_w = good;
  wide_w[0] = Tensor::zeros(wide[0].shape, DType::f32);
  const std::string shape = push(encode_weights(wide, wide_w, {}));
  EXPECT_NE(shape.find(specs[0].name), std::string::npos) << shape;
  EXPECT_NE(shape.find("shape"), std::string::npos) << shape;
  // A NaN in B's update.
  Weights nan = good;
  nan[3] = Tensor::zeros(specs[3].shape, DType::f32);  // its own storage, not good[3]'s
  nan[3].data<float>()[1] = std::nanf("");
  const std::string value = push(encode_weights(specs, nan, {}));
  EXPECT_NE(value.find("not finite"), std::string::npos) << value;
  // Whole-model tensors where adapters are expected.
  const std::string model = push(encode_weights({{"model.embed_tokens.weight", {320, 32}}},
                                                {Tensor::zeros({320, 32}, DType::f32)}, {}));
  EXPECT_NE(model.find("tensors"), std::string::npos) << model;
  EXPECT_FALSE(coordinator.round_complete());  // nothing was taken
  EXPECT_EQ(push(encode_weights(specs, good, {})), "");
  EXPECT_TRUE(coordinator.round_complete());
}

TEST(FedPostWire, PostKeysAreCheckedAndOtherTablesRefused) {
  const fs::path dir = temp_dir("post_keys");
  auto server_error = [&](const std::string& text) {
    write_file_atomic(dir / "fed.toml", text);
    return error_of([&] { load_server_config(dir / "fed.toml"); });
  };
  auto client_error = [&](const std::string& text) {
    write_file_atomic(dir / "client.toml", text);
    return error_of([&] { load_client_config(dir / "client.toml"); });
  };
  const std::string server = "[server]\ndir = 'x'\n[post]\nrun = 'r.toml'\n";
  EXPECT_EQ(server_error(server), "");
  EXPECT_EQ(server_error(server + "objective = 'rm'\n"), "");
  const std::string ppo = server_error(server + "objective = 'ppo'\n");
  EXPECT_NE(ppo.find("post.objective"), std::string::npos) << ppo;
  EXPECT_NE(ppo.find("\"sft\", \"dpo\", \"grpo\" or \"rm\""), std::string::npos) << ppo;
  EXPECT_NE(server_error(server + "colour = 1\n").find("colour"), std::string::npos);
  EXPECT_NE(
      server_error(server + "[model]\npreset = 'llama-tiny'\n").find("not allowed with [post]"),
      std::string::npos);
  const std::string rows = server_error(server + "[strategy]\nrow_weighting = 'token_counts'\n");
  EXPECT_NE(rows.find("strategy.row_weighting"), std::string::npos) << rows;
  EXPECT_NE(rows.find("[post]"), std::string::npos) << rows;
  const std::string scale = server_error(server + "[strategy]\nembedding_lr_scale = 2.0\n");
  EXPECT_NE(scale.find("strategy.embedding_lr_scale"), std::string::npos) << scale;
  EXPECT_NE(scale.find("[post]"), std::string::npos) << scale;
  const std::string client = "[client]\nid = 'a'\n[post]\nrun = 'r.toml'\ndata = 'd.jsonl'\n";
  EXPECT_EQ(client_error(client), "");
  EXPECT_NE(client_error("[client]\nid = 'a'\n[post]\nrun = 'r.toml'\n").find("data"),
            std::string::npos);
  const std::string train = client_error(client + "[train]\nlr = 1e-3\n");
  EXPECT_NE(train.find("train"), std::string::npos) << train;
  EXPECT_NE(train.find("not allowed with [post]"), std::string::npos) << train;
  // A silo of several ranks takes [parallel]'s reduction keys; its adapters' state is not sharded.
  write_file_atomic(dir / "client.toml", client + "[parallel]\nbucket_mb = 4\ntimeout_s = 30\n");
  const ClientConfig ranks = load_client_config(dir / "client.toml");
  EXPECT_EQ(ranks.parallel.bucket_mb, 4);
  EXPECT_EQ(ranks.parallel.timeout_s, 30);
  const std::string zero = client_error(client + "[parallel]\nzero = 1\n");
  EXPECT_NE(zero.find("parallel.zero"), std::string::npos) << zero;
  EXPECT_NE(zero.find("does not shard"), std::string::npos) << zero;

  // `pollen fed post` refuses the [strategy] keys a post-training federation has no use for, as
  // the server does with [post]; client sampling and the compressed download are the server's.
  write_file_atomic(dir / "r.toml", "");
  write_file_atomic(dir / "a.jsonl", "");
  write_file_atomic(dir / "b.jsonl", "");
  auto post_error = [&](const std::string& strategy) {
    write_file_atomic(dir / "post.toml",
                      "[federation]\nrun = 'r.toml'\nsilos = ['a', 'b']\n"
                      "data = ['a.jsonl', 'b.jsonl']\noutput = 'o'\n"
                      "[strategy]\n" +
                          strategy);
    return error_of([&] { load_fed_post_config(dir / "post.toml"); });
  };
  EXPECT_EQ(post_error("name = 'fedadam'\nfraction_fit = 0.5\nmin_clients = 1\n"), "");
  // A silo's data is looked for before any silo is built, named by its key.
  fs::rename(dir / "b.jsonl", dir / "b-moved.jsonl");
  const std::string missing = post_error("");
  EXPECT_NE(
      missing.find("key 'federation.data[1]': '" + (dir / "b.jsonl").string() + "' does not exist"),
      std::string::npos)
      << missing;
  fs::rename(dir / "b-moved.jsonl", dir / "b.jsonl");
  for (const char* key : {"row_weighting = 'token_counts'", "second_moments = 'factored'",
                          "first_moments = 'output'", "embedding_lr_scale = 2.0"}) {
    const std::string e = post_error(std::string(key) + "\n");
    const std::string name = std::string(key).substr(0, std::string(key).find(' '));
    EXPECT_NE(e.find("strategy." + name), std::string::npos) << key << ": " << e;
  }
  // [compression] is read as a server reads it, the download's codec included.
  EXPECT_EQ(post_error("[compression]\ncodec = 'int4'\nserver_codec = 'int8'\n"), "");
  const SimConfig read = load_fed_post_config(dir / "post.toml");
  EXPECT_EQ(read.server.server_codec, Codec::int8);
  EXPECT_EQ(read.clients.size(), 2u);
  EXPECT_EQ(read.clients[1].post.data, (dir / "b.jsonl").lexically_normal().string());
  const std::string bad = post_error("[compression]\ncodec = 'int7'\n");
  EXPECT_NE(bad.find("compression.codec"), std::string::npos) << bad;
  // More local steps than a client takes in a task: refused here, naming the key.
  write_file_atomic(dir / "post.toml",
                    "[federation]\nrun = 'r.toml'\nsilos = ['a', 'b']\n"
                    "data = ['a.jsonl', 'b.jsonl']\noutput = 'o'\nlocal_steps = 20000000\n");
  const std::string steps = error_of([&] { load_fed_post_config(dir / "post.toml"); });
  EXPECT_NE(steps.find("federation.local_steps': must be 1 to 10000000, got 20000000"),
            std::string::npos)
      << steps;  // Two silos of one id would share a state folder: refused, naming the key and the
                 // id.
  write_file_atomic(dir / "post.toml",
                    "[federation]\nrun = 'r.toml'\nsilos = ['a', 'a']\n"
                    "data = ['a.jsonl', 'b.jsonl']\noutput = 'o'\n");
  const std::string twice = error_of([&] { load_fed_post_config(dir / "post.toml"); });
  EXPECT_NE(twice.find("federation.silos': silo id 'a' appears twice"), std::string::npos) << twice;
}
