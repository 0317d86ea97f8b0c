// A federated silo run as several ranks: `pollen fed server` and `pollen fed client` under mpirun
// (oversubscribed on a small machine) push the pseudo-gradient of the same client as one
// process, with ZeRO-1 too, and a killed rank ends the silo's job naming it; the client then
// resumes its state at another world size and finishes the run. A post-training silo's hung
// rank is named as well.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "base/files.h"
#include "fed/fixtures.h"
#include "io/checkpoint.h"
#include "train/post_fixtures.h"

namespace fs = std::filesystem;
using namespace pollen;
using namespace pollen::fed::testing;
using pollen::fed::Weights;

namespace {

const fs::path& silo_data() {
  static const fs::path m = make_silo(temp_dir("silo_data"), 3);
  return m;
}

const char* const kModel =
    "[model]\nvocab_size = 64\nhidden_size = 32\nintermediate_size = 64\n"
    "num_hidden_layers = 2\nnum_attention_heads = 2\nnum_key_value_heads = 2\n"
    "max_position_embeddings = 64\n[tokenizer]\nfingerprint = 'test-tokenizer'\n";

struct Federation {
  fs::path dir;
  std::string address_;
  const std::string& address() const { return address_; }
};

// A server of 2 rounds of 3 local steps (FedAvg, lr 1: the new global model is the old one minus
// the only client's pseudo-gradient; or `strategy`) and its client: a global batch of 4 rows per
// step (2 rows, 2 micro-steps in one process; 1 micro-step of 2 rows per rank on 2 ranks),
// evaluation every round, the client's state under state/ (unless not `keep_state`), `train` added
// to its [train], `strategy_keys` to the server's [strategy] and `client_keys` to its [client].
Federation write_federation(const std::string& name, const std::string& parallel = "",
                            const std::string& strategy = "fedavg", const std::string& train = "",
                            const std::string& strategy_keys = "", bool keep_state = true,
                            const std::string& client_keys = "") {
  Federation f{temp_dir(name), loopback_address()};
  write_file_atomic(
      f.dir / "fed.toml",
      cat("[server]\ndir = '", (f.dir / "server").string(), "'\naddress = '", f.address(),
          "'\nseed = 5\nrounds = 2\nlocal_steps = 3\nround_timeout_s = 120\n"
          "wait_for_clients_s = 60\n[strategy]\nname = '",
          strategy, "'\n", strategy_keys, kModel));
  write_file_atomic(
      f.dir / "client.toml",
      cat("[client]\nid = 'silo-0'\nserver = '", f.address(), "'\nseed = 100\nthreads = 1\n",
          client_keys,
          keep_state ? cat("state_dir = '", (f.dir / "state").string(), "'\n") : std::string(),
          "[data]\nmanifests = ['", silo_data().string(),
          "']\n[train]\nmicro_batch = 2\naccumulation = 2\nseq = 16\nlr = 3e-3\n"
          "eval_batches = 2\n",
          train, "[parallel]\n", parallel.empty() ? "timeout_s = 20\n" : parallel, kModel));
  return f;
}

pid_t start_server(const Federation& f) {
  const pid_t pid = fork();
  if (pid == 0) {
    freopen((f.dir / "server.log").c_str(), "a", stderr);
    execl(POLLEN_BINARY, POLLEN_BINARY, "fed", "server", "--config", (f.dir / "fed.toml").c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

int wait_exit(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

struct Outcome {
  int exit_code = -1;
  std::string output;
};

// The client as `ranks` processes: mpirun (or `pollen launch` when `launch`), or one process
// without any launcher; `env` such as "POLLEN_FAULT_INJECT=kill:1:5".
Outcome run_client(const Federation& f, int ranks, bool launch = false,
                   const std::string& env = "") {
  std::string cmd = env.empty() ? "" : "env " + env + " ";
  const std::string pollen = POLLEN_BINARY;
  if (launch) {
    cmd += cat(pollen, " launch --nproc ", ranks, " -- ");
  } else if (ranks > 1) {
    cmd += cat("mpirun --oversubscribe --bind-to none -np ", ranks, " ");
    if (geteuid() == 0) cmd += "--allow-run-as-root ";
    cmd += "-x POLLEN_FAULT_INJECT " + pollen + " ";
  } else {
    cmd += pollen + " ";
  }
  Outcome o;
  o.output =
      run_capture(cmd + "fed client --config " + (f.dir / "client.toml").string(), &o.exit_code);
  return o;
}

// The server's global model after each round.
std::vector<Weights> global_models(const Federation& f) {
  std::vector<Weights> out;
  for (const auto& c : io::list_checkpoints(f.dir / "server" / "checkpoints"))
    out.push_back(read_model(c));
  return out;
}

// A whole federation: the server and the client as `ranks` processes; the global models.
std::vector<Weights> federate(const Federation& f, int ranks, bool launch = false) {
  const pid_t server = start_server(f);
  const Outcome client = run_client(f, ranks, launch);
  EXPECT_EQ(client.exit_code, 0) << client.output;
  EXPECT_EQ(wait_exit(server), 0) << "see " << (f.dir / "server.log").string();
  return global_models(f);
}

// One process: the models every silo of several ranks is held to.
const std::vector<Weights>& reference() {
  static const std::vector<Weights> models = federate(write_federation("reference"), 1);
  return models;
}

// a - b, one flat vector over every tensor.
std::vector<double> difference(const Weights& a, const Weights& b) {
  std::vector<double> d;
  for (size_t i = 0; i < a.size(); ++i) {
    const float* x = a[i].data<float>();
    const float* y = b[i].data<float>();
    for (int64_t j = 0; j < a[i].numel(); ++j) d.push_back(static_cast<double>(x[j]) - y[j]);
  }
  return d;
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

// a, one flat vector over every tensor.
std::vector<double> flat(const Weights& a) {
  std::vector<double> v;
  for (const Tensor& t : a) v.insert(v.end(), t.data<float>(), t.data<float>() + t.numel());
  return v;
}

// Round r's pseudo-gradient is the drop of the global model from round r - 1 to r; round 2's
// (after a round of inner AdamW state carried across) and the model after round 1 (whose drop
// from the common initial model is round 1's) must match the reference: every element of the
// pseudo-gradient within 1e-5 of the largest (float reduction order differs with the ranks;
// measured: 1.3e-6), plus one float32 rounding, 2^-23 of its magnitude, of each model value it
// is taken from (the RMSNorm weights stay near 1, where one rounding is 1.2e-7; seen on AMD Zen 4).
void expect_same_pseudo_gradients(const std::vector<Weights>& models, const std::string& what,
                                  const std::vector<Weights>& ref = reference()) {
  ASSERT_GE(ref.size(), 2u);
  ASSERT_EQ(models.size(), ref.size()) << what;
  const auto n = ref.size();
  const auto ref_delta = difference(ref[n - 2], ref[n - 1]);
  const auto delta = difference(models[n - 2], models[n - 1]);
  const auto before = flat(ref[n - 2]), after = flat(ref[n - 1]), got = flat(models[n - 2]);
  const double scale = max_abs(ref_delta);
  ASSERT_GT(scale, 1e-4) << "the round trained nothing";
  const double rounding = std::ldexp(1.0, -23);
  double worst_delta = 0, worst_model = 0;  // as a multiple of each element's tolerance
  for (size_t i = 0; i < delta.size(); ++i) {
    const double ends = rounding * (std::abs(before[i]) + std::abs(after[i]));
    worst_delta = std::max(worst_delta, std::abs(delta[i] - ref_delta[i]) / (1e-5 * scale + ends));
    worst_model = std::max(worst_model, std::abs(got[i] - before[i]) /
                                            (1e-5 * scale + rounding * std::abs(before[i])));
  }
  EXPECT_LE(worst_delta, 1.0) << what << ": round 2's pseudo-gradient";
  EXPECT_LE(worst_model, 1.0) << what << ": the global model after round 1";
}

// A second client of the federation, silo-1: one process, data of its own, the same [train].
void write_second_client(const Federation& f) {
  static const fs::path data = make_silo(temp_dir("silo_data_b"), 5);
  write_file_atomic(f.dir / "client2.toml",
                    cat("[client]\nid = 'silo-1'\nserver = '", f.address(),
                        "'\nseed = 101\nthreads = 1\n[data]\nmanifests = ['", data.string(),
                        "']\n[train]\nmicro_batch = 2\naccumulation = 2\nseq = 16\nlr = 3e-3\n"
                        "eval_batches = 2\n",
                        kModel));
}

// federate() with silo-1 beside silo-0 (the server waits for both: min_clients = 2).
std::vector<Weights> federate_with_second_client(const Federation& f, int ranks,
                                                 bool launch = false) {
  const pid_t server = start_server(f);
  const pid_t second = spawn_pollen(
      {"fed", "client", "--config", (f.dir / "client2.toml").string()}, f.dir / "client2.log");
  const Outcome client = run_client(f, ranks, launch);
  EXPECT_EQ(client.exit_code, 0) << client.output;
  EXPECT_EQ(wait_exit(second), 0) << "see " << (f.dir / "client2.log").string();
  EXPECT_EQ(wait_exit(server), 0) << "see " << (f.dir / "server.log").string();
  return global_models(f);
}

}  // namespace

TEST(FederatedSilo, TwoRanksPushTheOneProcessPseudoGradient) {
  const Federation f = write_federation("two_ranks");
  expect_same_pseudo_gradients(federate(f, 2), "2 ranks");
  // The client's state, written once by rank 0 after each round: 6 local steps in all.
  const auto states = io::list_checkpoints(f.dir / "state" / "checkpoints");
  ASSERT_FALSE(states.empty());
  EXPECT_EQ(io::checkpoint_step(states.back()), 6);
  fs::remove_all(f.dir);
}

TEST(FederatedSilo, ZeroShardedTwoRanksUnderPollenLaunchPushTheSamePseudoGradient) {
  // Small buckets: several per step, and parameters cut across the ranks' blocks.
  const Federation f = write_federation("zero", "zero = 1\nbucket_mb = 0.01\ntimeout_s = 20\n");
  expect_same_pseudo_gradients(federate(f, 2, true), "2 ranks, ZeRO-1");
  fs::remove_all(f.dir);
}

TEST(FederatedSilo, TwoRanksApplyTheDriftCorrectionOfOneProcess) {
  // Under DiLoCo's momentum the global model moves further than the client's own move, so round
  // 2 is corrected (docs/federated.md, Drift correction); every rank must take the same steps.
  const auto drifting = [](const std::string& name) {
    return write_federation(name, "", "diloco", "drift_correction = 1\n");
  };
  const Federation one = drifting("drift_one"), two = drifting("drift_two");
  const auto ref = federate(one, 1);
  expect_same_pseudo_gradients(federate(two, 2), "2 ranks with drift correction", ref);
  // And the correction changed round 2 (against the same federation without it).
  const Federation plain = write_federation("drift_plain", "", "diloco");
  const auto uncorrected = federate(plain, 1);
  ASSERT_EQ(uncorrected.size(), ref.size());
  EXPECT_GT(max_abs(difference(uncorrected.back(), ref.back())), 1e-6);
  for (const auto* f : {&one, &two, &plain}) fs::remove_all(f->dir);
}

TEST(FederatedSilo, TwoRanksTakeTheProximalStepsOfOneProcess) {
  // train.proximal_mu: each rank seeds its share of mu (w - w_start) into the gradients and the
  // reduction sums the shares, with and without ZeRO-1; a rank that seeded the whole term would
  // step with the term doubled.
  const auto proximal = [](const std::string& name, const std::string& parallel) {
    return write_federation(name, parallel, "diloco", "proximal_mu = 10\n");
  };
  const Federation one = proximal("prox_one", ""), two = proximal("prox_two", "");
  const Federation zero = proximal("prox_zero", "zero = 1\nbucket_mb = 0.01\ntimeout_s = 20\n");
  const auto ref = federate(one, 1);
  expect_same_pseudo_gradients(federate(two, 2), "2 ranks with the proximal term", ref);
  expect_same_pseudo_gradients(federate(zero, 2, true), "2 ranks, ZeRO-1, with the proximal term",
                               ref);
  // And the term changed the steps (against the same federation without it).
  const Federation plain = write_federation("prox_plain", "", "diloco");
  const auto without = federate(plain, 1);
  ASSERT_EQ(without.size(), ref.size());
  EXPECT_GT(max_abs(difference(without.back(), ref.back())), 1e-6);
  for (const auto* f : {&one, &two, &zero, &plain}) fs::remove_all(f->dir);
}

TEST(FederatedSilo, TwoRanksTakeTheDpSgdStepsOfOneProcess) {
  // [dp_sgd], its noise seeded: every rank draws rank 0's sample and clips every other sequence
  // of it, rank 0 alone adds the noise and the ranks sum their shares (all-reduced, or
  // reduce-scattered under ZeRO-1); a rank that added noise too, or clipped the other's
  // sequences, would release another gradient. FedProx's term is added as each rank's share
  // before the sum: under ZeRO-1, added after it, it would never reach the optimizer.
  const auto private_silo = [](const std::string& name, const std::string& parallel,
                               const std::string& proximal) {
    return write_federation(
        name, parallel, "fedavg",
        proximal + "[dp_sgd]\nclip = 0.5\nnoise_multiplier = 0.3\nnoise_seed = 7\n", "", true,
        "allow_repeatable_noise = true\n");
  };
  const std::string zero_1 = "zero = 1\nbucket_mb = 0.01\ntimeout_s = 20\n";
  const std::string mu = "proximal_mu = 10\n";
  const Federation one = private_silo("dp_sgd_one", "", ""),
                   two = private_silo("dp_sgd_two", "", "");
  const Federation zero = private_silo("dp_sgd_zero", zero_1, "");
  const Federation one_prox = private_silo("dp_sgd_one_prox", "", mu);
  const Federation zero_prox = private_silo("dp_sgd_zero_prox", zero_1, mu);
  const auto ref = federate(one, 1), ref_prox = federate(one_prox, 1);
  expect_same_pseudo_gradients(federate(two, 2), "2 ranks under [dp_sgd]", ref);
  expect_same_pseudo_gradients(federate(zero, 2, true), "2 ranks, ZeRO-1, under [dp_sgd]", ref);
  expect_same_pseudo_gradients(federate(zero_prox, 2, true),
                               "2 ranks, ZeRO-1, under [dp_sgd] with the proximal term", ref_prox);
  // Rank 0 kept the account: every local step of the 2 rounds.
  const auto account = nlohmann::json::parse(read_file(two.dir / "state" / "dp_sgd.json"));
  EXPECT_EQ(account.at("steps").get<int64_t>(), 6);
  // And DP-SGD, and the proximal term, changed the steps.
  ASSERT_EQ(reference().size(), ref.size());
  EXPECT_GT(max_abs(difference(reference().back(), ref.back())), 1e-4);
  ASSERT_EQ(ref_prox.size(), ref.size());
  EXPECT_GT(max_abs(difference(ref_prox.back(), ref.back())), 1e-6);
  for (const auto* f : {&one, &two, &zero, &one_prox, &zero_prox}) fs::remove_all(f->dir);
}

TEST(FederatedSilo, TwoRanksShareTheSecondMomentsOfOneProcess) {
  // strategy.second_moments: round 2 starts from the federation's moments (round 1's, through
  // the wire's 8-bit codes) on every rank, with and without ZeRO-1; a rank that kept its own
  // would train other weights, and rank 0's pseudo-gradient would differ from one process's.
  // ZeRO-1 factors them from each rank's blocks and rebuilds each rank's blocks alone, without a
  // state folder and with one (where rank 0 also gathers the whole state to write it).
  const auto sharing = [](const std::string& name, const std::string& parallel, bool state) {
    return write_federation(name, parallel, "diloco", "", "second_moments = 'factored'\n", state);
  };
  const std::string zero_1 = "zero = 1\nbucket_mb = 0.01\ntimeout_s = 20\n";
  const Federation one = sharing("moments_one", "", true), two = sharing("moments_two", "", true);
  const Federation zero = sharing("moments_zero", zero_1, false);
  const Federation zero_state = sharing("moments_zero_state", zero_1, true);
  const auto ref = federate(one, 1);
  expect_same_pseudo_gradients(federate(two, 2), "2 ranks sharing second moments", ref);
  expect_same_pseudo_gradients(federate(zero, 2, true), "2 ranks, ZeRO-1, sharing moments", ref);
  expect_same_pseudo_gradients(federate(zero_state, 2, true),
                               "2 ranks, ZeRO-1 with a state folder, sharing moments", ref);
  // And sharing changed round 2 (against the same federation without it).
  const Federation plain = write_federation("moments_plain", "", "diloco");
  const auto own = federate(plain, 1);
  ASSERT_EQ(own.size(), ref.size());
  EXPECT_GT(max_abs(difference(own.back(), ref.back())), 1e-6);
  for (const auto* f : {&one, &two, &zero, &zero_state, &plain}) fs::remove_all(f->dir);
}

TEST(FederatedSilo, KilledRankIsNamedAndTheClientResumesAsOneProcess) {
  const Federation f = write_federation("killed");
  const pid_t server = start_server(f);
  // Rank 1 dies before local step 5: inside round 2, after the state of round 1 was written.
  const Outcome killed = run_client(f, 2, false, "POLLEN_FAULT_INJECT=kill:1:5");
  EXPECT_NE(killed.exit_code, 0) << killed.output;
  // Named by mpirun, or by rank 0's watchdog when it fires first.
  EXPECT_TRUE(killed.output.find("process rank 1 ") != std::string::npos ||
              killed.output.find("rank 1 never reached it") != std::string::npos)
      << killed.output;
  const auto states = io::list_checkpoints(f.dir / "state" / "checkpoints");
  ASSERT_FALSE(states.empty()) << killed.output;
  EXPECT_EQ(io::checkpoint_step(states.back()), 3);
  // The same silo restarted as one process resumes the 2-rank state and finishes round 2.
  const Outcome resumed = run_client(f, 1);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed its state of round 1"), std::string::npos)
      << resumed.output;
  EXPECT_EQ(wait_exit(server), 0) << "see " << (f.dir / "server.log").string();
  expect_same_pseudo_gradients(global_models(f), "resumed as one process");
  fs::remove_all(f.dir);
}

TEST(FederatedSilo, HungRankIsNamedWithExitCodeFourAndTheRestartedClientFinishes) {
  const Federation f = write_federation("hung", "timeout_s = 3\n");
  const pid_t server = start_server(f);
  const Outcome hung = run_client(f, 2, false, "POLLEN_FAULT_INJECT=hang:1:2");
  EXPECT_EQ(hung.exit_code, 4) << hung.output;
  EXPECT_NE(hung.output.find("rank 1 never reached it (dead or hung)"), std::string::npos)
      << hung.output;
  EXPECT_NE(hung.output.find("Start the client again"), std::string::npos) << hung.output;
  // Round 1 is still open: the restarted client trains it from the start, then round 2.
  const Outcome again = run_client(f, 2);
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_EQ(wait_exit(server), 0) << "see " << (f.dir / "server.log").string();
  expect_same_pseudo_gradients(global_models(f), "restarted after a hang");
  fs::remove_all(f.dir);
}

// A rank that runs another client.toml than rank 0 (a stale copy on its node) ends the silo's
// job before it joins, naming the line that differs.
TEST(FederatedSilo, ARankWithAnotherClientFileEndsTheJobBeforeJoining) {
  const Federation f = write_federation("silo_other_file");
  std::string text = read_file(f.dir / "client.toml");
  ASSERT_NE(text.find("seed = 100"), std::string::npos);
  text.replace(text.find("seed = 100"), 10, "seed = 101");
  write_file_atomic(f.dir / "stale.toml", text);
  std::string cmd = "mpirun --oversubscribe --bind-to none ";
  if (geteuid() == 0) cmd += "--allow-run-as-root ";
  cmd += cat("-np 1 ", POLLEN_BINARY, " fed client --config ", (f.dir / "client.toml").string(),
             " : -np 1 ", POLLEN_BINARY, " fed client --config ", (f.dir / "stale.toml").string());
  int status = 0;
  const std::string out = run_capture(cmd, &status);  // no server: it must not get that far
  EXPECT_NE(status, 0) << out;
  EXPECT_NE(out.find("rank 0 has 'seed = 100', rank 1 has 'seed = 101'"), std::string::npos) << out;
  fs::remove_all(f.dir);
}

// An error that rank 1 alone meets inside a round (its data, its memory) ends the silo's job with
// exit code 1 and that error, instead of leaving rank 0 waiting in a reduction until the watchdog
// blames a hung rank 1; the restarted client finishes the run.
TEST(FederatedSilo, AnErrorOnOneRankEndsTheSilosJobWithThatError) {
  const Federation f = write_federation("one_rank_error");
  const pid_t server = start_server(f);
  const Outcome failed = run_client(f, 2, false, "POLLEN_FAULT_INJECT=error:1:5");
  EXPECT_EQ(failed.exit_code, 1) << failed.output;
  EXPECT_NE(failed.output.find("rank 1: POLLEN_FAULT_INJECT: an error before step 5"),
            std::string::npos)
      << failed.output;
  EXPECT_EQ(failed.output.find("never reached it"), std::string::npos) << failed.output;
  const Outcome again = run_client(f, 2);
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_EQ(wait_exit(server), 0) << "see " << (f.dir / "server.log").string();
  fs::remove_all(f.dir);
}

// A step's micro-steps that do not divide among the silo's ranks are refused before joining,
// saying what would.
TEST(FederatedSilo, AStepThatDoesNotSplitAmongTheRanksIsRefusedNamingWhatWould) {
  const Federation f = write_federation("no_split");
  const Outcome three = run_client(f, 3);
  EXPECT_EQ(three.exit_code, 1) << three.output;
  EXPECT_NE(three.output.find("client 'silo-0': train.accumulation (2) is not a multiple of the "
                              "silo's ranks (3)"),
            std::string::npos)
      << three.output;
  EXPECT_NE(three.output.find("give a train.accumulation that is a multiple of 3"),
            std::string::npos)
      << three.output;
  fs::remove_all(f.dir);
}

TEST(FederatedSilo, TwoRanksShareTheFirstMomentsOfOneProcess) {
  // strategy.first_moments with a second client (silo-1, one process, its own data), so that the
  // federation's first moments are not silo-0's own: round 2 starts from their average on every
  // rank of silo-0, with and without ZeRO-1 (whose ranks each keep their blocks of them; after
  // the round rank 0 gathers the token rows' alone, to send). A rank that kept its own would train
  // other weights, and the global model would differ from that of silo-0 as one process.
  const auto sharing = [](const std::string& name, const std::string& parallel, bool state) {
    Federation f = write_federation(name, parallel, "diloco", "",
                                    "first_moments = 'token_rows'\nsecond_moments = 'factored'\n"
                                    "min_clients = 2\n",
                                    state);
    write_second_client(f);
    return f;
  };
  const Federation one = sharing("first_one", "", true), two = sharing("first_two", "", true);
  const Federation zero =
      sharing("first_zero", "zero = 1\nbucket_mb = 0.01\ntimeout_s = 20\n", false);
  const auto ref = federate_with_second_client(one, 1);
  expect_same_pseudo_gradients(federate_with_second_client(two, 2), "2 ranks sharing first moments",
                               ref);
  expect_same_pseudo_gradients(federate_with_second_client(zero, 2, true),
                               "2 ranks, ZeRO-1, sharing first moments", ref);
  // And sharing changed round 2 (against the same federation without it), not round 1.
  const Federation plain = write_federation("first_plain", "", "diloco", "", "min_clients = 2\n");
  write_second_client(plain);
  const auto own = federate_with_second_client(plain, 1);
  ASSERT_EQ(own.size(), ref.size());
  EXPECT_TRUE(bitwise_equal(own.front(), ref.front()));
  EXPECT_GT(max_abs(difference(own.back(), ref.back())), 1e-6);
  for (const auto* f : {&one, &two, &zero, &plain}) fs::remove_all(f->dir);
}

// A post-training silo ([post]: SFT of LoRA adapters) of 2 ranks: a rank that hangs before local
// step 2 ends the silo's job with exit code 4 naming it, and the client restarted as 2 ranks
// trains the round still open and finishes the run with the server.
// A post-training silo's rank that hangs is named by the watchdog (exit 4); one that meets an
// error alone ends the silo's job with it (exit 1) rather than going on to the next round's
// collectives while the other rank is still in this step's; the restarted client finishes.
TEST(FederatedSilo, APostTrainingSiloNamesAHungOrFailedRankAndFinishesWhenRestarted) {
  const auto files = test_support::make_post_files("post_silo_hung");
  const fs::path data = test_support::write_sft_data(files.dir / "upper.jsonl", "upper", 40, 3);
  const fs::path run = files.dir / "run.toml";
  write_file_atomic(run, test_support::tiny_post_toml(
                             files.dir / "silo-run", files.model_file, files.tokenizer_path, 100,
                             "[sft]\nseq = 64\nmicro_batch = 2\naccumulation = 2\n"
                             "validation_fraction = 0\n\n[lora]\nrank = 4\ntrain_a = false\n"));
  Federation f{files.dir, loopback_address()};
  write_file_atomic(
      f.dir / "fed.toml",
      cat("[server]\ndir = '", (f.dir / "server").string(), "'\naddress = '", f.address(),
          "'\nrounds = 2\nlocal_steps = 2\nround_timeout_s = 120\nwait_for_clients_s = 60\n"
          "[strategy]\nmin_clients = 1\n[post]\nrun = '",
          run.string(), "'\nobjective = 'sft'\n"));
  write_file_atomic(
      f.dir / "client.toml",
      cat("[client]\nid = 'silo-0'\nserver = '", f.address(), "'\nthreads = 1\nstate_dir = '",
          (f.dir / "state").string(), "'\n[post]\nrun = '", run.string(),
          "'\nobjective = 'sft'\ndata = '", data.string(), "'\n[parallel]\ntimeout_s = 3\n"));
  const pid_t server = start_server(f);
  const Outcome hung = run_client(f, 2, false, "POLLEN_FAULT_INJECT=hang:1:2");
  EXPECT_EQ(hung.exit_code, 4) << hung.output;
  EXPECT_NE(hung.output.find("rank 1 never reached it (dead or hung)"), std::string::npos)
      << hung.output;
  const Outcome failed = run_client(f, 2, false, "POLLEN_FAULT_INJECT=error:0:2");
  EXPECT_EQ(failed.exit_code, 1) << failed.output;
  EXPECT_NE(failed.output.find(
                "rank 0: POLLEN_FAULT_INJECT: an error before step 2; ending the silo's job"),
            std::string::npos)
      << failed.output;
  const Outcome again = run_client(f, 2);
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("the silo runs as 2 ranks"), std::string::npos) << again.output;
  EXPECT_EQ(wait_exit(server), 0) << "see " << (f.dir / "server.log").string();
  EXPECT_EQ(read_jsonl(f.dir / "server" / "metrics.jsonl").size(), 2u);
  EXPECT_TRUE(fs::exists(f.dir / "server" / "adapter" / "adapter_model.safetensors"));
  fs::remove_all(f.dir);
}
