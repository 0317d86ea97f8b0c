#include "fed/run.h"

#include <atomic>
#include <csignal>
#include <thread>

#include "base/log.h"
#include "base/thread_pool.h"
#include "fed/client.h"
#include "fed/coordinator.h"
#include "fed/grpc.h"
#include "fed/server_metrics.h"
#include "obs/metrics_endpoint.h"

namespace pollen::fed {

namespace {
std::atomic<int> g_signal{0};
extern "C" void on_signal(int sig) {
  g_signal = sig;
}
// The Prometheus endpoint of server.metrics_address, when set.
std::unique_ptr<obs::MetricsEndpoint> serve_metrics(const Coordinator& c) {
  if (c.config().metrics_address.empty()) return nullptr;
  auto e = std::make_unique<obs::MetricsEndpoint>(c.config().metrics_address,
                                                  [&c] { return prometheus_metrics(c.status()); });
  log::info("fed server: metrics on http://",
            c.config().metrics_address.substr(0, c.config().metrics_address.rfind(':')), ":",
            e->port(), "/metrics");
  return e;
}

}  // namespace

int64_t run_server(const ServerConfig& config, bool resume) {
  Coordinator coordinator(config, resume);
  GrpcServer server(coordinator, config.address, config.tls);
  const auto metrics = serve_metrics(coordinator);
  g_signal = 0;
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  std::atomic<bool> done{false};
  std::thread watcher([&] {
    while (!done) {
      if (g_signal) {
        log::warn("fed server: signal ", g_signal.load(), "; stopping after the last round");
        coordinator.stop();
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  coordinator.run();
  // Let polling clients hear that the run is over before the port closes.
  if (coordinator.finished()) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  done = true;
  watcher.join();
  server.shutdown();
  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
  log::info("fed server: ", coordinator.rounds_done(), " of ", config.rounds, " rounds done");
  return coordinator.rounds_done();
}

void run_client(const ClientConfig& config) {
  if (config.threads > 0) set_num_threads(config.threads);
  GrpcTransport transport(config.server, config.tls, config.connect_timeout_s);
  Client client(config, transport);
  client.join();
  log::info("fed client '", config.id, "': joined ", config.server);
  client.run();
  log::info("fed client '", config.id, "': sent ", client.bytes_sent(), " bytes, received ",
            client.bytes_received());
}

SimulationResult run_simulation(const SimConfig& config, bool resume) {
  if (config.threads > 0) set_num_threads(config.threads);
  Coordinator coordinator(config.server, resume);
  const auto metrics = serve_metrics(coordinator);
  LocalTransport transport(coordinator);
  std::vector<std::unique_ptr<Client>> clients;
  for (const auto& cc : config.clients) {
    clients.push_back(std::make_unique<Client>(cc, transport));
    clients.back()->join();
  }
  std::sort(clients.begin(), clients.end(),
            [](const auto& a, const auto& b) { return a->id() < b->id(); });
  while (coordinator.begin_round()) {
    // One pass trains; secure aggregation takes a pass per phase. A pass where nobody had work
    // closes the phase like its deadline would.
    while (!coordinator.round_complete()) {
      bool worked = false;
      for (auto& c : clients) worked = c->poll_once() != pb::TASK_WAIT || worked;
      if (!worked && !coordinator.close_phase()) break;
    }
    coordinator.end_round();
  }
  SimulationResult r;
  r.rounds = coordinator.rounds_done();
  r.global = coordinator.global_weights();
  for (auto& c : clients) {
    set_model_weights(c->trainer().model(), r.global);
    int64_t tokens = 0;
    r.clients.push_back(c->id());
    r.eval_loss.push_back(c->trainer().evaluate(&tokens));
  }
  return r;
}

}  // namespace pollen::fed
