// A training round: the round's model (and shared first moments) pulled, the local steps, and
// the pseudo-gradient pushed, compressed with error feedback (or masked, client_secagg.cpp).
#include "fed/client.h"

#include <cmath>

#include "base/log.h"
#include "fed/first_moments.h"
#include "fed/received.h"
#include "fed/second_moments.h"
#include "fed/silo.h"

namespace pollen::fed {

namespace {

// One pulled tensor set: its header, checked by `validate` before any chunk is taken, and the
// whole stream, checked against the header's size and SHA-256.
struct PulledSet {
  pb::TensorSetHeader header;
  std::string bytes;
};
PulledSet pull_set(Transport& transport, const pb::PullRequest& request, const std::string& what,
                   const std::function<void(const pb::TensorSetHeader&)>& validate) {
  std::unique_ptr<ChunkAssembler> chunks;
  PulledSet set;
  transport.pull(request, [&](const pb::TensorStream& m) {
    if (!chunks) {
      POLLEN_CHECK(m.has_header(), what, ": the stream must open with a header");
      validate(m.header());
      set.header = m.header();
      chunks = std::make_unique<ChunkAssembler>(set.header, what);
    } else {
      POLLEN_CHECK(m.has_chunk(), what, ": after the header only chunks may follow");
      chunks->add(m.chunk());
    }
  });
  POLLEN_CHECK(chunks != nullptr, what, ": empty stream");
  set.bytes = chunks->finish();
  return set;
}

}  // namespace

const Weights& Client::pull_model(const pb::TaskReply& task, const CompressOptions& model_codec) {
  const std::string what = cat("global model of round ", task.round());
  // The server keeps at most kMaxChainLinks deltas, then the whole model or the empty delta.
  constexpr size_t kMaxPulls = kMaxChainLinks + 2;
  for (size_t pulls = 1;; ++pulls) {
    pb::PullRequest pr;
    pr.set_client_id(config_.id);
    pr.set_round(task.round());
    pr.set_held_model(held_->sha256());
    pr.set_want_model(task.model_sha256());
    const auto [header, bytes] = pull_set(transport_, pr, what, [&](const auto& h) {
      held_->validate(h, specs_, model_codec, what);
    });
    bytes_received_ += bytes.size() + header.second_moments().size();
    const Weights& model = held_->receive(header, bytes, specs_, what);
    pulled_second_moments_ = header.second_moments().empty()
                                 ? std::vector<float>{}
                                 : unpack_second_moments(specs_, header.second_moments(), what);
    if (task.model_sha256().empty() || held_->sha256() == task.model_sha256()) return model;
    // The whole model or an empty delta ends a chain: past it no pull brings another model.
    POLLEN_CHECK(!header.base_sha256().empty() && header.base_sha256() != header.model_sha256(),
                 what, ": the server sent model ", held_->sha256(), " as final, not the task's (",
                 task.model_sha256(), ")");
    POLLEN_CHECK(pulls < kMaxPulls, what, ": after ", kMaxPulls, " pulls the client holds model ",
                 held_->sha256(), ", not the round's (", task.model_sha256().substr(0, 64), ")");
  }
}

Weights Client::pull_first_moments(const pb::TaskReply& task, const CompressOptions& model_codec,
                                   const ParamSpecs& moments) {
  const std::string what = cat("first moments of round ", task.round());
  pb::PullRequest pr;
  pr.set_client_id(config_.id);
  pr.set_round(task.round());
  pr.set_first_moments(true);
  const auto [header, bytes] = pull_set(
      transport_, pr, what, [&](const auto& h) { validate_header(h, moments, model_codec, what); });
  bytes_received_ += bytes.size();
  return decode_set(header, bytes, moments, what);
}

pb::PushReply Client::push_update(const pb::UpdateInfo& info, const EncodedSet& set) {
  int stage = 0;
  size_t offset = 0;
  return transport_.push([&](pb::TensorStream& m) {
    if (stage == 0) {
      *m.mutable_update() = info;
      stage = 1;
      return true;
    }
    if (stage == 1) {
      *m.mutable_header() = set.header;
      stage = 2;
      return true;
    }
    if (offset >= set.bytes.size()) return false;
    const size_t n = std::min<size_t>(kMaxChunkBytes, set.bytes.size() - offset);
    auto* c = m.mutable_chunk();
    c->set_offset(offset);
    c->set_data(set.bytes.data() + offset, n);
    offset += n;
    return true;
  });
}

void Client::push_masked_again(const pb::TaskReply& task) {
  log::warn("fed client '", config_.id, "': round ", task.round(),
            ": its masked update did not arrive; it sends the same bytes again (trained and "
            "masked anew, the round's masks on another update would give away the difference)");
  note_push(task.round());
  const pb::PushReply reply = push_update(masked_push_->info, masked_push_->set);
  if (reply.accepted()) {
    bytes_sent_ += masked_push_->set.bytes.size();
    log::info("fed client '", config_.id, "': round ", task.round(), ": sent ",
              masked_push_->set.bytes.size(), " bytes");
  } else {
    log::warn("fed client '", config_.id, "': round ", task.round(),
              " update refused: ", reply.reason());
  }
}

void Client::train_round(const pb::TaskReply& task) {
  const TaskCodecs codecs = check_task(task);
  // A secure round's masked input needs the secrets this client advertised for the round; a
  // client restarted since holds none, and training would only take steps that are never sent.
  if (task.secure_aggregation() && !holds_secagg_session(task.round())) return drop_out(task);
  if (task.secure_aggregation() && masked_push_) return push_masked_again(task);
  if (task.round() <= last_round_ || unsaved_steps_) rewind(task.round());
  // Token counts leave the silo in the clear: local DP's noise does not cover them.
  POLLEN_CHECK(!task.token_counts() || !local_dp_, "client '", config_.id,
               "': the server weights rows by token counts (strategy.row_weighting), which "
               "[local_dp] does not protect; the client sends none");
  POLLEN_CHECK(!task.token_counts() || !config_.dp_sgd.enabled, "client '", config_.id,
               "': the server weights rows by token counts (strategy.row_weighting), counted on "
               "the silo's records in the clear, which [dp_sgd] does not protect; the client "
               "sends none");
  POLLEN_CHECK(
      !task.second_moments() || (local_ && !local_dp_), "client '", config_.id,
      "': the server shares the clients' second moments (strategy.second_moments), ",
      local_dp_ ? "which [local_dp] does not protect" : "which a [post] silo does not have",
      "; the client sends none");
  POLLEN_CHECK(task.first_moments().empty() || (local_ && !local_dp_ && !task.secure_aggregation()),
               "client '", config_.id, "': the server shares the clients' first moments ",
               "(strategy.first_moments), which ",
               !local_     ? "a [post] silo does not have"
               : local_dp_ ? "[local_dp] does not protect"
                           : "secure aggregation does not carry",
               "; the client sends none");
  const ParamSpecs first_moments =
      first_moment_specs(specs_, task.first_moments().empty() ? "none" : task.first_moments());
  // What the client trains from and takes its pseudo-gradient against: the model rebuilt from the
  // pulled sets, the same values on both sides whatever the codec.
  const Weights& global = pull_model(task, codecs.model);
  trainer_->set_exchanged_weights(global);
  // Drift correction (pre-training only): the move after each local step, on every rank.
  const Weights step_drift = drift_.step_drift(task.round(), global, task.local_steps());
  if (local_) local_->set_step_drift(step_drift);
  // Shared second moments: the round starts from the federation's (none before round 2), on
  // every rank; rank 0 takes them once the others have them too.
  const std::vector<float> no_moments;
  const std::vector<float>& moments = task.second_moments() ? pulled_second_moments_ : no_moments;
  // Shared first moments: likewise from round 2 on; a client that has not stepped yet would keep
  // its zeros, so it pulls none.
  Weights first_estimate;
  if (!first_moments.empty() && task.pull_first_moments() && local_->steps_taken() > 0)
    first_estimate = pull_first_moments(task, codecs.model, first_moments);
  if (several_ranks()) {
    const RoundOrder order{task.round(), task.local_steps(), task.evaluate(), task.second_moments(),
                           task.first_moments().empty() ? "none" : task.first_moments()};
    if (local_)
      send_order(*comm_, order, &local_->model(), step_drift, moments, first_estimate);
    else
      send_post_order(*comm_, order, global);
  }
  if (local_) {
    local_->share_second_moments(task.second_moments());
    local_->share_first_moments(first_moments);
  }
  if (!moments.empty()) local_->set_second_moments(moments);
  if (!first_estimate.empty()) local_->set_first_moments(first_moments, first_estimate);

  pb::UpdateInfo info;
  info.set_client_id(config_.id);
  info.set_round(task.round());
  info.set_data_manifest_hash(trainer_->manifest_hash());
  if (task.evaluate()) {
    int64_t tokens = 0;
    info.set_eval_loss(trainer_->evaluate(&tokens));
    info.set_eval_tokens(tokens);
  }
  unsaved_steps_ = true;  // until save_state below holds them
  const auto res = trainer_->train(task.local_steps());
  info.set_tokens(res.tokens);
  info.set_train_loss(res.loss);
  info.set_train_seconds(res.seconds);
  // What the server takes (fed/wire.h): a metric without a finite value this round is left out.
  for (const auto& [name, value] : res.metrics)
    if (std::isfinite(value) && std::abs(value) <= kMaxLoss)
      (*info.mutable_objective_metrics())[name] = value;
  if (task.token_counts()) {
    token_counts_to(res.input_counts, info.mutable_input_counts());
    token_counts_to(res.target_counts, info.mutable_target_counts());
  }
  if (task.second_moments()) {
    info.set_second_moments(pack_second_moments(specs_, local_->factored_second_moments()));
  }

  // The pseudo-gradient: global minus local, less the drift correction's share (what the
  // client's own steps moved).
  Weights delta = drift_.own_move(task.round(), global, trainer_->exchanged_weights(), step_drift,
                                  task.local_steps());
  if (local_dp_) {
    const bool clipped = local_dp_->apply(delta, static_cast<uint64_t>(task.round()));
    record_local_dp();
    const Epsilon e = local_dp_->epsilon();
    log::info("fed client '", config_.id, "': local DP", clipped ? " (update clipped)" : "",
              ": epsilon ", e.epsilon, " at delta ", config_.local_dp.delta, " after ",
              local_dp_->releases(), " updates released");
  }
  if (const optim::DpSgd* dp = local_ ? local_->dp_sgd() : nullptr) {
    log::info("fed client '", config_.id, "': DP-SGD: epsilon ", dp->epsilon().epsilon,
              " at delta ", dp->delta(), " for each of its sequences after ", dp->steps_accounted(),
              " local steps");
  }
  const Weights saved_residual = clone_weights(feedback_.residual());
  EncodedSet enc;
  if (task.secure_aggregation()) {
    masked_push_ = MaskedPush{info, masked_update(task.round(), delta, res.tokens)};
  } else {
    // The pseudo-gradient with error feedback, then the first moments without (a state, not a
    // sum over rounds).
    std::vector<std::string> payloads = feedback_.encode(delta, codecs.update);
    ParamSpecs sent = specs_;
    if (!first_moments.empty()) {
      const Weights m = local_->first_moments(first_moments);
      for (const Tensor& t : m) {
        payloads.emplace_back();
        encode(t.data<float>(), t.numel(), codecs.update, payloads.back());
      }
      sent.insert(sent.end(), first_moments.begin(), first_moments.end());
    }
    enc = encode_payloads(sent, std::move(payloads), codecs.update);
  }

  last_round_ = task.round();
  unsaved_steps_ = false;
  // Saved before the push: a client killed once the server has its update must not train the
  // round again after a restart (its data counted twice, its residual sent twice, a release
  // missing from its privacy account). A round whose update is lost comes back, and the client
  // then goes back to its state before it (rewind); a later round finds the push unsettled and
  // restores the residual from before it (settle_push).
  unsettled_push_ = UnsettledPush{task.round(), saved_residual};
  save_state();
  // A masked update is kept for a push that is lost (push_masked_again).
  const EncodedSet& sent = task.secure_aggregation() ? masked_push_->set : enc;
  note_push(task.round());
  const pb::PushReply reply = push_update(info, sent);  // thrown: the push stays unsettled
  unsettled_push_.reset();
  if (reply.accepted()) {
    bytes_sent_ += sent.bytes.size() + info.second_moments().size();
    std::string objective_metrics;  // a post-training objective's, GRPO's reward say
    for (const auto& [name, value] : res.metrics) objective_metrics += cat(", ", name, " ", value);
    log::info("fed client '", config_.id, "': round ", task.round(), ": ", res.tokens,
              " tokens, loss ", res.loss, objective_metrics, ", sent ", sent.bytes.size(),
              " bytes");
  } else {
    // The update did not count: what error feedback kept back for it is void too.
    feedback_.set_residual(saved_residual);
    log::warn("fed client '", config_.id, "': round ", task.round(),
              " update refused: ", reply.reason());
    save_state();
  }
}

}  // namespace pollen::fed
