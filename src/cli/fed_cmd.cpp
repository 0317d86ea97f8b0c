// `pollen fed server | client | simulate | certs`: federated training across silos
// (docs/federated.md). Parsing and wiring only.
#include <cstdio>

#include "base/log.h"
#include "cli/commands.h"
#include "fed/config.h"
#include "fed/grpc.h"
#include "fed/run.h"

namespace pollen::cli {

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
  };
  auto o = std::make_shared<Opts>();

  auto* server = fed->add_subcommand("server",
                                     "Run the federation server (global model, outer "
                                     "optimizer, rounds, checkpoints)");
  server->add_option("--config", o->config, "fed.toml")->required();
  server->add_flag("--resume", o->resume, "Continue from the newest valid checkpoint");
  server->callback([o] {
    const auto cfg = fed::load_server_config(o->config);
    const int64_t done = fed::run_server(cfg, o->resume);
    if (done < cfg.rounds) throw Error(cat("stopped after ", done, " of ", cfg.rounds, " rounds"));
  });

  auto* client = fed->add_subcommand("client",
                                     "Run one silo: join, train local steps, push "
                                     "pseudo-gradients");
  client->add_option("--config", o->config, "client.toml")->required();
  client->callback([o] { fed::run_client(fed::load_client_config(o->config)); });

  auto* sim = fed->add_subcommand("simulate", "N virtual clients and the server in one process");
  sim->add_option("--config", o->config, "sim.toml")->required();
  sim->add_flag("--resume", o->resume, "Continue from the newest valid checkpoint");
  sim->callback([o] {
    const auto cfg = fed::load_sim_config(o->config);
    const auto r = fed::run_simulation(cfg, o->resume);
    std::printf("%-24s %s\n", "client", "validation loss of the global model");
    for (size_t i = 0; i < r.clients.size(); ++i) {
      std::printf("%-24s %.4f\n", r.clients[i].c_str(), r.eval_loss[i]);
    }
    std::printf("%lld rounds; metrics in %s\n", static_cast<long long>(r.rounds),
                (cfg.server.dir / "metrics.jsonl").c_str());
  });

  auto* certs = fed->add_subcommand(
      "certs", "Make a development CA, a server certificate and per-client certificates");
  certs->add_option("--dir", o->dir, "Where the PEM files go")->capture_default_str();
  certs->add_option("--client", o->clients, "A client id (repeat for more)");
  certs->add_option("--server-name", o->names, "DNS names or IPs of the server")
      ->capture_default_str();
  certs->add_option("--days", o->days, "Validity in days")->capture_default_str();
  certs->add_option("--revoke", o->revoke, "Revoke this client's certificate (writes crl.pem)");
  certs->callback([o] {
    if (!o->revoke.empty()) {
      fed::revoke_client_cert(o->dir, o->revoke);
    } else {
      fed::make_dev_certs(o->dir, o->clients, o->names, o->days);
    }
  });
}

}  // namespace pollen::cli
