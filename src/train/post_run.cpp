#include "train/post_run.h"

#include <algorithm>
#include <chrono>

#include "autograd/tape.h"
#include "base/config.h"
#include "base/files.h"
#include "base/folder_lock.h"
#include "base/log.h"
#include "base/thread_pool.h"
#include "io/checkpoint.h"
#include "io/peft.h"
#include "model/config.h"
#include "obs/metrics.h"
#include "obs/progress.h"
#include "optim/adamw.h"
#include "tokenizer/open.h"
#include "train/run_control.h"
#include "train/trainer_optimizer.h"

namespace fs = std::filesystem;

namespace pollen::train {
namespace {

// The objective's metrics under "<prefix><name>/<metric>".
void add_metrics(nlohmann::ordered_json& record, const std::string& prefix, const std::string& name,
                 const nlohmann::ordered_json& metrics) {
  for (const auto& [k, v] : metrics.items()) record[prefix + name + "/" + k] = v;
}

void add_scalars(RunMetrics& out, const std::string& prefix, const std::string& name,
                 const nlohmann::ordered_json& metrics, int64_t step, double wall) {
  for (const auto& [k, v] : metrics.items())
    if (v.is_number()) out.scalar(prefix + name + "/" + k, v.get<double>(), step, wall);
}

// An objective section's keys without sft.micro_batch and sft.accumulation, and a step's rows
// (their product; 4 x 1 when unset): a resume may group the same rows into other micro-batches,
// as a world size that does not divide the accumulation needs. The gradient, that of the mean
// over the step's scored tokens, stays the same to float rounding.
struct StepRows {
  std::vector<std::pair<std::string, std::string>> other_keys;
  int64_t micro_batch = 4, accumulation = 1;
  int64_t rows() const { return micro_batch * accumulation; }
};
StepRows step_rows(const std::vector<std::pair<std::string, std::string>>& keys) {
  StepRows s;
  for (const auto& [key, value] : keys) {
    if (key == "sft.micro_batch") {
      s.micro_batch = std::stoll(value);
    } else if (key == "sft.accumulation") {
      s.accumulation = std::stoll(value);
    } else {
      s.other_keys.emplace_back(key, value);
    }
  }
  return s;
}

// Without the template's special tokens its markup would be encoded as plain bytes: every example
// grows long and truncates, GRPO never sees an end of turn, and chat refuses the result.
void check_chat_markup(const PostConfig& cfg, const PostBase& b) {
  const std::vector<std::string> missing =
      tokenizer::missing_chat_markup(*b.tokenizer, b.chat_format.kind);
  if (missing.empty()) return;
  std::string names;
  for (const auto& m : missing) names += (names.empty() ? "" : ", ") + m;
  fail("config file '", cfg.source, "': the tokenizer '", b.tokenizer_path.string(),
       "' (model.tokenizer, or model.base's) lacks the special tokens ", names, " of the ",
       tokenizer::chat_template_name(b.chat_format.kind),
       " chat template (model.chat_template, or model.base's); train a tokenizer with them "
       "(pollen tokenizer train --special) or choose the template the tokenizer has");
}

// io::resolve_model of model.base, its errors naming the run file and the key.
io::ModelSource resolve_base_model(const PostConfig& cfg) {
  try {
    return io::resolve_model(cfg.base);
  } catch (const Error& e) {
    fail("config file '", cfg.source, "': model.base: ", e.what());
  }
}

}  // namespace

PostBase resolve_post_base(const PostConfig& cfg) {
  PostBase b;
  b.source = resolve_base_model(cfg);
  b.tokenizer_path = cfg.tokenizer;
  if (b.tokenizer_path.empty()) {
    POLLEN_CHECK(b.source.tokenizer.has_value(), "config file '", cfg.source, "': model.base '",
                 cfg.base, "' (", io::model_kind_name(b.source.kind),
                 ") has no tokenizer that goes with it; set model.tokenizer");
    b.tokenizer_path = *b.source.tokenizer;
  }
  try {
    b.tokenizer = std::make_shared<const tokenizer::Tokenizer>(
        tokenizer::open_tokenizer(b.tokenizer_path, ""));
  } catch (const Error& e) {
    fail("config file '", cfg.source,
         "': ", cfg.tokenizer.empty() ? "model.base's tokenizer" : "model.tokenizer", ": ",
         e.what());
  }
  POLLEN_CHECK(b.tokenizer->vocab_size() <= b.source.config.vocab_size, "config file '", cfg.source,
               "': the tokenizer '", b.tokenizer_path.string(), "' has ", b.tokenizer->vocab_size(),
               " ids but model.base '", cfg.base, "' only ", b.source.config.vocab_size);
  const std::string named =
      !cfg.chat_template.empty() ? cfg.chat_template : b.source.chat_template.value_or("");
  try {
    b.chat_format =
        tokenizer::choose_chat_format(io::tokenizer_config_dir(b.source, b.tokenizer_path), named);
  } catch (const Error& e) {
    fail("config file '", cfg.source, "': no chat template for model.base '", cfg.base, "' (",
         e.what(), "); set model.chat_template to \"chatml\" or \"llama3\"");
  }
  check_chat_markup(cfg, b);
  return b;
}

TrainedParameters trained_model_parameters(model::Llama& model, const LoraSettings& lora) {
  if (!lora.enabled) return {model.named_parameters(), nullptr};
  auto adapters = std::make_shared<model::Lora>(model.config(), lora.config);
  model.attach_lora(adapters);  // freezes the base
  return {adapters->named_parameters(), adapters};
}

std::string lora_checkpoint_config(const model::Lora& lora, const std::string& base) {
  return io::peft_config_json(lora.config(), base).dump(2) + "\n";
}

namespace {

// The config.toml of the checkpoint a run resumes from, read as this command's. A checkpoint of
// another command's run (an sft folder given to dpo) is refused naming both, rather than failing
// on the other objective's section as an unknown key.
PostConfig checkpoint_post_config(const PostConfig& cfg, const fs::path& checkpoint) {
  const fs::path file = checkpoint / "config.toml";
  const std::string text = read_file(file);
  const ConfigTable table = ConfigTable::parse(text, file.string());
  for (const char* other : {"sft", "dpo", "rm", "grpo"})
    POLLEN_CHECK(other == cfg.objective || !table.has(other), "run folder '", cfg.dir.string(),
                 "' holds a run of pollen ", other, " (checkpoint '", checkpoint.string(),
                 "'), not of pollen ", cfg.objective, ": choose another run.dir");
  // Relative paths of an older pollen's config.toml: the folder it ran from (as pollen train).
  return parse_post_config(text, file.string(), cfg.objective, {}, fs::current_path());
}

// model.base as this run uses it. A run folder stands for its newest checkpoint, which moves on
// while that run trains: the run pins the checkpoint it started from (its checkpoints name it as
// model.base), and a resumed run takes it again rather than whatever is newest now.
// `saved`: the config of the checkpoint a resumed run starts from.
std::string pinned_base(const PostConfig& cfg, const std::optional<PostConfig>& saved) {
  if (saved) {
    const fs::path pinned = fs::absolute(saved->base).lexically_normal();
    if (pinned.parent_path() == fs::absolute(fs::path(cfg.base) / "checkpoints").lexically_normal())
      return saved->base;
    if (saved->base == cfg.base) return cfg.base;  // a run begun before bases were pinned
  }
  return io::pinned_model_spec(cfg.base, resolve_base_model(cfg));
}

// A resumed full fine-tune takes its weights from the checkpoint, which also holds the base's
// architecture, tokenizer and chat template: a base that is gone since the run began (a pinned
// checkpoint retention removed, a folder moved) is read there instead. The run's config still
// names it.
PostBase resolve_resumed_base(const PostConfig& resolved, const std::string& named,
                              const fs::path& checkpoint) {
  const std::vector<std::string> presets = model::preset_names();
  if (std::find(presets.begin(), presets.end(), resolved.base) != presets.end() ||
      fs::exists(resolved.base))
    return resolve_post_base(resolved);
  log::warn_job(
      "resume: model.base '", named, "'",
      resolved.base == named ? "" : cat(" (pinned to '", resolved.base, "')"),
      " is gone; the architecture, tokenizer and chat template come from the checkpoint '",
      checkpoint.string(), "'");
  PostConfig from_checkpoint = resolved;
  from_checkpoint.base = checkpoint.string();
  return resolve_post_base(from_checkpoint);
}

PostResult post_train(const PostConfig& given, const PostOptions& o,
                      const ObjectiveFactory& make_objective) {
  SignalGuard signals(o.handle_signals);
  dist::SingleProcess alone;
  dist::Communicator& comm = o.comm ? *o.comm : alone;
  const bool lead = comm.rank() == 0;  // writes the run's files
  set_num_threads(given.threads > 0 ? given.threads : comm.threads_per_rank());
  // The thread count used, as in pollen train: checkpoints record it and a resume compares it.
  PostConfig cfg = given;
  cfg.threads = num_threads();
  const fs::path ckpt_root = check_run_dir(cfg.dir, o.resume);
  std::optional<FolderLock> lock;  // one job at a time writes the folder
  if (lead) lock.emplace(cfg.dir, "run.dir");
  fs::create_directories(cfg.dir);
  const std::optional<fs::path> resume_from =
      o.resume ? agree_on_checkpoint(ckpt_root, comm) : std::nullopt;

  std::optional<PostConfig> saved;
  if (resume_from) saved = checkpoint_post_config(cfg, *resume_from);
  PostConfig resolved = cfg;
  resolved.base = pinned_base(cfg, saved);
  // Adapters are trained on their base's weights, which only the pinned checkpoint holds.
  POLLEN_CHECK(
      !resume_from || !cfg.lora.enabled || resolved.base == cfg.base || fs::exists(resolved.base),
      "cannot resume: the run's adapters were trained on '", resolved.base,
      "', the checkpoint of model.base '", cfg.base,
      "' it was pinned to when it began, which is gone (the base run's retention, "
      "checkpoint.keep, may have removed it); a LoRA run needs those base weights: put "
      "that checkpoint back, or start a new run");
  const PostBase base = resume_from && !cfg.lora.enabled
                            ? resolve_resumed_base(resolved, cfg.base, *resume_from)
                            : resolve_post_base(resolved);
  const model::LlamaConfig& arch = base.source.config;
  // The checkpoints name the chat template the run used, also when it came from the base, so
  // that chat and serve on the result (and a run that starts from it) find it.
  if (resolved.chat_template.empty())
    resolved.chat_template = std::string(tokenizer::chat_template_name(base.chat_format.kind));
  const std::string config_toml = resolved.to_toml(arch);
  if (saved) {
    const fs::path file = *resume_from / "config.toml";
    POLLEN_CHECK(saved->architecture.has_value(), "'", file.string(), "' has no architecture");
    // Runs of an older pollen did not record the chat template.
    if (saved->chat_template.empty()) saved->chat_template = resolved.chat_template;
    // The objective's section may not change, a key added or removed included, but for the
    // same rows of a step grouped into other micro-batches.
    const StepRows before = step_rows(saved->objective_keys), now = step_rows(cfg.objective_keys);
    if (!changed_settings(saved->objective_keys, cfg.objective_keys).empty() &&
        changed_settings(before.other_keys, now.other_keys).empty() &&
        before.rows() == now.rows()) {
      if (before.micro_batch != now.micro_batch)  // not a default written out
        log::warn_job("resume: sft.micro_batch x sft.accumulation (", before.micro_batch, " x ",
                      before.accumulation, " -> ", now.micro_batch, " x ", now.accumulation,
                      "): a step's ", now.rows(),
                      " rows grouped into other micro-batches, the same training to float rounding",
                      cfg.lora.enabled && cfg.lora.config.dropout > 0
                          ? " (under other [lora] dropout masks)"
                          : "");
      saved->objective_keys = cfg.objective_keys;
    }
    for (const auto& w :
         check_resume_compatible(saved->flat(*saved->architecture), resolved.flat(arch),
                                 "docs/posttraining.md, 'Checkpoints and resuming'"))
      log::warn_job("resume: ", w);
    const std::string changed = changed_settings(saved->objective_keys, cfg.objective_keys);
    POLLEN_CHECK(changed.empty(), "cannot resume: [", cfg.objective,
                 "] differs from the checkpoint's: ", changed,
                 "; the objective's keys may not change in a resumed run (see ",
                 "docs/posttraining.md, 'Checkpoints and resuming')");
  }
  // A resumed run takes its weights from the checkpoint, not from the base; under LoRA the
  // checkpoint holds only the adapters and the base is loaded again.
  model::Llama model = resume_from && !cfg.lora.enabled
                           ? model::Llama(arch, cfg.seed)
                           : io::load_model(base.source, DType::f32, cfg.seed);
  // The base LoRA's adapters are trained on: a resumed run must find the same weights at the
  // base's path (adapters on other weights would train on silently).
  const std::string base_sha256 = cfg.lora.enabled ? model::weights_sha256(model) : "";
  TrainedParameters trained_params = trained_model_parameters(model, cfg.lora);
  auto& trained = trained_params.named;
  const std::shared_ptr<model::Lora> lora = trained_params.lora;

  const ObjectiveContext ctx{cfg.objective_section(),
                             cfg.base_dir,
                             base.tokenizer.get(),
                             base.chat_format,
                             cfg.seed,
                             arch.max_position_embeddings,
                             arch,
                             cfg.dir,
                             resolved.base,
                             io::model_stop_tokens(base.source, *base.tokenizer)};
  const std::unique_ptr<Objective> objective = make_objective(ctx);
  const std::string name = objective->name();
  if (!objective->uses_output_head()) {
    std::erase_if(trained, [&](const auto& named) {
      const std::string& n = named.first;
      return n == "lm_head.weight" ||
             (lora && model::Lora::base_weight_name(n) == "lm_head.weight");
    });
  }
  const auto extras = objective->extra_parameters();
  trained.insert(trained.end(), extras.begin(), extras.end());

  std::vector<ag::Var> params;
  for (const auto& [n, v] : trained) params.push_back(v);
  // Several ranks: each runs its share of a step, and the gradients are summed over the ranks
  // (with parallel.zero = 1 each rank keeps its blocks of AdamW's state alone).
  TrainerOptimizer opt(cfg.optimizer, cfg.grad_clip, cfg.zero, cfg.bucket_mb, false, trained,
                       comm.world() > 1 ? &comm : nullptr);
  if (opt.reducer()) objective->split_across(comm, *opt.reducer());

  // The weight files of a checkpoint: the whole model (or its adapters, A and B with PEFT's
  // names), and the objective's own parameters.
  auto weight_files = [&] {
    std::vector<CheckpointTensors> files{
        {lora ? "adapter_model.safetensors" : "model.safetensors", {}}};
    for (const auto& [n, v] : lora ? lora->named_tensors() : model.named_parameters())
      files[0].tensors.emplace_back(n, v.value());
    if (!extras.empty()) {
      files.push_back({"objective.safetensors", {}});
      for (const auto& [n, v] : extras) files[1].tensors.emplace_back(n, v.value());
    }
    return files;
  };

  LoopCounters counters;
  nlohmann::ordered_json state;  // the resumed checkpoint's
  fs::path last_checkpoint;
  if (resume_from) {
    const fs::path dir = *resume_from;
    for (const auto& f : weight_files()) load_checkpoint_tensors(dir / f.file, f.tensors);
    opt.load_moments(dir);
    state = nlohmann::ordered_json::parse(read_file(dir / "state.json"));
    const std::string saved_base = state.value("base_sha256", "");
    POLLEN_CHECK(saved_base.empty() || saved_base == base_sha256, "cannot resume: the base '",
                 resolved.base, "' holds other weights (SHA-256 ", base_sha256.substr(0, 16),
                 "..) than the checkpoint's adapters were trained on (", saved_base.substr(0, 16),
                 "..); put that base back or start a new run");
    counters.restore(state);
    POLLEN_CHECK(cfg.steps >= counters.step, "--resume: train.steps (", cfg.steps,
                 ") is below the step of checkpoint '", dir.string(), "' (", counters.step,
                 "): nothing is left to train; give train.steps of at least ", counters.step);
    objective->restore(state.at("objective"));
    last_checkpoint = dir;
    log::info("resuming from '", dir.string(), "' at step ", counters.step);
  }

  std::optional<RunMetrics> metrics;
  std::vector<std::pair<std::string, std::string>> texts;
  if (lead) {
    metrics = RunMetrics::open(cfg.dir, cfg.tensorboard,
                               resume_from ? &state.at("metrics") : nullptr, counters.step);
    mark_running(cfg.dir, counters.step, cfg.steps);
    write_file_atomic(cfg.dir / "config.toml", config_toml);
    // The tokenizer travels with every checkpoint, so that the checkpoint is a model on its own.
    tokenizer::save_tokenizer(*base.tokenizer, cfg.dir / "tokenizer.json");
    texts.emplace_back("tokenizer.json", read_file(cfg.dir / "tokenizer.json"));
    // The base the adapters were trained on: a run folder's pinned checkpoint, not the folder,
    // whose newest checkpoint moves on.
    if (lora)
      texts.emplace_back("adapter_config.json", lora_checkpoint_config(*lora, resolved.base));
  }

  int64_t trained_count = 0;
  for (const auto& p : params) trained_count += p.value().numel();
  log::info(name, ": ", arch.name, " from '", cfg.base, "' (", arch.parameter_count(),
            " parameters, ", trained_count, " trained) for ", cfg.steps, " steps, ", num_threads(),
            num_threads() == 1 ? " thread" : " threads",
            comm.world() > 1 ? cat(" on each of ", comm.world(), " ranks",
                                   opt.sharded() ? " (AdamW's state sharded: ZeRO-1)" : "")
                             : "",
            ", chat template ", tokenizer::chat_template_name(base.chat_format.kind));
  if (comm.world() > 1) log::info("ranks: ", comm.placement());
  if (lead) warn_if_warmup_outlasts_run(cfg.schedule);

  // The last step's and the last validation's loss and metrics: checkpointed, so that a resumed
  // run with no step left to take still reports them.
  double& last_loss = counters.last_loss;
  double& last_val = counters.last_val_loss;
  nlohmann::ordered_json last_metrics = nlohmann::ordered_json::object();
  nlohmann::ordered_json last_val_metrics = nlohmann::ordered_json::object();
  if (resume_from) {
    last_metrics = state.value("last_metrics", nlohmann::ordered_json::object());
    last_val_metrics = state.value("last_val_metrics", nlohmann::ordered_json::object());
  }

  const auto run_start = Clock::now();
  auto save = [&](int64_t at) {
    const OptimizerMoments moments = opt.moments(lead);  // gathered from every rank's blocks
    if (!lead) {
      last_checkpoint = ckpt_root / io::checkpoint_name(at);
      return;
    }
    metrics->sync();
    nlohmann::ordered_json st;
    counters.save(st, seconds_since(run_start));
    st["metrics"] = metrics->positions();
    st["objective"] = objective->state();
    if (!base_sha256.empty()) st["base_sha256"] = base_sha256;
    st["last_metrics"] = last_metrics;
    st["last_val_metrics"] = last_val_metrics;
    std::vector<std::string> names;
    for (const auto& [n, v] : trained) names.push_back(n);
    const auto w =
        write_checkpoint(ckpt_root, at, weight_files(), names, moments, st, config_toml, texts);
    last_checkpoint = w.dir;
    log_checkpoint_and_retain(ckpt_root, at, w, cfg.keep_checkpoints);
  };

  PostResult r;
  const int64_t& step = counters.step;
  obs::Progress progress(name, cfg.steps, step,
                         o.quiet || !lead ? (int64_t{1} << 62) : cfg.log_interval);
  int64_t steps_here = 0;
  // What the log lines show: the loss, or the objective's headline metric.
  const std::string headline = objective->headline_metric();
  const auto shown = [&](double loss, const nlohmann::ordered_json& values) {
    if (headline.empty()) return cat("loss ", loss);
    if (!values.contains(headline) || !values[headline].is_number()) return std::string();
    return cat(headline, " ", values[headline].get<double>());
  };
  const std::string no_validation = objective->no_validation_data();
  if (!no_validation.empty()) log::warn_job("no evaluation: ", no_validation);
  bool stopped = false;
  const FailedSummaryOnError failed(cfg.dir, counters, cfg.steps, lead);
  for (auto& p : params) p.zero_grad();
  while (step < cfg.steps) {
    inject_fault_at(o.fault, comm.rank(), step + 1, opt.reducer());
    const auto t0 = Clock::now();
    const double lr = optim::lr_at(cfg.schedule, step);
    if (lora) lora->set_dropout_step(static_cast<uint64_t>(step));
    const ObjectiveStep s = objective->train_step(model, step + 1);
    if (lora) lora->disable_dropout();
    double gnorm = NAN;
    bool good = std::isfinite(s.loss);
    if (good) {
      gnorm = opt.step(lr);
      good = std::isfinite(gnorm);  // AdamW leaves the weights alone then
    }
    for (auto& p : params) p.zero_grad();
    counters.count_step(s.tokens, good, s.loss, cfg.max_bad_steps, progress);
    ++steps_here;
    last_loss = s.loss;
    last_metrics = s.metrics;
    const double dt = seconds_since(t0);
    const double tps = static_cast<double>(s.tokens) / dt;
    const double wall = obs::wall_time_now();
    nlohmann::ordered_json rec;
    rec["step"] = step;
    rec["tokens"] = counters.tokens;
    rec["loss"] = json_number(s.loss);
    rec["lr"] = lr;
    rec["grad_norm"] = json_number(gnorm);
    add_metrics(rec, "", name, s.metrics);
    rec["tokens_per_s"] = std::round(tps * 10) / 10;
    rec["elapsed_s"] =
        std::round((counters.elapsed_before + seconds_since(run_start)) * 1000) / 1000;
    rec["rss_mb"] = std::round(rss_mb() * 10) / 10;
    if (!good) rec["skipped"] = true;
    if (metrics) {
      metrics->jsonl.write(rec);
      metrics->scalar("train/loss", s.loss, step, wall);
      metrics->scalar("train/lr", lr, step, wall);
      metrics->scalar("train/grad_norm", gnorm, step, wall);
      metrics->scalar("perf/tokens_per_s", tps, step, wall);
      metrics->scalar("sys/rss_mb", rss_mb(), step, wall);
      add_scalars(*metrics, "", name, s.metrics, step, wall);
    }
    if (counters.bad_in_row >= cfg.max_bad_steps) {
      progress.finish();
      if (metrics) metrics->jsonl.file().sync();
      r.status = RunStatus::failed;
      r.message =
          counters.too_many_bad_steps(cfg.max_bad_steps, last_checkpoint, step, "model.base");
      stopped = true;
      break;
    }
    const bool last = step == cfg.steps;
    if (no_validation.empty() &&
        ((cfg.eval_interval > 0 && step % cfg.eval_interval == 0) || last)) {
      ObjectiveStep v;
      {
        ag::NoGrad no_grad;
        v = objective->evaluate(model);
      }
      counters.record_validation(v.loss);
      last_val_metrics = v.metrics;
      nlohmann::ordered_json e;
      e["step"] = step;
      e["tokens"] = counters.tokens;
      e["val_loss"] = json_number(v.loss);
      add_metrics(e, "val/", name, v.metrics);
      if (metrics) {
        metrics->jsonl.write(e);
        metrics->scalar("val/loss", v.loss, step, wall);
        add_scalars(*metrics, "val/", name, v.metrics, step, wall);
      }
      progress.finish();
      if (!shown(v.loss, v.metrics).empty())
        log::info("step ", step, ": validation ", shown(v.loss, v.metrics));
    }
    if (metrics) metrics->flush();
    char fields[128];
    const bool headline_shown = !headline.empty() && s.metrics.contains(headline);
    std::snprintf(fields, sizeof(fields), "%s=%.4f lr=%.3g grad_norm=%.3g tok/s=%.0f",
                  headline_shown ? headline.c_str() : "loss",
                  headline_shown ? s.metrics[headline].get<double>() : s.loss, lr, gnorm, tps);
    progress.update(step, fields);

    // Every rank stops after the same step (a signal reaches each at its own time).
    const bool stop_here = stop_requested() || (o.stop_after >= 0 && steps_here >= o.stop_after);
    double stops[1] = {stop_here ? 1.0 : 0.0};
    comm.all_reduce_sum(stops, "whether a rank was asked to stop");
    const bool preempt = stops[0] > 0;
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
  r.record(counters, last_loss, last_val, last_checkpoint);
  r.last_val_metrics = last_val_metrics;
  if (auto done = already_finished(o.resume, steps_here, cfg.dir, step, last_checkpoint, comm)) {
    if (metrics) metrics->tb.discard_if_unused();
    r.message = *done;
    return r;
  }
  const double total = counters.elapsed_before + seconds_since(run_start);
  nlohmann::ordered_json summary =
      run_summary(r.status, step, cfg.steps, counters, last_loss, last_val, total, last_checkpoint);
  summary["objective"] = name;
  add_metrics(summary, "val/", name, last_val_metrics);
  if (comm.world() > 1) {
    summary["ranks"] = comm.world();
    summary["zero"] = opt.sharded() ? 1 : 0;
    summary["optimizer_state_bytes_per_rank"] = opt.state_bytes_per_rank(comm);
  }
  if (lead) write_file_atomic(cfg.dir / "summary.json", summary.dump(2) + "\n");
  if (!stopped) {
    const std::string train_shown = shown(last_loss, last_metrics);
    const std::string val_shown =
        no_validation.empty() ? shown(last_val, last_val_metrics) : std::string();
    r.message =
        cat("finished ", counters.step, " steps (", counters.tokens, " tokens) in ",
            obs::format_duration(total), ": ", train_shown.empty() ? "" : train_shown + ", ",
            val_shown.empty() ? "" : cat("validation ", val_shown, val_step_note(counters), ", "),
            counters.skipped, " steps skipped; checkpoint '", last_checkpoint.string(), "'");
  }
  return r;
}

}  // namespace

PostResult run_post_training(const PostConfig& cfg, const PostOptions& o,
                             const ObjectiveFactory& make_objective) {
  try {
    return post_train(cfg, o, make_objective);
  } catch (const dist::PeerFailure& e) {
    return PostResult{rank_failed_result(e.what(), cfg.dir), {}};
  }
}

}  // namespace pollen::train
