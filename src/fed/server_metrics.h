#pragma once
// The server's status as Prometheus metrics (text format 0.0.4), served on /metrics by
// `pollen fed server` and `pollen fed simulate` when server.metrics_address is set.
//
//   pollen_fed_rounds_done, pollen_fed_rounds_planned, pollen_fed_round_open     gauges
//   pollen_fed_clients_joined, pollen_fed_clients_connected                   gauges
//   pollen_fed_last_round, ..._participants, ..._dropped, ..._tokens,
//   ..._bytes_sent, ..._bytes_received, ..._wall_seconds, ..._train_loss,
//   ..._eval_loss (pollen_fed_last_round_*)                                    gauges
//   pollen_fed_client_train_loss{client}, pollen_fed_client_eval_loss{client} gauges
//   pollen_fed_privacy_epsilon, ..._delta, pollen_fed_private_rounds (under [privacy]) gauges
//   pollen_fed_bytes_sent_total, pollen_fed_bytes_received_total,
//   pollen_fed_dropped_total, pollen_fed_retries_total, pollen_fed_tokens_total counters
//
// Totals count from the server process's start (a restarted server starts them at 0, as
// Prometheus expects of counters).
#include <string>

#include "fed/coordinator.h"

namespace pollen::fed {

std::string prometheus_metrics(const ServerStatus& status);

}  // namespace pollen::fed
