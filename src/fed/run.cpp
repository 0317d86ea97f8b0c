#include "fed/run.h"

#include <atomic>
#include <cmath>
#include <csignal>
#include <thread>

#include "base/folder_lock.h"
#include "base/log.h"
#include "base/thread_pool.h"
#include "fed/client.h"
#include "fed/coordinator.h"
#include "fed/grpc.h"
#include "fed/server_metrics.h"
#include "fed/silo.h"
#include "obs/metrics_endpoint.h"
#include "train/run_control.h"

namespace pollen::fed {

namespace {
std::atomic<int> g_signal{0};
extern "C" void on_signal(int sig) {
  g_signal = sig;
}

// While it lives, SIGINT and SIGTERM set g_signal instead of ending the process; the default
// handlers come back after.
struct SignalCatcher {
  SignalCatcher() {
    g_signal = 0;
    std::signal(SIGINT, on_signal);
    std::signal(SIGTERM, on_signal);
  }
  ~SignalCatcher() {
    std::signal(SIGINT, SIG_DFL);
    std::signal(SIGTERM, SIG_DFL);
  }
};

// The Prometheus endpoint of server.metrics_address, when set.
std::unique_ptr<obs::MetricsEndpoint> serve_metrics(const Coordinator& c) {
  if (c.config().metrics_address.empty()) return nullptr;
  std::unique_ptr<obs::MetricsEndpoint> e;
  try {
    e = std::make_unique<obs::MetricsEndpoint>(c.config().metrics_address,
                                               [&c] { return prometheus_metrics(c.status()); });
  } catch (const Error& error) {
    fail("server.metrics_address: ", error.what());
  }
  log::info("fed server: metrics on http://",
            c.config().metrics_address.substr(0, c.config().metrics_address.rfind(':')), ":",
            e->port(), "/metrics");
  return e;
}

// A reward model's federation exports it once its last round is done; a run that stopped before
// (the privacy budget, too few clients, failed retries) says why there is none.
void export_reward_model_when_done(Coordinator& coordinator, const ServerConfig& config,
                                   const std::string& who) {
  if (!config.post.enabled() || config.post.objective != "rm") return;
  if (coordinator.rounds_done() < config.rounds || !coordinator.stopped_reason().empty()) {
    log::warn(who, ": no reward model exported: the run stopped after ", coordinator.rounds_done(),
              " of ", config.rounds, " rounds",
              coordinator.stopped_reason().empty() ? "" : ": " + coordinator.stopped_reason());
    return;
  }
  log::info(who, ": reward model exported to '", coordinator.export_reward_model().string(),
            "' (LlamaForSequenceClassification)");
}

}  // namespace

int64_t run_server(const ServerConfig& config, bool resume) {
  const FolderLock lock(config.dir, "server.dir");  // one server at a time writes its run
  Coordinator coordinator(config, resume);
  const auto metrics = serve_metrics(coordinator);  // before the clients' port opens
  GrpcServer server(coordinator, config.address, config.tls);
  const SignalCatcher signals;
  {
    // Joined however run() ends, so that its error (a full disk at a checkpoint, say) reaches
    // the caller as that error and not as std::terminate on a joinable thread.
    struct SignalWatcher {
      std::atomic<bool> done{false};
      std::thread thread;
      ~SignalWatcher() {
        done = true;
        if (thread.joinable()) thread.join();
      }
    } watcher;
    watcher.thread = std::thread([&] {
      while (!watcher.done) {
        if (g_signal) {
          if (coordinator.finished())
            log::info("fed server: signal ", g_signal.load(),
                      "; every round is done: the server stops without waiting for the "
                      "clients to hear it");
          else
            log::warn("fed server: signal ", g_signal.load(),
                      "; stopping now: the open round is left unfinished, and --resume redoes it");
          coordinator.stop();
          return;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    });
    coordinator.run();
    // The port stays open until every live client has heard that the run is over (one still
    // training a late round pushes, is refused, and asks), for client_timeout_s at most.
    if (coordinator.finished() && coordinator.clients_not_told_done() > 0) {
      log::info("fed server: the run is over; waiting up to ", config.client_timeout_s,
                " s (server.client_timeout_s) for ", coordinator.clients_not_told_done(),
                " client(s) to hear it");
      const auto until =
          std::chrono::steady_clock::now() + std::chrono::duration<double>(config.client_timeout_s);
      while (coordinator.clients_not_told_done() > 0 && std::chrono::steady_clock::now() < until &&
             !g_signal)
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  server.shutdown();
  log::info("fed server: ", coordinator.rounds_done(), " of ", config.rounds, " rounds done");
  export_reward_model_when_done(coordinator, config, "fed server");
  return coordinator.rounds_done();
}

namespace {

void lead_silo(const ClientConfig& config, dist::Communicator& comm,
               const train::FaultInjection& fault) {
  GrpcTransport transport(config.server, config.tls, config.connect_timeout_s,
                          config.busy_timeout_s);
  Client client(config, transport, &comm);
  if (config.post.enabled())
    client.lora_silo()->set_fault_injection(fault);
  else
    client.trainer().set_fault_injection(fault);
  client.join();
  log::info("fed client '", config.id, "': joined ", config.server,
            comm.world() > 1 ? cat(" (the silo runs as ", comm.world(), " ranks)") : "");
  client.run();
  log::info("fed client '", config.id, "': sent ", client.bytes_sent(), " bytes, received ",
            client.bytes_received());
}

}  // namespace

void run_client(const ClientConfig& config, const train::FaultInjection& fault,
                const dist::RankInputs& inputs) {
  // One process unless a launcher (mpirun, srun) started several.
  const auto comm = train::connect_ranks(config.parallel.timeout_s, fault);
  if (config.threads > 0 || comm->world() > 1) {
    set_num_threads(config.threads > 0 ? config.threads : comm->threads_per_rank());
  }
  if (comm->rank() != 0) log::follow_job_lead();  // rank 0 reports for the silo
  // One client process (one silo's job) at a time keeps its state in a folder; refused inside the
  // try, whose handler says why before it ends the silo's other ranks.
  std::optional<FolderLock> lock;
  try {
    if (comm->rank() == 0 && !config.state_dir.empty())
      lock.emplace(config.state_dir, "client.state_dir");
    if (comm->world() > 1)
      log::info("fed client ranks (", comm->topology().launcher, "): ", comm->placement());
    if (!inputs.run_file.empty()) dist::check_ranks_run_the_same(*comm, inputs);
    if (comm->rank() == 0) {
      lead_silo(config, *comm, fault);
    } else {
      follow_orders(config, *comm, fault);
    }
  } catch (const dist::PeerFailure& e) {
    log::error(e.what(), "; stopping the silo's job. Start the client again: it resumes its state",
               config.state_dir.empty() ? " (none kept: client.state_dir is not set)"
                                        : cat(" under '", config.state_dir.string(), "'"));
    comm->abort_job(4);  // ends the hung rank too
  } catch (const std::exception& e) {
    if (comm->world() == 1) throw;
    // An error on one rank: the others wait for it in a collective, so end the job.
    log::error("rank ", comm->rank(), ": ", e.what());
    comm->abort_job(1);
  }
}

SimulationResult run_simulation(const SimConfig& config, bool resume) {
  if (config.threads > 0) set_num_threads(config.threads);
  // Before the server's folder is made: a mistyped path names its key.
  for (const ClientConfig& cc : config.clients)
    for (const std::string& m : cc.manifests)
      POLLEN_CHECK(std::filesystem::is_regular_file(m), config.command, ": client '", cc.id,
                   "': no manifest '", m,
                   "' (sim.manifests; paths are relative to the working folder)");
  const FolderLock lock(config.server.dir, config.server.dir_key);  // its clients' states inside
  Coordinator coordinator(config.server, resume);
  const auto metrics = serve_metrics(coordinator);
  LocalTransport transport(coordinator);
  std::vector<std::unique_ptr<Client>> clients;
  for (ClientConfig cc : config.clients) {
    // Each client keeps its state beside the server's, so that --resume continues the clients
    // (optimizer, data position, residual) as well as the server.
    // A run that starts at round 1 (afresh, or resumed without a checkpoint) starts them
    // afresh too: states left by a run stopped before its first checkpoint are not the round's.
    // A [dp_sgd] account beside them stays: the steps it counts were released.
    if (cc.state_dir.empty() && config.client_states) {
      cc.state_dir = config.server.dir / "clients" / cc.id;
      if (coordinator.rounds_done() == 0) {
        std::filesystem::remove_all(cc.state_dir / "checkpoints");
        std::filesystem::remove(cc.state_dir / "server_run_id");  // that run's id, not this one's
      }
    } else if (cc.state_dir.empty() && coordinator.rounds_done() > 0) {
      log::warn(config.command, ": client '", cc.id, "' resumes at round ",
                coordinator.rounds_done() + 1,
                " with a fresh optimizer and its data from the start (sim.client_states = false)");
    }
    clients.push_back(std::make_unique<Client>(cc, transport));
    clients.back()->join();
  }
  std::sort(clients.begin(), clients.end(),
            [](const auto& a, const auto& b) { return a->id() < b->id(); });
  // SIGINT or SIGTERM: the round in progress finishes (and is checkpointed), then the run stops.
  const SignalCatcher signals;
  for (;;) {
    if (g_signal) {
      log::warn(config.command, ": signal ", g_signal.load(), "; stopped after round ",
                coordinator.rounds_done(), " (--resume continues)");
      break;
    }
    // The clients take turns, so the first one is not heard from again until the last one has
    // trained: each asks for a task between rounds, as a deployed client does while it waits,
    // or a round longer than server.client_timeout_s would leave it out of the next one.
    for (auto& c : clients) c->poll_once();
    if (!coordinator.begin_round()) break;
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
  r.stopped = coordinator.stopped_reason();
  r.global = coordinator.global_weights();
  if (g_signal) {  // stopped by hand: no final evaluation
    r.stopped = cat("signal ", g_signal.load(), "; --resume continues from round ", r.rounds + 1);
    return r;
  }
  // A round begins only with min_clients; the simulation's clients are all there will be.
  if (r.stopped.empty() && r.rounds < config.server.rounds &&
      static_cast<int64_t>(clients.size()) < config.server.strategy.min_clients)
    r.stopped = cat(clients.size(), " clients, fewer than strategy.min_clients ",
                    config.server.strategy.min_clients);
  for (auto& c : clients) {
    r.clients.push_back(c->id());
    c->round_trainer().set_exchanged_weights(r.global);
    if (LoraSilo* silo = c->lora_silo()) {  // the objective's held-out loss and headline metric
      const train::ObjectiveStep held_out = silo->evaluate_held_out();
      r.headline = silo->objective().headline_metric();
      r.eval_loss.push_back(held_out.loss);
      r.eval_headline.push_back(held_out.metrics.contains(r.headline)
                                    ? held_out.metrics[r.headline].get<double>()
                                    : std::nan(""));
    } else {
      int64_t tokens = 0;
      const double loss = c->round_trainer().evaluate(&tokens);
      r.eval_loss.push_back(tokens > 0 ? loss : std::nan(""));  // NaN: no held-out data
    }
  }
  export_reward_model_when_done(coordinator, config.server, config.command);
  return r;
}

}  // namespace pollen::fed
