#include "train/trainer.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <thread>

#include "autograd/tape.h"
#include "base/files.h"
#include "base/log.h"
#include "base/rng.h"
#include "base/thread_pool.h"
#include "data/loader.h"
#include "data/shards.h"
#include "dist/nccl_communicator.h"
#include "dist/zero_adamw.h"
#include "io/checkpoint.h"
#include "io/model_source.h"
#include "obs/metrics.h"
#include "obs/progress.h"
#include "ops/gemm.h"
#include "tensor/cuda_memory.h"
#include "train/run_control.h"
#include "train/samples.h"

namespace fs = std::filesystem;

namespace pollen::train {
namespace {

// Mean validation loss over `batches` batches; with several ranks each evaluates every
// world-th batch and the sums are reduced, so the result is the single process's.
double evaluate(const model::Llama& model, data::Loader& loader, const data::LoaderState& start,
                int64_t batches, dist::Communicator* comm) {
  ag::NoGrad no_grad;
  loader.restore(start);  // the same validation batches at every evaluation
  const int64_t rank = comm ? comm->rank() : 0, world = comm ? comm->world() : 1;
  double sums[2] = {0, 0};  // loss, scored tokens
  for (int64_t i = 0; i < batches; ++i) {
    const model::Batch b = loader.next();
    if (i % world != rank) continue;
    int64_t n = 0;
    const ag::Var l = model.loss(b, ag::Reduction::sum, &n);
    sums[0] += l.value().item();
    sums[1] += static_cast<double>(n);
  }
  if (comm) comm->all_reduce_sum(sums, "the validation loss");
  return sums[1] > 0 ? sums[0] / sums[1] : NAN;
}

}  // namespace

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

FaultInjection parse_fault_injection(const std::string& text) {
  FaultInjection f;
  if (text.empty()) return f;
  const auto a = text.find(':'), b = text.rfind(':');
  const std::string kind = text.substr(0, a);
  try {
    POLLEN_CHECK(
        a != std::string::npos && b != a && (kind == "kill" || kind == "hang" || kind == "error"),
        "");
    size_t used = 0;
    f.rank = std::stoi(text.substr(a + 1, b - a - 1), &used);
    POLLEN_CHECK(used == b - a - 1, "");
    f.step = std::stoll(text.substr(b + 1), &used);
    POLLEN_CHECK(used == text.size() - b - 1 && f.rank >= 0 && f.step >= 1, "");
  } catch (const std::exception&) {
    fail("POLLEN_FAULT_INJECT='", text,
         "': expected kill:RANK:STEP, hang:RANK:STEP or error:RANK:STEP");
  }
  f.kind = kind == "kill"   ? FaultInjection::Kind::kill
           : kind == "hang" ? FaultInjection::Kind::hang
                            : FaultInjection::Kind::error;
  return f;
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

void inject_fault_at(const FaultInjection& f, int rank, int64_t step) {
  if (f.kind == FaultInjection::Kind::none || f.rank != rank || f.step != step) return;
  if (f.kind == FaultInjection::Kind::error)
    fail("rank ", f.rank, ": POLLEN_FAULT_INJECT: an error before step ", f.step);
  log::warn("rank ", f.rank,
            ": POLLEN_FAULT_INJECT: ", f.kind == FaultInjection::Kind::kill ? "dying" : "hanging",
            " before step ", f.step);
  if (f.kind == FaultInjection::Kind::kill) ::raise(SIGKILL);
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

namespace {

TrainResult train_run(const TrainConfig& cfg, const TrainOptions& o) {
  SignalGuard signals(o.handle_signals);
  dist::SingleProcess alone;
  dist::Communicator& comm = o.comm ? *o.comm : alone;
  const bool parallel = comm.world() > 1, lead = comm.rank() == 0;
  set_num_threads(cfg.threads > 0 ? cfg.threads : threads_per_rank(comm.topology().local_world));
  const fs::path ckpt_root = check_run_dir(cfg.dir, o.resume);
  for (const auto& m : cfg.manifests) {
    const auto man = data::Manifest::load(m);
    POLLEN_CHECK(man.vocab_size <= cfg.model.vocab_size, "data manifest '", m, "' has vocab_size ",
                 man.vocab_size, " but model '", cfg.model.name, "' has vocab_size ",
                 cfg.model.vocab_size);
  }

  // model.init_from: its weights, the optimizer fresh (a resumed run's checkpoint replaces them).
  model::Llama model = cfg.init_from.empty()
                           ? model::Llama(cfg.model, cfg.seed)
                           : io::load_initial_weights(cfg.init_from, cfg.model, "model.init_from");
  model.set_recompute(cfg.recompute);
  const Device device = parse_device(cfg.device);
  // Several ranks on GPUs: one GPU per rank (its local rank), gradients reduced by NCCL.
  std::unique_ptr<dist::NcclCommunicator> gpu_comm;
  if (device == Device::cuda) {
    if (parallel) gpu_comm = std::make_unique<dist::NcclCommunicator>(comm, cfg.timeout_s);
    POLLEN_CHECK(cfg.sample_prompts.empty(),
                 "run.device = \"cuda\": [samples] generates on the "
                 "CPU only so far; remove samples.prompts for a GPU run");
  }
  model.to(device);  // the optimizer below allocates its state where the parameters are
  fs::create_directories(cfg.dir);
  const auto named = model.named_parameters();
  std::vector<ag::Var> params;
  for (const auto& [n, v] : named) params.push_back(v);
  optim::AdamWOptions ao;
  ao.lr = cfg.lr;
  ao.beta1 = cfg.beta1;
  ao.beta2 = cfg.beta2;
  ao.eps = cfg.eps;
  ao.weight_decay = cfg.weight_decay;
  ao.max_grad_norm = cfg.grad_clip;
  // Several ranks: gradients reduced in buckets; with parallel.zero = 1 the optimizer's state
  // is sharded (ZeRO-1), else every rank holds all of it.
  std::unique_ptr<dist::GradReducer> reducer;
  std::unique_ptr<dist::ZeroAdamW> zero;
  std::optional<optim::AdamW> opt;
  if (parallel) {
    reducer = std::make_unique<dist::GradReducer>(
        gpu_comm ? *gpu_comm : comm, params, static_cast<int64_t>(cfg.bucket_mb * 1048576.0),
        cfg.zero == 1 ? dist::ReduceMode::reduce_scatter : dist::ReduceMode::all_reduce);
  }
  if (reducer && cfg.zero == 1) {
    zero = std::make_unique<dist::ZeroAdamW>(*reducer, ao, decay_mask(named, cfg.no_decay));
    if (cfg.precision == "bf16") zero->compute_in_bf16();  // master blocks sharded too
  } else {
    opt.emplace(params, ao, decay_mask(named, cfg.no_decay));
    if (cfg.precision == "bf16") opt->compute_in_bf16();  // on the GPU: the config requires it
  }
  auto optimizer_step = [&](double lr) { return zero ? zero->step(lr) : opt->step(lr); };
  auto optimizer_state_bytes = [&] {
    if (zero) return zero->state_bytes();
    int64_t bytes = 0;
    for (const auto& slot : opt->slots())
      bytes += static_cast<int64_t>(slot.exp_avg.nbytes() + slot.exp_avg_sq.nbytes());
    return bytes;
  };
  // ZeRO-1: the whole f32 weights and moments are read on every rank, which keeps its blocks.
  auto load = [&](const fs::path& dir) {
    if (!zero) return load_checkpoint(dir, model, *opt);
    std::vector<Tensor> weights;
    std::vector<std::pair<std::string, Tensor>> into;
    OptimizerMoments m;
    for (const auto& [name, p] : named) {
      weights.push_back(Tensor::empty(p.shape(), DType::f32));
      into.emplace_back(name, weights.back());
      m.exp_avg.push_back(Tensor::empty(p.shape(), DType::f32));
      m.exp_avg_sq.push_back(Tensor::empty(p.shape(), DType::f32));
    }
    load_checkpoint_tensors(dir / "model.safetensors", into);
    load_optimizer_moments(dir, named, m);
    zero->load_weights(weights);
    zero->load_state(m.exp_avg, m.exp_avg_sq);
    zero->set_steps_taken(m.steps);
  };

  // Each micro-step reads micro_batch rows on every rank: one global micro-batch of
  // micro_batch x ranks rows, split by rank; a step is the same global batch at any world size.
  const int64_t global_rows = cfg.micro_batch * comm.world();
  POLLEN_CHECK(cfg.batch_tokens % (global_rows * cfg.seq) == 0, "train.batch_tokens (",
               cfg.batch_tokens, ") is not a multiple of micro_batch * seq * ranks (",
               cfg.micro_batch, " * ", cfg.seq, " * ", comm.world(),
               "): each rank reads micro_batch rows per micro-step");
  const int64_t accum = cfg.batch_tokens / (global_rows * cfg.seq);

  data::LoaderOptions lo;
  for (const auto& m : cfg.manifests) lo.manifests.emplace_back(m);
  lo.weights = cfg.weights;
  lo.split = cfg.train_split;
  lo.batch = global_rows;
  lo.step_batch = global_rows * accum;  // batch_tokens / seq, the same at any world size
  lo.seq = cfg.seq;
  lo.seed = cfg.seed;
  lo.rank = comm.rank();
  lo.world = comm.world();
  data::Loader loader(lo);

  std::unique_ptr<data::Loader> val_loader;
  data::LoaderState val_start;
  if (!cfg.validation_split.empty() && cfg.eval_batches > 0) {
    data::LoaderOptions vo = lo;
    vo.batch = cfg.micro_batch;  // every rank reads every batch and scores its share of them
    vo.step_batch = 0;
    vo.rank = 0;
    vo.world = 1;
    vo.manifests.clear();
    for (const auto& m : cfg.validation_manifests) vo.manifests.emplace_back(m);
    vo.weights = cfg.validation_manifests == cfg.manifests ? cfg.weights : std::vector<double>{};
    vo.split = cfg.validation_split;
    try {
      val_loader = std::make_unique<data::Loader>(vo);
      if (val_loader->windows_per_epoch() < cfg.micro_batch) {
        log::warn("validation split '", cfg.validation_split, "' has ",
                  val_loader->windows_per_epoch(), " windows of ", cfg.seq + 1,
                  " tokens, fewer than one micro-batch: no evaluation");
        val_loader.reset();
      } else {
        val_start = val_loader->state();
      }
    } catch (const Error& e) {
      log::warn("no evaluation: ", e.what());
      val_loader.reset();
    }
    // Evaluation is a collective: it runs only if every rank has the validation data (one rank
    // that cannot read it would leave the others' reductions paired with the wrong ones).
    if (parallel) {
      double ranks_with_data[1] = {val_loader ? 1.0 : 0.0};
      comm.all_reduce_sum(ranks_with_data, "whether every rank has validation data");
      if (ranks_with_data[0] < comm.world() && val_loader) {
        log::warn("no evaluation: ", comm.world() - static_cast<int>(ranks_with_data[0]),
                  " rank(s) could not read validation split '", cfg.validation_split, "'");
        val_loader.reset();
      }
    }
  }

  LoopCounters counters;
  std::optional<nlohmann::ordered_json> state;  // the resumed checkpoint's
  std::optional<uint64_t> samples_at = 0;
  Rng rng(cfg.seed);
  fs::path last_checkpoint;
  if (o.resume) {
    // Rank 0 chooses the checkpoint and tells the others: {step or -1 for none, skipped}.
    int64_t choice_of_lead[2] = {-1, 0};
    if (lead) {
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
    } else {
      const fs::path dir = ckpt_root / io::checkpoint_name(chosen);
      // Relative paths in a config.toml of an older pollen were relative to the folder it ran
      // from: resumed from there, they compare equal to today's absolute ones.
      const TrainConfig saved = parse_train_config(
          read_file(dir / "config.toml"), (dir / "config.toml").string(), {}, fs::current_path());
      for (const auto& w : check_resume_compatible(saved, cfg)) log::warn("resume: ", w);
      load(dir);
      state = nlohmann::ordered_json::parse(read_file(dir / "state.json"));
      const nlohmann::ordered_json& st = *state;
      counters.restore(st);
      loader.restore(data::LoaderState::from_json(nlohmann::json(st.at("loader"))));
      rng = Rng(st.at("rng").at("seed").get<uint64_t>(), st.at("rng").at("offset").get<uint64_t>());
      // Checkpoints written before samples were turned on have no position: append.
      samples_at = st.at("metrics").contains("samples_bytes")
                       ? std::optional(st.at("metrics").at("samples_bytes").get<uint64_t>())
                       : std::nullopt;
      last_checkpoint = dir;
      log::info("resuming from '", dir.string(), "' at step ", counters.step, " (", counters.tokens,
                " tokens)");
    }
  }

  // Rank 0 writes the run's files (metrics, config, checkpoints, summary); every rank holds the
  // same weights and loader state.
  std::optional<RunMetrics> metrics;
  if (lead)
    metrics = RunMetrics::open(cfg.dir, cfg.tensorboard, state ? &state->at("metrics") : nullptr,
                               counters.step);
  SampleWriter samples;
  if (!cfg.sample_prompts.empty() && lead) samples = SampleWriter(cfg, samples_at);
  const std::string config_toml = cfg.to_toml();
  if (lead) write_file_atomic(cfg.dir / "config.toml", config_toml);

  const double peak =
      cfg.peak_flops > 0
          ? cfg.peak_flops
          : measure_peak_flops(device, cfg.precision == "bf16" ? DType::bf16 : DType::f32);
  const double flops_per_token = cfg.model.flops_per_token(cfg.seq);
  // The step's shape as a product equal to its tokens: with several ranks, theirs comes first.
  const std::string ranks = parallel ? cat(comm.world(), " ranks x ") : "";
  log::info("training ", cfg.model.name, " (", cfg.model.parameter_count(), " parameters) for ",
            cfg.steps, " steps of ", cfg.batch_tokens, " tokens (", ranks, accum, " x ",
            cfg.micro_batch, " x ", cfg.seq, "), ", num_threads(), " threads, ",
            loader.tokens_per_epoch(), " tokens per epoch; peak ", peak / 1e9, " GFLOP/s",
            cfg.peak_flops > 0 ? "" : " (measured)");
  if (parallel) {
    log::info("data parallel over ", comm.world(), " ranks (", comm.topology().launcher,
              gpu_comm ? ", NCCL on one GPU each" : "", "): ", reducer->buckets().size(),
              " gradient buckets of up to ", cfg.bucket_mb, " MiB, optimizer state ",
              zero ? "sharded (ZeRO-1)" : "replicated", ", ", optimizer_state_bytes(),
              " bytes on rank 0");
    log::info("ranks: ", comm.placement());
  }

  const auto run_start = Clock::now();
  auto save = [&](int64_t at) {
    // ZeRO-1: every rank's blocks of the moments (and of the master weights in bf16), gathered
    // for rank 0 to write; the other ranks keep none of them.
    OptimizerMoments gathered;
    CheckpointTensors weights{"model.safetensors", {}};
    std::vector<std::string> trained;
    if (zero) {
      zero->gather_state(gathered.exp_avg, gathered.exp_avg_sq, lead);
      gathered.steps = zero->steps_taken();
      const std::vector<Tensor> whole = zero->gather_weights(lead);
      for (size_t i = 0; i < named.size(); ++i) {
        weights.tensors.emplace_back(named[i].first, whole[i]);
        trained.push_back(named[i].first);
      }
    }
    if (!lead) {
      last_checkpoint = ckpt_root / io::checkpoint_name(at);
      return;
    }
    metrics->sync();
    if (samples.enabled()) samples.file().sync();
    nlohmann::ordered_json st;
    counters.save(st, seconds_since(run_start));
    st["loader"] = loader.state().to_json();
    st["rng"] = {{"seed", rng.seed()}, {"offset", rng.offset()}};
    st["metrics"] = metrics->positions();
    if (samples.enabled()) st["metrics"]["samples_bytes"] = samples.file().position();
    const auto w =
        zero ? write_checkpoint(ckpt_root, at, {weights}, trained, gathered, st, config_toml, {})
             : write_checkpoint(ckpt_root, at, model, *opt, st, config_toml);
    last_checkpoint = w.dir;
    log_checkpoint_and_retain(ckpt_root, at, w, cfg.keep_checkpoints);
  };

  TrainResult r;
  const int64_t& step = counters.step;
  obs::Progress progress("train", cfg.steps, step,
                         o.quiet || !lead ? (int64_t{1} << 62) : cfg.log_interval);
  double reduce_wait_total = 0, step_time_total = 0;
  int64_t steps_here = 0;
  double last_val = NAN, last_loss = NAN;
  bool stopped = false;
  while (step < cfg.steps) {
    inject_fault_at(o.fault, comm.rank(), step + 1);
    const auto t0 = Clock::now();
    const double lr = optim::lr_at(cfg.schedule, step);
    std::vector<model::Batch> micro;
    micro.reserve(static_cast<size_t>(accum));
    for (int64_t i = 0; i < accum; ++i) micro.push_back(loader.next());
    // Several ranks agree on stopping at the start of a step (a signal reaches each at its own
    // moment); one process decides after the step, as it always has.
    bool stop_all = stop_requested() || (o.stop_after >= 0 && steps_here + 1 >= o.stop_after);
    double reduce_wait = 0;
    const AccumulatedLoss acc =
        parallel ? accumulate_gradients(model, micro, comm, *reducer, stop_all, reduce_wait)
                 : accumulate_gradients(model, micro);
    double gnorm = NAN;
    bool good = std::isfinite(acc.loss);
    if (good) {
      gnorm = optimizer_step(lr);
      good = std::isfinite(gnorm);  // AdamW leaves the weights alone then
      if (zero) reduce_wait += zero->last_wait_s();
    }
    for (auto& p : params) p.zero_grad();
    if (device == Device::cuda) cuda::synchronize();  // the step's time includes its GPU work
    counters.count_step(cfg.batch_tokens, good, acc.loss, cfg.max_bad_steps, progress);
    ++steps_here;
    last_loss = acc.loss;
    const double dt = seconds_since(t0);
    reduce_wait_total += reduce_wait;
    step_time_total += dt;
    const double elapsed = counters.elapsed_before + seconds_since(run_start);
    const double tps = static_cast<double>(cfg.batch_tokens) / dt;
    const double mfu = tps * flops_per_token / peak;
    const double wall = obs::wall_time_now();
    nlohmann::ordered_json rec;
    rec["step"] = step;
    rec["tokens"] = counters.tokens;
    rec["loss"] = json_number(acc.loss);
    rec["lr"] = lr;
    rec["grad_norm"] = json_number(gnorm);
    rec["scored"] = acc.scored;
    rec["tokens_per_s"] = std::round(tps * 10) / 10;
    rec["mfu"] = std::round(mfu * 1e5) / 1e5;
    rec["elapsed_s"] = std::round(elapsed * 1000) / 1000;
    rec["rss_mb"] = std::round(rss_mb() * 10) / 10;
    if (device == Device::cuda) {  // the GPU allocator's peak of bytes in use so far
      const double peak_bytes =
          static_cast<double>(CudaAllocator::instance().stats().peak_in_use_bytes);
      rec["gpu_peak_mb"] = std::round(peak_bytes / 1048576.0 * 10) / 10;
    }
    if (parallel) {
      rec["ranks"] = comm.world();
      rec["tokens_per_s_per_rank"] = std::round(tps / comm.world() * 10) / 10;
      rec["reduce_wait_s"] = std::round(reduce_wait * 1e5) / 1e5;
      rec["reduce_wait_frac"] = std::round(reduce_wait / dt * 1e4) / 1e4;
    }
    if (!good) rec["skipped"] = true;
    if (metrics) {
      metrics->jsonl.write(rec);
      metrics->scalar("train/loss", acc.loss, step, wall);
      metrics->scalar("train/lr", lr, step, wall);
      metrics->scalar("train/grad_norm", gnorm, step, wall);
      metrics->scalar("perf/tokens_per_s", tps, step, wall);
      metrics->scalar("perf/mfu", mfu, step, wall);
      metrics->scalar("sys/rss_mb", rss_mb(), step, wall);
    }
    if (counters.bad_in_row >= cfg.max_bad_steps) {
      progress.finish();
      if (metrics) metrics->jsonl.file().sync();
      r.status = RunStatus::failed;
      r.message = counters.too_many_bad_steps(cfg.max_bad_steps, last_checkpoint);
      stopped = true;
      break;
    }
    const bool last = step == cfg.steps;
    const bool eval_now = (cfg.eval_interval > 0 && step % cfg.eval_interval == 0) || last;
    if (val_loader && eval_now) {
      last_val =
          evaluate(model, *val_loader, val_start, cfg.eval_batches, parallel ? &comm : nullptr);
      nlohmann::ordered_json v;
      v["step"] = step;
      v["tokens"] = counters.tokens;
      v["val_loss"] = json_number(last_val);
      if (metrics) {
        metrics->jsonl.write(v);
        metrics->scalar("val/loss", last_val, step, wall);
      }
      progress.finish();
      log::info("step ", step, ": validation loss ", last_val);
    }
    if (samples.enabled() && eval_now) {
      progress.finish();
      samples.write(model, step, counters.tokens, metrics->tb);
    }
    if (metrics) metrics->flush();
    char fields[160];
    std::snprintf(fields, sizeof(fields), "loss=%.4f lr=%.3g grad_norm=%.3g tok/s=%.0f mfu=%.3f",
                  acc.loss, lr, gnorm, tps, mfu);
    progress.update(step, fields);

    const bool preempt =
        parallel ? stop_all : stop_requested() || (o.stop_after >= 0 && steps_here >= o.stop_after);
    if (checkpoint_due(step, last, cfg.checkpoint_interval, counters.bad_in_row, preempt)) {
      progress.finish();
      save(step);
    }
    if (preempt && !last) {
      r.status = RunStatus::preempted;
      r.message = preempted_message(step, last_checkpoint);
      stopped = true;
      break;
    }
  }
  progress.finish();
  r.step = step;
  r.tokens = counters.tokens;
  r.skipped_steps = counters.skipped;
  r.last_loss = last_loss;
  r.last_val_loss = last_val;
  r.last_checkpoint = last_checkpoint;
  if (auto done = already_finished(o.resume, steps_here, cfg.dir, step, last_checkpoint)) {
    r.message = *done;
    return r;
  }
  const double total = counters.elapsed_before + seconds_since(run_start);
  nlohmann::ordered_json summary =
      run_summary(r.status, step, cfg.steps, counters, last_loss, last_val, total, last_checkpoint);
  summary["tokens_per_s_this_process"] =
      std::round(static_cast<double>(steps_here * cfg.batch_tokens) / seconds_since(run_start));
  if (parallel) {
    std::vector<double> state_bytes(static_cast<size_t>(comm.world()), 0.0);
    state_bytes[static_cast<size_t>(comm.rank())] = static_cast<double>(optimizer_state_bytes());
    comm.all_reduce_sum(state_bytes, "the optimizer state sizes");
    summary["ranks"] = comm.world();
    summary["zero"] = cfg.zero;
    summary["optimizer_state_bytes_per_rank"] = state_bytes;
    summary["reduce_wait_frac"] =
        step_time_total > 0 ? std::round(reduce_wait_total / step_time_total * 1e4) / 1e4 : 0.0;
  }
  if (lead) write_file_atomic(cfg.dir / "summary.json", summary.dump(2) + "\n");
  if (!stopped) {
    r.message = finished_message(counters, total, last_loss, last_val, last_checkpoint);
  }
  return r;
}

}  // namespace

TrainResult run_training(const TrainConfig& cfg, const TrainOptions& o) {
  try {
    return train_run(cfg, o);
  } catch (const dist::PeerFailure& e) {
    TrainResult r;
    r.status = RunStatus::rank_failed;
    r.message = cat(e.what(), "; stopping the job. Rerun it with --resume to continue from the ",
                    "last checkpoint under '", (cfg.dir / "checkpoints").string(), "'");
    return r;
  }
}

}  // namespace pollen::train
