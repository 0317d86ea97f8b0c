#include "train/trainer.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <set>
#include <utility>

#include "autograd/tape.h"
#include "base/files.h"
#include "base/folder_lock.h"
#include "base/log.h"
#include "base/rng.h"
#include "base/thread_pool.h"
#include "data/shards.h"
#include "dist/nccl_communicator.h"
#include "io/checkpoint.h"
#include "io/model_source.h"
#include "obs/metrics.h"
#include "obs/progress.h"
#include "ops/gemm.h"
#include "tensor/cuda_memory.h"
#include "train/private_gradients.h"
#include "train/run_control.h"
#include "train/samples.h"
#include "train/trainer_data.h"
#include "train/trainer_optimizer.h"

namespace fs = std::filesystem;

namespace pollen::train {

int64_t count_scored(const model::Batch& batch) {
  const int32_t* t = batch.targets.data<int32_t>();
  int64_t n = 0;
  for (int64_t i = 0; i < batch.targets.numel(); ++i) n += t[i] >= 0;
  return n;
}

AccumulatedLoss accumulate_gradients(const model::Llama& model,
                                     const std::vector<model::Batch>& micro_batches) {
  AccumulatedLoss r;
  for (const auto& b : micro_batches) r.scored += count_scored(b);
  if (r.scored == 0) {
    r.loss = NAN;
    return r;
  }
  const double scale = 1.0 / static_cast<double>(r.scored);
  double sum = 0;
  for (const auto& b : micro_batches) {
    ag::Tape tape;
    ag::Var l;
    {
      ag::TapeScope scope(tape);
      l = model.loss(b, ag::Reduction::sum);
    }
    sum += l.value().item();
    tape.backward(l, scale);
  }
  r.loss = sum * scale;
  return r;
}

AccumulatedLoss accumulate_gradients(const model::Llama& model,
                                     const std::vector<model::Batch>& micro_batches,
                                     dist::Communicator& comm, dist::GradReducer& reducer,
                                     bool& stop, double& reduce_wait_s) {
  double counts[2] = {0, stop ? 1.0 : 0.0};  // scored targets, ranks asking to stop
  for (const auto& b : micro_batches) counts[0] += static_cast<double>(count_scored(b));
  comm.all_reduce_sum(counts, "the count of scored tokens");
  AccumulatedLoss r;
  r.scored = static_cast<int64_t>(counts[0]);
  stop = counts[1] > 0;
  // Every rank runs backward and the reductions even when nothing is scored, so that all start
  // the same collectives; the gradients are then zero and the loss NaN.
  const double scale = r.scored > 0 ? 1.0 / static_cast<double>(r.scored) : 0.0;
  double sum = 0;
  for (size_t i = 0; i < micro_batches.size(); ++i) {
    ag::Tape tape;
    ag::Var l;
    {
      ag::TapeScope scope(tape);
      l = model.loss(micro_batches[i], ag::Reduction::sum);
    }
    sum += l.value().item();
    if (i + 1 < micro_batches.size()) {
      tape.backward(l, scale);
    } else {
      ag::ObserveBackward observe(reducer);
      tape.backward(l, scale);
    }
  }
  reduce_wait_s = reducer.finish();
  comm.all_reduce_sum(std::span<double>(&sum, 1), "the loss");
  r.loss = r.scored > 0 ? sum * scale : NAN;
  return r;
}

std::vector<bool> decay_mask(const std::vector<std::pair<std::string, ag::Var>>& params,
                             const std::vector<std::string>& no_decay) {
  auto has = [&](const char* g) {
    return std::find(no_decay.begin(), no_decay.end(), g) != no_decay.end();
  };
  const bool norms = has("norms"), biases = has("biases"), embeddings = has("embeddings");
  std::vector<bool> mask;
  for (const auto& [name, v] : params) {
    bool decay = true;
    if (norms && name.find("norm") != std::string::npos) decay = false;
    if (biases && name.ends_with(".bias")) decay = false;
    if (embeddings && name.find("embed_tokens") != std::string::npos) decay = false;
    mask.push_back(decay);
  }
  return mask;
}

double measure_peak_flops(Device device, DType dtype) {
  const int64_t n = device == Device::cpu ? 1024 : 4096;
  Tensor a = Tensor::full({n, n}, 0.5, dtype).to(device);
  Tensor b = Tensor::full({n, n}, 0.25, dtype).to(device);
  Tensor c = Tensor::zeros({n, n}, dtype, device);
  ops::gemm(a, false, b, false, c);  // warm up
  if (device == Device::cuda) cuda::synchronize();
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = Clock::now();
    ops::gemm(a, false, b, false, c);
    if (device == Device::cuda) cuda::synchronize();
    best = std::max(best, 2.0 * static_cast<double>(n * n * n) / seconds_since(t0));
  }
  return best;
}

