// `pollen fed server | client | simulate | certs | tokenizer | counts`: federated training across
// silos (docs/federated.md; `fed privacy` and `fed post` are in their own files). Parsing and
// wiring only.
#include <cstdio>

#include "base/log.h"
#include "base/thread_pool.h"
#include "cli/commands.h"
#include "fed/config.h"
#include "fed/grpc.h"
#include "fed/held_out_table.h"
#include "fed/run.h"
#include "fed/tokenizer_round.h"

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
    bool replace = false;
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
    fed::ClientConfig cfg = fed::load_client_config(o->config);
    if (!o->device.empty()) fed::set_train_device(cfg, o->device);
    std::vector<std::string> options;
    if (!o->device.empty()) options.push_back("--device " + o->device);
    fed::run_client(cfg, train::fault_from_environment(),
                    {o->config, options, {cfg.manifests.begin(), cfg.manifests.end()}});
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
    std::fputs(fed::held_out_table(r, "validation loss of the global model").c_str(), stdout);
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
  auto seed = std::make_shared<uint64_t>(0);
  auto* seed_option = counts
                          ->add_option("--seed", *seed,
                                       "Seed of the noise (default: drawn from the OS; one who "
                                       "knows it can subtract the noise)")
                          ->check(seed_number());
  counts->add_option("--min-count", c->min_count, "Drop pieces counted fewer times (before noise)")
      ->capture_default_str();
  counts->add_option("--output", c->output, "Where the received tokenizer.json goes")->required();
  counts->add_option("--counts-file", c->counts_file,
                     "Where the counts sent are kept, and sent from again on a rerun, so that a "
                     "retry never sends other noise (default: the output's name + .counts; delete "
                     "it to count again)");
  counts->add_option("--ca", c->tls.ca, "TLS: the federation's CA (PEM)");
  counts->add_option("--cert", c->tls.cert, "TLS: this silo's certificate (PEM)");
  counts->add_option("--key", c->tls.key, "TLS: this silo's key (PEM)");
  counts->add_option("--server-name", c->tls.server_name,
                     "TLS: the name to check the server's certificate against");
  counts->add_option("--connect-timeout", c->connect_timeout_s, "Seconds to wait for the server")
      ->capture_default_str();
  auto threads = std::make_shared<int>(0);
  counts->add_option("--threads", *threads, "Threads for counting (default: all)");
  counts->callback([c, threads, seed, seed_option] {
    if (*threads > 0) set_num_threads(*threads);
    if (seed_option->count() > 0) c->seed = *seed;
    std::printf("fingerprint %s\n", fed::run_counts_client(*c).c_str());
  });

  auto* certs = fed->add_subcommand(
      "certs", "Make a development CA, a server certificate and per-client certificates");
  certs->add_option("--dir", o->dir, "Where the PEM files go")->capture_default_str();
  auto* client_ids = certs->add_option("--client", o->clients, "A client id (repeat for more)");
  auto* server_names =
      certs
          ->add_option("--server-name", o->names,
                       "DNS names or IPs of the server (given: a new server certificate; not "
                       "given: the one in --dir is kept, made when there is none)")
          ->capture_default_str();
  auto* days = certs->add_option("--days", o->days, "Validity in days")->capture_default_str();
  auto* replace = certs->add_flag("--replace", o->replace,
                                  "Make a new certificate for a --client that has one, revoking "
                                  "the old one (without it such a client is refused)");
  // Revoking makes no certificate: the options that shape one would be silently left out.
  certs
      ->add_option("--revoke", o->revoke,
                   "Revoke this client's certificate (writes crl.pem; makes no certificate)")
      ->excludes(client_ids)
      ->excludes(server_names)
      ->excludes(days)
      ->excludes(replace);
  certs->callback([o, server_names] {
    if (!o->revoke.empty()) {
      fed::revoke_client_cert(o->dir, o->revoke);
    } else {
      fed::make_dev_certs(o->dir, o->clients, o->names, o->days,
                          /*replace_server=*/server_names->count() > 0, o->replace);
    }
  });
}

}  // namespace pollen::cli
