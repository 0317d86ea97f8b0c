// The client's steps of secure aggregation (fed/secagg/session.h): advertise keys, share the
// secrets, mask the update, reveal the shares that unmask the sum.
#include "base/log.h"
#include "base/rng.h"
#include "fed/client.h"
#include "fed/client_state.h"
#include "fed/privacy.h"
#include "fed/secagg/masked_set.h"
#include "fed/secagg/private_quantize.h"
#include "fed/secagg/quantize.h"

namespace pollen::fed {

pb::SecAggReply Client::secagg_call(int64_t round,
                                    const std::function<void(pb::SecAggRequest&)>& fill) {
  pb::SecAggRequest r;
  r.set_client_id(config_.id);
  r.set_round(round);
  fill(r);
  const size_t sent = r.ByteSizeLong();
  pb::SecAggReply reply = transport_.secagg(r);
  bytes_sent_ += sent;
  bytes_received_ += reply.ByteSizeLong();
  return reply;
}

void Client::secagg_step(const pb::TaskReply& task) {
  const int64_t round = task.round();
  POLLEN_CHECK(round >= 1, "task: secure aggregation for round ", round);
  if (task.kind() == pb::TASK_SECAGG_ADVERTISE) {
    secagg_ = std::make_unique<secagg::ClientSession>(config_.id, round);
    masked_push_.reset();
    const pb::SecAggKeys keys = secagg_->advertise();
    secagg_call(round, [&](pb::SecAggRequest& r) { *r.mutable_advertise() = keys; });
    return;
  }
  // A client restarted after it advertised keys has lost the round's secrets.
  if (!holds_secagg_session(round)) return drop_out(task);
  if (task.kind() == pb::TASK_SECAGG_SHARE) {
    const auto reply = secagg_call(round, [](pb::SecAggRequest& r) { r.set_get_roster(true); });
    POLLEN_CHECK(reply.has_roster(), "secure aggregation: the server sent no roster");
    const pb::SecAggShares shares = secagg_->share(reply.roster());
    refuse_repeatable_noise(round, secagg_->options().noise);
    secagg_call(round, [&](pb::SecAggRequest& r) { *r.mutable_shares() = shares; });
    return;
  }
  POLLEN_ASSERT(task.kind() == pb::TASK_SECAGG_UNMASK);
  const auto reply = secagg_call(round, [](pb::SecAggRequest& r) { r.set_get_survivors(true); });
  POLLEN_CHECK(reply.has_survivors(), "secure aggregation: the server sent no survivors");
  const pb::SecAggReveal reveal = secagg_->reveal(reply.survivors());
  note_revealed(round);
  secagg_call(round, [&](pb::SecAggRequest& r) { *r.mutable_reveal() = reveal; });
  secagg_.reset();
  masked_push_.reset();
}

void Client::note_revealed(int64_t round) {
  revealed_round_ = std::max(revealed_round_, round);
  if (!config_.state_dir.empty()) save_revealed_round(config_.state_dir, revealed_round_);
}

bool Client::holds_secagg_session(int64_t round) const {
  return secagg_ && secagg_->round() == round;
}

void Client::drop_out(const pb::TaskReply& task) {
  const char* step = task.kind() == pb::TASK_TRAIN          ? "its masked update"
                     : task.kind() == pb::TASK_SECAGG_SHARE ? "its shares"
                                                            : "its revealed shares";
  log::warn("fed client '", config_.id, "': round ", task.round(), ": secure aggregation asks for ",
            step,
            ", but this client holds no secrets of the round (it restarted after advertising "
            "its keys); it drops out of the round, training nothing, and waits for the next");
  secagg_call(task.round(), [](pb::SecAggRequest& r) { r.set_drop_out(true); });
}

namespace {

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

}  // namespace

Weights Client::clip_and_weigh(int64_t round, const Weights& delta, int64_t tokens,
                               const secagg::DistributedNoise& noise, bool* clipped_out) const {
  Weights out = clone_weights(delta);
  const double norm = l2_norm(out);
  const bool clipped = clip_to_norm(out, norm, noise.clip);
  *clipped_out = clipped;
  const double weight =
      noise.token_cap > 0
          ? std::min(1.0, static_cast<double>(tokens) / static_cast<double>(noise.token_cap))
          : 1.0;
  if (weight < 1) {
    for (Tensor& t : out) {
      float* p = t.data<float>();
      for (int64_t j = 0; j < t.numel(); ++j) p[j] = static_cast<float>(p[j] * weight);
    }
  }
  log::info("fed client '", config_.id, "': round ", round, ": distributed DP: update norm ", norm,
            clipped ? cat(", clipped to ", noise.clip) : std::string(), ", weight ", weight,
            ", discrete Gaussian noise of std ", noise.stddev, " per value");
  return out;
}

void Client::refuse_repeatable_noise(int64_t round, const secagg::DistributedNoise& noise) const {
  if (noise.seed < 0) return;
  if (!config_.allow_repeatable_noise) {
    throw RoundCannotSucceed(cat(
        "fed client '", config_.id, "': round ", round, ": the server asks for repeatable noise ",
        "(its privacy.noise_seed is ", noise.seed,
        "), which leaves this silo's update without privacy from anyone who knows the seed; the "
        "client stops (client.allow_repeatable_noise = true takes it, for tests only)"));
  }
  log::warn("fed client '", config_.id, "': round ", round, ": repeatable noise (noise_seed ",
            noise.seed, "): the update has no privacy from anyone who knows the seed");
}

EncodedSet Client::masked_update(int64_t round, const Weights& delta, int64_t tokens) {
  POLLEN_CHECK(secagg_ && secagg_->round() == round,
               "secure aggregation: no shared keys for round ", round);
  const auto& options = secagg_->options();
  // With distributed DP every client's update weighs at most 1 and carries its noise share.
  const secagg::DistributedNoise& noise = options.noise;
  const int64_t weight = noise.enabled() ? 1 : tokens;
  try {
    secagg::check_fits(weight, options);
  } catch (const Error& e) {
    throw RoundCannotSucceed(cat("fed client '", config_.id, "': round ", round, ": ", e.what()));
  }
  secagg::QuantizeStats stats;
  // Stochastic rounding drawn from the client's seed and the round: runs repeat bitwise.
  const uint64_t seed = Rng(config_.seed).fork(static_cast<uint64_t>(round)).next_u64();
  std::vector<uint64_t> words;
  if (noise.enabled()) {
    const Rng noise_draws =
        noise_rng(noise.seed, fnv1a(config_.id)).fork(static_cast<uint64_t>(round));
    bool clipped = false;
    words =
        secagg::quantize_private(clip_and_weigh(round, delta, tokens, noise, &clipped), noise.clip,
                                 noise.stddev, options, seed, noise_draws.fork(0), &stats);
    if (noise.counts_unclipped()) {
      // Adaptive clipping: the centred indicator [norm <= C] - 1/2, with the count's noise share.
      const Weights indicator{Tensor::from<float>({1}, {clipped ? -0.5f : 0.5f})};
      const auto count = secagg::quantize_private(indicator, 0.5, noise.count_stddev, options,
                                                  seed + 1, noise_draws.fork(1));
      words.insert(words.end(), count.begin(), count.end());
    }
  } else {
    words = secagg::quantize(delta, weight, options, seed, &stats);
  }
  if (stats.clipped > 0) {
    log::warn("fed client '", config_.id, "': round ", round, ": ", stats.clipped,
              " pseudo-gradient values clipped to +/-", options.range,
              " (secure_aggregation.range)");
  }
  const auto reply = secagg_call(round, [](pb::SecAggRequest& r) { r.set_get_inbox(true); });
  POLLEN_CHECK(reply.has_inbox(), "secure aggregation: the server sent no inbox");
  secagg_->mask(reply.inbox(), words);
  return secagg::masked_set(secagg::masked_specs(specs_, noise.counts_unclipped()), words,
                            options.ring_bits);
}

}  // namespace pollen::fed