namespace {

// What one step did, as its metrics record reports it.
struct StepReport {
  int64_t step = 0, tokens = 0, scored = 0;
  double loss = 0, lr = 0, grad_norm = 0;
  double tokens_per_s = 0, mfu = 0, elapsed_s = 0;
  double seconds = 0, reduce_wait_s = 0;  // the step's, and of them waiting for reductions
  bool good = true;
  std::optional<PrivateGradient> dp;  // under [privacy]: the sample and its clipping
  double epsilon = NAN;               // under [privacy]: spent after this step
};

// The step's line in metrics.jsonl and its TensorBoard scalars.
void record_step(RunMetrics& metrics, const StepReport& s, Device device, int world, double wall) {
  nlohmann::ordered_json rec;
  rec["step"] = s.step;
  rec["tokens"] = s.tokens;
  rec["loss"] = json_number(s.loss);
  rec["lr"] = s.lr;
  rec["grad_norm"] = json_number(s.grad_norm);
  rec["scored"] = s.scored;
  rec["tokens_per_s"] = std::round(s.tokens_per_s * 10) / 10;
  rec["mfu"] = std::round(s.mfu * 1e5) / 1e5;
  rec["elapsed_s"] = std::round(s.elapsed_s * 1000) / 1000;
  rec["rss_mb"] = std::round(rss_mb() * 10) / 10;
  if (device == Device::cuda) {  // the GPU allocator's peak of bytes in use so far
    const double peak_bytes =
        static_cast<double>(CudaAllocator::instance().stats().peak_in_use_bytes);
    rec["gpu_peak_mb"] = std::round(peak_bytes / 1048576.0 * 10) / 10;
  }
  if (world > 1) {
    rec["ranks"] = world;
    rec["tokens_per_s_per_rank"] = std::round(s.tokens_per_s / world * 10) / 10;
    rec["reduce_wait_s"] = std::round(s.reduce_wait_s * 1e5) / 1e5;
    rec["reduce_wait_frac"] = std::round(s.reduce_wait_s / s.seconds * 1e4) / 1e4;
  }
  if (s.dp) {
    rec["sampled"] = s.dp->rows;
    rec["clipped"] = s.dp->clipped;
    rec["epsilon"] = json_number(s.epsilon);
  }
  if (!s.good) rec["skipped"] = true;
  metrics.jsonl.write(rec);
  metrics.scalar("train/loss", s.loss, s.step, wall);
  metrics.scalar("train/lr", s.lr, s.step, wall);
  metrics.scalar("train/grad_norm", s.grad_norm, s.step, wall);
  metrics.scalar("perf/tokens_per_s", s.tokens_per_s, s.step, wall);
  metrics.scalar("perf/mfu", s.mfu, s.step, wall);
  metrics.scalar("sys/rss_mb", rss_mb(), s.step, wall);
  if (s.dp) metrics.scalar("privacy/epsilon", s.epsilon, s.step, wall);
}

}  // namespace

std::optional<fs::path> agree_on_checkpoint(const fs::path& ckpt_root, dist::Communicator& comm) {
  int64_t choice_of_lead[2] = {-1, 0};  // {step or -1 for none, skipped}
  if (comm.rank() == 0) {
    const io::ResumePoint point = io::choose_checkpoint_to_resume(ckpt_root, "--resume");
    if (point.dir) choice_of_lead[0] = io::checkpoint_step(*point.dir);
    choice_of_lead[1] = point.skipped;
  }
  // No watchdog: rank 0 verifies the checkpoint's hashes first, which for a large model on a
  // shared file system can take longer than parallel.timeout_s.
  comm.wait_for_broadcast(choice_of_lead, 0, "the choice of checkpoint to resume");
  const int64_t chosen = choice_of_lead[0];
  POLLEN_CHECK(chosen >= 0 || choice_of_lead[1] == 0, "--resume: no checkpoint under '",
               ckpt_root.string(), "' verifies (", choice_of_lead[1], " skipped, reasons above)");
  if (chosen == -1) {
    log::info("--resume: no checkpoint under '", ckpt_root.string(), "' yet; starting at step 0");
    return std::nullopt;
  }
  return ckpt_root / io::checkpoint_name(chosen);
}

