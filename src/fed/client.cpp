#include "fed/client.h"

#include <chrono>
#include <cmath>
#include <thread>

#include "autograd/tape.h"
#include "base/log.h"
#include "data/shards.h"
#include "fed/client_state.h"
#include "fed/first_moments.h"
#include "fed/received.h"
#include "fed/second_moments.h"
#include "fed/silo.h"
#include "io/model_source.h"
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

// Counts the token ids at the batch's scored positions into counts[0, vocab) and their targets
// into counts[vocab, 2 vocab).
void count_scored_tokens(const model::Batch& b, std::vector<double>& counts) {
  const int32_t* in = b.tokens.data<int32_t>();
  const int32_t* out = b.targets.data<int32_t>();
  const auto vocab = static_cast<int32_t>(counts.size() / 2);
  for (int64_t i = 0; i < b.targets.numel(); ++i) {
    if (out[i] < 0) continue;
    POLLEN_CHECK(in[i] >= 0 && in[i] < vocab && out[i] < vocab, "token id ", in[i], " or ", out[i],
                 " is outside the model's vocabulary of ", vocab);
    counts[static_cast<size_t>(in[i])] += 1;
    counts[static_cast<size_t>(vocab + out[i])] += 1;
  }
}

// The non-zero counts of dense[begin, begin + n), ids counted from begin.
TokenCounts sparse_counts(const std::vector<double>& dense, size_t begin, size_t n) {
  TokenCounts c;
  for (size_t id = 0; id < n; ++id) {
    if (dense[begin + id] <= 0) continue;
    c.ids.push_back(static_cast<int64_t>(id));
    c.counts.push_back(static_cast<int64_t>(dense[begin + id]));
  }
  return c;
}

}  // namespace

namespace {

model::Llama initial_model(const ClientConfig& c) {
  if (c.init_from.empty()) return model::Llama(c.model, c.seed);
  return io::load_initial_weights(c.init_from, c.model, "model.init_from");
}

}  // namespace

LocalTrainer::LocalTrainer(const ClientConfig& config, dist::Communicator* comm)
    : config_(config), comm_(comm ? comm : &alone_), model_(initial_model(config)) {
  for (const auto& [name, p] : model_.named_parameters()) params_.push_back(p);
  const int world = comm_->world();
  if (world > 1) {
    reducer_ = std::make_unique<dist::GradReducer>(
        *comm_, params_, static_cast<int64_t>(config.parallel.bucket_mb * 1048576.0),
        config.parallel.zero == 1 ? dist::ReduceMode::reduce_scatter
                                  : dist::ReduceMode::all_reduce);
  }
  // Weight decay on matrices only (optim::AdamW's default), with or without ZeRO-1.
  std::vector<bool> decay;
  for (const auto& p : params_) decay.push_back(p.value().dim() >= 2);
  if (reducer_ && config.parallel.zero == 1) {
    zero_ = std::make_unique<dist::ZeroAdamW>(*reducer_, adamw_options(config.train), decay);
  } else {
    opt_.emplace(params_, adamw_options(config.train), decay);
  }
  // A step is the same global batch at any world size: each micro-step reads a global
  // micro-batch of micro_batch x ranks rows and this rank takes its micro_batch of them.
  POLLEN_CHECK(config.train.accumulation % world == 0, "client '", config.id,
               "': train.accumulation (", config.train.accumulation,
               ") is not a multiple of the silo's ranks (", world,
               "): each rank reads train.micro_batch rows per micro-step");
  micro_steps_ = config.train.accumulation / world;
  data::LoaderOptions lo;
  lo.manifests = paths(config.manifests);
  lo.batch = config.train.micro_batch * world;
  lo.step_batch = config.train.micro_batch * config.train.accumulation;  // any number of ranks
  lo.seq = config.train.seq;
  lo.seed = config.seed;
  lo.split = "train";
  lo.rank = comm_->rank();
  lo.world = world;
  train_ = std::make_unique<data::Loader>(lo);
  if (config.train.eval_batches > 0 && has_split(config.manifests, "validation")) {
    lo.batch = config.train.micro_batch;  // every rank reads every batch and scores its share
    lo.step_batch = 0;
    lo.rank = 0;
    lo.world = 1;
    lo.split = "validation";
    validation_ = std::make_unique<data::Loader>(lo);
  }
  for (const auto& m : config.manifests) {
    if (!manifest_hash_.empty()) manifest_hash_ += "+";
    manifest_hash_ += data::dataset_version(m).substr(0, config.manifests.size() > 1 ? 16 : 64);
  }
  for (const auto& m : config.manifests) {
    const data::Manifest manifest = data::Manifest::load(m);
    POLLEN_CHECK(manifest.vocab_size <= config.model.vocab_size, "client '", config.id,
                 "': dataset ", m, " has vocab_size ", manifest.vocab_size,
                 ", more than the model's ", config.model.vocab_size);
    // The federation's agreement on a tokenizer holds only if the data was tokenised with it:
    // the server compares the configs' fingerprints, this the data's with the config's.
    const auto& tokenizer = manifest.json.value("tokenizer", nlohmann::json::object());
    const std::string used =
        tokenizer.is_object() ? tokenizer.value("fingerprint", std::string()) : std::string();
    POLLEN_CHECK(used.empty() || used == config.tokenizer_fingerprint, "client '", config.id,
                 "': dataset ", m, " was tokenised with tokenizer ", used,
                 ", not the federation's (tokenizer.fingerprint = '",
                 config.tokenizer_fingerprint.substr(0, 80), "')");
  }
}

