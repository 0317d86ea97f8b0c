// The calls a client makes, bar secure aggregation's: join (the agreement check), task, pull
// the round's model and push an update (checked before and after its chunks arrive); and which
// clients are alive.
#include "fed/coordinator.h"

#include <algorithm>

#include "base/log.h"

namespace pollen::fed {

using Clock = std::chrono::steady_clock;

namespace {

// Whether round `round`'s task asks the clients to evaluate the global model (eval_every).
bool evaluates(const ServerConfig& c, int64_t round) {
  return c.eval_every > 0 && (round - 1) % c.eval_every == 0;
}

}  // namespace

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
  reply.set_post_objective(terms_.post_objective);
  reply.set_run_id(run_id_);
  try {
    check_join_request(r, terms_);
    const std::string id = check_peer(r.client_id(), peer_id, "join");
    std::lock_guard lock(mutex_);
    if (auto earlier = clients_.find(id);
        earlier != clients_.end() && earlier->second.manifest_hash != r.data_manifest_hash() &&
        std::chrono::duration<double>(Clock::now() - earlier->second.last_seen).count() <=
            config_.client_timeout_s)
      log::warn("fed server: client '", id, "' joined again with other data (",
                earlier->second.manifest_hash.substr(0, 16), " -> ",
                r.data_manifest_hash().substr(0, 16),
                ") while its earlier join is live: if two "
                "processes run with this id (one client.toml copied to two silos), each join "
                "replaces the other's and the other's updates are refused");
    clients_[id] = {r.data_manifest_hash(), Clock::now(), last_aggregated_round_locked(id)};
    revoked_.erase(id);
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
  touch_locked(id);
  pb::TaskReply t;
  t.set_update_round(open_ && updates_.count(id) ? done_ + 1 : it->second.last_aggregated_round);
  if (finished_) {
    t.set_kind(pb::TASK_DONE);
    t.set_stopped(stopped_);
    it->second.told_done = true;
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
  // A push of this attempt still arriving (its client may have lost the connection while the
  // server takes it in) is waited for: the round is not given again before it is held or failed.
  const auto arriving = pushing_.find(id);
  const bool pushing = arriving != pushing_.end() && arriving->second.attempt == attempts_;
  if (open_ && selected_.count(id) && !updates_.count(id) && may_train && !pushing) {
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
    t.set_evaluate(evaluates(config_, round));
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
  touch_locked(id);
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
    // An evaluation the round did not ask for would set the round's federated eval_loss.
    POLLEN_CHECK(
        evaluates(config_, info.round()) || (info.eval_tokens() == 0 && info.eval_loss() == 0),
        what, ": evaluation results (", info.eval_tokens(), " tokens, loss ", info.eval_loss(),
        ") for round ", info.round(), ", whose task asked for none (server.eval_every ",
        config_.eval_every, ")");
    // The lineage records the data each update was trained on: the data the client joined with.
    const auto joined = clients_.find(info.client_id());
    POLLEN_CHECK(
        joined != clients_.end() && joined->second.manifest_hash == info.data_manifest_hash(), what,
        ": trained on data of manifest hash '", info.data_manifest_hash().substr(0, 64),
        "', not the data it joined with ('",
        joined == clients_.end() ? std::string() : joined->second.manifest_hash,
        "'); a client whose data changed joins again");
    const auto open = pushing_.find(info.client_id());
    POLLEN_CHECK(open == pushing_.end() || open->second.attempt != attempts_, what,
                 ": another push from this client is still arriving for round ", info.round());
    const uint64_t serial = ++pushes_begun_;
    pushing_[info.client_id()] = {attempts_, serial};
    p.arriving = std::shared_ptr<void>(nullptr, [this, id = info.client_id(), serial](void*) {
      std::lock_guard arrived(mutex_);
      if (auto it = pushing_.find(id); it != pushing_.end() && it->second.serial == serial)
        pushing_.erase(it);
    });
    if (secagg_) secagg_->check_input(info.client_id());
    p.attempt = attempts_;
    touch_locked(info.client_id());
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
  if (secagg_) secagg_->add_input(p.info.client_id(), bytes);
  touch_locked(p.info.client_id());
  updates_.emplace(p.info.client_id(), std::move(u));
  // After the update is held: closing the input phase weighs every input's tokens.
  if (secagg_) advance_secagg_locked();
  show_progress_locked();
  changed_.notify_all();
  pb::PushReply reply;
  reply.set_accepted(true);
  return reply;
}

void Coordinator::check_push_open(const Push& p) const {
  std::lock_guard lock(mutex_);
  POLLEN_CHECK(open_ && p.info.round() == done_ + 1 && p.attempt == attempts_, "update from '",
               p.info.client_id(), "': round ", p.info.round(),
               " closed while the update was arriving");
}

int64_t Coordinator::last_aggregated_round_locked(const std::string& id) const {
  for (auto round = lineage_.rbegin(); round != lineage_.rend(); ++round) {
    if (!round->contains("clients")) continue;  // the record of the starting model
    for (const auto& c : round->at("clients"))
      if (c.at("client") == id) return round->at("round").get<int64_t>();
  }
  return 0;
}

void Coordinator::client_revoked(const std::string& id) {
  std::lock_guard lock(mutex_);
  if (!revoked_.insert(id).second) return;
  clients_.erase(id);  // no later round selects it
  if (open_ && selected_.count(id) && !updates_.count(id))
    log::warn("fed server: client '", id, "' of round ", done_ + 1,
              " has a revoked certificate; the round no longer waits for its update");
  changed_.notify_all();
}

void Coordinator::touch_locked(const std::string& id) {
  if (auto it = clients_.find(id); it != clients_.end()) it->second.last_seen = Clock::now();
}

std::vector<std::string> Coordinator::alive_ids_locked() const {
  const auto now = Clock::now();
  std::vector<std::string> alive;
  for (const auto& [id, c] : clients_) {
    if (std::chrono::duration<double>(now - c.last_seen).count() <= config_.client_timeout_s)
      alive.push_back(id);
  }
  return alive;
}

size_t Coordinator::clients_not_told_done() const {
  std::lock_guard lock(mutex_);
  const auto alive = alive_ids_locked();
  return std::count_if(alive.begin(), alive.end(),
                       [&](const std::string& id) { return !clients_.at(id).told_done; });
}

size_t Coordinator::alive_clients() const {
  std::lock_guard lock(mutex_);
  return alive_ids_locked().size();
}

}  // namespace pollen::fed
