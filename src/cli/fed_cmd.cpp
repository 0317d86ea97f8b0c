// `pollen fed server | client | simulate | privacy | certs | tokenizer | counts`: federated
// training across silos (docs/federated.md). Parsing and wiring only.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "base/log.h"
#include "base/thread_pool.h"
#include "cli/commands.h"
#include "fed/config.h"
#include "fed/grpc.h"
#include "fed/privacy.h"
#include "fed/run.h"
#include "fed/secagg/private_quantize.h"
#include "fed/tokenizer_round.h"
#include "optim/dp_sgd.h"
#include "optim/privacy_accountant.h"

namespace pollen::cli {

namespace {

constexpr const char* kDeviceHelp =
    "cpu or cuda: where the silo trains (as [train] device; on cuda one GPU, and [train] "
    "precision = \"bf16\" computes in bf16 with f32 master weights)";

}  // namespace

void add_fed_command(CLI::App& app) {
  auto* fed = app.add_subcommand("fed", "Federated training across data silos");
  fed->require_subcommand(1);

  struct Opts {
    std::string config;
    bool resume = false;
    std::string dir = "certs";
    std::vector<std::string> clients, names{"localhost", "127.0.0.1"};
    std::string revoke;
    int days = 365;
    std::string device;  // --device of client and simulate: train.device
  };
  auto o = std::make_shared<Opts>();

  auto* server = fed->add_subcommand("server",
                                     "Run the federation server (global model, outer "
                                     "optimizer, rounds, checkpoints); with [post] the "
                                     "exchanged state is LoRA adapters (post-training)");
  server->add_option("--config", o->config, "fed.toml")->required();
  server->add_flag("--resume", o->resume, "Continue from the newest valid checkpoint");
  server->callback([o] {
    const auto cfg = fed::load_server_config(o->config);
    const int64_t done = fed::run_server(cfg, o->resume);
    if (done < cfg.rounds) throw Error(cat("stopped after ", done, " of ", cfg.rounds, " rounds"));
  });

  auto* client = fed->add_subcommand(
      "client",
      "Run one silo: join, train local steps, push "
      "pseudo-gradients (with [post]: SFT, DPO, GRPO or reward-model steps on LoRA "
      "adapters). As several ranks under mpirun -np N, "
      "srun or pollen launch --nproc N (docs/parallel.md); exit "
      "code 4: a rank died or hung");
  client->add_option("--config", o->config, "client.toml")->required();
  client->add_option("--device", o->device, kDeviceHelp)->check(CLI::IsMember({"cpu", "cuda"}));
  client->callback([o] {
    const char* fault = std::getenv("POLLEN_FAULT_INJECT");
    fed::ClientConfig cfg = fed::load_client_config(o->config);
    if (!o->device.empty()) fed::set_train_device(cfg, o->device);
    fed::run_client(cfg, train::parse_fault_injection(fault ? fault : ""));
  });

  auto* sim = fed->add_subcommand("simulate", "N virtual clients and the server in one process");
  sim->add_option("--config", o->config, "sim.toml")->required();
  sim->add_flag("--resume", o->resume, "Continue from the newest valid checkpoint");
  sim->add_option("--device", o->device, kDeviceHelp)->check(CLI::IsMember({"cpu", "cuda"}));
  sim->callback([o] {
    fed::SimConfig cfg = fed::load_sim_config(o->config);
    if (!o->device.empty())
      for (auto& c : cfg.clients) fed::set_train_device(c, o->device);
    const auto r = fed::run_simulation(cfg, o->resume);
    if (!r.clients.empty())  // a run stopped by a signal has no final evaluation
      std::printf("%-24s %s\n", "client", "validation loss of the global model");
    for (size_t i = 0; i < r.clients.size(); ++i) {
      std::printf("%-24s %.4f\n", r.clients[i].c_str(), r.eval_loss[i]);
    }
    std::printf("%lld rounds; metrics in %s\n", static_cast<long long>(r.rounds),
                (cfg.server.dir / "metrics.jsonl").c_str());
    // As `fed server`: a run that stopped early (the privacy budget, too many retries) fails.
    if (r.rounds < cfg.server.rounds)
      throw Error(cat("stopped after ", r.rounds, " of ", cfg.server.rounds, " rounds",
                      r.stopped.empty() ? "" : ": " + r.stopped));
  });

  auto* tok = fed->add_subcommand(
      "tokenizer", "Train the shared tokenizer on the silos' pre-token counts, sent over the wire");
  tok->add_option("--config", o->config, "fed-tokenizer.toml")->required();
  tok->callback([o] {
    const auto cfg = fed::load_tokenizer_server_config(o->config);
    std::printf("fingerprint %s\n", fed::run_tokenizer_server(cfg).c_str());
  });

  auto c = std::make_shared<fed::CountsClientOptions>();
  auto* counts = fed->add_subcommand(
      "counts",
      "Send this silo's pre-token counts to `pollen fed tokenizer`, receive the tokenizer");
  counts->add_option("--server", c->server, "host:port of the server")->capture_default_str();
  counts->add_option("--id", c->id, "This silo's client id")->required();
  counts->add_option("--input", c->inputs, "Text files (a line is a document) or JSONL files")
      ->required()
      ->check(CLI::ExistingFile);
  counts->add_flag("--jsonl", c->jsonl, "Inputs are JSONL; the text is in --field");
  counts->add_option("--field", c->field, "JSONL field holding the text")->capture_default_str();
  counts->add_option("--pattern", c->pattern, "Pre-tokenisation: a known pattern name or a regex")
      ->capture_default_str();
  counts
      ->add_option("--noise-stddev", c->noise_stddev,
                   "Add round(N(0, S^2)) to every count before sending (0: exact counts)")
      ->capture_default_str();
  counts->add_option("--seed", c->seed, "Seed of the noise")->capture_default_str();
  counts->add_option("--min-count", c->min_count, "Drop pieces counted fewer times (after noise)")
      ->capture_default_str();
  counts->add_option("--output", c->output, "Where the received tokenizer.json goes")->required();
  counts->add_option("--ca", c->tls.ca, "TLS: the federation's CA (PEM)");
  counts->add_option("--cert", c->tls.cert, "TLS: this silo's certificate (PEM)");
  counts->add_option("--key", c->tls.key, "TLS: this silo's key (PEM)");
  counts->add_option("--server-name", c->tls.server_name,
                     "TLS: the name to check the server's certificate against");
  counts->add_option("--connect-timeout", c->connect_timeout_s, "Seconds to wait for the server")
      ->capture_default_str();
  auto threads = std::make_shared<int>(0);
  counts->add_option("--threads", *threads, "Threads for counting (default: all)");
  counts->callback([c, threads] {
    if (*threads > 0) set_num_threads(*threads);
    POLLEN_CHECK(
        c->tls.ca.empty() == c->tls.cert.empty() && c->tls.ca.empty() == c->tls.key.empty(),
        "fed counts: give all of --ca, --cert and --key, or none");
    std::printf("fingerprint %s\n", fed::run_counts_client(*c).c_str());
  });

  struct PrivacyOpts {
    double noise = -1, target_epsilon = 0, rate = 0, delta = 1e-5;
    int64_t rounds = 0, every = 0;
    std::string sampling = "fixed";
    // Distributed DP (secure aggregation): the discrete Gaussian's cost.
    int64_t values = 0, clients = 0;
    double clip = 0, step = 0x1p-24;
    std::string rounding = "stochastic";
  };
  auto p = std::make_shared<PrivacyOpts>();
  auto* privacy = fed->add_subcommand(
      "privacy",
      "Epsilon of central or distributed DP after some rounds, for planning (RDP accountant)");
  auto* noise_option =
      privacy->add_option("--noise-multiplier", p->noise, "z: noise std / clip norm");
  privacy
      ->add_option("--target-epsilon", p->target_epsilon,
                   "Instead of --noise-multiplier: the smallest z (to 0.1%) whose epsilon after "
                   "--rounds is at most this")
      ->excludes(noise_option);
  privacy
      ->add_option("--sampling-rate", p->rate,
                   "q: share of the clients selected per round (1 with secure aggregation, whose "
                   "server knows the sample; --values accounts its discrete Gaussian)")
      ->required();
  privacy->add_option("--rounds", p->rounds, "Rounds")->required();
  privacy->add_option("--delta", p->delta, "delta")->capture_default_str();
  privacy->add_option("--every", p->every, "Also print epsilon every this many rounds");
  privacy
      ->add_option(
          "--sampling", p->sampling,
          "privacy.sampling: fixed (a sample without replacement, accounted with "
          "multiplier z / 2 below rate 1, or as every client selected where that is tighter) or "
          "poisson")
      ->check(CLI::IsMember({"fixed", "poisson"}))
      ->capture_default_str();
  privacy->add_option("--values", p->values,
                      "Distributed DP under secure aggregation: the values each update holds "
                      "(the model's parameters); with --clip and --clients, the clients' "
                      "discrete Gaussian is accounted instead of the Gaussian");
  privacy->add_option("--clip", p->clip, "Distributed DP: privacy.clip, the L2 norm C");
  privacy->add_option("--clients", p->clients, "Distributed DP: the clients selected per round");
  privacy->add_option("--step", p->step, "Distributed DP: secure_aggregation.step")
      ->capture_default_str();
  privacy->add_option("--rounding", p->rounding, "Distributed DP: secure_aggregation.rounding")
      ->check(CLI::IsMember({"stochastic", "nearest"}))
      ->capture_default_str();
  privacy->callback([p] {
    POLLEN_CHECK(p->rounds >= 1, "--rounds must be at least 1, got ", p->rounds);
    POLLEN_CHECK(p->every >= 0, "--every must be 0 or more, got ", p->every);
    POLLEN_CHECK((p->noise >= 0) != (p->target_epsilon > 0),
                 "give --noise-multiplier (0 or more) or --target-epsilon (above 0)");
    POLLEN_CHECK(p->rate > 0 && p->rate <= 1, "--sampling-rate must be in (0, 1], got ", p->rate);
    POLLEN_CHECK(p->delta > 0 && p->delta < 1, "--delta must be in (0, 1), got ", p->delta);
    const bool distributed = p->values > 0;
    fed::secagg::Options o;
    if (distributed) {
      POLLEN_CHECK(p->clip > 0 && p->clients >= 2 && p->rate == 1,
                   "distributed DP (--values) needs --clip above 0, --clients of at least 2, and "
                   "--sampling-rate 1 (the server knows whom it selected)");
      o.step = p->step;
      o.stochastic = p->rounding == "stochastic";
      o.validate([](std::string key) { return "--" + key; });
    }
    // R rounds at one rate and noise compose to R times one round's RDP (as Opacus computes it):
    // each row is one product, whatever the number of rounds.
    auto epsilon_after = [&](double z, int64_t r) {
      if (!distributed) {
        return fed::after_central_releases(fed::PrivacyAccountant(), p->sampling, p->rate, z, r)
            .epsilon(p->delta);
      }
      fed::secagg::DistributedNoise central;  // the whole sum's noise
      central.clip = p->clip;
      central.stddev = z * p->clip;
      std::vector<double> rdp = fed::secagg::release_rdp(o, central, p->values, p->clients);
      for (double& v : rdp) v *= static_cast<double>(r);
      return optim::rdp_to_epsilon(rdp, p->delta);
    };
    if (p->target_epsilon > 0) {
      p->noise = optim::smallest_noise_multiplier(
          [&](double z) { return epsilon_after(z, p->rounds).epsilon; }, p->target_epsilon,
          [&] {
            return cat("--target-epsilon ", p->target_epsilon, " at delta ", p->delta,
                       " cannot be reached in ", p->rounds,
                       " rounds with any noise multiplier up to 1000; ask for a larger epsilon, "
                       "fewer rounds or a lower sampling rate");
          });
    }
    std::printf("%-8s %-12s %s\n", "rounds", "epsilon", "best RDP order");
    auto print_after = [&](int64_t r) {
      const optim::Epsilon e = epsilon_after(p->noise, r);
      std::printf("%-8lld %-12.6g %g\n", static_cast<long long>(r), e.epsilon, e.order);
    };
    if (p->every > 0)
      for (int64_t r = p->every; r < p->rounds; r += p->every) print_after(r);
    print_after(p->rounds);
    std::printf("noise multiplier %g%s, sampling rate %g (%s), delta %g\n", p->noise,
                p->target_epsilon > 0 ? cat(" (for epsilon ", p->target_epsilon, ")").c_str() : "",
                p->rate, p->sampling.c_str(), p->delta);
    if (distributed) {
      std::printf(
          "distributed discrete Gaussian: %lld values, clip %g, step %g (%s), up to %lld "
          "clients\n",
          static_cast<long long>(p->values), p->clip, p->step, p->rounding.c_str(),
          static_cast<long long>(p->clients));
    }
  });

  auto* certs = fed->add_subcommand(
      "certs", "Make a development CA, a server certificate and per-client certificates");
  certs->add_option("--dir", o->dir, "Where the PEM files go")->capture_default_str();
  certs->add_option("--client", o->clients, "A client id (repeat for more)");
  auto* server_names =
      certs
          ->add_option("--server-name", o->names,
                       "DNS names or IPs of the server (given: a new server certificate; not "
                       "given: the one in --dir is kept, made when there is none)")
          ->capture_default_str();
  certs->add_option("--days", o->days, "Validity in days")->capture_default_str();
  certs->add_option("--revoke", o->revoke, "Revoke this client's certificate (writes crl.pem)");
  certs->callback([o, server_names] {
    if (!o->revoke.empty()) {
      fed::revoke_client_cert(o->dir, o->revoke);
    } else {
      fed::make_dev_certs(o->dir, o->clients, o->names, o->days,
                          /*replace_server=*/server_names->count() > 0);
    }
  });
}

}  // namespace pollen::cli
