// The client's steps of secure aggregation (fed/secagg/session.h): advertise keys, share the
// secrets, mask the update, reveal the shares that unmask the sum.
#include "base/log.h"
#include "base/rng.h"
#include "fed/client.h"
#include "fed/secagg/masked_set.h"
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
    const pb::SecAggKeys keys = secagg_->advertise();
    secagg_call(round, [&](pb::SecAggRequest& r) { *r.mutable_advertise() = keys; });
    return;
  }
  POLLEN_CHECK(secagg_ && secagg_->round() == round, "secure aggregation: round ", round,
               " asks for a step before this client advertised keys for it");
  if (task.kind() == pb::TASK_SECAGG_SHARE) {
    const auto reply = secagg_call(round, [](pb::SecAggRequest& r) { r.set_get_roster(true); });
    POLLEN_CHECK(reply.has_roster(), "secure aggregation: the server sent no roster");
    const pb::SecAggShares shares = secagg_->share(reply.roster());
    secagg_call(round, [&](pb::SecAggRequest& r) { *r.mutable_shares() = shares; });
    return;
  }
  POLLEN_ASSERT(task.kind() == pb::TASK_SECAGG_UNMASK);
  const auto reply = secagg_call(round, [](pb::SecAggRequest& r) { r.set_get_survivors(true); });
  POLLEN_CHECK(reply.has_survivors(), "secure aggregation: the server sent no survivors");
  const pb::SecAggReveal reveal = secagg_->reveal(reply.survivors());
  secagg_call(round, [&](pb::SecAggRequest& r) { *r.mutable_reveal() = reveal; });
  secagg_.reset();
}

EncodedSet Client::masked_update(int64_t round, const Weights& delta, int64_t tokens) {
  POLLEN_CHECK(secagg_ && secagg_->round() == round,
               "secure aggregation: no shared keys for round ", round);
  const auto& options = secagg_->options();
  try {
    secagg::check_fits(tokens, options);
  } catch (const Error& e) {
    throw RoundCannotSucceed(cat("fed client '", config_.id, "': round ", round, ": ", e.what()));
  }
  secagg::QuantizeStats stats;
  // Stochastic rounding drawn from the client's seed and the round: runs repeat bitwise.
  const uint64_t seed = Rng(config_.seed).fork(static_cast<uint64_t>(round)).next_u64();
  std::vector<uint64_t> words = secagg::quantize(delta, tokens, options, seed, &stats);
  if (stats.clipped > 0) {
    log::warn("fed client '", config_.id, "': round ", round, ": ", stats.clipped,
              " pseudo-gradient values clipped to +/-", options.range,
              " (secure_aggregation.range)");
  }
  const auto reply = secagg_call(round, [](pb::SecAggRequest& r) { r.set_get_inbox(true); });
  POLLEN_CHECK(reply.has_inbox(), "secure aggregation: the server sent no inbox");
  secagg_->mask(reply.inbox(), words);
  return secagg::masked_set(specs_, words, options.ring_bits);
}

}  // namespace pollen::fed
