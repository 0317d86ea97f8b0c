#pragma once
// What `pollen fed server | client | simulate` run.
#include <string>
#include <vector>

#include "dist/same_inputs.h"
#include "fed/config.h"
#include "fed/strategy.h"
#include "train/trainer.h"

namespace pollen::fed {

// Serves rounds until done; SIGINT/SIGTERM stop it after checkpointing the last finished round.
// Returns the rounds done.
int64_t run_server(const ServerConfig& config, bool resume);

// Joins and trains until the server says the run is over. Under a launcher of several ranks
// (mpirun, srun) the silo runs as all of them (fed/silo.h); a rank that dies or hangs ends the
// job with exit code 4 (docs/parallel.md); ranks that run another client.toml (`inputs`: the
// file, the command's options and the manifests) than rank 0 end it before joining.
// `fault`: POLLEN_FAULT_INJECT's, for tests.
void run_client(const ClientConfig& config, const train::FaultInjection& fault = {},
                const dist::RankInputs& inputs = {});

struct SimulationResult {
  int64_t rounds = 0;
  Weights global;
  std::vector<std::string> clients;
  // Each client's validation loss of the final global model (NaN without held-out data).
  std::vector<double> eval_loss;
  // Post-training: the objective's headline metric (GRPO's reward; empty: the loss is the
  // headline) of the final global adapters on each silo's held-out data (NaN without one).
  std::string headline;
  std::vector<double> eval_headline;
  std::string stopped;  // why the run ended before its last round (empty: it did not)
};

// N clients and the server in one process: the same Coordinator and Client, the in-process
// transport, clients run one after another in id order (bitwise repeatable). Pre-training
// (`pollen fed simulate`) or, with server.post, post-training (`pollen fed post`; a reward
// model is exported after the last round, as the server exports it).
SimulationResult run_simulation(const SimConfig& config, bool resume);

}  // namespace pollen::fed
