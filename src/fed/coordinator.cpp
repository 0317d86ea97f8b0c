// Starting the server (afresh, or resumed from its newest checkpoint), `pollen fed server`'s
// loop over rounds and what the server reports. The rest of Coordinator: coordinator_clients.cpp
// (join, task, pull, push), coordinator_round.cpp (opening and closing rounds),
// coordinator_secagg.cpp (secure aggregation), coordinator_checkpoint.cpp (the saved state).
#include "fed/coordinator.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>

#include "base/files.h"
#include "base/hash.h"
#include "base/log.h"
#include "fed/first_moments.h"
#include "fed/post_lora.h"
#include "fed/secagg/masked_set.h"
#include "io/checkpoint.h"
#include "io/model_source.h"
#include "model/llama.h"

namespace pollen::fed {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

// The last round metrics.jsonl records (as a resumed server left it: up to its checkpoint), for
// /metrics until a round closes (round 0: none).
RoundSummary last_round_of(const fs::path& metrics) {
  RoundSummary s;
  std::ifstream in(metrics);
  nlohmann::json last;
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.contains("participants")) last = std::move(j);
  }
  if (last.is_null()) return s;
  const auto number = [&](const char* key) {
    return last.contains(key) && last[key].is_number() ? last[key].get<double>() : std::nan("");
  };
  s.round = last.value("round", int64_t{0});
  s.aggregated = last.value("status", "") == "aggregated";
  s.participants = last.value("participants", std::vector<std::string>{});
  s.dropped = last.value("dropped", std::vector<std::string>{});
  s.tokens = last.value("tokens", int64_t{0});
  s.bytes_sent = last.value("bytes_sent", uint64_t{0});
  s.bytes_received = last.value("bytes_received", uint64_t{0});
  s.wall_s = last.value("wall_s", 0.0);
  s.train_loss = number("train_loss");
  s.eval_loss = number("eval_loss");
  if (last.contains("clients") && last["clients"].is_object())
    for (const auto& [id, c] : last["clients"].items()) {
      if (c.contains("train_loss") && c["train_loss"].is_number())
        s.client_train_loss[id] = c["train_loss"].get<double>();
      if (c.contains("eval_loss") && c["eval_loss"].is_number())
        s.client_eval_loss[id] = c["eval_loss"].get<double>();
    }
  return s;
}

}  // namespace

