#include "fed/coordinator.h"

#include <algorithm>
#include <cmath>
#include <thread>

#include "base/files.h"
#include "base/hash.h"
#include "base/log.h"
#include "fed/first_moments.h"
#include "fed/post_lora.h"
#include "fed/secagg/masked_set.h"
#include "fed/secagg/quantize.h"
#include "fed/second_moments.h"
#include "io/checkpoint.h"
#include "io/model_source.h"
#include "io/peft.h"
#include "model/llama.h"
#include "train/config.h"

namespace pollen::fed {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

Coordinator::Coordinator(ServerConfig config, bool resume) : config_(std::move(config)) {
  strategy_ = make_strategy(config_.strategy);
  if (config_.privacy.enabled) dp_ = std::make_unique<CentralDp>(config_.privacy);
  io::ModelSource init;
  if (config_.post.enabled()) {
    const PostBaseInfo post = read_post_base(config_.post);
    config_.model = post.architecture;
    config_.tokenizer_fingerprint = post.tokenizer_fingerprint;
    adapter_ = std::make_unique<model::Lora>(post.architecture, post.lora);  // B zero
    specs_ = lora_specs(*adapter_);
    global_ = lora_weights(*adapter_);
    terms_.lora_json = lora_config_json(post.lora);
    terms_.base_sha256 = post.base_sha256;
    post_base_ = post.base;
    log::info("fed server: post-training (", config_.post.objective, ") of LoRA adapters on '",
              post.base, "' (base SHA-256 ", terms_.base_sha256.substr(0, 16), "); ", specs_.size(),
              " tensors of B travel");
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
  update_rules_.vocab_size = config_.model.vocab_size;
  // Clients that built the same initial model hold the first view already.
  publisher_ = std::make_unique<ModelPublisher>(specs_, config_.download(), clone_weights(global_));
  fs::create_directories(config_.dir);
  const fs::path ckpts = config_.dir / "checkpoints";
  std::optional<uint64_t> metrics_pos, lineage_pos;
  std::string tb_file;
  uint64_t tb_pos = 0;
  if (!resume) {
    POLLEN_CHECK(io::list_checkpoints(ckpts).empty(), "fed server: ", ckpts.string(),
                 " already holds checkpoints; resume the run (--resume) or choose another "
                 "server.dir");
  }
  if (resume) {
    const auto choice = io::choose_checkpoint_to_resume(ckpts, "fed server");
    POLLEN_CHECK(choice.dir || choice.skipped == 0, "fed server --resume: no checkpoint under ",
                 ckpts.string(), " verifies (", choice.skipped,
                 " skipped, reasons above); nothing was changed");
    if (choice.dir) {
      load_checkpoint(*choice.dir);
      const auto state = nlohmann::json::parse(read_file(*choice.dir / "state.json"));
      metrics_pos = state.at("metrics_bytes").get<uint64_t>();
      lineage_pos = state.at("lineage_bytes").get<uint64_t>();
      tb_file = state.value("tensorboard_file", "");
      tb_pos = state.value("tensorboard_bytes", uint64_t{0});
      log::info("fed server: resumed from ", choice.dir->string(), " after round ", done_);
    } else {
      log::info("fed server: no checkpoint under ", ckpts.string(), "; starting at round 1");
    }
  }
  if (!metrics_pos) {
    // A fresh run: nothing of an earlier attempt that never checkpointed is kept.
    fs::remove(config_.dir / "metrics.jsonl");
    fs::remove(config_.dir / "lineage.jsonl");
  }
  metrics_ = obs::JsonlWriter(config_.dir / "metrics.jsonl", metrics_pos);
  lineage_file_ = obs::JsonlWriter(config_.dir / "lineage.jsonl", lineage_pos);
  if (!lineage_pos && adapter_) {
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
    tensorboard_ = obs::EventFileWriter::resume(tb_dir / tb_file, tb_pos);
  } else {
    if (!metrics_pos) fs::remove_all(tb_dir);  // a fresh run: no stale curves
    tensorboard_ = obs::EventFileWriter::create(tb_dir);
  }
  totals_.last.eval_loss = std::nan("");
  finished_ = done_ >= config_.rounds;
  progress_ = std::make_unique<obs::Progress>("fed server", config_.rounds, done_);
  if (!progress_->on_terminal()) progress_.reset();  // the log's round lines say it all there
}

Coordinator::~Coordinator() = default;

void Coordinator::load_checkpoint(const fs::path& dir) {
  const auto state = nlohmann::json::parse(read_file(dir / "state.json"));
  POLLEN_CHECK(state.at("model_config").get<std::string>() == terms_.model_json,
               "fed server: checkpoint ", dir.string(),
               " holds another model config than server config's [model]");
  const auto fingerprint = state.at("tokenizer_fingerprint").get<std::string>();
  POLLEN_CHECK(fingerprint == config_.tokenizer_fingerprint, "fed server: checkpoint ",
               dir.string(), " was trained with tokenizer fingerprint ", fingerprint,
               ", the config says ", config_.tokenizer_fingerprint,
               " ([tokenizer]): its weights belong to the other tokenizer's ids");
  POLLEN_CHECK(state.at("strategy").get<std::string>() == strategy_->name(),
               "fed server: checkpoint ", dir.string(), " was written by strategy '",
               state.at("strategy").get<std::string>(), "', the config says '", strategy_->name(),
               "'");
  const auto model = io::read_safetensors(dir / "model.safetensors");
  POLLEN_CHECK(model.tensors.size() == specs_.size(), "fed server: ", dir.string(),
               "/model.safetensors has ", model.tensors.size(), " tensors, the model ",
               specs_.size());
  for (size_t i = 0; i < specs_.size(); ++i) {
    const Tensor* t = model.find(specs_[i].name);
    POLLEN_CHECK(t && t->shape() == specs_[i].shape, "fed server: ", dir.string(),
                 "/model.safetensors: tensor '", specs_[i].name,
                 "' is missing or has another shape");
    global_[i] = t->to(DType::f32);
  }
  if (fs::exists(dir / "strategy.safetensors")) {
    strategy_->load_state(io::read_safetensors(dir / "strategy.safetensors").tensors);
  }
  if (config_.strategy.shares_second_moments() && fs::exists(dir / "second_moments.safetensors")) {
    const auto f = io::read_safetensors(dir / "second_moments.safetensors");
    const Tensor* t = f.find("second_moments");
    const std::string what = cat("fed server: ", dir.string(), "/second_moments.safetensors");
    POLLEN_CHECK(t && t->dim() == 1 && t->dtype() == DType::u8, what,
                 ": expected one uint8 vector 'second_moments' (the moments as sent)");
    std::string wire(reinterpret_cast<const char*>(t->data<uint8_t>()),
                     static_cast<size_t>(t->numel()));
    unpack_second_moments(specs_, wire, what);
    second_moments_ = std::move(wire);
  }
  if (!moment_specs_.empty() && fs::exists(dir / "first_moments.safetensors")) {
    const std::string what = cat("fed server: ", dir.string(), "/first_moments.safetensors");
    const auto f = io::read_safetensors(dir / "first_moments.safetensors");
    Weights mean;
    for (const auto& m : moment_specs_) {
      const Tensor* t = f.find(m.name);
      if (!t) break;  // written with other tensors shared (strategy.first_moments changed)
      POLLEN_CHECK(t->shape() == m.shape && t->dtype() == DType::f32, what, ": tensor '", m.name,
                   "' is not float32 of its shape");
      mean.push_back(t->clone());
    }
    if (mean.size() == moment_specs_.size()) {
      check_first_moments(moment_specs_, mean, what);
      set_first_moments(std::move(mean));
    } else {
      log::warn(what, " holds other tensors' moments than strategy.first_moments = '",
                config_.strategy.first_moments, "' shares; the clients start from their own");
    }
  }
  if (publisher_->compressed()) {
    // The model the clients hold; without it (compression turned on at resume) the next round
    // sends the whole model to every client.
    Weights view = clone_weights(global_);
    if (fs::exists(dir / "view.safetensors")) {
      const auto f = io::read_safetensors(dir / "view.safetensors");
      for (size_t i = 0; i < specs_.size(); ++i) {
        const Tensor* t = f.find(specs_[i].name);
        POLLEN_CHECK(t && t->shape() == specs_[i].shape && t->dtype() == DType::f32,
                     "fed server: ", dir.string(), "/view.safetensors: tensor '", specs_[i].name,
                     "' is missing or not float32 of its shape");
        view[i] = t->clone();
      }
    }
    publisher_->restore(std::move(view));
  }
  POLLEN_CHECK(state.value("base_sha256", std::string()) == terms_.base_sha256 &&
                   state.value("lora_config", std::string()) == terms_.lora_json,
               "fed server: checkpoint ", dir.string(),
               terms_.base_sha256.empty()
                   ? " holds LoRA adapters, the config trains the whole model"
                   : " holds another base or LoRA config than post.run's");
  if (dp_) {
    POLLEN_CHECK(state.contains("privacy"), "fed server: checkpoint ", dir.string(),
                 " was written without [privacy]; its rounds were not accounted for");
    dp_->load_state(state.at("privacy"));
  }
  done_ = state.at("round").get<int64_t>();
  lineage_ = state.at("lineage");
}

void Coordinator::save_checkpoint(const RoundSummary& s) {
  metrics_.file().sync();
  lineage_file_.file().sync();
  tensorboard_.file().sync();
  io::CheckpointWriter w(config_.dir / "checkpoints", done_);
  io::NamedTensors model;
  for (size_t i = 0; i < specs_.size(); ++i) model.emplace_back(specs_[i].name, global_[i]);
  w.add_tensors("model.safetensors", model, {{"round", std::to_string(done_)}});
  const auto st = strategy_->state();
  if (!st.empty()) w.add_tensors("strategy.safetensors", st);
  if (!second_moments_.empty()) {
    Tensor t = Tensor::empty({static_cast<int64_t>(second_moments_.size())}, DType::u8);
    std::copy(second_moments_.begin(), second_moments_.end(),
              reinterpret_cast<char*>(t.data<uint8_t>()));
    w.add_tensors("second_moments.safetensors", {{"second_moments", t}});
  }
  if (!first_moments_.empty()) {
    io::NamedTensors moments;
    for (size_t i = 0; i < moment_specs_.size(); ++i)
      moments.emplace_back(moment_specs_[i].name, first_moments_[i]);
    w.add_tensors("first_moments.safetensors", moments);
  }
  if (publisher_->compressed()) {
    io::NamedTensors view;
    for (size_t i = 0; i < specs_.size(); ++i)
      view.emplace_back(specs_[i].name, publisher_->view()[i]);
    w.add_tensors("view.safetensors", view);
  }
  nlohmann::ordered_json state{{"round", done_},
                               {"strategy", strategy_->name()},
                               {"model_config", terms_.model_json},
                               {"tokenizer_fingerprint", config_.tokenizer_fingerprint},
                               {"protocol_version", kProtocolVersion},
                               {"metrics_bytes", metrics_.file().position()},
                               {"lineage_bytes", lineage_file_.file().position()},
                               {"tensorboard_file", tensorboard_.file().path().filename().string()},
                               {"tensorboard_bytes", tensorboard_.file().position()},
                               {"lineage", lineage_}};
  if (dp_) state["privacy"] = dp_->state();
  if (adapter_) {
    state["base_sha256"] = terms_.base_sha256;
    state["lora_config"] = terms_.lora_json;
  }
  w.add_text("state.json", state.dump(1));
  if (!adapter_) {
    // The architecture as [model]: the folder is then a pollen checkpoint that generate, eval,
    // serve and export take as --model (the tokenizer given beside it).
    std::vector<std::pair<std::string, std::string>> flat;
    train::flat_model(config_.model, flat);
    w.add_text("config.toml",
               train::flat_to_toml(flat, cat("# The global model after round ", done_,
                                             " of a pollen fed server (tokenizer fingerprint ",
                                             config_.tokenizer_fingerprint, ").\n")));
  }
  w.commit();
  if (adapter_) {
    // The global adapters as `pollen chat --adapter` and PEFT take them.
    set_lora_weights(*adapter_, global_);
    io::save_peft_adapter(*adapter_, config_.dir / "adapter", post_base_);
  }
  io::apply_retention(config_.dir / "checkpoints", config_.keep_checkpoints);
  (void)s;
}

std::string Coordinator::check_peer(const std::string& claimed, const std::string& peer_id,
                                    const char* what) const {
  check_client_id(claimed, what);
  POLLEN_CHECK(peer_id.empty() || peer_id == claimed, what, ": client id '", claimed,
               "' does not match its certificate's common name '", peer_id, "'");
  return claimed;
}

pb::JoinReply Coordinator::join(const pb::JoinRequest& r, const std::string& peer_id) {
  pb::JoinReply reply;
  reply.set_protocol_version(kProtocolVersion);
  reply.set_model_config(terms_.model_json);
  reply.set_tokenizer_fingerprint(config_.tokenizer_fingerprint);
  reply.set_base_fingerprint(terms_.base_sha256);
  reply.set_lora_config(terms_.lora_json);
  try {
    check_join_request(r, terms_);
    const std::string id = check_peer(r.client_id(), peer_id, "join");
    std::lock_guard lock(mutex_);
    clients_[id] = {r.data_manifest_hash(), Clock::now()};
    reply.set_accepted(true);
    reply.set_round(done_);
    log::info("fed server: client '", id, "' joined (data ", r.data_manifest_hash().substr(0, 16),
              ")");
    changed_.notify_all();
  } catch (const Error& e) {
    reply.set_accepted(false);
    reply.set_reason(e.what());
    log::warn("fed server: refused a join: ", e.what());
  }
  return reply;
}

pb::TaskReply Coordinator::task(const pb::TaskRequest& r, const std::string& peer_id) {
  const std::string id = check_peer(r.client_id(), peer_id, "task");
  std::lock_guard lock(mutex_);
  auto it = clients_.find(id);
  POLLEN_CHECK(it != clients_.end(), "task: client '", id, "' has not joined");
  it->second.last_seen = Clock::now();
  pb::TaskReply t;
  if (finished_) {
    t.set_kind(pb::TASK_DONE);
    t.set_stopped(stopped_);
    return t;
  }
  using Phase = secagg::ServerSession::Phase;
  if (open_ && secagg_ && secagg_->expects(id) && secagg_->phase() != Phase::input) {
    t.set_round(done_ + 1);
    t.set_kind(secagg_->phase() == Phase::advertise ? pb::TASK_SECAGG_ADVERTISE
               : secagg_->phase() == Phase::share   ? pb::TASK_SECAGG_SHARE
                                                    : pb::TASK_SECAGG_UNMASK);
    return t;
  }
  const bool may_train = !secagg_ || secagg_->expects(id);  // secure: in the input phase only
  if (open_ && selected_.count(id) && !updates_.count(id) && may_train) {
    const int64_t round = done_ + 1;
    t.set_kind(pb::TASK_TRAIN);
    t.set_round(round);
    t.set_local_steps(config_.local_steps);
    t.set_codec(codec_name(config_.compression.codec));
    t.set_codec_block(config_.compression.block);
    t.set_codec_topk(config_.compression.codec == Codec::topk ? config_.compression.topk : 0);
    t.set_model_codec(codec_name(config_.server_codec));
    t.set_model_codec_block(config_.compression.block);
    t.set_model_codec_topk(config_.server_codec == Codec::topk ? config_.compression.topk : 0);
    t.set_codec_scale(scale_format_name(config_.compression.scale));
    t.set_model_codec_scale(scale_format_name(config_.compression.scale));
    t.set_model_sha256(publisher_->view_sha256());
    t.set_second_moments(config_.strategy.shares_second_moments());
    if (config_.strategy.shares_first_moments())
      t.set_first_moments(config_.strategy.first_moments);
    t.set_pull_first_moments(first_moments_set_ != nullptr);
    t.set_evaluate(config_.eval_every > 0 && (round - 1) % config_.eval_every == 0);
    t.set_secure_aggregation(secagg_ != nullptr);
    t.set_token_counts(config_.strategy.weights_rows());
    return t;
  }
  t.set_kind(pb::TASK_WAIT);
  t.set_wait_ms(200);
  return t;
}

std::shared_ptr<const EncodedSet> Coordinator::pull(const pb::PullRequest& r,
                                                    const std::string& peer_id) {
  const std::string id = check_peer(r.client_id(), peer_id, "pull");
  std::lock_guard lock(mutex_);
  POLLEN_CHECK(open_ && r.round() == done_ + 1, "pull: round ", r.round(), " is not open");
  POLLEN_CHECK(selected_.count(id), "pull: client '", id, "' is not part of round ", r.round());
  for (const std::string* name : {&r.held_model(), &r.want_model()}) {
    POLLEN_CHECK(name->empty() || name->size() == 64, "pull: client '", id, "' names a model by ",
                 name->size(), " characters, not a SHA-256 hex digest");
  }
  POLLEN_CHECK(r.want_model().empty() || r.want_model() == publisher_->view_sha256(),
               "pull: client '", id, "' wants model ", r.want_model(), ", but round ", r.round(),
               " was opened again since and trains from ", publisher_->view_sha256(),
               "; ask for the task again");
  if (r.first_moments()) {
    POLLEN_CHECK(first_moments_set_, "pull: client '", id, "' asks for first moments, which ",
                 moment_specs_.empty() ? "this federation does not share (strategy.first_moments)"
                                       : "no round has averaged yet");
    if (pulled_.insert(id + "\nfirst_moments").second)
      bytes_sent_ += first_moments_set_->header.total_bytes();
    return first_moments_set_;
  }
  auto set = publisher_->for_client(r.held_model());
  // Each set a client pulls counts once, however often the pull is retried.
  if (pulled_.insert(id + '\n' + set->header.base_sha256() + set->header.model_sha256()).second)
    bytes_sent_ += set->header.total_bytes() + set->header.second_moments().size();
  return set;
}

Coordinator::Push Coordinator::push_begin(const pb::UpdateInfo& info,
                                          const pb::TensorSetHeader& header,
                                          const std::string& peer_id) {
  const std::string what = cat("update from '", info.client_id().substr(0, kMaxIdBytes), "'");
  check_update_info(info, update_rules_, what);
  check_peer(info.client_id(), peer_id, "push");
  Push p;
  {
    std::lock_guard lock(mutex_);
    POLLEN_CHECK(open_ && info.round() == done_ + 1, what, ": round ", info.round(),
                 " is not open (the server is at round ", done_ + 1,
                 open_ ? ", open)" : ", closed)");
    POLLEN_CHECK(selected_.count(info.client_id()), what, ": not part of round ", info.round());
    POLLEN_CHECK(!updates_.count(info.client_id()), what, ": already pushed for round ",
                 info.round());
    if (secagg_) secagg_->check_input(info.client_id());
    p.attempt = attempts_;
  }
  check_update_header(header, update_rules_, what);
  p.info = info;
  p.header = header;
  p.chunks = std::make_unique<ChunkAssembler>(header, what);
  return p;
}

pb::PushReply Coordinator::push_finish(Push& p) {
  const std::string what = cat("update from '", p.info.client_id(), "'");
  const std::string bytes = p.chunks->finish();
  Update u;
  u.update.client_id = p.info.client_id();
  u.update.tokens = p.info.tokens();
  // A masked update is only added to the session's running sum; it is never decoded.
  if (!config_.secure_aggregation.enabled) {
    UpdateTensors tensors = decode_update(p.header, bytes, update_rules_, what);
    u.update.delta = std::move(tensors.delta);
    u.first_moments = std::move(tensors.first_moments);
  }
  u.update.metrics = {{"train_loss", p.info.train_loss()}};
  u.update.input_counts = token_counts_from(p.info.input_counts());
  u.update.target_counts = token_counts_from(p.info.target_counts());
  u.info = p.info;
  u.bytes = bytes.size() + p.info.second_moments().size();
  std::lock_guard lock(mutex_);
  POLLEN_CHECK(open_ && p.info.round() == done_ + 1 && p.attempt == attempts_, what, ": round ",
               p.info.round(), " closed while the update was arriving");
  POLLEN_CHECK(!updates_.count(p.info.client_id()), what, ": already pushed");
  if (secagg_) {
    secagg_->add_input(p.info.client_id(), bytes);
    advance_secagg_locked();
  }
  updates_.emplace(p.info.client_id(), std::move(u));
  show_progress_locked();
  changed_.notify_all();
  pb::PushReply reply;
  reply.set_accepted(true);
  return reply;
}

size_t Coordinator::alive_locked() const {
  const auto now = Clock::now();
  size_t n = 0;
  for (const auto& [id, c] : clients_) {
    if (std::chrono::duration<double>(now - c.last_seen).count() <= config_.client_timeout_s) ++n;
  }
  return n;
}

size_t Coordinator::alive_clients() const {
  std::lock_guard lock(mutex_);
  return alive_locked();
}

bool Coordinator::begin_round() {
  std::lock_guard lock(mutex_);
  POLLEN_ASSERT(!open_);
  if (finished_ || done_ >= config_.rounds) return false;
  std::vector<std::string> alive;
  const auto now = Clock::now();
  for (const auto& [id, c] : clients_) {
    if (std::chrono::duration<double>(now - c.last_seen).count() <= config_.client_timeout_s) {
      alive.push_back(id);
    }
  }
  if (static_cast<int64_t>(alive.size()) < config_.strategy.min_clients) return false;
  const int64_t round = done_ + 1;
  Rng rng = Rng(config_.seed).fork(static_cast<uint64_t>(round * 1000 + retries_));
  const auto chosen = strategy_->configure_round(round, alive, rng);
  if (dp_) {
    const std::string why = dp_->refuse_round(round, static_cast<int64_t>(chosen.size()),
                                              static_cast<int64_t>(alive.size()));
    if (!why.empty()) {
      log::error("fed server: ", why);
      metrics_.write({{"round", round}, {"status", "refused"}, {"reason", why}});
      metrics_.file().flush();
      finished_ = true;
      stopped_ = why;
      changed_.notify_all();
      return false;
    }
  }
  round_available_ = static_cast<int64_t>(alive.size());
  ++attempts_;
  selected_ = {chosen.begin(), chosen.end()};
  pulled_.clear();
  updates_.clear();
  bytes_sent_ = 0;
  secagg_.reset();
  secagg_bytes_in_ = secagg_bytes_out_ = 0;
  if (config_.secure_aggregation.enabled) {
    int64_t numel = 0;
    for (const auto& p : specs_) numel += shape_numel(p.shape);
    secagg_ = std::make_unique<secagg::ServerSession>(round, chosen, config_.secure_aggregation,
                                                      rng.next_u64(), numel);
  }
  // The clients train from, and take their pseudo-gradients against, the view of the exact
  // weights, which the server keeps (docs/federated.md, "Compression").
  publisher_->set_second_moments(second_moments_);
  publisher_->publish(global_);
  round_start_ = Clock::now();
  open_ = true;
  log::info("fed server: round ", round, " of ", config_.rounds, " with ", chosen.size(),
            " clients");
  show_progress_locked();
  changed_.notify_all();
  return true;
}

bool Coordinator::round_complete_locked() const {
  if (!open_) return false;
  if (!secagg_) return updates_.size() == selected_.size();
  using Phase = secagg::ServerSession::Phase;
  return secagg_->phase() == Phase::done || secagg_->phase() == Phase::failed;
}

bool Coordinator::round_complete() const {
  std::lock_guard lock(mutex_);
  return round_complete_locked();
}

void Coordinator::advance_secagg_locked() {
  using Phase = secagg::ServerSession::Phase;
  while (secagg_->phase() != Phase::done && secagg_->phase() != Phase::failed &&
         secagg_->phase_complete()) {
    secagg_->close_phase();
  }
  changed_.notify_all();
}

bool Coordinator::close_phase() {
  std::lock_guard lock(mutex_);
  using Phase = secagg::ServerSession::Phase;
  if (!open_ || !secagg_ || secagg_->phase() == Phase::done || secagg_->phase() == Phase::failed) {
    return false;
  }
  log::info("fed server: secure aggregation phase '",
            secagg::ServerSession::phase_name(secagg_->phase()), "' of round ", done_ + 1,
            " closes with the clients that answered");
  secagg_->close_phase();
  advance_secagg_locked();
  return true;
}

pb::SecAggReply Coordinator::secagg(const pb::SecAggRequest& r, const std::string& peer_id) {
  try {
    const std::string id = check_peer(r.client_id(), peer_id, "secure aggregation");
    std::lock_guard lock(mutex_);
    POLLEN_CHECK(secagg_ != nullptr && open_ && r.round() == done_ + 1, "secure aggregation from '",
                 id, "': round ", r.round(),
                 config_.secure_aggregation.enabled ? " is not open"
                                                    : " (the server does not aggregate securely)");
    if (auto it = clients_.find(id); it != clients_.end()) it->second.last_seen = Clock::now();
    pb::SecAggReply reply;
    switch (r.body_case()) {
      case pb::SecAggRequest::kAdvertise:
        secagg_->advertise(id, r.advertise());
        reply.set_accepted(true);
        break;
      case pb::SecAggRequest::kGetRoster:
        *reply.mutable_roster() = secagg_->roster(id);
        break;
      case pb::SecAggRequest::kShares:
        secagg_->shares(id, r.shares());
        reply.set_accepted(true);
        break;
      case pb::SecAggRequest::kGetInbox:
        *reply.mutable_inbox() = secagg_->inbox(id);
        break;
      case pb::SecAggRequest::kGetSurvivors:
        *reply.mutable_survivors() = secagg_->survivors(id);
        break;
      case pb::SecAggRequest::kReveal:
        secagg_->reveal(id, r.reveal());
        reply.set_accepted(true);
        break;
      default:
        fail("secure aggregation from '", id, "': the request holds no step");
    }
    secagg_bytes_in_ += r.ByteSizeLong();
    secagg_bytes_out_ += reply.ByteSizeLong();
    advance_secagg_locked();
    return reply;
  } catch (const Error& e) {
    log::warn("fed server: refused a secure aggregation message: ", e.what());
    throw;
  }
}

bool Coordinator::aggregate_secure(int64_t round, int64_t tokens, size_t participants,
                                   std::string* why) {
  using Phase = secagg::ServerSession::Phase;
  if (secagg_->phase() != Phase::done) {
    *why = secagg_->phase() == Phase::failed
               ? secagg_->failure()
               : cat("secure aggregation of round ", round, " did not finish (phase '",
                     secagg::ServerSession::phase_name(secagg_->phase()), "')");
    return false;
  }
  if (static_cast<int64_t>(participants) < config_.strategy.min_clients) {
    *why =
        cat(participants, " masked updates, fewer than min_clients ", config_.strategy.min_clients);
    return false;
  }
  try {
    // Before unmasking: a sum that may not fit the ring is refused without rebuilding any
    // client's secrets for a round that is then thrown away.
    secagg::check_fits(tokens, config_.secure_aggregation);
    const std::vector<uint64_t> sum = secagg_->unmasked_sum();
    const Weights mean = secagg::dequantize(sum, tokens, config_.secure_aggregation, global_);
    strategy_->aggregate_mean(round, global_, mean);
  } catch (const Error& e) {
    *why = e.what();
    return false;
  }
  return true;
}

void Coordinator::set_first_moments(Weights mean) {
  first_moments_ = std::move(mean);
  // Encoded once for every pull of the rounds until the next average.
  first_moments_set_ = std::make_shared<const EncodedSet>(
      encode_weights(moment_specs_, first_moments_, config_.download()));
}

RoundSummary Coordinator::end_round() {
  std::unique_lock lock(mutex_);
  POLLEN_ASSERT(open_);
  open_ = false;
  RoundSummary s;
  s.round = done_ + 1;
  s.selected = {selected_.begin(), selected_.end()};
  std::vector<ClientUpdate> ups;
  std::vector<ClientEval> evals;
  nlohmann::ordered_json clients = nlohmann::ordered_json::object();
  nlohmann::ordered_json lineage_clients = nlohmann::ordered_json::array();
  uint64_t bytes_received = 0;
  double loss_sum = 0;
  std::vector<std::vector<float>> moments;  // strategy.second_moments: each participant's
  std::vector<double> moment_weights;
  std::vector<Weights> first_moments;  // strategy.first_moments: each participant's
  std::vector<double> first_moment_weights;
  for (const auto& id : s.selected) {
    auto it = updates_.find(id);
    if (it == updates_.end()) {
      s.dropped.push_back(id);
      continue;
    }
    s.participants.push_back(id);
    const auto& info = it->second.info;
    s.tokens += info.tokens();
    loss_sum += info.train_loss() * static_cast<double>(info.tokens());
    bytes_received += it->second.bytes;
    if (info.eval_tokens() > 0) evals.push_back({id, info.eval_tokens(), info.eval_loss()});
    nlohmann::ordered_json c{{"tokens", info.tokens()},
                             {"train_loss", info.train_loss()},
                             {"train_seconds", info.train_seconds()},
                             {"bytes", it->second.bytes}};
    if (info.eval_tokens() > 0) c["eval_loss"] = info.eval_loss();
    clients[id] = c;
    s.client_train_loss[id] = info.train_loss();
    if (info.eval_tokens() > 0) s.client_eval_loss[id] = info.eval_loss();
    lineage_clients.push_back({{"client", id},
                               {"data_manifest_hash", info.data_manifest_hash()},
                               {"tokens", info.tokens()}});
    if (!info.second_moments().empty()) {
      moments.push_back(
          unpack_second_moments(specs_, info.second_moments(), cat("update from '", id, "'")));
      moment_weights.push_back(static_cast<double>(info.tokens()));
    }
    if (!it->second.first_moments.empty()) {
      first_moments.push_back(std::move(it->second.first_moments));
      first_moment_weights.push_back(static_cast<double>(info.tokens()));
    }
    ups.push_back(std::move(it->second.update));
  }
  updates_.clear();
  selected_.clear();
  publisher_->release();
  std::string secure_error;
  AggregationReport report;
  if (secagg_) {
    s.aggregated = aggregate_secure(s.round, s.tokens, ups.size(), &secure_error);
    secagg_.reset();  // nothing of the round's masked inputs outlives it
  } else {
    s.aggregated = static_cast<int64_t>(ups.size()) >= config_.strategy.min_clients;
    if (s.aggregated && dp_) {
      const auto selected = static_cast<int64_t>(s.selected.size());
      strategy_->aggregate_mean(
          s.round, global_,
          dp_->aggregate(s.round, global_, ups, selected, round_available_, &report));
    } else if (s.aggregated) {
      strategy_->aggregate(s.round, global_, ups, &report);
    }
  }
  if (s.aggregated && !moments.empty()) {
    std::vector<const std::vector<float>*> each;
    for (const auto& m : moments) each.push_back(&m);
    // Kept as sent, in the wire's 8-bit codes.
    second_moments_ = pack_second_moments(specs_, average_second_moments(each, moment_weights));
  }
  if (s.aggregated && !first_moments.empty()) {
    std::vector<const Weights*> each;
    for (const auto& m : first_moments) each.push_back(&m);
    set_first_moments(average_first_moments(each, first_moment_weights));
  }
  if (s.aggregated) {
    s.train_loss = loss_sum / static_cast<double>(s.tokens);
    ++done_;
    retries_ = 0;
    lineage_.push_back({{"round", s.round}, {"clients", lineage_clients}});
  } else if (!secure_error.empty()) {
    ++retries_;
    log::warn("fed server: ", secure_error, "; nothing is applied and the round is retried");
  } else {
    ++retries_;
    log::warn("fed server: round ", s.round, " got ", ups.size(), " updates, fewer than ",
              config_.strategy.min_clients, "; the round is retried");
  }
  const double wall = std::chrono::duration<double>(Clock::now() - round_start_).count();
  s.wall_s = wall;
  s.bytes_sent = bytes_sent_;
  s.bytes_received = bytes_received;
  s.eval_loss = evals.empty() ? std::nan("") : Strategy::aggregate_evaluate(evals).loss;
  nlohmann::ordered_json m{{"round", s.round},
                           {"status", s.aggregated ? "aggregated" : "retry"},
                           {"selected", s.selected.size()},
                           {"participants", s.participants},
                           {"dropped", s.dropped},
                           {"tokens", s.tokens},
                           {"bytes_sent", bytes_sent_},
                           {"bytes_received", bytes_received},
                           {"wall_s", wall}};
  if (config_.secure_aggregation.enabled) {
    m["secagg_bytes_received"] = secagg_bytes_in_;
    m["secagg_bytes_sent"] = secagg_bytes_out_;
    if (!secure_error.empty()) m["secagg_error"] = secure_error;
  }
  if (s.aggregated) m["train_loss"] = s.train_loss;
  if (!evals.empty()) m["eval_loss"] = s.eval_loss;
  if (s.aggregated) {
    m["aggregation"] = dp_                                  ? "dp_mean"
                       : config_.secure_aggregation.enabled ? "secure_mean"
                                                            : config_.strategy.robust.aggregation;
    m["clipped"] = report.clipped();
    m["rejected"] = report.rejected();
    if (dp_) m["privacy"] = report.extra;
    for (const auto& [id, r] : report.clients) {
      auto& c = clients[id];
      c["update_norm"] = r.norm;
      c["clipped"] = r.clipped;
      c["rejected"] = r.rejected;
      if (r.trimmed >= 0) c["trimmed"] = r.trimmed;
    }
  }
  m["clients"] = clients;
  metrics_.write(m);
  record_status(s);
  if (s.aggregated) {
    write_tensorboard(s, m);
    lineage_file_.write({{"round", s.round}, {"clients", lineage_clients}});
    save_checkpoint(s);
    log::info("fed server: round ", s.round, " done: ", s.participants.size(), " clients, ",
              s.tokens, " tokens, train loss ", s.train_loss,
              evals.empty() ? "" : cat(", eval loss ", s.eval_loss), ", ", bytes_received,
              " bytes in, ", bytes_sent_, " out, ", wall, " s");
  } else {
    metrics_.file().flush();
  }
  if (done_ >= config_.rounds || retries_ > config_.max_round_retries) {
    if (retries_ > config_.max_round_retries) {
      stopped_ = cat("round ", s.round, " failed ", retries_, " times (server.max_round_retries ",
                     config_.max_round_retries, ")");
      log::error("fed server: ", stopped_, "; stopping");
    }
    finished_ = true;
  }
  show_progress_locked();
  if (finished_ && progress_) progress_->finish();
  changed_.notify_all();
  return s;
}

void Coordinator::show_progress_locked() {
  if (!progress_) return;
  const std::string fields = open_ ? cat("round ", done_ + 1, ": ", updates_.size(), "/",
                                         selected_.size(), " clients reported")
                                   : cat("rounds done, ", alive_locked(), " clients connected");
  progress_->update(done_, fields, /*force=*/true);
}

void Coordinator::run() {
  while (!stop_) {
    {
      std::unique_lock lock(mutex_);
      if (finished_) break;
      const auto give_up =
          Clock::now() + std::chrono::duration_cast<Clock::duration>(
                             std::chrono::duration<double>(config_.wait_for_clients_s));
      while (!stop_ && static_cast<int64_t>(alive_locked()) < config_.strategy.min_clients) {
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
      std::lock_guard lock(mutex_);
      open_ = false;  // the unfinished round is redone after a restart
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

void Coordinator::record_status(const RoundSummary& s) {
  totals_.last = s;
  totals_.bytes_sent_total += s.bytes_sent;
  totals_.bytes_received_total += s.bytes_received;
  totals_.dropped_total += static_cast<int64_t>(s.dropped.size());
  totals_.retries_total += s.aggregated ? 0 : 1;
  totals_.tokens_total += s.aggregated ? s.tokens : 0;
}

void Coordinator::write_tensorboard(const RoundSummary& s,
                                    const nlohmann::ordered_json& round_metrics) {
  const double now = obs::wall_time_now();
  auto add = [&](const std::string& tag, double value) {
    tensorboard_.add_scalar(tag, value, s.round, now);
  };
  add("fed/train_loss", s.train_loss);
  if (!std::isnan(s.eval_loss)) add("fed/eval_loss", s.eval_loss);
  add("fed/participants", static_cast<double>(s.participants.size()));
  add("fed/dropped", static_cast<double>(s.dropped.size()));
  add("fed/tokens", static_cast<double>(s.tokens));
  add("fed/bytes_sent", static_cast<double>(s.bytes_sent));
  add("fed/bytes_received", static_cast<double>(s.bytes_received));
  add("fed/wall_s", s.wall_s);
  for (const auto& [id, loss] : s.client_train_loss) add("client/" + id + "/train_loss", loss);
  for (const auto& [id, loss] : s.client_eval_loss) add("client/" + id + "/eval_loss", loss);
  for (const char* key : {"clipped", "rejected"})
    if (round_metrics.contains(key)) add(cat("fed/", key), round_metrics.at(key).get<double>());
  if (round_metrics.contains("privacy"))
    for (const auto& [key, value] : round_metrics.at("privacy").items())
      if (value.is_number()) add("privacy/" + key, value.get<double>());
  tensorboard_.file().flush();
}

ServerStatus Coordinator::status() const {
  std::lock_guard lock(mutex_);
  ServerStatus st = totals_;
  st.rounds_done = done_;
  st.rounds_total = config_.rounds;
  st.open_round = open_ ? done_ + 1 : 0;
  st.clients_joined = clients_.size();
  st.clients_alive = alive_locked();
  return st;
}

Weights Coordinator::global_weights() const {
  std::lock_guard lock(mutex_);
  return clone_weights(global_);
}

}  // namespace pollen::fed