namespace {

// Under [privacy]: the accountant after every step released, in the run folder.
constexpr const char* kPrivacyLedger = "privacy.json";

// A resumed run's [privacy] must be the checkpoint's, key by key: a new delta would report
// epsilon at another delta, a new noise seed make the noise predictable.
void check_same_privacy(const optim::DpSgdOptions& saved, const optim::DpSgdOptions& now) {
  // `unset`: the value that stands for a key left out (delta 0: 0.1 / the sequences or 1e-5;
  // target_epsilon 0: none; noise_seed -1: none), named as such.
  const auto same = [](const char* key, double a, double b, std::optional<double> unset = {}) {
    const auto shown = [&](double v) { return v == unset ? std::string("unset") : cat(v); };
    POLLEN_CHECK(a == b, "cannot resume: privacy.", key, " (", shown(a), " -> ", shown(b),
                 ") differs from the checkpoint's; a private run keeps its [privacy] table");
  };
  if (!saved.enabled || !now.enabled) return;  // recover_privacy refuses adding or dropping it
  same("clip", saved.clip, now.clip);
  same("noise_multiplier", saved.noise_multiplier, now.noise_multiplier);
  same("target_epsilon", saved.target_epsilon, now.target_epsilon, 0.0);
  same("delta", saved.delta, now.delta, 0.0);
  same("noise_seed", static_cast<double>(saved.noise_seed), static_cast<double>(now.noise_seed),
       -1.0);
}

// A pre-training run in this process once its model, optimizer and data are set up: resuming,
// the steps with their evaluations and checkpoints, and the summary. Rank 0 writes the run's
// files (metrics, config, checkpoints, summary); every rank holds the same weights and loader
// state.
// Each manifest's dataset version (the SHA-256 of its manifest.json), in order.
nlohmann::ordered_json data_versions(const std::vector<std::string>& manifests) {
  nlohmann::ordered_json versions = nlohmann::ordered_json::array();
  for (const auto& m : manifests) versions.push_back(data::dataset_version(m));
  return versions;
}

void check_same_data(const nlohmann::ordered_json& saved, const nlohmann::ordered_json& now,
                     const TrainConfig& cfg) {
  POLLEN_CHECK(saved.size() == now.size(), "cannot resume: the checkpoint trained on ",
               saved.size(), " manifests, data.manifests names ", now.size());
  for (size_t i = 0; i < now.size(); ++i)
    POLLEN_CHECK(saved[i] == now[i], "cannot resume: data manifest '", cfg.manifests[i],
                 "' is not the data the checkpoint trained on (dataset version ",
                 saved[i].get<std::string>().substr(0, 16), ", now ",
                 now[i].get<std::string>().substr(0, 16),
                 "): the loader's position would fall elsewhere in it. Resume on the data the ",
                 "run trained on, or start a new run (model.init_from) on the new data");
}

class TrainingRun {
 public:
  TrainingRun(const TrainConfig& cfg, const TrainOptions& o, dist::Communicator& comm,
              fs::path ckpt_root, model::Llama& model, Device device, TrainerOptimizer& optimizer,
              TrainData& data)
      : cfg_(cfg),
        o_(o),
        comm_(comm),
        parallel_(comm.world() > 1),
        lead_(comm.rank() == 0),
        ckpt_root_(std::move(ckpt_root)),
        model_(model),
        device_(device),
        optimizer_(optimizer),
        data_(data),
        data_versions_(data_versions(cfg.manifests)),
        rng_(cfg.seed) {
    if (cfg.privacy.enabled)
      dp_.emplace(cfg.privacy, data.loader.windows_total(), cfg.batch_tokens / cfg.seq, cfg.steps);
  }

  // --resume: the weights, optimizer state, counters, loader, RNG and metrics positions of the
  // checkpoint rank 0 chooses, if there is one.
  void resume();
  // Under [privacy], after resume() or in a fresh run: the accountant of every step released so
  // far, the resumed checkpoint's or, when it holds more (steps that ran after the checkpoint,
  // whose metrics and evaluations may have been seen, and that this run trains again), the run
  // folder's privacy.json. Refuses a checkpoint whose steps were private when the run is not,
  // and the other way round.
  void recover_privacy();
  // Rank 0's files: metrics (continued where a resumed checkpoint left them), samples and
  // config.toml.
  void open_outputs();
  // Sets the peak FLOP/s that MFU is a fraction of (measured unless the config gives it) and
  // logs what the run will do; `nccl`: gradients are reduced by NCCL.
  void log_start(bool nccl);
  // The steps, then the summary.
  TrainResult run();

 private:
  // One step with its metrics, evaluation and checkpoint; false when the run stops after it
  // (result_ says why).
  bool step(obs::Progress& progress);
  // The validation loss and the samples, at an evaluation step.
  void evaluate(obs::Progress& progress, double wall);
  void save(int64_t at);
  TrainResult finish(bool stopped);

  const TrainConfig& cfg_;
  const TrainOptions& o_;
  dist::Communicator& comm_;
  const bool parallel_, lead_;
  const fs::path ckpt_root_;
  model::Llama& model_;
  const Device device_;
  TrainerOptimizer& optimizer_;
  TrainData& data_;
  const nlohmann::ordered_json data_versions_;  // each training manifest's, as the run began
  std::optional<optim::DpSgd> dp_;              // [privacy]

