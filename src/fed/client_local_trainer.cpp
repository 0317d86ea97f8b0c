// LocalTrainer, a silo's inner loop: its model, optimizer and loaders, the local steps of a
// round (over one rank or several) and the validation loss. Its optimizer moments, kept and
// shared: client_local_trainer_moments.cpp.
#include "fed/client.h"

#include <chrono>
#include <cmath>

#include "autograd/tape.h"
#include "base/files.h"
#include "base/log.h"
#include "data/shards.h"
#include "fed/proximal.h"
#include "io/model_source.h"
#include "ops/elementwise.h"
#include "optim/schedule.h"
#include "train/private_gradients.h"
#include "train/trainer.h"

namespace pollen::fed {

using Clock = std::chrono::steady_clock;

// [dp_sgd]: the accountant after every local step, in client.state_dir.
constexpr const char* kDpSgdLedger = "dp_sgd.json";

namespace {

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

model::Llama initial_model(const ClientConfig& c) {
  if (c.init_from.empty()) return model::Llama(c.model, c.seed);
  return io::load_initial_weights(c.init_from, c.model, "model.init_from");
}

// train.device, refused naming the key when this build or machine has no GPU, or for a silo of
// several ranks on GPUs.
Device silo_device(const ClientConfig& c, int world) {
  const std::string key = cat("client '", c.id, "': train.device");
  Device d = Device::cpu;
  try {
    d = parse_device(c.train.device);
  } catch (const Error& e) {
    fail(key, ": ", e.what());
  }
  if (d == Device::cuda) {
    require_gpu(key);
    POLLEN_CHECK(world == 1, key,
                 " = \"cuda\" trains a silo on one GPU; a silo of several GPU ranks is not "
                 "supported yet (run it as one rank, or on the CPU)");
  }
  return d;
}

}  // namespace

LocalTrainer::LocalTrainer(const ClientConfig& config, dist::Communicator* comm)
    : config_(config),
      comm_(comm ? comm : &alone_),
      device_(silo_device(config, comm_->world())),
      model_(initial_model(config)) {
  const int world = comm_->world();
  model_.to(device_);  // the optimizer below allocates its state where the parameters are
  for (const auto& [name, p] : model_.named_parameters()) params_.push_back(p);
  if (world > 1) {
    reducer_ = std::make_unique<dist::GradReducer>(
        *comm_, params_, static_cast<int64_t>(config.parallel.bucket_mb * 1048576.0),
        config.parallel.zero == 1 ? dist::ReduceMode::reduce_scatter
                                  : dist::ReduceMode::all_reduce);
  }
  // Weight decay spares the groups train.no_decay names, as pollen train's does.
  const std::vector<bool> decay =
      train::decay_mask(model_.named_parameters(), config.train.optimizer.no_decay);
  const optim::AdamWOptions adamw = config.train.optimizer.adamw(config.train.grad_clip);
  if (reducer_ && config.parallel.zero == 1) {
    zero_ = std::make_unique<dist::ZeroAdamW>(*reducer_, adamw, decay);
  } else {
    opt_.emplace(params_, adamw, decay);
    if (config.train.precision == "bf16") opt_->compute_in_bf16();  // the config requires cuda
  }
  // A step is the same global batch at any world size: each micro-step reads a global
  // micro-batch of micro_batch x ranks rows and this rank takes its micro_batch of them.
  if (config.train.accumulation % world != 0) {
    // What would fit: the same rows a step, split so that the micro-steps divide among the ranks.
    int64_t rows = 0;
    std::string fits;
    if (!__builtin_mul_overflow(config.train.micro_batch, config.train.accumulation, &rows) &&
        rows <= (int64_t{1} << 20))  // a step's rows, within what a search may go through
      for (int64_t accumulation = world; accumulation <= rows; accumulation += world)
        if (rows % accumulation == 0)
          fits += cat(fits.empty() ? "" : ", ", rows / accumulation, " x ", accumulation);
    fail("client '", config.id, "': train.accumulation (", config.train.accumulation,
         ") is not a multiple of the silo's ranks (", world,
         "): each rank reads train.micro_batch rows per micro-step; ",
         fits.empty() ? cat("give a train.accumulation that is a multiple of ", world)
                      : cat("a step of the same ", rows,
                            " rows as train.micro_batch x train.accumulation: ", fits));
  }
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
  try {
    train_ = std::make_unique<data::Loader>(lo);
  } catch (const Error& e) {
    fail("client '", config.id, "': the train split of data.manifests: ", e.what());
  }
  if (config.train.eval_batches > 0 && has_split(config.manifests, "validation")) {
    lo.batch = config.train.micro_batch;  // every rank reads every batch and scores its share
    lo.step_batch = 0;
    lo.rank = 0;
    lo.world = 1;
    lo.split = "validation";
    try {
      // A split of fewer windows than a micro-batch is scored whole, as one batch (as in
      // pollen train).
      const int64_t windows = data::Loader::count_windows(lo);
      if (windows > 0 && windows < lo.batch) lo.batch = windows;
      validation_.loader = std::make_unique<data::Loader>(lo);
    } catch (const Error& e) {
      fail("client '", config.id, "': the validation split of data.manifests: ", e.what());
    }
    validation_.start = {config.seed, 0, 0};
    // No window scored twice (the loader's next epoch), as in pollen train.
    validation_.batches =
        std::min(config.train.eval_batches, validation_.loader->windows_per_epoch() / lo.batch);
  }
  if (config.dp_sgd.enabled) open_dp_sgd();
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

void LocalTrainer::open_dp_sgd() {
  const ClientConfig& c = config_;
  POLLEN_CHECK(device_ == Device::cpu && c.train.precision == "f32", "client '", c.id,
               "': [dp_sgd] runs on the CPU in float32 so far");
  POLLEN_CHECK(!c.state_dir.empty(), "client '", c.id,
               "': [dp_sgd] keeps its accountant in client.state_dir, so that a restarted client "
               "counts every local step it ran; set client.state_dir (in a simulation, leave "
               "sim.client_states on)");
  dp_.emplace(c.dp_sgd, train_->windows_total(), c.train.micro_batch * c.train.accumulation, 1);
  // Never rolled back with the state: a step that ran was released, whatever became of its round.
  // Rank 0 writes it; every rank reads it, as the client's state.
  const std::filesystem::path ledger = c.state_dir / kDpSgdLedger;
  if (comm_->rank() == 0) std::filesystem::create_directories(c.state_dir);
  if (std::filesystem::exists(ledger)) {
    try {
      dp_->restore_accountant(nlohmann::json::parse(read_file(ledger)));
    } catch (const std::exception& e) {
      fail("client '", c.id, "': '", ledger.string(), "': ", e.what());
    }
    log::info("client '", c.id, "': [dp_sgd] goes on from the account in '", ledger.string(),
              "': ", dp_->steps_accounted(), " local steps released so far, epsilon ",
              dp_->epsilon().epsilon);
  }
}

LocalTrainer::Result LocalTrainer::train(int64_t steps) {
  return on_every_rank_or_none(comm_, config_.id, [&] { return train_steps(steps); });
}

double LocalTrainer::evaluate(int64_t* tokens) {
  return on_every_rank_or_none(comm_, config_.id, [&] { return evaluate_share(tokens); });
}

LocalTrainer::Result LocalTrainer::train_steps(int64_t steps) {
  const auto t0 = Clock::now();
  const auto& tc = config_.train;
  optim::Schedule sched;
  sched.kind = optim::parse_schedule_kind(tc.schedule);
  sched.lr = tc.optimizer.lr;
  sched.min_lr = tc.min_lr;
  sched.warmup_steps = tc.warmup_steps;
  sched.total_steps = tc.total_steps > 0 ? tc.total_steps : int64_t{1} << 40;
  Result r;
  double loss_sum = 0;
  // Dense per-rank counts, summed over ranks after the round (exact in double below 2^53).
  const auto vocab = static_cast<size_t>(config_.model.vocab_size);
  std::vector<double> counts(2 * vocab, 0.0);  // inputs, then targets
  // FedProx: the weights the round starts from anchor its proximal term.
  Weights anchor;
  if (tc.proximal_mu > 0)
    for (const Tensor& w : weights()) anchor.push_back(w.clone());
  for (int64_t s = 0; s < steps; ++s) {
    train::inject_fault_at(fault_, comm_->rank(), step_ + 1, reducer_.get());
    if (dp_) {
      const train::AccumulatedLoss acc = private_step(anchor);
      step_with_lr(sched, s);
      loss_sum += std::isfinite(acc.loss) ? acc.loss * static_cast<double>(acc.scored) : 0.0;
      r.tokens += acc.scored;
      continue;
    }
    std::vector<model::Batch> micro;
    for (int64_t a = 0; a < micro_steps_; ++a) micro.push_back(train_->next());
    for (const auto& b : micro) count_scored_tokens(b, counts);
    // Each rank's share of mu (w - anchor): the reduction sums the ranks' gradients.
    if (!anchor.empty())
      seed_proximal_gradients(params_, weights(), anchor, tc.proximal_mu / comm_->world());
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
      throw RoundFailure(
          cat("client '", config_.id, "': non-finite loss at local step ", step_ + 1));
    const int64_t scored = acc.scored;
    const double step_loss = acc.loss * static_cast<double>(scored);
    step_with_lr(sched, s);
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

void LocalTrainer::step_with_lr(const optim::Schedule& sched, int64_t s) {
  const auto& tc = config_.train;
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
}

train::AccumulatedLoss LocalTrainer::private_step(const Weights& anchor) {
  // FedProx's term, data-free: each rank adds its share to its share of the release before the
  // shares are summed (under ZeRO-1 nothing reads the whole gradient after).
  const auto add_proximal_share = [&] {
    std::vector<Tensor> released;
    for (const auto& p : params_) released.push_back(p.grad());
    seed_proximal_gradients(params_, weights(), anchor, config_.train.proximal_mu / comm_->world());
    for (size_t i = 0; i < params_.size(); ++i) ops::axpy(1.0, released[i], params_[i].grad());
  };
  // Several ranks: each clips its share of rank 0's sample, and the reducer sums the shares.
  const train::PrivateGradient g = train::private_gradients(
      model_, *train_, *dp_, step_ + 1, config_.train.micro_batch, reducer_.get(),
      anchor.empty() ? std::function<void()>() : add_proximal_share);
  // Accounted on disk before the step's update can leave the silo.
  if (comm_->rank() == 0)
    write_file_atomic(config_.state_dir / kDpSgdLedger, dp_->state().dump() + "\n");
  return g.loss;
}

void LocalTrainer::set_step_drift(Weights drift) {
  step_drift_.clear();
  for (Tensor& d : drift) step_drift_.push_back(d.device() == device_ ? d : d.to(device_));
}

void LocalTrainer::apply_step_drift() {
  if (step_drift_.empty()) return;
  POLLEN_ASSERT(step_drift_.size() == params_.size());
  std::vector<Tensor> w = weights();
  for (size_t i = 0; i < w.size(); ++i) ops::axpy(-1.0, step_drift_[i], w[i]);  // w -= drift
  weights_changed();
}

std::vector<Tensor> LocalTrainer::weights() const {
  std::vector<Tensor> w;
  const bool masters = opt_ && opt_->computes_in_bf16();
  for (size_t i = 0; i < params_.size(); ++i)
    w.push_back(masters ? opt_->slots()[i].param : params_[i].value());
  return w;
}

void LocalTrainer::weights_changed() {
  if (opt_ && opt_->computes_in_bf16()) opt_->refresh_model_copies();
}

Weights LocalTrainer::exchanged_weights() const {
  Weights out;
  for (const Tensor& w : weights()) {
    Tensor host = Tensor::empty(w.shape(), DType::f32);
    host.copy_(w);  // from host or GPU memory
    out.push_back(std::move(host));
  }
  return out;
}

void LocalTrainer::set_exchanged_weights(const Weights& w) {
  const auto named = model_.named_parameters();
  std::vector<Tensor> dst = weights();
  POLLEN_CHECK(w.size() == dst.size(), "client '", config_.id, "': ", w.size(), " tensors for ",
               dst.size(), " parameters");
  for (size_t i = 0; i < w.size(); ++i) {
    POLLEN_CHECK(dst[i].shape() == w[i].shape(), "client '", config_.id, "': '", named[i].first,
                 "' has shape ", shape_str(dst[i].shape()), ", got ", shape_str(w[i].shape()));
    dst[i].copy_(w[i]);
  }
  weights_changed();
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
  if (!validation_.loader) return 0;
  const double loss =
      train::validation_loss(model_, validation_, config_.train.eval_batches, comm_, tokens);
  return *tokens > 0 ? loss : 0;
}

}  // namespace pollen::fed