Coordinator::Coordinator(ServerConfig config, bool resume) : config_(std::move(config)) {
  strategy_ = make_strategy(config_.strategy);
  // Poisson sampling exists for central DP's accountant; without [privacy] nothing would account
  // for it, and the strategy's fixed-size draw is what min_clients and retries are made for.
  POLLEN_CHECK(config_.privacy.enabled || !config_.privacy.poisson(),
               "privacy.sampling = 'poisson' needs central DP ([privacy])");
  if (config_.privacy.enabled)
    dp_ = std::make_unique<CentralDp>(config_.privacy, config_.strategy.fraction_fit,
                                      config_.secure_aggregation.enabled);
  io::ModelSource init;
  if (config_.post.enabled()) {
    const PostBaseInfo post = read_post_base(config_.post);
    warn_if_schedule_ends_early(post.schedule, config_.post.run,
                                config_.rounds * config_.local_steps);
    config_.model = post.architecture;
    config_.tokenizer_fingerprint = post.tokenizer_fingerprint;
    // B zero, and the objective's own parameters as a silo's objective draws them
    post_global_ = std::make_unique<PostGlobal>(post.architecture, post.lora,
                                                config_.post.objective, post.seed);
    specs_ = post_global_->specs();
    global_ = post_global_->weights();
    terms_.lora_json = lora_config_json(post.lora);
    terms_.base_sha256 = post.base_sha256;
    terms_.post_objective = config_.post.objective;
    post_base_ = post.base;
    log::info("fed server: post-training (", config_.post.objective, ") of LoRA adapters on '",
              post.base, "' (base SHA-256 ", terms_.base_sha256.substr(0, 16), "); ", specs_.size(),
              " tensors travel");
  } else {
    const model::Llama m =
        config_.init_from.empty()
            ? model::Llama(config_.model, config_.seed)
            : io::load_initial_weights(config_.init_from, config_.model, "model.init_from", &init);
    specs_ = param_specs(m);
    global_ = model_weights(m);
  }
  terms_.model_json = model_config_json(config_.model);
  terms_.tokenizer_fingerprint = config_.tokenizer_fingerprint;
  strategy_->set_token_rows(token_row_tensors(specs_));
  moment_specs_ = first_moment_specs(specs_, config_.strategy.first_moments);
  update_rules_.model = specs_;
  update_rules_.first_moments = moment_specs_;
  update_rules_.codec = config_.compression;
  update_rules_.token_counts = config_.strategy.weights_rows();
  update_rules_.second_moments = config_.strategy.shares_second_moments();
  update_rules_.ring_bits =
      config_.secure_aggregation.enabled ? config_.secure_aggregation.ring_bits : 0;
  update_rules_.masked = secagg::masked_specs(specs_, counts_unclipped());
  update_rules_.vocab_size = config_.model.vocab_size;
  update_rules_.negative_losses = config_.post.enabled() && config_.post.objective == "grpo";
  // Clients that built the same initial model hold the first view already.
  publisher_ = std::make_unique<ModelPublisher>(specs_, config_.download(), clone_weights(global_));
  fs::create_directories(config_.dir);
  const fs::path ckpts = config_.dir / "checkpoints";
  std::optional<uint64_t> metrics_pos, lineage_pos;
  std::string tb_file;
  uint64_t tb_pos = 0;
  if (!resume) {
    POLLEN_CHECK(io::list_checkpoints(ckpts).empty(), "fed server: ", ckpts.string(),
                 " already holds checkpoints; resume the run (--resume) or choose another ",
                 config_.dir_key);
    POLLEN_CHECK(!fs::exists(privacy_charge_path()), "fed server: '",
                 privacy_charge_path().string(),
                 "' holds the privacy charge of an earlier run's round whose shares were "
                 "revealed; resume the run (--resume) so that it is accounted, or choose another ",
                 config_.dir_key);
    POLLEN_CHECK(!fs::exists(privacy_ledger_path()), "fed server: '",
                 privacy_ledger_path().string(),
                 "' holds the privacy account of an earlier private run; resume the run "
                 "(--resume) so that it goes on counting, or choose another ",
                 config_.dir_key);
  }
  if (resume) {
    const auto choice = io::choose_checkpoint_to_resume(ckpts, "fed server");
    POLLEN_CHECK(choice.dir || choice.skipped == 0, "fed server --resume: no checkpoint under ",
                 ckpts.string(), " verifies (", choice.skipped,
                 " skipped, reasons above); nothing was changed");
    if (choice.dir) {
      load_checkpoint(*choice.dir);
      // Fewer rounds than the checkpoint took leave nothing to run: refused, not "finished".
      const std::string rounds_key =
          config_.dir_key.substr(0, config_.dir_key.find('.') + 1) + "rounds";
      POLLEN_CHECK(config_.rounds >= done_, "--resume: ", rounds_key, " (", config_.rounds,
                   ") is below the ", done_, " rounds of checkpoint '", choice.dir->string(),
                   "'; give at least ", done_);
      // A stop between the checkpoint and adapter/ left the adapters of the round before.
      if (post_global_) save_global_adapter();
      const auto state = nlohmann::json::parse(read_file(*choice.dir / "state.json"));
      metrics_pos = state.at("metrics_bytes").get<uint64_t>();
      lineage_pos = state.at("lineage_bytes").get<uint64_t>();
      tb_file = state.value("tensorboard_file", "");
      tb_pos = state.value("tensorboard_bytes", uint64_t{0});
      warn_of_changed_settings(state, *choice.dir);
      log::info("fed server: resumed from ", choice.dir->string(), " after round ", done_);
    } else {
      log::info("fed server: no checkpoint under ", ckpts.string(), "; starting at round 1");
    }
    take_privacy_ledger();
    take_privacy_charge();
  }
  // The run's id: made when it begins, kept across resumes (clients refuse a state of another).
  const fs::path run_id_file = config_.dir / "run_id";
  if (resume && fs::exists(run_id_file)) run_id_ = read_file(run_id_file);
  if (run_id_.empty()) {
    std::random_device os;  // the OS's randomness: no two runs share an id
    char word[9];
    for (int i = 0; i < 4; ++i) {
      std::snprintf(word, sizeof word, "%08x", static_cast<unsigned>(os()));
      run_id_ += word;
    }
    write_file_atomic(run_id_file, run_id_);
  }
  if (!metrics_pos) {
    // A fresh run: nothing of an earlier attempt that never checkpointed is kept.
    fs::remove(config_.dir / "metrics.jsonl");
    fs::remove(config_.dir / "lineage.jsonl");
  }
  metrics_ = obs::JsonlWriter(config_.dir / "metrics.jsonl", metrics_pos,
                              obs::Shortfall::keep_whole_lines);
  if (metrics_pos) totals_.last = last_round_of(config_.dir / "metrics.jsonl");
  lineage_file_ = obs::JsonlWriter(config_.dir / "lineage.jsonl", lineage_pos);
  if (!lineage_pos && post_global_) {
    // Round 0 of a post-training lineage: the base every silo trains adapters on.
    const nlohmann::ordered_json start{{"round", 0},
                                       {"post", config_.post.objective},
                                       {"base", post_base_},
                                       {"base_sha256", terms_.base_sha256},
                                       {"lora", nlohmann::json::parse(terms_.lora_json)}};
    lineage_.push_back(nlohmann::json(start));
    lineage_file_.write(start);
  }
  if (!lineage_pos && !config_.init_from.empty()) {
    // Round 0 of the lineage: the weights the run started from, so that an audit can follow
    // them to the run (and its data) that made them.
    Sha256 weights;
    for (const auto& w : global_) weights.update(w.data<float>(), w.nbytes());
    const nlohmann::ordered_json start{{"round", 0},
                                       {"init_from", config_.init_from},
                                       {"source", io::model_kind_name(init.kind)},
                                       {"path", init.path.string()},
                                       {"weights_sha256", weights.hex_digest()}};
    lineage_.push_back(nlohmann::json(start));
    lineage_file_.write(start);
  }
  const fs::path tb_dir = config_.dir / "tensorboard";
  if (!tb_file.empty() && fs::exists(tb_dir / tb_file)) {
    tensorboard_ = obs::EventFileWriter::resume(tb_dir / tb_file, tb_pos, done_ + 1);
  } else {
    if (!metrics_pos) fs::remove_all(tb_dir);  // a fresh run: no stale curves
    tensorboard_ = obs::EventFileWriter::create(tb_dir, done_ + 1);
  }
  totals_.last.eval_loss = std::nan("");
  finished_ = done_ >= config_.rounds;
  progress_ = std::make_unique<obs::Progress>("fed server", config_.rounds, done_);
  if (!progress_->on_terminal()) progress_.reset();  // the log's round lines say it all there
}