  LoopCounters counters_;
  Rng rng_;
  fs::path last_checkpoint_;
  std::optional<nlohmann::ordered_json> resumed_;  // the resumed checkpoint's state.json
  std::optional<uint64_t> samples_at_ = 0;
  std::optional<RunMetrics> metrics_;  // rank 0's
  SampleWriter samples_;
  std::string config_toml_;
  double peak_ = 0, flops_per_token_ = 0;
  Clock::time_point run_start_;
  double reduce_wait_total_ = 0, step_time_total_ = 0;
  int64_t steps_here_ = 0;
  TrainResult result_;
};

void TrainingRun::resume() {
  const std::optional<fs::path> dir = agree_on_checkpoint(ckpt_root_, comm_);
  if (!dir) return;
  // Relative paths in a config.toml of an older pollen were relative to the folder it ran
  // from: resumed from there, they compare equal to today's absolute ones.
  const TrainConfig saved = parse_train_config(
      read_file(*dir / "config.toml"), (*dir / "config.toml").string(), {}, fs::current_path());
  for (const auto& w : check_resume_compatible(saved, cfg_)) log::warn_job("resume: ", w);
  check_same_privacy(saved.privacy, cfg_.privacy);
  optimizer_.load(*dir, model_);
  resumed_ = nlohmann::ordered_json::parse(read_file(*dir / "state.json"));
  const nlohmann::ordered_json& st = *resumed_;
  counters_.restore(st);
  POLLEN_CHECK(cfg_.steps >= counters_.step, "--resume: train.steps (", cfg_.steps,
               ") is below the step of checkpoint '", dir->string(), "' (", counters_.step,
               "): nothing is left to train; give train.steps of at least ", counters_.step);
  // The loader's position is into the data the checkpoint trained on; re-prepared data under
  // the same path would put it elsewhere. (Checkpoints before this record have none.)
  if (st.contains("data_versions")) check_same_data(st.at("data_versions"), data_versions_, cfg_);
  data_.loader.restore(data::LoaderState::from_json(nlohmann::json(st.at("loader"))));
  rng_ = Rng(st.at("rng").at("seed").get<uint64_t>(), st.at("rng").at("offset").get<uint64_t>());
  // Checkpoints written before samples were turned on have no position: append.
  samples_at_ = st.at("metrics").contains("samples_bytes")
                    ? std::optional(st.at("metrics").at("samples_bytes").get<uint64_t>())
                    : std::nullopt;
  last_checkpoint_ = *dir;
  log::info("resuming from '", dir->string(), "' at step ", counters_.step, " (", counters_.tokens,
            " tokens)");
}

void TrainingRun::recover_privacy() {
  const bool private_checkpoint = resumed_ && resumed_->contains("privacy");
  POLLEN_CHECK(!resumed_ || private_checkpoint == dp_.has_value(),
               "--resume: the checkpoint's steps ", private_checkpoint ? "were" : "were not",
               " trained under [privacy] (DP-SGD) and this run's config ", dp_ ? "has" : "has no",
               " [privacy] table; a run keeps its privacy setting");
  // A private run's account (even one that reached no checkpoint) is never overwritten.
  const fs::path ledger = cfg_.dir / kPrivacyLedger;
  if (!dp_) {
    if (!fs::exists(ledger)) return;
    // A run resumed from checkpoints of its own trained without [privacy]: the account is of an
    // earlier private run in the folder (one that reached no checkpoint), and stays as it is.
    if (resumed_) {
      log::warn_job("'", ledger.string(),
                    "' is the privacy account of an earlier private run in this ",
                    "folder; this run's checkpoints are not private, and it is left as it is");
      return;
    }
    fail("run folder '", cfg_.dir.string(), "' holds the privacy account of a private run (",
         kPrivacyLedger, ") and this run's config has no [privacy] table; continue that run with ",
         "its [privacy] table (--resume), or choose another run.dir");
  }
  POLLEN_CHECK(o_.resume || !fs::exists(ledger), "run folder '", cfg_.dir.string(),
               "' holds the privacy account of an earlier private run (", kPrivacyLedger,
               "); continue that run with --resume, or choose another run.dir");
  std::optional<nlohmann::json> state;
  bool released_since = false;  // steps released after the checkpoint, which run again
  if (private_checkpoint) state = nlohmann::json(resumed_->at("privacy"));
  if (fs::exists(ledger)) {
    try {
      nlohmann::json released = nlohmann::json::parse(read_file(ledger));
      const int64_t before = state ? state->at("steps").get<int64_t>() : 0;
      const int64_t steps = released.at("steps").get<int64_t>();
      if (steps > before) {
        log::warn_job("privacy: ", steps - before, " private step(s) ran after ",
                      state ? "the checkpoint resumed" : "this run's start",
                      " and stay accounted (", ledger.string(), ")");
        state = std::move(released);
        released_since = true;
      }
    } catch (const nlohmann::json::exception& e) {
      fail("'", ledger.string(), "': expected the privacy accountant's state: ", e.what());
    }
  }
  if (state) dp_->load_state(*state, cfg_.steps, counters_.step, released_since);
}

void TrainingRun::open_outputs() {
  // The samples' tokenizer is checked before any file is opened, so that a run refused for it
  // leaves the earlier run's files as they were. A fresh run's samples replace an earlier run's,
  // as its metrics do, with or without samples of its own.
  if (!cfg_.sample_prompts.empty() && lead_) samples_ = SampleWriter(cfg_, samples_at_);
  if (lead_ && !resumed_ && cfg_.sample_prompts.empty()) fs::remove(cfg_.dir / "samples.jsonl");
  if (lead_)
    metrics_ = RunMetrics::open(cfg_.dir, cfg_.tensorboard,
                                resumed_ ? &resumed_->at("metrics") : nullptr, counters_.step);
  config_toml_ = cfg_.to_toml();
  if (lead_) write_file_atomic(cfg_.dir / "config.toml", config_toml_);
  if (lead_) mark_running(cfg_.dir, counters_.step, cfg_.steps);
}

void TrainingRun::log_start(bool nccl) {
  peak_ = cfg_.peak_flops > 0
              ? cfg_.peak_flops
              : measure_peak_flops(device_, cfg_.precision == "bf16" ? DType::bf16 : DType::f32);
  flops_per_token_ = cfg_.model.flops_per_token(cfg_.seq);
  warn_if_warmup_outlasts_run(cfg_.schedule);
  // The step's shape as a product equal to its tokens: with several ranks, theirs comes first.
  const std::string ranks = parallel_ ? cat(comm_.world(), " ranks x ") : "";
  log::info("training ", cfg_.model.name, " (", cfg_.model.parameter_count(), " parameters) for ",
            cfg_.steps, " steps of ", cfg_.batch_tokens, " tokens (", ranks, data_.accum, " x ",
            cfg_.micro_batch, " x ", cfg_.seq, "), ", num_threads(), " threads, ",
            data_.loader.tokens_per_epoch(), " tokens per epoch; peak ", peak_ / 1e9, " GFLOP/s",
            cfg_.peak_flops > 0 ? "" : " (measured)");
  if (parallel_) {
    log::info("data parallel over ", comm_.world(), " ranks (", comm_.topology().launcher,
              nccl ? ", NCCL on one GPU each" : "", "): ", optimizer_.reducer()->buckets().size(),
              " gradient buckets of up to ", cfg_.bucket_mb, " MiB, optimizer state ",
              optimizer_.sharded() ? "sharded (ZeRO-1)" : "replicated", ", ",
              optimizer_.state_bytes(), " bytes on rank 0");
    log::info("ranks: ", comm_.placement());
  }
  if (dp_) {
    const int64_t left = cfg_.steps - counters_.step;
    log::info("DP-SGD: each of ", data_.loader.windows_total(), " sequences sampled with ",
              "probability ", dp_->sampling_rate(), " per step, clipped to ", dp_->options().clip,
              ", noise multiplier ", dp_->noise_multiplier(),
              cfg_.privacy.target_epsilon > 0 ? " (calibrated)" : "", "; epsilon ",
              dp_->epsilon().epsilon, " now, ", dp_->epsilon_after(left).epsilon, " after ", left,
              " more steps, at delta ", dp_->delta(),
              automatic_clip_method(cfg_.model, cfg_.seq) == ClipMethod::batched
                  ? "; each sequence's gradient clipped in passes of train.micro_batch sequences"
                  : "; each sequence's gradient computed and clipped in a pass of its own");
  }
}

TrainResult TrainingRun::run() {
  run_start_ = Clock::now();
  obs::Progress progress("train", cfg_.steps, counters_.step,
                         o_.quiet || !lead_ ? (int64_t{1} << 62) : cfg_.log_interval);
  bool stopped = false;
  const FailedSummaryOnError failed(cfg_.dir, counters_, cfg_.steps, lead_);
  while (!stopped && counters_.step < cfg_.steps) stopped = !step(progress);
  progress.finish();
  return finish(stopped);
}

bool TrainingRun::step(obs::Progress& progress) {
  const int64_t& step = counters_.step;
  inject_fault_at(o_.fault, comm_.rank(), step + 1, optimizer_.reducer());
  const auto t0 = Clock::now();
  const double lr = optim::lr_at(cfg_.schedule, step);
  // Several ranks agree on stopping at the start of a step (a signal reaches each at its own
  // moment); one process decides after the step, as it always has.
  bool stop_all = stop_requested() || (o_.stop_after >= 0 && steps_here_ + 1 >= o_.stop_after);
  double reduce_wait = 0;
  AccumulatedLoss acc;
  std::optional<PrivateGradient> dp;
  if (dp_) {
    dp = private_gradients(model_, data_.loader, *dp_, step + 1, cfg_.micro_batch,
                           optimizer_.reducer());
    reduce_wait = dp->reduce_wait_s;
    // Accounted on disk before anything the step changes is seen.
    if (lead_) write_file_atomic(cfg_.dir / kPrivacyLedger, dp_->state().dump() + "\n");
    acc = dp->loss;
    if (parallel_) {  // the ranks stop together, as accumulate_gradients has them agree
      double stopping[1] = {stop_all ? 1.0 : 0.0};
      comm_.all_reduce_sum(stopping, "whether a rank stops");
      stop_all = stopping[0] > 0;
    }
  } else {
    std::vector<model::Batch> micro;
    micro.reserve(static_cast<size_t>(data_.accum));
    for (int64_t i = 0; i < data_.accum; ++i) micro.push_back(data_.loader.next());
    acc = parallel_ ? accumulate_gradients(model_, micro, comm_, *optimizer_.reducer(), stop_all,
                                           reduce_wait)
                    : accumulate_gradients(model_, micro);
  }
  // A step whose windows hold no target has no loss: that is the data (documents of one token,
  // each target a document's start), not a diverging run to stop after max_bad_steps.
  POLLEN_CHECK(dp || acc.scored > 0, "step ", step + 1, ": its batch holds no target to score ",
               "(every target is the first token of a document: documents of one token?); ",
               "check data.manifests");
  // A DP-SGD sample may score nothing: its gradient, noise alone, is still the step's.
  const int64_t step_tokens = dp ? dp->rows * cfg_.seq : cfg_.batch_tokens;
  double gnorm = NAN;
  // Under DP-SGD a step is skipped only when the noised gradient is not finite: one sequence's
  // non-finite loss left its gradient out and must not decide it.
  bool good = dp || std::isfinite(acc.loss);
  if (good) {
    gnorm = optimizer_.step(lr);
    good = std::isfinite(gnorm);  // AdamW leaves the weights alone then
    reduce_wait += optimizer_.last_wait_s();
  }
  optimizer_.zero_grad();
  if (device_ == Device::cuda) cuda::synchronize();  // the step's time includes its GPU work
  counters_.count_step(step_tokens, good, acc.loss, cfg_.max_bad_steps, progress);
  ++steps_here_;
  counters_.last_loss = acc.loss;
  const double dt = seconds_since(t0);
  reduce_wait_total_ += reduce_wait;
  step_time_total_ += dt;
  StepReport s;
  s.step = step;
  s.tokens = counters_.tokens;
  s.scored = acc.scored;
  s.loss = acc.loss;
  s.lr = lr;
  s.grad_norm = gnorm;
  s.tokens_per_s = static_cast<double>(step_tokens) / dt;
  // tokens_per_s is the whole job's and peak_ one rank's threads'.
  s.mfu = s.tokens_per_s * flops_per_token_ / (peak_ * comm_.world());
  s.elapsed_s = counters_.elapsed_before + seconds_since(run_start_);
  s.seconds = dt;
  s.reduce_wait_s = reduce_wait;
  s.good = good;
  s.dp = dp;
  if (dp_) s.epsilon = dp_->epsilon().epsilon;
  const double wall = obs::wall_time_now();
  if (metrics_) record_step(*metrics_, s, device_, comm_.world(), wall);
  if (counters_.bad_in_row >= cfg_.max_bad_steps) {
    progress.finish();
    if (metrics_) metrics_->jsonl.file().sync();
    result_.status = RunStatus::failed;
    result_.message =
        counters_.too_many_bad_steps(cfg_.max_bad_steps, last_checkpoint_, step, "model.init_from");
    return false;
  }
  const bool last = step == cfg_.steps;
  if ((cfg_.eval_interval > 0 && step % cfg_.eval_interval == 0) || last) evaluate(progress, wall);
  if (metrics_) metrics_->flush();
  char fields[160];
  std::snprintf(fields, sizeof(fields), "loss=%.4f lr=%.3g grad_norm=%.3g tok/s=%.0f mfu=%.3f",
                acc.loss, lr, gnorm, s.tokens_per_s, s.mfu);
  progress.update(step, fields);

  const bool preempt =
      parallel_ ? stop_all
                : stop_requested() || (o_.stop_after >= 0 && steps_here_ >= o_.stop_after);
  if (checkpoint_due(step, last, cfg_.checkpoint_interval, counters_.bad_in_row, preempt)) {
    progress.finish();
    save(step);
  }
  if (preempt && !last) {
    result_.status = RunStatus::preempted;
    result_.message = preempted_message(step, last_checkpoint_);
    return false;
  }
  return true;
}

void TrainingRun::evaluate(obs::Progress& progress, double wall) {
  const int64_t step = counters_.step;
  if (data_.validation.loader) {
    counters_.record_validation(
        validation_loss(model_, data_.validation, cfg_.eval_batches, parallel_ ? &comm_ : nullptr));
    nlohmann::ordered_json v;
    v["step"] = step;
    v["tokens"] = counters_.tokens;
    v["val_loss"] = json_number(counters_.last_val_loss);
    if (metrics_) {
      metrics_->jsonl.write(v);
      metrics_->scalar("val/loss", counters_.last_val_loss, step, wall);
    }
    progress.finish();
    log::info("step ", step, ": validation loss ", counters_.last_val_loss);
  }
  if (samples_.enabled()) {
    progress.finish();
    samples_.write(model_, step, counters_.tokens, metrics_->tb);
  }
}

void TrainingRun::save(int64_t at) {
  // ZeRO-1: every rank's blocks of the moments (and of the master weights in bf16), gathered
  // for rank 0 to write; the other ranks keep none of them.
  const TrainerOptimizer::Gathered gathered = optimizer_.gather_for_checkpoint(lead_);
  if (!lead_) {
    last_checkpoint_ = ckpt_root_ / io::checkpoint_name(at);
    return;
  }
  metrics_->sync();
  if (samples_.enabled()) samples_.file().sync();
  nlohmann::ordered_json st;
  counters_.save(st, seconds_since(run_start_));
  // The last step's loss is computed on the sample without noise: a private checkpoint leaves it
  // out (the guarantee covers checkpoints).
  if (dp_) st.erase("last_loss");
  st["loader"] = data_.loader.state().to_json();
  st["data_versions"] = data_versions_;
  if (dp_) st["privacy"] = dp_->state();
  st["rng"] = {{"seed", rng_.seed()}, {"offset", rng_.offset()}};
  st["metrics"] = metrics_->positions();
  if (samples_.enabled()) st["metrics"]["samples_bytes"] = samples_.file().position();
  const auto w = optimizer_.write_checkpoint(ckpt_root_, at, model_, gathered, st, config_toml_);
  last_checkpoint_ = w.dir;
  log_checkpoint_and_retain(ckpt_root_, at, w, cfg_.keep_checkpoints);
}

TrainResult TrainingRun::finish(bool stopped) {
  const int64_t step = counters_.step;
  TrainResult& r = result_;
  r.record(counters_, counters_.last_loss, counters_.last_val_loss, last_checkpoint_);
  if (auto done =
          already_finished(o_.resume, steps_here_, cfg_.dir, step, last_checkpoint_, comm_)) {
    if (metrics_) metrics_->tb.discard_if_unused();
    r.message = *done;
    return r;
  }
  const double total = counters_.elapsed_before + seconds_since(run_start_);
  nlohmann::ordered_json summary =
      run_summary(r.status, step, cfg_.steps, counters_, counters_.last_loss,
                  counters_.last_val_loss, total, last_checkpoint_);
  summary["tokens_per_s_this_process"] =
      std::round(static_cast<double>(steps_here_ * cfg_.batch_tokens) / seconds_since(run_start_));
  if (parallel_) {
    summary["ranks"] = comm_.world();
    summary["zero"] = cfg_.zero;
    summary["optimizer_state_bytes_per_rank"] = optimizer_.state_bytes_per_rank(comm_);
    summary["reduce_wait_frac"] =
        step_time_total_ > 0 ? std::round(reduce_wait_total_ / step_time_total_ * 1e4) / 1e4 : 0.0;
  }
  if (dp_) {
    summary["privacy"] = {{"epsilon", json_number(dp_->epsilon().epsilon)},
                          {"delta", dp_->delta()},
                          {"noise_multiplier", dp_->noise_multiplier()},
                          {"sampling_rate", dp_->sampling_rate()},
                          {"clip", dp_->options().clip},
                          {"private_steps", dp_->steps_accounted()}};
  }
  if (lead_) write_file_atomic(cfg_.dir / "summary.json", summary.dump(2) + "\n");
  if (!stopped) {
    r.message = finished_message(counters_, total, counters_.last_loss, counters_.last_val_loss,
                                 last_checkpoint_);
  }
  return r;
}

// What DP-SGD does not do yet, refused before anything runs.
void check_private_run(const TrainConfig& cfg) {
  POLLEN_CHECK(cfg.device == "cpu" && cfg.precision == "f32",
               "[privacy]: DP-SGD runs on the CPU in float32 so far; set run.device = \"cpu\" "
               "and run.precision = \"f32\" (got \"",
               cfg.device, "\" and \"", cfg.precision, "\")");
  POLLEN_CHECK(cfg.weights.empty(), "[privacy]: DP-SGD samples every sequence of the data with ",
               "the same probability, which data.weights would contradict; remove data.weights");
  // Evaluating on the very records trained on would publish a loss over them. A dataset is known
  // by its version (the SHA-256 of its manifest), not its path: another spelling of the path, a
  // link or a copy of the folder holds the same records.
  if (cfg.validation_split.empty() || cfg.validation_split != cfg.train_split) return;
  std::set<std::string> trained;
  for (const auto& m : cfg.manifests) trained.insert(data::dataset_version(m));
  for (const auto& m : cfg.validation_manifests)
    POLLEN_CHECK(!trained.contains(data::dataset_version(m)), "[privacy]: data.validation_split '",
                 cfg.validation_split, "' of '", m,
                 "' is a training split of the same dataset: its loss would describe the "
                 "protected records; evaluate on a held-out split");
}

// Every manifest trained or evaluated on fits the model's vocabulary, and the validation data
// speaks the training data's ids; checked before step 0, not at the first evaluation.
void check_manifests_fit(const TrainConfig& cfg) {
  const data::Manifest first = data::Manifest::load(cfg.manifests.front());
  const auto fits = [&](const data::Manifest& man, const char* key) {
    POLLEN_CHECK(man.vocab_size <= cfg.model.vocab_size, key, ": manifest '", man.path.string(),
                 "' has vocab_size ", man.vocab_size, " but model '", cfg.model.name,
                 "' has vocab_size ", cfg.model.vocab_size);
  };
  for (const auto& m : cfg.manifests) fits(data::Manifest::load(m), "data.manifests");
  if (cfg.validation_split.empty()) return;
  for (const auto& m : cfg.validation_manifests) {
    const data::Manifest man = data::Manifest::load(m);
    fits(man, "data.validation_manifests");
    data::check_same_tokens(first, man);
  }
}

TrainResult train_run(const TrainConfig& given, const TrainOptions& o) {
  SignalGuard signals(o.handle_signals);
  dist::SingleProcess alone;
  dist::Communicator& comm = o.comm ? *o.comm : alone;
  set_num_threads(given.threads > 0 ? given.threads : comm.threads_per_rank());
  // The thread count used, not run.threads = 0 ("all"): the checkpoints record it, and a resume
  // compares what ran (a thread count changes the float sums, so the run only to rounding).
  TrainConfig cfg = given;
  cfg.threads = num_threads();
  fs::path ckpt_root = check_run_dir(cfg.dir, o.resume);
  if (cfg.privacy.enabled) check_private_run(cfg);
  check_manifests_fit(cfg);

  // model.init_from: its weights, the optimizer fresh. A run resumed from a checkpoint takes the
  // checkpoint's weights (resume() loads one or refuses to start when none verifies), so
  // init_from is not read then: it may be gone, a warm-up run's checkpoint it kept no longer.
  const bool from_checkpoint = o.resume && !io::list_checkpoints(ckpt_root).empty();
  model::Llama model = cfg.init_from.empty() || from_checkpoint
                           ? model::Llama(cfg.model, cfg.seed)
                           : io::load_initial_weights(cfg.init_from, cfg.model, "model.init_from");
  model.set_recompute(cfg.recompute);
  const Device device = parse_device(cfg.device);
  // Several ranks on GPUs: one GPU per rank (its local rank), gradients reduced by NCCL.
  std::unique_ptr<dist::NcclCommunicator> gpu_comm;
  if (device == Device::cuda) {
    if (comm.world() > 1) gpu_comm = std::make_unique<dist::NcclCommunicator>(comm, cfg.timeout_s);
    POLLEN_CHECK(cfg.sample_prompts.empty(),
                 "run.device = \"cuda\": [samples] generates on the "
                 "CPU only so far; remove samples.prompts for a GPU run");
  }
  model.to(device);  // the optimizer below allocates its state where the parameters are
  // One job at a time writes the folder (its rank 0 holds the lock): a second launch with
  // --resume while the first still runs is refused rather than interleaved with it.
  std::optional<FolderLock> lock;
  if (comm.rank() == 0) lock.emplace(cfg.dir, "run.dir");
  fs::create_directories(cfg.dir);
  // Several ranks: gradients reduced by NCCL on GPUs, else over the job's communicator.
  dist::Communicator* reduce_over = comm.world() == 1 ? nullptr : gpu_comm ? gpu_comm.get() : &comm;
  TrainerOptimizer optimizer(cfg, model.named_parameters(), reduce_over);
  TrainData data = open_train_data(cfg, comm);

  TrainingRun run(cfg, o, comm, std::move(ckpt_root), model, device, optimizer, data);
  if (o.resume) run.resume();
  run.recover_privacy();
  run.open_outputs();
  run.log_start(gpu_comm != nullptr);
  return run.run();
}

}  // namespace

TrainResult run_training(const TrainConfig& cfg, const TrainOptions& o) {
  try {
    return train_run(cfg, o);
  } catch (const dist::PeerFailure& e) {
    return rank_failed_result(e.what(), cfg.dir);
  }
}

}  // namespace pollen::train
