#include "fed/server_metrics.h"

#include <cmath>

#include "obs/prometheus.h"

namespace pollen::fed {

std::string prometheus_metrics(const ServerStatus& st) {
  obs::PrometheusText p;
  const auto d = [](auto v) { return static_cast<double>(v); };
  p.gauge("pollen_fed_rounds_done", "Rounds aggregated so far.", d(st.rounds_done));
  p.gauge("pollen_fed_rounds_planned", "Rounds the run aggregates.", d(st.rounds_total));
  p.gauge("pollen_fed_round_open", "The round open now (0: none).", d(st.open_round));
  p.gauge("pollen_fed_clients_joined", "Clients that joined.", d(st.clients_joined));
  p.gauge("pollen_fed_clients_connected", "Clients heard from within client_timeout_s.",
          d(st.clients_alive));
  const RoundSummary& r = st.last;
  p.gauge("pollen_fed_last_round", "The last closed round (0: none yet).", d(r.round));
  p.gauge("pollen_fed_last_round_aggregated", "1 when the last closed round was aggregated.",
          r.aggregated ? 1 : 0);
  p.gauge("pollen_fed_last_round_participants", "Clients whose update the last round used.",
          d(r.participants.size()));
  p.gauge("pollen_fed_last_round_dropped", "Selected clients the last round left out.",
          d(r.dropped.size()));
  p.gauge("pollen_fed_last_round_tokens", "Tokens trained in the last round.", d(r.tokens));
  p.gauge("pollen_fed_last_round_bytes_sent", "Bytes of the model sent in the last round.",
          d(r.bytes_sent));
  p.gauge("pollen_fed_last_round_bytes_received", "Bytes of updates received in the last round.",
          d(r.bytes_received));
  p.gauge("pollen_fed_last_round_wall_seconds", "Wall time of the last round.", r.wall_s);
  if (r.aggregated && !std::isnan(r.train_loss)) {
    p.gauge("pollen_fed_last_round_train_loss", "Token-weighted train loss of the last round.",
            r.train_loss);
  }
  if (r.round > 0 && !std::isnan(r.eval_loss)) {
    p.gauge("pollen_fed_last_round_eval_loss",
            "Token-weighted validation loss of the model the last round started from.",
            r.eval_loss);
  }
  if (!r.client_train_loss.empty()) {
    p.family("pollen_fed_client_train_loss", "gauge", "Each client's train loss, last round.");
    for (const auto& [id, loss] : r.client_train_loss) p.sample(loss, {{"client", id}});
  }
  if (!r.client_eval_loss.empty()) {
    p.family("pollen_fed_client_eval_loss", "gauge",
             "Each client's validation loss of the global model, last round.");
    for (const auto& [id, loss] : r.client_eval_loss) p.sample(loss, {{"client", id}});
  }
  if (st.private_) {
    p.gauge("pollen_fed_privacy_epsilon", "Epsilon spent so far at pollen_fed_privacy_delta.",
            st.epsilon);
    p.gauge("pollen_fed_privacy_delta", "The delta epsilon is reported at.", st.delta);
    p.gauge("pollen_fed_private_rounds", "Releases the privacy accountant has counted.",
            d(st.private_rounds));
  }
  p.counter("pollen_fed_bytes_sent_total", "Bytes of models sent to clients.",
            d(st.bytes_sent_total));
  p.counter("pollen_fed_bytes_received_total", "Bytes of updates received from clients.",
            d(st.bytes_received_total));
  p.counter("pollen_fed_dropped_total", "Selected clients left out of their round.",
            d(st.dropped_total));
  p.counter("pollen_fed_retries_total", "Rounds retried for want of updates.", d(st.retries_total));
  p.counter("pollen_fed_tokens_total", "Tokens trained in aggregated rounds.", d(st.tokens_total));
  return p.text();
}

}  // namespace pollen::fed