template <typename Work>
auto LocalTrainer::with_the_other_ranks(Work&& work) {
  try {
    return work();
  } catch (const dist::PeerFailure&) {
    throw;
  } catch (const RoundFailure&) {
    throw;
  } catch (const Error& e) {
    if (comm_->world() > 1) {
      log::error("client '", config_.id, "' rank ", comm_->rank(), ": ", e.what(),
                 "; ending the silo's job");
      comm_->abort_job(1);
    }
    throw;
  }
}

LocalTrainer::Result LocalTrainer::train(int64_t steps) {
  return with_the_other_ranks([&] { return train_steps(steps); });
}

double LocalTrainer::evaluate(int64_t* tokens) {
  return with_the_other_ranks([&] { return evaluate_share(tokens); });
}

LocalTrainer::Result LocalTrainer::train_steps(int64_t steps) {
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
  // Dense per-rank counts, summed over ranks after the round (exact in double below 2^53).
  const auto vocab = static_cast<size_t>(config_.model.vocab_size);
  std::vector<double> counts(2 * vocab, 0.0);  // inputs, then targets
  for (int64_t s = 0; s < steps; ++s) {
    train::inject_fault_at(fault_, comm_->rank(), step_ + 1);
    std::vector<model::Batch> micro;
    for (int64_t a = 0; a < micro_steps_; ++a) micro.push_back(train_->next());
    for (const auto& b : micro) count_scored_tokens(b, counts);
    // The trainer's rule: the gradient of the mean loss over every scored token of the step
    // (over every rank's rows: the count and the loss are the same on every rank).
    bool stop = false;
    double reduce_wait_s = 0;
    const train::AccumulatedLoss acc =
        reducer_
            ? train::accumulate_gradients(model_, micro, *comm_, *reducer_, stop, reduce_wait_s)
            : train::accumulate_gradients(model_, micro);
    // The count and the loss are the same on every rank: these failures are the round's.
    if (acc.scored <= 0)
      throw RoundFailure(cat("client '", config_.id, "': a step without scored tokens"));
    if (!std::isfinite(acc.loss))
      throw RoundFailure(cat("client '", config_.id, "': non-finite loss at local step ", step_));
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
    if (zero_) {
      zero_->step(lr);
    } else {
      opt_->step(lr);
    }
    for (auto& p : params_) p.zero_grad();
    apply_step_drift();
    ++step_;
    loss_sum += step_loss;
    r.tokens += scored;
  }
  if (zero_) gather_after_round();
  comm_->all_reduce_sum(counts, "the round's token counts");
  r.input_counts = sparse_counts(counts, 0, vocab);
  r.target_counts = sparse_counts(counts, vocab, vocab);
  r.loss = r.tokens > 0 ? loss_sum / static_cast<double>(r.tokens) : 0;
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

void LocalTrainer::apply_step_drift() {
  if (step_drift_.empty()) return;
  POLLEN_ASSERT(step_drift_.size() == params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor w = params_[i].value();
    POLLEN_ASSERT(w.dtype() == DType::f32 && w.numel() == step_drift_[i].numel());
    float* p = w.data<float>();
    const float* d = step_drift_[i].data<float>();
    for (int64_t j = 0; j < w.numel(); ++j) p[j] -= d[j];
  }
}

void LocalTrainer::gather_after_round() {
  const bool lead = comm_->rank() == 0;
  gathered_ = {};
  if (!config_.state_dir.empty()) {
    zero_->gather_state(gathered_.exp_avg, gathered_.exp_avg_sq, lead);
  } else if (!first_moment_specs_.empty()) {
    std::vector<bool> wanted(params_.size(), false);
    for (size_t i : moment_slots(first_moment_specs_)) wanted[i] = true;
    gathered_.exp_avg = zero_->gather_first_moments(wanted, lead);
  }
  gathered_.steps = zero_->steps_taken();
  gathered_factored_ = share_moments_ ? sharded_factored_second_moments() : std::vector<float>{};
  if (!lead) {  // took part; keeps nothing
    gathered_ = {};
    gathered_factored_.clear();
  }
}

std::vector<float> LocalTrainer::sharded_factored_second_moments() {
  const ParamSpecs specs = exchanged_specs();
  std::vector<double> sums(static_cast<size_t>(factored_size(specs)), 0.0);
  for (const auto& block : zero_->blocks()) {
    const Tensor& v = block.exp_avg_sq;
    const Tensor host = v.device() == Device::cpu ? v : v.to(Device::cpu);
    add_factor_sums(specs, block.param, block.in_param, host.data<float>(), host.numel(), sums);
  }
  comm_->all_reduce_sum(sums, "the factored second moments");
  return factor_means(specs, sums);
}

train::OptimizerMoments LocalTrainer::optimizer_moments() {
  if (zero_) {
    POLLEN_CHECK(!gathered_.exp_avg_sq.empty(), "client '", config_.id,
                 "': no inner optimizer state gathered yet (rank ", comm_->rank(), ")");
    return gathered_;
  }
  train::OptimizerMoments m;
  for (const auto& slot : opt_->slots()) {
    m.exp_avg.push_back(slot.exp_avg);
    m.exp_avg_sq.push_back(slot.exp_avg_sq);
  }
  m.steps = opt_->steps_taken();
  return m;
}

double LocalTrainer::second_moment_bias() const {
  const int64_t steps = zero_ ? zero_->steps_taken() : opt_->steps_taken();
  return 1.0 - std::pow(config_.train.beta2, static_cast<double>(steps));
}

std::vector<float> LocalTrainer::factored_second_moments() {
  std::vector<float> f;
  if (zero_) {
    POLLEN_CHECK(share_moments_ && !gathered_factored_.empty(), "client '", config_.id,
                 "': no second moments gathered after the round (rank ", comm_->rank(), ")");
    f = gathered_factored_;
  } else {
    std::vector<const Tensor*> v;
    for (const auto& slot : opt_->slots()) v.push_back(&slot.exp_avg_sq);
    f = factor_second_moments(exchanged_specs(), v);
  }
  // AdamW's estimate v / (1 - beta2^t), so that clients of another age agree on its scale.
  const double bias = second_moment_bias();
  for (float& x : f) x = bias > 0 ? static_cast<float>(x / bias) : 0.0f;
  return f;
}

void LocalTrainer::set_second_moments(const std::vector<float>& factored) {
  // Stored so that AdamW's estimate is the federation's: v / (1 - beta2^t) = shared. A client
  // that has not stepped yet (t = 0) keeps its empty moments, as AdamW starts.
  const auto bias = static_cast<float>(second_moment_bias());
  const auto scale = [bias](Tensor& t) {
    float* x = t.data<float>();
    for (int64_t j = 0; j < t.numel(); ++j) x[j] *= bias;
  };
  const ParamSpecs specs = exchanged_specs();
  if (!zero_) {
    std::vector<Tensor*> v;
    for (auto& slot : opt_->slots()) v.push_back(&slot.exp_avg_sq);
    expand_second_moments(specs, factored, v);
    for (Tensor* t : v) scale(*t);
    return;
  }
  // ZeRO-1: each rank rebuilds its own blocks alone.
  for (const auto& block : zero_->blocks()) {
    Tensor v = Tensor::empty({block.exp_avg_sq.numel()}, DType::f32);
    expand_second_moments_range(specs, factored, block.param, block.in_param, v.numel(),
                                v.data<float>());
    scale(v);
    Tensor target = block.exp_avg_sq;  // a view into the optimizer's state
    target.copy_(v);
  }
}

double LocalTrainer::first_moment_bias() const {
  const int64_t steps = zero_ ? zero_->steps_taken() : opt_->steps_taken();
  return 1.0 - std::pow(config_.train.beta1, static_cast<double>(steps));
}

std::vector<size_t> LocalTrainer::moment_slots(const ParamSpecs& moments) const {
  const auto named = model_.named_parameters();
  std::vector<size_t> slots;
  for (const auto& m : moments) {
    const std::string name = moment_tensor_name(m);
    size_t i = 0;
    while (i < named.size() && named[i].first != name) ++i;
    POLLEN_CHECK(i < named.size(), "client '", config_.id, "': the model has no tensor '", name,
                 "' for its first moments");
    slots.push_back(i);
  }
  return slots;
}

Weights LocalTrainer::first_moments(const ParamSpecs& moments) const {
  const std::vector<size_t> slots = moment_slots(moments);
  for (size_t k = 0; k < slots.size(); ++k) {
    POLLEN_CHECK(
        !zero_ || (slots[k] < gathered_.exp_avg.size() && gathered_.exp_avg[slots[k]].defined()),
        "client '", config_.id, "': the first moments of '", moment_tensor_name(moments[k]),
        "' were not gathered after the round (rank ", comm_->rank(), ")");
  }
  const double bias = first_moment_bias();
  Weights out;
  for (size_t i : slots) {
    const Tensor& m = zero_ ? gathered_.exp_avg[i] : opt_->slots()[i].exp_avg;
    Tensor e = Tensor::empty(m.shape(), DType::f32);
    const float* x = m.data<float>();
    float* o = e.data<float>();
    for (int64_t j = 0; j < m.numel(); ++j)
      o[j] = bias > 0 ? static_cast<float>(x[j] / bias) : 0.0f;
    out.push_back(std::move(e));
  }
  return out;
}

void LocalTrainer::set_first_moments(const ParamSpecs& moments, const Weights& estimate) {
  const std::vector<size_t> slots = moment_slots(moments);
  POLLEN_ASSERT(estimate.size() == slots.size());
  // m = estimate (1 - beta1^t), so that AdamW's m / (1 - beta1^t) is the federation's. With
  // ZeRO-1 the whole tensors are built on every rank, which keeps its blocks of them.
  const auto bias = static_cast<float>(first_moment_bias());
  std::vector<Tensor> whole(params_.size());
  for (size_t k = 0; k < slots.size(); ++k) {
    Tensor m =
        zero_ ? Tensor::empty(estimate[k].shape(), DType::f32) : opt_->slots()[slots[k]].exp_avg;
    POLLEN_ASSERT(m.shape() == estimate[k].shape());
    const float* e = estimate[k].data<float>();
    float* x = m.data<float>();
    for (int64_t j = 0; j < m.numel(); ++j) x[j] = e[j] * bias;
    whole[slots[k]] = std::move(m);
  }
  if (zero_) zero_->load_first_moments(whole);
}

void LocalTrainer::load_checkpoint(const std::filesystem::path& dir) {
  if (!zero_) return train::load_checkpoint(dir, model_, *opt_);
  train::OptimizerMoments m;
  train::load_checkpoint(dir, model_, m);
  zero_->load_state(m.exp_avg, m.exp_avg_sq);
  zero_->set_steps_taken(m.steps);
}

double LocalTrainer::evaluate_share(int64_t* tokens) {
  *tokens = 0;
  if (!validation_) return 0;
  validation_->restore({config_.seed, 0, 0});  // the same batches every time
  // Each rank scores every world-th batch; the sums are reduced (one process: all of them).
  const int64_t rank = comm_->rank(), world = comm_->world();
  double sums[2] = {0, 0};  // loss, scored tokens
  for (int64_t i = 0; i < config_.train.eval_batches; ++i) {
    const model::Batch b = validation_->next();
    if (i % world != rank) continue;
    int64_t scored = 0;
    const ag::Var loss = model_.loss(b, ag::Reduction::sum, &scored);
    sums[0] += loss.value().item();
    sums[1] += static_cast<double>(scored);
  }
  comm_->all_reduce_sum(sums, "the validation loss");
  *tokens = static_cast<int64_t>(sums[1]);
  return *tokens > 0 ? sums[0] / sums[1] : 0;
}

// ---- the client
// ------------------------------------------------------------------------------------

Client::Client(ClientConfig config, Transport& transport, dist::Communicator* comm)
    : config_(std::move(config)), transport_(transport), drift_(config_.train.drift_correction) {
  if (config_.post.enabled()) {
    POLLEN_CHECK(comm == nullptr || comm->world() == 1, "client '", config_.id,
                 "': a post-training silo ([post]) runs as one process, not ", comm->world(),
                 " ranks");
    silo_ = std::make_unique<LoraSilo>(
        config_.id, silo_post_config(config_.post),
        lora_objective_factory(config_.post.objective, "post.objective"));
    // What Join proposes: the base's architecture and tokenizer, as the run file resolved them.
    config_.model = silo_->model().config();
    config_.tokenizer_fingerprint = silo_->tokenizer_fingerprint();
    trainer_ = silo_.get();
  } else {
    local_ = std::make_unique<LocalTrainer>(config_, comm);
    trainer_ = local_.get();
  }
  specs_ = trainer_->exchanged_specs();
  if (config_.local_dp.enabled) local_dp_ = std::make_unique<LocalDp>(config_.local_dp);
  Weights pulled;  // the last round's model, from the state
  if (!config_.state_dir.empty()) {
    last_round_ = silo_ ? load_client_state(config_.state_dir, config_.id, *silo_, specs_,
                                            feedback_, &pulled, local_dp_.get())
                        : load_client_state(config_.state_dir, config_.id, *local_, specs_,
                                            feedback_, drift_, &pulled, local_dp_.get());
  }
  // A client holding the server's last model, or one that built the server's initial model (the
  // same seed or model.init_from), takes the round's compressed model as a delta; otherwise the
  // server names another model and sends it whole.
  held_ = std::make_unique<HeldModel>(pulled.empty() ? trainer_->exchanged_weights()
                                                     : std::move(pulled));
  // The state before round 1, for a first round trained again (its update lost) to start from.
  if (last_round_ == 0 && !several_ranks()) save_state();
}

LocalTrainer& Client::trainer() {
  POLLEN_CHECK(local_ != nullptr, "client '", config_.id,
               "': a post-training silo has no pre-training trainer");
  return *local_;
}

void Client::save_state() {
  if (config_.state_dir.empty()) return;
  if (silo_) {
    save_client_state(config_.state_dir, config_.keep_checkpoints, config_.id, last_round_, *silo_,
                      specs_, feedback_, held_->model(), local_dp_.get());
  } else {
    save_client_state(config_.state_dir, config_.keep_checkpoints, config_.id, last_round_, *local_,
                      specs_, feedback_, drift_, held_->model(), local_dp_.get());
  }
}

void Client::join() {
  pb::JoinRequest r;
  r.set_protocol_version(kProtocolVersion);
  r.set_client_id(config_.id);
  r.set_model_config(model_config_json(config_.model));
  r.set_tokenizer_fingerprint(config_.tokenizer_fingerprint);
  r.set_data_manifest_hash(trainer_->manifest_hash());
  if (silo_) {
    r.set_base_fingerprint(silo_->base_sha256());
    r.set_lora_config(lora_config_json(silo_->lora_config()));
  }
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
        if (several_ranks()) send_order(local_->communicator(), {}, nullptr);
        // A run the server gave up is a failure for its clients too (a non-zero exit).
        POLLEN_CHECK(
            t.stopped().empty(), "fed client '", config_.id,
            "': the server stopped the run before its last round: ", t.stopped().substr(0, 1024));
        log::info("fed client '", config_.id, "': the run is over");
        return;
      case pb::TASK_TRAIN:
      case pb::TASK_SECAGG_ADVERTISE:
      case pb::TASK_SECAGG_SHARE:
      case pb::TASK_SECAGG_UNMASK:
        try {
          handle(t);
        } catch (const dist::PeerFailure&) {
          throw;  // a rank of this silo died or hangs: the silo's job ends
        } catch (const RoundCannotSucceed&) {
          throw;
        } catch (const Error& e) {
          // A round that closed or a stream that broke: the next task says what to do, after a
          // pause, so that a failure that repeats does not spin.
          log::warn("fed client '", config_.id, "': round ", t.round(), " failed: ", e.what());
          std::this_thread::sleep_for(std::chrono::seconds(1));
        }
        break;
      default:
        std::this_thread::sleep_for(
            std::chrono::milliseconds(std::clamp<int64_t>(t.wait_ms(), 10, 5000)));
    }
  }
}

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

