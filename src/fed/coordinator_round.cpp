// A round from opening to closing: begin_round selects the clients and publishes the model;
// end_round aggregates the updates (or retries the round), averages the shared moments, writes
// the metrics, TensorBoard and lineage lines and checkpoints.
#include "fed/coordinator.h"

#include <cmath>
#include <map>

#include "base/log.h"
#include "fed/first_moments.h"
#include "fed/second_moments.h"

namespace pollen::fed {

using Clock = std::chrono::steady_clock;

bool Coordinator::begin_round() {
  std::lock_guard lock(mutex_);
  POLLEN_ASSERT(!open_);
  if (finished_ || done_ >= config_.rounds) return false;
  const std::vector<std::string> alive = alive_ids_locked();
  if (static_cast<int64_t>(alive.size()) < config_.strategy.min_clients) return false;
  const int64_t round = done_ + 1;
  Rng rng = Rng(config_.seed).fork(static_cast<uint64_t>(round * 1000 + retries_));
  const auto chosen = select_clients(round, alive, rng);
  if (dp_) {
    const std::string why = refuse_private_round_locked(round, static_cast<int64_t>(chosen.size()),
                                                        static_cast<int64_t>(alive.size()));
    if (!why.empty()) {
      log::error("fed server: ", why);
      metrics_.write({{"round", round}, {"status", "refused"}, {"reason", why}});
      metrics_.file().flush();
      finished_ = true;
      stopped_ = why;
      changed_.notify_all();
      return false;
    }
    if (config_.secure_aggregation.enabled && !warned_rounding_growth_) {
      const double growth = rounding_growth_locked();
      if (growth > 1.01) {
        log::warn("fed server: distributed DP: rounding to secure_aggregation.step ",
                  config_.secure_aggregation.step, " may grow an update of norm ", dp_->clip(),
                  " to ", growth, " times that, so each round costs about ", growth * growth,
                  " times the Gaussian's RDP at the round's noise; a finer step brings it back");
        warned_rounding_growth_ = true;
      }
    }
  }
  round_available_ = static_cast<int64_t>(alive.size());
  ++attempts_;
  selected_ = {chosen.begin(), chosen.end()};
  pulled_.clear();
  updates_.clear();
  bytes_sent_ = 0;
  secagg_.reset();
  secagg_bytes_in_ = secagg_bytes_out_ = 0;
  if (config_.secure_aggregation.enabled) {
    int64_t numel = 0;
    for (const auto& p : update_rules_.masked) numel += shape_numel(p.shape);
    secagg_ = std::make_unique<secagg::ServerSession>(round, chosen, config_.secure_aggregation,
                                                      rng.next_u64(), numel);
    secagg_->require_inputs(static_cast<size_t>(config_.strategy.min_clients));
  }
  // The clients train from, and take their pseudo-gradients against, the view of the exact
  // weights, which the server keeps (docs/federated.md, "Compression").
  publisher_->set_second_moments(second_moments_);
  publisher_->publish(global_);
  round_start_ = Clock::now();
  open_ = true;
  log::info("fed server: round ", round, " of ", config_.rounds, " with ", chosen.size(),
            " clients");
  show_progress_locked();
  changed_.notify_all();
  return true;
}

std::vector<std::string> Coordinator::select_clients(int64_t round,
                                                     const std::vector<std::string>& alive,
                                                     Rng& rng) const {
  if (!dp_) return strategy_->configure_round(round, alive, rng);
  if (poisson_dp()) return dp_->sample_clients(round, retries_, alive);
  // Central DP's fixed-size sample comes from its secret generator as well: with the server's
  // seed anyone who knows it could draw the sample again, and amplification by sampling
  // assumes nobody knows who was sampled.
  Rng secret = dp_->sampling_rng(round, retries_);
  return strategy_->configure_round(round, alive, secret);
}

bool Coordinator::round_complete_locked() const {
  if (!open_) return false;
  if (!secagg_) {
    size_t waited_for = 0;  // selected, without an update, and able to send one
    for (const auto& id : selected_)
      if (!updates_.count(id) && !revoked_.count(id)) ++waited_for;
    return waited_for == 0;
  }
  using Phase = secagg::ServerSession::Phase;
  return secagg_->phase() == Phase::done || secagg_->phase() == Phase::failed;
}

bool Coordinator::round_complete() const {
  std::lock_guard lock(mutex_);
  return round_complete_locked();
}

void Coordinator::set_first_moments(Weights mean) {
  first_moments_ = std::move(mean);
  // Encoded once for every pull of the rounds until the next average.
  first_moments_set_ = std::make_shared<const EncodedSet>(
      encode_weights(moment_specs_, first_moments_, config_.download()));
}

RoundSummary Coordinator::end_round() {
  std::unique_lock lock(mutex_);
  POLLEN_ASSERT(open_);
  open_ = false;
  RoundSummary s;
  s.round = done_ + 1;
  s.selected = {selected_.begin(), selected_.end()};
  std::vector<ClientUpdate> ups;
  std::vector<ClientEval> evals;
  nlohmann::ordered_json clients = nlohmann::ordered_json::object();
  nlohmann::ordered_json lineage_clients = nlohmann::ordered_json::array();
  uint64_t bytes_received = 0;
  double loss_sum = 0;
  std::map<std::string, double> objective_metrics;  // token-weighted sums
  std::vector<std::vector<float>> moments;          // strategy.second_moments: each participant's
  std::vector<double> moment_weights;
  std::vector<Weights> first_moments;  // strategy.first_moments: each participant's
  std::vector<double> first_moment_weights;
  for (const auto& id : s.selected) {
    auto it = updates_.find(id);
    if (it == updates_.end()) {
      s.dropped.push_back(id);
      continue;
    }
    s.participants.push_back(id);
    const auto& info = it->second.info;
    s.tokens += info.tokens();
    loss_sum += info.train_loss() * static_cast<double>(info.tokens());
    bytes_received += it->second.bytes;
    if (info.eval_tokens() > 0) evals.push_back({id, info.eval_tokens(), info.eval_loss()});
    nlohmann::ordered_json c{{"tokens", info.tokens()},
                             {"train_loss", info.train_loss()},
                             {"train_seconds", info.train_seconds()},
                             {"bytes", it->second.bytes}};
    if (info.eval_tokens() > 0) c["eval_loss"] = info.eval_loss();
    if (!info.objective_metrics().empty()) {
      // Sorted by name: a protobuf map's order is unspecified.
      const std::map<std::string, double> m(info.objective_metrics().begin(),
                                            info.objective_metrics().end());
      c["metrics"] = m;
      for (const auto& [name, value] : m)
        objective_metrics[name] += value * static_cast<double>(info.tokens());
    }
    clients[id] = c;
    s.client_train_loss[id] = info.train_loss();
    if (info.eval_tokens() > 0) s.client_eval_loss[id] = info.eval_loss();
    lineage_clients.push_back({{"client", id},
                               {"data_manifest_hash", info.data_manifest_hash()},
                               {"tokens", info.tokens()}});
    if (!info.second_moments().empty()) {
      moments.push_back(
          unpack_second_moments(specs_, info.second_moments(), cat("update from '", id, "'")));
      moment_weights.push_back(static_cast<double>(info.tokens()));
    }
    if (!it->second.first_moments.empty()) {
      first_moments.push_back(std::move(it->second.first_moments));
      first_moment_weights.push_back(static_cast<double>(info.tokens()));
    }
    ups.push_back(std::move(it->second.update));
  }
  updates_.clear();
  selected_.clear();
  publisher_->release();
  std::string secure_error;
  AggregationReport report;
  bool released_unapplied = false;
  if (secagg_) {
    std::optional<double> count;
    s.aggregated =
        aggregate_secure(s.round, s.tokens, ups.size(), s.selected.size(), &count, &secure_error);
    if (dp_ && secagg_->revealed()) {
      // Once shares are revealed the server may be able to unmask a sum (all of it, or with
      // SecAgg+ the part of a piece of the graph), so the release is accounted whether or not
      // the round is applied, and a round that is not is saved with the accountant.
      report.extra["rounded_norm_over_clip"] = rounding_growth_locked();
      dp_->account_distributed(static_cast<int64_t>(s.selected.size()), round_available_,
                               static_cast<int64_t>(secagg_->inputs()),
                               secagg_options_locked(s.selected.size()).noise,
                               distributed_release_rdp_locked(s.selected.size()), &report);
      if (count) dp_->adapt_distributed(*count, &report);
      released_unapplied = !s.aggregated;
    } else if (dp_) {
      std::error_code ec;  // a charge left behind is only ever too much, never too little
      std::filesystem::remove(privacy_charge_path(), ec);  // nothing revealed: nothing released
    }
    secagg_.reset();  // nothing of the round's masked inputs outlives it
  } else {
    // A Poisson-sampled DP round releases whatever came, none included: retrying it for too few
    // updates would condition the released sample on its size, which the accountant does not
    // cover.
    s.aggregated = poisson_dp() || static_cast<int64_t>(ups.size()) >= config_.strategy.min_clients;
    if (s.aggregated && dp_) {
      const auto selected = static_cast<int64_t>(s.selected.size());
      strategy_->aggregate_mean(
          s.round, global_,
          dp_->aggregate(s.round, global_, ups, selected, round_available_, &report));
    } else if (s.aggregated) {
      strategy_->aggregate(s.round, global_, ups, &report);
    }
  }
  // An outer step that made the global model not finite must not become a checkpoint (a resume
  // would load it): the run stops, and the last round's checkpoint stands.
  if (s.aggregated) {
    for (size_t i = 0; i < global_.size(); ++i) {
      const float* x = global_[i].data<float>();
      for (int64_t j = 0; j < global_[i].numel(); ++j)
        POLLEN_CHECK(std::isfinite(x[j]), "fed server: round ", s.round,
                     ": the outer step of "
                     "strategy '",
                     strategy_->name(), "' made value ", j, " of '", specs_[i].name,
                     "' not finite; check the [strategy] settings (the checkpoint of round ",
                     s.round - 1, " is kept)");
    }
  }
  if (s.aggregated && !moments.empty()) {
    std::vector<const std::vector<float>*> each;
    for (const auto& m : moments) each.push_back(&m);
    // Kept as sent, in the wire's 8-bit codes.
    second_moments_ = pack_second_moments(specs_, average_second_moments(each, moment_weights));
  }
  if (s.aggregated && !first_moments.empty()) {
    std::vector<const Weights*> each;
    for (const auto& m : first_moments) each.push_back(&m);
    set_first_moments(average_first_moments(each, first_moment_weights));
  }
  if (s.aggregated) {
    s.train_loss = s.tokens > 0 ? loss_sum / static_cast<double>(s.tokens) : std::nan("");
    ++done_;
    retries_ = 0;
    lineage_.push_back({{"round", s.round}, {"clients", lineage_clients}});
    for (const auto& id : s.participants)
      if (auto c = clients_.find(id); c != clients_.end())
        c->second.last_aggregated_round = s.round;
  } else {
    ++retries_;
    const std::string then =
        retries_ > config_.max_round_retries
            ? cat("no retry is left (server.max_round_retries ", config_.max_round_retries, ")")
            : "the round is retried";
    if (!secure_error.empty())
      log::warn("fed server: ", secure_error, "; nothing is applied and ", then);
    else
      log::warn("fed server: round ", s.round, " got ", ups.size(), " updates, fewer than ",
                config_.strategy.min_clients, "; ", then);
  }
  const double wall = std::chrono::duration<double>(Clock::now() - round_start_).count();
  s.wall_s = wall;
  s.bytes_sent = bytes_sent_;
  s.bytes_received = bytes_received;
  s.eval_loss = evals.empty() ? std::nan("") : Strategy::aggregate_evaluate(evals).loss;
  for (const auto& [name, sum] : objective_metrics)
    if (s.tokens > 0) s.metrics[name] = sum / static_cast<double>(s.tokens);
  nlohmann::ordered_json m{{"round", s.round},
                           {"status", s.aggregated ? "aggregated" : "retry"},
                           {"selected", s.selected.size()},
                           {"participants", s.participants},
                           {"dropped", s.dropped},
                           {"tokens", s.tokens},
                           {"bytes_sent", bytes_sent_},
                           {"bytes_received", bytes_received},
                           {"wall_s", wall}};
  if (config_.secure_aggregation.enabled) {
    m["secagg_bytes_received"] = secagg_bytes_in_;
    m["secagg_bytes_sent"] = secagg_bytes_out_;
    if (!secure_error.empty()) m["secagg_error"] = secure_error;
  }
  if (s.aggregated && s.tokens > 0) m["train_loss"] = s.train_loss;
  if (!s.metrics.empty()) m["metrics"] = s.metrics;
  if (!evals.empty()) m["eval_loss"] = s.eval_loss;
  if (s.aggregated) {
    const bool secure = config_.secure_aggregation.enabled;
    m["aggregation"] = dp_ ? (secure ? "secure_dp_mean" : "dp_mean")
                           : (secure ? "secure_mean" : config_.strategy.robust.aggregation);
    if (!secure) {  // the server sees no single update to clip or reject
      m["clipped"] = report.clipped();
      m["rejected"] = report.rejected();
    }
    for (const auto& [id, r] : report.clients) {
      auto& c = clients[id];
      c["update_norm"] = r.norm;
      c["clipped"] = r.clipped;
      c["rejected"] = r.rejected;
      if (r.trimmed >= 0) c["trimmed"] = r.trimmed;
    }
  }
  if (dp_ && !report.extra.empty()) m["privacy"] = report.extra;
  m["clients"] = clients;
  metrics_.write(m);
  record_status(s);
  if (s.aggregated) {
    write_tensorboard(s, m);
    lineage_file_.write({{"round", s.round}, {"clients", lineage_clients}});
    save_checkpoint(s);
    log::info("fed server: round ", s.round, " done: ", s.participants.size(), " clients, ",
              s.tokens, " tokens, train loss ", s.train_loss,
              evals.empty() ? "" : cat(", eval loss ", s.eval_loss), ", ", bytes_received,
              " bytes in, ", bytes_sent_, " out, ", wall, " s");
  } else if (released_unapplied) {
    save_checkpoint(s);  // the round's model as before, with the release accounted
  } else {
    metrics_.file().flush();
  }
  // A round ended by a stop (under distributed DP, to account its revealed shares) is not a
  // failed run: the run stops as preempted, and a resumed one retries the round.
  const bool out_of_retries = retries_ > config_.max_round_retries && !stop_;
  if (done_ >= config_.rounds || out_of_retries) {
    if (out_of_retries) {
      stopped_ = cat("round ", s.round, " failed ", retries_, " times (server.max_round_retries ",
                     config_.max_round_retries, ")");
      log::error("fed server: ", stopped_, "; stopping");
    }
    finished_ = true;
  }
  show_progress_locked();
  if (finished_ && progress_) progress_->finish();
  changed_.notify_all();
  return s;
}

void Coordinator::show_progress_locked() {
  if (!progress_) return;
  const std::string fields =
      open_ ? cat("round ", done_ + 1, ": ", updates_.size(), "/", selected_.size(),
                  " clients reported")
            : cat("rounds done, ", alive_ids_locked().size(), " clients connected");
  progress_->update(done_, fields, /*force=*/true);
}

void Coordinator::record_status(const RoundSummary& s) {
  totals_.last = s;
  totals_.bytes_sent_total += s.bytes_sent;
  totals_.bytes_received_total += s.bytes_received;
  totals_.dropped_total += static_cast<int64_t>(s.dropped.size());
  totals_.retries_total += s.aggregated ? 0 : 1;
  totals_.tokens_total += s.aggregated ? s.tokens : 0;
}

void Coordinator::write_tensorboard(const RoundSummary& s,
                                    const nlohmann::ordered_json& round_metrics) {
  const double now = obs::wall_time_now();
  auto add = [&](const std::string& tag, double value) {
    tensorboard_.add_scalar(tag, value, s.round, now);
  };
  if (!std::isnan(s.train_loss)) add("fed/train_loss", s.train_loss);
  if (!std::isnan(s.eval_loss)) add("fed/eval_loss", s.eval_loss);
  add("fed/participants", static_cast<double>(s.participants.size()));
  add("fed/dropped", static_cast<double>(s.dropped.size()));
  add("fed/tokens", static_cast<double>(s.tokens));
  add("fed/bytes_sent", static_cast<double>(s.bytes_sent));
  add("fed/bytes_received", static_cast<double>(s.bytes_received));
  add("fed/wall_s", s.wall_s);
  for (const auto& [id, loss] : s.client_train_loss) add("client/" + id + "/train_loss", loss);
  for (const auto& [id, loss] : s.client_eval_loss) add("client/" + id + "/eval_loss", loss);
  for (const auto& [name, value] : s.metrics) add("fed/" + name, value);
  for (const char* key : {"clipped", "rejected"})
    if (round_metrics.contains(key)) add(cat("fed/", key), round_metrics.at(key).get<double>());
  if (round_metrics.contains("privacy"))
    for (const auto& [key, value] : round_metrics.at("privacy").items())
      if (value.is_number()) add("privacy/" + key, value.get<double>());
  tensorboard_.file().flush();
}

}  // namespace pollen::fed
