#include "fed/client.h"

#include <chrono>
#include <cmath>
#include <thread>

#include "autograd/tape.h"
#include "base/log.h"
#include "data/shards.h"
#include "fed/client_state.h"
#include "optim/schedule.h"
#include "train/trainer.h"

namespace pollen::fed {

using Clock = std::chrono::steady_clock;

// ---- the server's side of the streams ---------------------------------------------------------

void serve_pull(Coordinator& c, const pb::PullRequest& r, const std::string& peer_id,
                const std::function<void(const pb::TensorStream&)>& write) {
  const auto model = c.pull(r, peer_id);
  pb::TensorStream msg;
  *msg.mutable_header() = model->header;
  write(msg);
  for_each_chunk(model->bytes, kMaxChunkBytes, [&](const pb::Chunk& chunk) {
    *msg.mutable_chunk() = chunk;
    write(msg);
  });
}

pb::PushReply serve_push(Coordinator& c, const std::string& peer_id,
                         const std::function<bool(pb::TensorStream&)>& read) {
  pb::TensorStream first, second;
  POLLEN_CHECK(read(first) && first.has_update(), "push: the stream must open with update info");
  POLLEN_CHECK(read(second) && second.has_header(),
               "push: the update info must be followed by a tensor header");
  auto push = c.push_begin(first.update(), second.header(), peer_id);
  pb::TensorStream msg;
  while (read(msg)) {
    POLLEN_CHECK(msg.has_chunk(), "push: after the header only chunks may follow");
    push.chunks->add(msg.chunk());
  }
  return c.push_finish(push);
}

void LocalTransport::pull(const pb::PullRequest& r,
                          const std::function<void(const pb::TensorStream&)>& on_message) {
  // Through bytes, as over the network: what the client parses is what a peer would send.
  serve_pull(c_, r, "", [&](const pb::TensorStream& m) {
    pb::TensorStream copy;
    POLLEN_CHECK(copy.ParseFromString(m.SerializeAsString()), "pull: unparsable message");
    on_message(copy);
  });
}

pb::PushReply LocalTransport::push(const std::function<bool(pb::TensorStream&)>& next) {
  return serve_push(c_, "", [&](pb::TensorStream& m) {
    pb::TensorStream out;
    if (!next(out)) return false;
    POLLEN_CHECK(m.ParseFromString(out.SerializeAsString()), "push: unparsable message");
    return true;
  });
}

pb::SecAggReply LocalTransport::secagg(const pb::SecAggRequest& r) {
  pb::SecAggRequest request;
  POLLEN_CHECK(request.ParseFromString(r.SerializeAsString()), "secagg: unparsable message");
  pb::SecAggReply reply;
  POLLEN_CHECK(reply.ParseFromString(c_.secagg(request, "").SerializeAsString()),
               "secagg: unparsable reply");
  return reply;
}

// ---- the local trainer
// ---------------------------------------------------------------------------

namespace {

optim::AdamWOptions adamw_options(const LocalTrainConfig& t) {
  optim::AdamWOptions o;
  o.lr = t.lr;
  o.beta1 = t.beta1;
  o.beta2 = t.beta2;
  o.eps = t.eps;
  o.weight_decay = t.weight_decay;
  o.max_grad_norm = t.grad_clip;
  return o;
}

std::vector<std::filesystem::path> paths(const std::vector<std::string>& s) {
  return {s.begin(), s.end()};
}

bool has_split(const std::vector<std::string>& manifests, const std::string& split) {
  for (const auto& m : manifests) {
    if (data::Manifest::load(m).split(split).empty()) return false;
  }
  return true;
}

}  // namespace

LocalTrainer::LocalTrainer(const ClientConfig& config)
    : config_(config),
      model_(config.model, config.seed),
      opt_(model_.parameters(), adamw_options(config.train)) {
  data::LoaderOptions lo;
  lo.manifests = paths(config.manifests);
  lo.batch = config.train.micro_batch;
  lo.seq = config.train.seq;
  lo.seed = config.seed;
  lo.split = "train";
  train_ = std::make_unique<data::Loader>(lo);
  if (config.train.eval_batches > 0 && has_split(config.manifests, "validation")) {
    lo.split = "validation";
    validation_ = std::make_unique<data::Loader>(lo);
  }
  for (const auto& m : config.manifests) {
    if (!manifest_hash_.empty()) manifest_hash_ += "+";
    manifest_hash_ += data::dataset_version(m).substr(0, config.manifests.size() > 1 ? 16 : 64);
  }
  for (const auto& m : config.manifests) {
    const auto vocab = data::Manifest::load(m).vocab_size;
    POLLEN_CHECK(vocab <= config.model.vocab_size, "client '", config.id, "': dataset ", m,
                 " has vocab_size ", vocab, ", more than the model's ", config.model.vocab_size);
  }
}

LocalTrainer::Result LocalTrainer::train(int64_t steps) {
  const auto t0 = Clock::now();
  const auto& tc = config_.train;
  optim::Schedule sched;
  sched.kind = optim::parse_schedule_kind(tc.schedule);
  sched.lr = tc.lr;
  sched.min_lr = tc.min_lr;
  sched.warmup_steps = tc.warmup_steps;
  sched.total_steps = tc.total_steps > 0 ? tc.total_steps : int64_t{1} << 40;
  Result r;
  double loss_sum = 0;
  for (int64_t s = 0; s < steps; ++s) {
    std::vector<model::Batch> micro;
    for (int64_t a = 0; a < tc.accumulation; ++a) micro.push_back(train_->next());
    // The trainer's rule: the gradient of the mean loss over every scored token of the step.
    const train::AccumulatedLoss acc = train::accumulate_gradients(model_, micro);
    POLLEN_CHECK(acc.scored > 0, "client '", config_.id, "': a step without scored tokens");
    POLLEN_CHECK(std::isfinite(acc.loss), "client '", config_.id,
                 "': non-finite loss at local step ", step_);
    const int64_t scored = acc.scored;
    const double step_loss = acc.loss * static_cast<double>(scored);
    // train.round_warmup_steps: the round's step s + 1 of them takes that fraction of the lr.
    const double round_ramp =
        tc.round_warmup_steps > 0
            ? std::min(1.0, static_cast<double>(s + 1) / static_cast<double>(tc.round_warmup_steps))
            : 1.0;
    const double lr =
        round_ramp *
        optim::lr_at(sched, tc.total_steps > 0 ? std::min(step_, tc.total_steps - 1) : step_);
    opt_.step(lr);
    opt_.zero_grad();
    ++step_;
    loss_sum += step_loss;
    r.tokens += scored;
  }
  r.loss = r.tokens > 0 ? loss_sum / static_cast<double>(r.tokens) : 0;
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

double LocalTrainer::evaluate(int64_t* tokens) {
  *tokens = 0;
  if (!validation_) return 0;
  validation_->restore({config_.seed, 0, 0});  // the same batches every time
  double sum = 0;
  for (int64_t i = 0; i < config_.train.eval_batches; ++i) {
    const model::Batch b = validation_->next();
    int64_t scored = 0;
    const ag::Var loss = model_.loss(b, ag::Reduction::sum, &scored);
    sum += loss.value().item();
    *tokens += scored;
  }
  return *tokens > 0 ? sum / static_cast<double>(*tokens) : 0;
}

// ---- the client
// ------------------------------------------------------------------------------------

Client::Client(ClientConfig config, Transport& transport)
    : config_(std::move(config)), transport_(transport), trainer_(config_) {
  specs_ = param_specs(trainer_.model());
  if (config_.local_dp.enabled) local_dp_ = std::make_unique<LocalDp>(config_.local_dp);
  if (!config_.state_dir.empty()) {
    last_round_ = load_client_state(config_.state_dir, config_.id, trainer_, specs_, feedback_);
  }
}

void Client::save_state() {
  if (config_.state_dir.empty()) return;
  save_client_state(config_.state_dir, config_.keep_checkpoints, config_.id, last_round_, trainer_,
                    specs_, feedback_);
}

void Client::join() {
  pb::JoinRequest r;
  r.set_protocol_version(kProtocolVersion);
  r.set_client_id(config_.id);
  r.set_model_config(model_config_json(config_.model));
  r.set_tokenizer_fingerprint(config_.tokenizer_fingerprint);
  r.set_data_manifest_hash(trainer_.manifest_hash());
  const auto reply = transport_.join(r);
  POLLEN_CHECK(reply.accepted(), "the server refused client '", config_.id, "': ", reply.reason());
}

pb::TaskKind Client::poll_once() {
  pb::TaskRequest r;
  r.set_client_id(config_.id);
  const auto t = transport_.task(r);
  handle(t);
  return t.kind();
}

void Client::handle(const pb::TaskReply& t) {
  switch (t.kind()) {
    case pb::TASK_TRAIN:
      return train_round(t);
    case pb::TASK_SECAGG_ADVERTISE:
    case pb::TASK_SECAGG_SHARE:
    case pb::TASK_SECAGG_UNMASK:
      return secagg_step(t);
    default:
      return;
  }
}

void Client::run() {
  for (;;) {
    pb::TaskRequest r;
    r.set_client_id(config_.id);
    pb::TaskReply t;
    try {
      t = transport_.task(r);
    } catch (const Error& e) {
      // A restarted server has forgotten who joined (and a server that stays away past
      // connect_timeout_s makes join throw): join again, then ask again.
      log::warn("fed client '", config_.id, "': task failed (", e.what(), "); joining again");
      join();
      continue;
    }
    switch (t.kind()) {
      case pb::TASK_DONE:
        log::info("fed client '", config_.id, "': the run is over");
        return;
      case pb::TASK_TRAIN:
      case pb::TASK_SECAGG_ADVERTISE:
      case pb::TASK_SECAGG_SHARE:
      case pb::TASK_SECAGG_UNMASK:
        try {
          handle(t);
        } catch (const Error& e) {
          // A round that closed or a stream that broke: the next task says what to do.
          log::warn("fed client '", config_.id, "': round ", t.round(), " failed: ", e.what());
        }
        break;
      default:
        std::this_thread::sleep_for(
            std::chrono::milliseconds(std::clamp<int64_t>(t.wait_ms(), 10, 5000)));
    }
  }
}

void Client::train_round(const pb::TaskReply& task) {
  POLLEN_CHECK(task.round() >= 1 && task.local_steps() >= 1 && task.local_steps() <= 10000000,
               "task: round ", task.round(), " with ", task.local_steps(), " local steps");
  CompressOptions codec;
  codec.codec = parse_codec(task.codec());
  codec.block = task.codec_block();
  codec.validate();
  CompressOptions model_codec;
  model_codec.codec = task.model_codec().empty() ? Codec::none : parse_codec(task.model_codec());
  model_codec.block = task.model_codec().empty() ? codec.block : task.model_codec_block();
  model_codec.validate();
  // Pull the global model.
  pb::PullRequest pr;
  pr.set_client_id(config_.id);
  pr.set_round(task.round());
  const std::string what = cat("global model of round ", task.round());
  std::unique_ptr<ChunkAssembler> chunks;
  pb::TensorSetHeader header;
  transport_.pull(pr, [&](const pb::TensorStream& m) {
    if (!chunks) {
      POLLEN_CHECK(m.has_header(), what, ": the stream must open with a header");
      validate_header(m.header(), specs_, model_codec, what);
      header = m.header();
      chunks = std::make_unique<ChunkAssembler>(header, what);
    } else {
      POLLEN_CHECK(m.has_chunk(), what, ": after the header only chunks may follow");
      chunks->add(m.chunk());
    }
  });
  POLLEN_CHECK(chunks != nullptr, what, ": empty stream");
  const std::string bytes = chunks->finish();
  bytes_received_ += bytes.size();
  // What the client trains from and takes its pseudo-gradient against: the decoded model, the
  // same values on both sides whatever the codec.
  const Weights global = decode_set(header, bytes, specs_, what);
  set_model_weights(trainer_.model(), global);

  pb::UpdateInfo info;
  info.set_client_id(config_.id);
  info.set_round(task.round());
  info.set_data_manifest_hash(trainer_.manifest_hash());
  if (task.evaluate()) {
    int64_t tokens = 0;
    info.set_eval_loss(trainer_.evaluate(&tokens));
    info.set_eval_tokens(tokens);
  }
  const auto res = trainer_.train(task.local_steps());
  info.set_tokens(res.tokens);
  info.set_train_loss(res.loss);
  info.set_train_seconds(res.seconds);

  // The pseudo-gradient: global minus local.
  const Weights local = model_weights(trainer_.model());
  Weights delta;
  for (size_t i = 0; i < global.size(); ++i) {
    Tensor d = Tensor::empty(global[i].shape(), DType::f32);
    const float* g = global[i].data<float>();
    const float* l = local[i].data<float>();
    float* o = d.data<float>();
    for (int64_t j = 0; j < d.numel(); ++j) o[j] = g[j] - l[j];
    delta.push_back(std::move(d));
  }
  if (local_dp_) {
    const bool clipped = local_dp_->apply(delta, static_cast<uint64_t>(task.round()));
    const Epsilon e = local_dp_->epsilon();
    log::info("fed client '", config_.id, "': local DP", clipped ? " (update clipped)" : "",
              ": epsilon ", e.epsilon, " at delta ", config_.local_dp.delta, " after ",
              task.round(), " rounds");
  }
  const Weights saved_residual = clone_weights(feedback_.residual());
  EncodedSet enc = task.secure_aggregation()
                       ? masked_update(task.round(), delta, res.tokens)
                       : encode_payloads(specs_, feedback_.encode(delta, codec), codec);

  last_round_ = task.round();
  int stage = 0;
  size_t offset = 0;
  pb::PushReply reply;
  try {
    reply = transport_.push([&](pb::TensorStream& m) {
      if (stage == 0) {
        *m.mutable_update() = info;
        stage = 1;
        return true;
      }
      if (stage == 1) {
        *m.mutable_header() = enc.header;
        stage = 2;
        return true;
      }
      if (offset >= enc.bytes.size()) return false;
      const size_t n = std::min<size_t>(kMaxChunkBytes, enc.bytes.size() - offset);
      auto* c = m.mutable_chunk();
      c->set_offset(offset);
      c->set_data(enc.bytes.data() + offset, n);
      offset += n;
      return true;
    });
  } catch (const Error&) {
    feedback_.set_residual(saved_residual);  // the update did not arrive
    save_state();
    throw;
  }
  if (reply.accepted()) {
    bytes_sent_ += enc.bytes.size();
    log::info("fed client '", config_.id, "': round ", task.round(), ": ", res.tokens,
              " tokens, loss ", res.loss, ", sent ", enc.bytes.size(), " bytes");
  } else {
    // The update did not count: what error feedback kept back for it is void too.
    feedback_.set_residual(saved_residual);
    log::warn("fed client '", config_.id, "': round ", task.round(),
              " update refused: ", reply.reason());
  }
  save_state();
}

}  // namespace pollen::fed