void Client::rewind(int64_t round) {
  int64_t was = -1;
  Weights pulled;
  if (!config_.state_dir.empty() && !several_ranks()) {
    was = silo_ ? rewind_client_state(config_.state_dir, config_.id, round, *silo_, specs_,
                                      feedback_, &pulled)
                : rewind_client_state(config_.state_dir, config_.id, round, *local_, specs_,
                                      feedback_, drift_, &pulled);
  }
  if (was < 0) {
    log::warn("fed client '", config_.id, "': round ", round,
              " again (its update was lost); the local steps it took for it stay in its "
              "optimizer and data position",
              config_.state_dir.empty() ? " (client.state_dir keeps states to go back to)"
              : several_ranks()         ? " (a silo of several ranks does not go back)"
                                        : " (no saved state of an earlier round)");
    return;
  }
  last_round_ = was;
  if (!pulled.empty()) held_ = std::make_unique<HeldModel>(std::move(pulled));
}

void Client::train_round(const pb::TaskReply& task) {
  const TaskCodecs codecs = check_task(task);
  if (task.round() <= last_round_) rewind(task.round());
  // Token counts leave the silo in the clear: local DP's noise does not cover them.
  POLLEN_CHECK(!task.token_counts() || !local_dp_, "client '", config_.id,
               "': the server weights rows by token counts (strategy.row_weighting), which "
               "[local_dp] does not protect; the client sends none");
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
    send_order(local_->communicator(), order, &local_->model(), step_drift, moments,
               first_estimate);
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
  const auto res = trainer_->train(task.local_steps());
  info.set_tokens(res.tokens);
  info.set_train_loss(res.loss);
  info.set_train_seconds(res.seconds);
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
    const Epsilon e = local_dp_->epsilon();
    log::info("fed client '", config_.id, "': local DP", clipped ? " (update clipped)" : "",
              ": epsilon ", e.epsilon, " at delta ", config_.local_dp.delta, " after ",
              task.round(), " rounds");
  }
  const Weights saved_residual = clone_weights(feedback_.residual());
  EncodedSet enc;
  if (task.secure_aggregation()) {
    enc = masked_update(task.round(), delta, res.tokens);
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
    bytes_sent_ += enc.bytes.size() + info.second_moments().size();
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
