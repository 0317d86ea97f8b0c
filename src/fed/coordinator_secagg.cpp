// The server's side of secure aggregation (fed/secagg/session.h): the clients' key, share and
// unmask steps, the phases' closing, and the unmasked sum applied to the global model.
#include "fed/coordinator.h"

#include "base/log.h"
#include "fed/secagg/private_quantize.h"
#include "fed/secagg/quantize.h"

namespace pollen::fed {

using Clock = std::chrono::steady_clock;

void Coordinator::advance_secagg_locked() {
  using Phase = secagg::ServerSession::Phase;
  while (secagg_->phase() != Phase::done && secagg_->phase() != Phase::failed &&
         secagg_->phase_complete()) {
    close_secagg_phase_locked();
  }
  changed_.notify_all();
}

void Coordinator::close_secagg_phase_locked() {
  using Phase = secagg::ServerSession::Phase;
  const bool inputs_close = secagg_->phase() == Phase::input;
  secagg_->close_phase();
  if (!inputs_close || secagg_->phase() != Phase::unmask) return;
  // Every input's weight is known now, and nobody has revealed a share. A sum that may wrap the
  // ring fails the attempt here: refused after the reveals, it would leave the server able to
  // unmask it, and the retry's sum over other participants would differ from it by whole
  // clients' inputs.
  const int64_t weights = [&] {
    if (dp_) return static_cast<int64_t>(secagg_->inputs());
    int64_t tokens = 0;
    for (const auto& [id, u] : updates_) tokens += u.info.tokens();
    return tokens;
  }();
  try {
    secagg::check_fits(weights, secagg_options_locked(selected_.size()));
  } catch (const Error& e) {
    secagg_->fail_round(cat(e.what(), "; nothing was revealed"));
    return;
  }
  if (!dp_) return;
  try {
    write_privacy_charge_locked();
  } catch (const Error& e) {  // a full disk, say: no reveal the accountant might not keep
    secagg_->fail_round(cat("the round's privacy charge cannot be recorded (", e.what(),
                            "); nothing was revealed"));
  }
}

bool Coordinator::close_phase() {
  std::lock_guard lock(mutex_);
  using Phase = secagg::ServerSession::Phase;
  if (!open_ || !secagg_ || secagg_->phase() == Phase::done || secagg_->phase() == Phase::failed) {
    return false;
  }
  log::info("fed server: secure aggregation phase '",
            secagg::ServerSession::phase_name(secagg_->phase()), "' of round ", done_ + 1,
            " closes with the clients that answered");
  close_secagg_phase_locked();
  advance_secagg_locked();
  return true;
}

pb::SecAggReply Coordinator::secagg(const pb::SecAggRequest& r, const std::string& peer_id) {
  try {
    const std::string id = check_peer(r.client_id(), peer_id, "secure aggregation");
    std::lock_guard lock(mutex_);
    POLLEN_CHECK(secagg_ != nullptr && open_ && r.round() == done_ + 1, "secure aggregation from '",
                 id, "': round ", r.round(),
                 config_.secure_aggregation.enabled ? " is not open"
                                                    : " (the server does not aggregate securely)");
    touch_locked(id);
    pb::SecAggReply reply;
    switch (r.body_case()) {
      case pb::SecAggRequest::kAdvertise:
        secagg_->advertise(id, r.advertise());
        reply.set_accepted(true);
        break;
      case pb::SecAggRequest::kGetRoster: {
        *reply.mutable_roster() = secagg_->roster(id);
        const secagg::DistributedNoise noise = secagg_options_locked(selected_.size()).noise;
        if (noise.enabled()) {
          auto* p = reply.mutable_roster()->mutable_params();
          p->set_dp_clip(noise.clip);
          p->set_dp_noise_stddev(noise.stddev);
          p->set_dp_token_cap(noise.token_cap);
          if (noise.seed >= 0) p->set_dp_noise_seed(noise.seed);
          p->set_dp_count_stddev(noise.count_stddev);
        }
        break;
      }
      case pb::SecAggRequest::kShares:
        secagg_->shares(id, r.shares());
        reply.set_accepted(true);
        break;
      case pb::SecAggRequest::kGetInbox:
        *reply.mutable_inbox() = secagg_->inbox(id);
        break;
      case pb::SecAggRequest::kGetSurvivors:
        *reply.mutable_survivors() = secagg_->survivors(id);
        break;
      case pb::SecAggRequest::kReveal:
        secagg_->reveal(id, r.reveal());
        reply.set_accepted(true);
        break;
      case pb::SecAggRequest::kDropOut:
        secagg_->drop_out(id);
        log::warn("fed server: client '", id, "' drops out of secure aggregation phase '",
                  secagg::ServerSession::phase_name(secagg_->phase()), "' of round ", done_ + 1,
                  " (it lost the round's secrets)");
        reply.set_accepted(true);
        break;
      default:
        fail("secure aggregation from '", id, "': the request holds no step");
    }
    secagg_bytes_in_ += r.ByteSizeLong();
    secagg_bytes_out_ += reply.ByteSizeLong();
    advance_secagg_locked();
    return reply;
  } catch (const Error& e) {
    log::warn("fed server: refused a secure aggregation message: ", e.what());
    throw;
  }
}

secagg::Options Coordinator::secagg_options_locked(size_t selected) const {
  secagg::Options o = config_.secure_aggregation;
  if (dp_) {
    // Any sum the server can unmask, all of it or (SecAgg+) a piece of the graph, holds at
    // least the threshold's inputs: a survivor's self mask needs that many revealed shares, and
    // only clients that sent an input reveal.
    o.noise = dp_->distributed_noise(static_cast<int64_t>(secagg_->threshold()),
                                     static_cast<int64_t>(selected));
  }
  return o;
}

namespace {

int64_t values_of(const Weights& weights) {
  int64_t values = 0;
  for (const Tensor& t : weights) values += t.numel();
  return values;
}

}  // namespace

std::vector<double> Coordinator::distributed_release_rdp_locked(size_t selected) const {
  // The noise of the whole sum: the share of a sum of one input.
  const secagg::DistributedNoise central =
      dp_->distributed_noise(1, static_cast<int64_t>(selected));
  return secagg::release_rdp(config_.secure_aggregation, central, values_of(global_),
                             static_cast<int64_t>(selected));
}

double Coordinator::rounding_growth_locked() const {
  const secagg::Options& o = config_.secure_aggregation;
  return secagg::rounded_norm_bound(dp_->clip(), values_of(global_), o) * o.step / dp_->clip();
}

std::string Coordinator::refuse_private_round_locked(int64_t round, int64_t selected,
                                                     int64_t available) const {
  // The Gaussian of multiplier z first: adaptive clipping's refusal, and a budget that even it
  // would pass (the discrete Gaussian's release costs more).
  const std::string why = dp_->refuse_round(round, selected, available);
  if (!why.empty() || !config_.secure_aggregation.enabled) return why;
  try {
    // The ring must hold the selected clients' values with the largest noise share (threshold
    // 2), checked before any client adds noise or reveals a share.
    secagg::check_noise_fits(config_.secure_aggregation, dp_->distributed_noise(2, selected),
                             selected, [](const std::string& key) {
                               return cat("secure_aggregation.", key, " with [privacy]'s noise");
                             });
    const std::vector<double> rdp = distributed_release_rdp_locked(static_cast<size_t>(selected));
    return dp_->refuse_round(round, selected, available, &rdp);
  } catch (const Error& e) {
    return cat("privacy: round ", round, ": ", e.what());
  }
}

bool Coordinator::aggregate_secure(int64_t round, int64_t tokens, size_t participants,
                                   size_t selected, std::optional<double>* count,
                                   std::string* why) {
  using Phase = secagg::ServerSession::Phase;
  if (secagg_->phase() != Phase::done) {
    *why = secagg_->phase() == Phase::failed
               ? secagg_->failure()
               : cat("secure aggregation of round ", round, " did not finish (phase '",
                     secagg::ServerSession::phase_name(secagg_->phase()), "')");
    return false;
  }
  try {
    // With distributed DP every client's weight is 1 and the sum is divided by the clients
    // selected (a fixed denominator); else the token-weighted mean.
    const secagg::Options options = secagg_options_locked(selected);
    const int64_t weights = dp_ ? static_cast<int64_t>(participants) : tokens;
    const double denominator = dp_ ? static_cast<double>(selected) : static_cast<double>(tokens);
    // That the sum fits the ring was checked when the input phase closed, before any reveal
    // (close_secagg_phase_locked).
    const std::vector<uint64_t> sum = secagg_->unmasked_sum();
    Weights like = global_;
    if (counts_unclipped()) like.push_back(Tensor::zeros({1}, DType::f32));
    Weights mean = secagg::dequantize(sum, weights, denominator, options, like);
    std::optional<double> unclipped;
    if (counts_unclipped()) {
      unclipped = static_cast<double>(mean.back().data<float>()[0]);
      mean.pop_back();
    }
    strategy_->aggregate_mean(round, global_, mean);
    *count = unclipped;  // only for a round that is applied
  } catch (const Error& e) {
    *why = e.what();
    return false;
  }
  return true;
}

}  // namespace pollen::fed