Coordinator::~Coordinator() = default;

void Coordinator::run() {
  while (!stop_) {
    {
      std::unique_lock lock(mutex_);
      if (finished_) break;
      const auto give_up =
          Clock::now() + std::chrono::duration_cast<Clock::duration>(
                             std::chrono::duration<double>(config_.wait_for_clients_s));
      while (!stop_ &&
             static_cast<int64_t>(alive_ids_locked().size()) < config_.strategy.min_clients) {
        if (Clock::now() > give_up) {
          stopped_ = cat("fewer than ", config_.strategy.min_clients,
                         " clients (strategy.min_clients) after ", config_.wait_for_clients_s,
                         " s (server.wait_for_clients_s)");
          log::error("fed server: ", stopped_, "; stopping");
          finished_ = true;
          return;
        }
        changed_.wait_for(lock, std::chrono::milliseconds(200));
      }
    }
    if (stop_ || !begin_round()) continue;
    auto after = [](double seconds) {
      return Clock::now() +
             std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
    };
    // Training gets round_timeout_s; secure aggregation's other phases phase_timeout_s each.
    auto phase_deadline = [&] {
      using Phase = secagg::ServerSession::Phase;
      const bool training = !secagg_ || secagg_->phase() == Phase::input;
      return after(training ? config_.round_timeout_s : config_.secure_aggregation.phase_timeout_s);
    };
    for (;;) {
      std::unique_lock lock(mutex_);
      const auto phase = secagg_ ? secagg_->phase() : secagg::ServerSession::Phase::input;
      const auto deadline = phase_deadline();
      while (!stop_ && !round_complete_locked() && Clock::now() < deadline &&
             (!secagg_ || secagg_->phase() == phase)) {
        changed_.wait_for(lock, std::chrono::milliseconds(100));
      }
      if (stop_ || round_complete_locked() || !secagg_) break;
      if (secagg_->phase() == phase) {  // its deadline passed
        lock.unlock();
        close_phase();
      }
    }
    if (stop_) {
      {
        std::lock_guard lock(mutex_);
        // Under distributed DP, shares revealed before the stop may let the server unmask a
        // sum: the round ends as a failed unmask does, its release accounted and saved, so that
        // a resumed run does not spend that budget again.
        if (!(dp_ && secagg_ && secagg_->revealed())) {
          std::error_code ec;  // a charge left behind is only ever too much, never too little
          if (dp_) fs::remove(privacy_charge_path(), ec);  // nothing was revealed
          open_ = false;  // the unfinished round is redone after a restart
          break;
        }
      }
      end_round();
      break;
    }
    end_round();
  }
}

void Coordinator::stop() {
  stop_ = true;
  changed_.notify_all();
}

int64_t Coordinator::rounds_done() const {
  std::lock_guard lock(mutex_);
  return done_;
}

std::string Coordinator::stopped_reason() const {
  std::lock_guard lock(mutex_);
  return stopped_;
}

bool Coordinator::finished() const {
  std::lock_guard lock(mutex_);
  return finished_;
}

ServerStatus Coordinator::status() const {
  std::lock_guard lock(mutex_);
  ServerStatus st = totals_;
  st.rounds_done = done_;
  st.rounds_total = config_.rounds;
  st.open_round = open_ ? done_ + 1 : 0;
  st.round_retries = retries_;
  st.clients_joined = clients_.size();
  st.clients_alive = alive_ids_locked().size();
  if (dp_) {
    st.private_ = true;
    st.private_rounds = dp_->private_rounds();
    st.epsilon = st.private_rounds > 0 ? dp_->epsilon().epsilon : 0;  // nothing released yet
    st.delta = dp_->options().delta;
  }
  return st;
}

Weights Coordinator::global_weights() const {
  std::lock_guard lock(mutex_);
  return clone_weights(global_);
}

}  // namespace pollen::fed
