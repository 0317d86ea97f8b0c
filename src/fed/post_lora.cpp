#include "fed/post_lora.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "autograd/tape.h"
#include "base/config.h"
#include "base/files.h"
#include "base/hash.h"
#include "base/json_depth.h"
#include "fed/strategy.h"
#include "io/peft.h"
#include "io/safetensors.h"
#include "optim/schedule.h"
#include "train/config.h"
#include "train/dpo.h"
#include "train/grpo.h"
#include "train/reward.h"
#include "train/sft.h"
#include "train/trainer.h"

namespace pollen::fed {
namespace {

std::string targets_text(const std::vector<model::LoraTarget>& targets) {
  std::string s = "[";
  for (const auto t : targets)
    s += std::string(s.size() > 1 ? ", " : "") + model::lora_target_name(t);
  return s + "]";
}

}  // namespace

ParamSpecs lora_specs(const model::Lora& lora) {
  ParamSpecs out;
  for (const auto& [name, v] : lora.named_parameters()) out.push_back({name, v.value().shape()});
  return out;
}

Weights lora_weights(const model::Lora& lora) {
  Weights out;
  for (const auto& [name, v] : lora.named_parameters()) out.push_back(v.value().to(DType::f32));
  return out;
}

void set_lora_weights(const model::Lora& lora, const Weights& w) {
  const auto params = lora.named_parameters();
  POLLEN_CHECK(params.size() == w.size(), "adapters: ", w.size(), " tensors for ", params.size());
  for (size_t i = 0; i < w.size(); ++i) {
    ag::Var v = params[i].second;
    POLLEN_CHECK(v.value().shape() == w[i].shape(), "adapters: tensor '", params[i].first, "' is ",
                 shape_str(v.value().shape()), ", got ", shape_str(w[i].shape()));
    v.value().copy_(w[i].to(v.value().dtype()));
  }
}

io::NamedTensors initial_objective_params(const std::string& objective,
                                          const model::LlamaConfig& base, uint64_t seed) {
  if (objective == "rm") return {{"score.weight", train::initial_score_head(base, seed)}};
  return {};
}

ParamSpecs post_specs(const model::Lora& lora, const io::NamedTensors& objective) {
  ParamSpecs specs = lora_specs(lora);
  for (const auto& [name, t] : objective) specs.push_back({name, t.shape()});
  return specs;
}

Weights post_weights(const model::Lora& lora, const io::NamedTensors& objective) {
  Weights w = lora_weights(lora);
  for (const auto& [name, t] : objective) w.push_back(t.to(DType::f32));
  return w;
}

void set_post_weights(const model::Lora& lora, const io::NamedTensors& objective, const Weights& w,
                      const std::string& what) {
  const size_t adapters = lora.named_parameters().size();
  POLLEN_CHECK(w.size() == adapters + objective.size(), what, ": ", w.size(), " tensors for ",
               adapters, " of B and ", objective.size(), " of the objective's");
  set_lora_weights(lora, Weights(w.begin(), w.begin() + static_cast<std::ptrdiff_t>(adapters)));
  for (size_t i = 0; i < objective.size(); ++i) {
    const auto& [name, t] = objective[i];
    POLLEN_CHECK(t.shape() == w[adapters + i].shape(), what, ": tensor '", name, "' is ",
                 shape_str(t.shape()), ", got ", shape_str(w[adapters + i].shape()));
    Tensor(t).copy_(w[adapters + i]);
  }
}

// ---- the server's global state ------------------------------------------------------------------

PostGlobal::PostGlobal(const model::LlamaConfig& base, const model::LoraConfig& lora,
                       const std::string& objective, uint64_t seed)
    : lora_(base, lora),
      objective_params_(initial_objective_params(objective, base, seed)),
      specs_(post_specs(lora_, objective_params_)) {}

void PostGlobal::save(const std::filesystem::path& dir, const std::string& base_name) const {
  io::save_peft_adapter(lora_, dir, base_name);
  if (objective_params_.empty()) return;
  // Written atomically, as the adapter is: a reader never sees a torn file.
  io::write_safetensors_atomic(dir / "objective.safetensors", objective_params_,
                               {{"format", "pt"}});
}

void export_federated_reward_model(const train::PostConfig& config, const PostGlobal& global,
                                   const std::filesystem::path& dir) {
  POLLEN_CHECK(global.objective_params().size() == 1,
               "export_federated_reward_model: the "
               "federation's objective has no score head");
  const train::PostBase base = train::resolve_post_base(config);
  const model::Llama merged =
      model::merge_lora(io::load_model(base.source, DType::f32, config.seed), global.lora());
  ConfigTable section = config.objective_section();
  const uint32_t pad = train::rm_pad_token_id(section, *base.tokenizer);
  train::export_reward_model_with_tokenizer(merged, ag::Var(global.objective_params()[0].second),
                                            pad, base.tokenizer_path, dir);
}

std::string lora_agreement_differences(const model::LoraConfig& s, const model::LoraConfig& c,
                                       std::pair<const char*, const char*> names) {
  std::string out;
  auto differ = [&](const char* key, const std::string& server, const std::string& client) {
    if (server != client)
      out += cat(out.empty() ? "" : "; ", "lora.", key, ": ", names.first, " ", server, ", ",
                 names.second, " ", client);
  };
  auto num = [](double v) { return cat(v); };
  differ("rank", cat(s.rank), cat(c.rank));
  differ("alpha", num(s.alpha), num(c.alpha));
  differ("dropout", num(s.dropout), num(c.dropout));
  differ("target_modules", targets_text(s.targets), targets_text(c.targets));
  differ("rslora", s.rslora ? "true" : "false", c.rslora ? "true" : "false");
  differ("train_a", s.train_a ? "true" : "false", c.train_a ? "true" : "false");
  differ("seed", cat(s.seed), cat(c.seed));
  return out;
}

std::string lora_config_json(const model::LoraConfig& c) {
  nlohmann::json targets = nlohmann::json::array();
  for (const auto t : c.targets) targets.push_back(model::lora_target_name(t));
  const nlohmann::json j{{"rank", c.rank},     {"alpha", c.alpha},          {"dropout", c.dropout},
                         {"rslora", c.rslora}, {"target_modules", targets}, {"train_a", c.train_a},
                         {"seed", c.seed}};
  return j.dump();  // keys sorted
}

model::LoraConfig parse_lora_config_json(const std::string& text, const std::string& what) {
  POLLEN_CHECK(text.size() <= 4096, what, ": the LoRA config is ", text.size(),
               " bytes, more than 4096");
  model::LoraConfig c;
  try {
    check_json_depth(text, what);
    const nlohmann::json j = nlohmann::json::parse(text);
    POLLEN_CHECK(j.is_object() && j.size() == 7, what,
                 ": expected the LoRA config's 7 keys (rank, alpha, dropout, rslora, "
                 "target_modules, train_a, seed)");
    c.rank = j.at("rank").get<int64_t>();
    c.alpha = j.at("alpha").get<double>();
    c.dropout = j.at("dropout").get<double>();
    c.rslora = j.at("rslora").get<bool>();
    c.train_a = j.at("train_a").get<bool>();
    c.seed = j.at("seed").get<uint64_t>();
    c.targets.clear();
    for (const auto& t : j.at("target_modules"))
      c.targets.push_back(model::parse_lora_target(t.get<std::string>(), what));
  } catch (const nlohmann::json::exception& e) {
    fail(what, ": the LoRA config is not valid: ", e.what());
  }
  try {
    c.validate();
  } catch (const Error& e) {
    fail(what, ": ", e.what());
  }
  return c;
}

std::string post_agreement_differences(const pb::JoinRequest& client, const ServerTerms& terms) {
  const std::string& lora_json = terms.lora_json;
  if (lora_json.empty() && client.lora_config().empty()) return "";  // pre-training, both
  if (lora_json.empty())
    return "post-training: the server trains the whole model, the client LoRA adapters ([post])";
  if (client.lora_config().empty())
    return "post-training: the server exchanges LoRA adapters ([post]), the client the whole "
           "model";
  std::string out = lora_agreement_differences(
      parse_lora_config_json(lora_json, "the server's LoRA config"),
      parse_lora_config_json(client.lora_config(), "the client's LoRA config"));
  if (client.base_fingerprint() != terms.base_sha256)
    out += cat(out.empty() ? "" : "; ", "base weights (SHA-256): server ", terms.base_sha256,
               ", client ", client.base_fingerprint().substr(0, 80));
  if (client.post_objective() != terms.post_objective)
    out += cat(out.empty() ? "" : "; ", "post.objective: server ", terms.post_objective,
               ", client ", client.post_objective().substr(0, 16));
  return out;
}

train::ObjectiveFactory lora_objective_factory(const std::string& objective,
                                               const std::string& where, const std::string& base) {
  if (objective == "sft") return train::make_sft_objective;
  if (objective == "dpo") return train::make_dpo_objective;
  if (objective == "rm") return train::make_reward_objective;
  if (objective == "grpo") {
    return [base](const train::ObjectiveContext& context) {
      return train::make_grpo_objective(context, base);
    };
  }
  fail(where, ": the objective '", objective,
       "' does not federate; expected \"sft\", \"dpo\", \"grpo\" or \"rm\"");
}

PostBaseInfo read_post_base(const PostSettings& post) {
  const train::PostConfig config = train::load_post_config(post.run, post.objective);
  POLLEN_CHECK(config.lora.enabled, "post.run '", post.run.string(),
               "': no [lora] table; a post-training federation exchanges LoRA adapters");
  POLLEN_CHECK(!config.lora.config.train_a, "post.run '", post.run.string(),
               "': lora.train_a must be false (A frozen from the shared lora.seed), which makes "
               "averaging B exact");
  const train::PostBase base = train::resolve_post_base(config);
  const model::Llama model = io::load_model(base.source, DType::f32, config.seed);
  PostBaseInfo info;
  info.base = config.base;
  info.architecture = model.config();
  info.base_sha256 = model::weights_sha256(model);
  info.tokenizer_fingerprint = base.tokenizer->fingerprint();
  info.lora = config.lora.config;
  info.seed = config.seed;
  info.schedule = config.schedule;
  return info;
}

void warn_if_schedule_ends_early(const optim::Schedule& s, const std::filesystem::path& run,
                                 int64_t federation_steps) {
  const double end = optim::lr_at(s, s.total_steps);
  if (federation_steps <= s.total_steps || end >= s.lr) return;
  log::warn("'", run.string(), "': train.steps (", s.total_steps, ") is fewer than the ",
            federation_steps, " local steps of the federation (rounds x local_steps): past it its ",
            "schedule keeps the rate at ", end, ", and the silos learn ",
            end == 0 ? "nothing" : "slowly", " in the rounds after; set train.steps to ",
            federation_steps);
}

train::PostConfig silo_post_config(const PostSettings& post) {
  const std::string data = std::filesystem::absolute(post.data).string();
  POLLEN_CHECK(std::filesystem::exists(data), "post.data: '", post.data, "' does not exist");
  train::PostConfig run = train::load_post_config(
      post.run, post.objective, {post.objective + ".data=" + train::toml_string(data)});
  // A silo's ranks take client.toml's [parallel]; the run file's would be silently ignored.
  POLLEN_CHECK(run.zero == 0, "post.run '", post.run.string(),
               "': parallel.zero = 1 does not apply to a federated silo, which keeps its "
               "adapters' AdamW state whole; its ranks take client.toml's [parallel]");
  return run;
}

// ---- a silo ------------------------------------------------------------------------------------

LoraSilo::LoraSilo(std::string id, const train::PostConfig& config,
                   const train::ObjectiveFactory& make_objective)
    : id_(std::move(id)), config_(config), model_([&] {
        POLLEN_CHECK(config.lora.enabled, "silo '", id_, "': its run file '", config.source,
                     "' has no [lora] table; federated post-training exchanges adapters");
        POLLEN_CHECK(!config.lora.config.train_a, "silo '", id_, "': '", config.source,
                     "' sets lora.train_a = true; federated post-training keeps A frozen from the "
                     "shared lora.seed (set lora.train_a = false), which makes averaging B exact");
        const train::PostBase base = train::resolve_post_base(config);
        return io::load_model(base.source, DType::f32, config.seed);
      }()) {
  const train::PostBase base = train::resolve_post_base(config);
  base_sha256_ = model::weights_sha256(model_);
  tokenizer_ = base.tokenizer;
  tokenizer_fingerprint_ = tokenizer_->fingerprint();
  train::TrainedParameters trained = train::trained_model_parameters(model_, config.lora);
  lora_ = trained.lora;
  trained_ = trained.named;
  // run_dir: DPO's reference cache, which a restarted client reads again.
  const train::ObjectiveContext ctx{config.objective_section(),
                                    config.base_dir,
                                    tokenizer_.get(),
                                    base.chat_format,
                                    config.seed,
                                    model_.config().max_position_embeddings,
                                    model_.config(),
                                    config.dir,
                                    std::string(),  // the factory holds the base
                                    io::model_stop_tokens(base.source, *tokenizer_)};
  objective_ = make_objective(ctx);
  // The data version: the objective's section (which names the data) and the data file.
  Sha256 data;
  data.update(config.objective_identity);
  ConfigTable section = config.objective_section();
  if (section.has("data")) {
    const std::filesystem::path file(section.get_string("data", ""));
    data.update(sha256_file(file.is_absolute() ? file : config.base_dir / file));
  }
  data_hash_ = data.hex_digest();
  // The objective's own parameters (a reward model's head) train and travel beside B.
  for (const auto& [name, v] : objective_->extra_parameters()) {
    trained_.emplace_back(name, v);
    objective_params_.emplace_back(name, v.value());  // the same storage, trained in place
  }
  for (const auto& [n, v] : trained_) params_.push_back(v);
  opt_ = std::make_unique<optim::AdamW>(params_, config.optimizer.adamw(config.grad_clip),
                                        train::decay_mask(trained_, config.optimizer.no_decay));
}

RoundTrainer::Result LoraSilo::train(int64_t steps) {
  return on_every_rank_or_none(comm_, id_, [&] { return train_steps(steps); });
}

double LoraSilo::evaluate(int64_t* tokens) {
  return on_every_rank_or_none(comm_, id_, [&] { return evaluate_share(tokens); });
}

RoundTrainer::Result LoraSilo::train_steps(int64_t steps) {
  const auto start = std::chrono::steady_clock::now();
  Result r;
  double loss_sum = 0;
  for (auto& p : params_) p.zero_grad();
  for (int64_t s = 0; s < steps; ++s) {
    train::inject_fault_at(fault_, comm_ ? comm_->rank() : 0, step_ + 1, reducer_.get());
    lora_->set_dropout_step(static_cast<uint64_t>(step_));
    const train::ObjectiveStep st = objective_->train_step(model_, step_ + 1);
    lora_->disable_dropout();
    // The loss is the whole step's on every rank: the round fails on all of them alike.
    if (!std::isfinite(st.loss))
      throw RoundFailure(cat("silo '", id_, "': non-finite loss at local step ", step_ + 1));
    opt_->step(optim::lr_at(config_.schedule, step_));
    for (auto& p : params_) p.zero_grad();
    ++step_;
    loss_sum += st.loss;
    r.tokens += st.tokens;
    for (const auto& [name, value] : st.metrics.items())
      if (value.is_number()) r.metrics[name] += value.get<double>();
  }
  r.loss = steps > 0 ? loss_sum / static_cast<double>(steps) : 0;
  for (auto& [name, sum] : r.metrics) sum /= static_cast<double>(steps);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

void LoraSilo::split_across(dist::Communicator& comm, double bucket_mb) {
  comm_ = &comm;
  reducer_ = std::make_unique<dist::GradReducer>(
      comm, params_, static_cast<int64_t>(bucket_mb * 1048576.0), dist::ReduceMode::all_reduce);
  objective_->split_across(comm, *reducer_);
}

std::unique_ptr<LoraSilo> make_lora_silo(const ClientConfig& config, dist::Communicator* comm) {
  const train::PostConfig run = silo_post_config(config.post);
  auto silo = std::make_unique<LoraSilo>(
      config.id, run, lora_objective_factory(config.post.objective, "post.objective", run.base));
  if (comm != nullptr && comm->world() > 1) silo->split_across(*comm, config.parallel.bucket_mb);
  return silo;
}

train::ObjectiveStep LoraSilo::evaluate_held_out() {
  ag::NoGrad no_grad;
  return objective_->evaluate(model_);
}

double LoraSilo::evaluate_share(int64_t* tokens) {
  ag::NoGrad no_grad;
  const train::ObjectiveStep st = objective_->evaluate(model_);
  const bool held_out = st.tokens > 0 && std::isfinite(st.loss);
  *tokens = held_out ? st.tokens : 0;
  return held_out ? st.loss : 0;
}

nlohmann::ordered_json LoraSilo::write_state(io::CheckpointWriter& w) const {
  io::NamedTensors adapters, moments;
  const train::OptimizerMoments m = train::moments_of(*opt_);
  for (size_t i = 0; i < trained_.size(); ++i) {
    adapters.emplace_back(trained_[i].first, trained_[i].second.value());
    moments.emplace_back(trained_[i].first + ".exp_avg", m.exp_avg[i]);
    moments.emplace_back(trained_[i].first + ".exp_avg_sq", m.exp_avg_sq[i]);
  }
  w.add_tensors("adapter.safetensors", adapters);
  w.add_tensors("optimizer.safetensors", moments,
                {{"step", std::to_string(opt_->steps_taken())}, {"optimizer", "adamw"}});
  return {{"local_steps", step_}, {"objective", objective_->state()}};
}

void LoraSilo::read_state(const std::filesystem::path& checkpoint,
                          const nlohmann::ordered_json& state) {
  std::vector<std::pair<std::string, Tensor>> into;
  for (const auto& [name, v] : trained_) into.emplace_back(name, v.value());
  train::load_checkpoint_tensors(checkpoint / "adapter.safetensors", into);
  train::OptimizerMoments m = train::moments_of(*opt_);  // filled in place
  train::load_optimizer_moments(checkpoint, trained_, m);
  opt_->set_steps_taken(m.steps);
  step_ = state.at("local_steps").get<int64_t>();
  objective_->restore(state.at("objective"));
}

// ---- `pollen fed post` --------------------------------------------------------------------------

SimConfig load_fed_post_config(const std::filesystem::path& path) {
  ConfigTable root = ConfigTable::load(path);
  const std::filesystem::path here = path.parent_path();
  auto relative = [&](const std::string& p) {
    const std::filesystem::path x(p);
    return x.is_absolute() ? x : (here / x).lexically_normal();
  };
  SimConfig c;
  c.command = "fed post";
  c.server.command = c.command;
  c.server.settings = root.flat();
  ServerConfig& server = c.server;
  auto f = root.table("federation");
  POLLEN_CHECK(f.has_value(), "config file '", path.string(), "': no [federation] table");
  server.post.run = relative(f->require_string("run"));
  POLLEN_CHECK(std::filesystem::is_regular_file(server.post.run), f->where("run"), ": '",
               server.post.run.string(), "' is no file; expected the silos' run file");
  // The silos' run file trains them: a resume warns of its changed keys as of the federation's.
  for (const auto& [key, value] : ConfigTable::load(server.post.run).flat())
    c.server.settings["run file: " + key] = value;
  server.post.objective = f->get_string("objective", server.post.objective);
  lora_objective_factory(server.post.objective, f->where("objective"));  // refuses the others
  const std::vector<std::string> silos = f->get_strings("silos");
  std::vector<std::string> data;
  for (const auto& d : f->get_strings("data")) data.push_back(relative(d).string());
  POLLEN_CHECK(!silos.empty(), f->where("silos"), ": expected the silos' ids");
  POLLEN_CHECK(data.size() == silos.size(), f->where("data"), ": expected one data file per ",
               "silo (", silos.size(), "), got ", data.size());
  server.dir = relative(f->require_string("output"));
  server.dir_key = "federation.output";
  server.rounds = f->get_int("rounds", 1);
  server.local_steps = f->get_int("local_steps", 10);
  server.eval_every = f->get_int("eval_every", 0);
  POLLEN_CHECK(server.rounds >= 1, f->where("rounds"), ": expected 1 or more");
  POLLEN_CHECK(server.local_steps >= 1 && server.local_steps <= kMaxLocalSteps,
               f->where("local_steps"), ": must be 1 to ", kMaxLocalSteps, ", got ",
               server.local_steps);
  POLLEN_CHECK(server.eval_every >= 0, f->where("eval_every"),
               ": expected 0 (only at the end) or more");
  for (size_t i = 0; i < data.size(); ++i)
    POLLEN_CHECK(std::filesystem::exists(data[i]), f->where(cat("data[", i, "]")), ": '", data[i],
                 "' does not exist");
  f->finish();
  for (size_t i = 0; i < silos.size(); ++i) {
    ClientConfig client;
    client.id = silos[i];
    check_client_id(client.id, f->where("silos"));
    // Two silos of one id would share a state folder and count as one in every round.
    POLLEN_CHECK(std::find(silos.begin(), silos.begin() + static_cast<std::ptrdiff_t>(i),
                           silos[i]) == silos.begin() + static_cast<std::ptrdiff_t>(i),
                 f->where("silos"), ": silo id '", silos[i], "' appears twice");
    client.post = {server.post.run, server.post.objective, data[i]};
    c.clients.push_back(std::move(client));
  }
  if (auto s = root.table("strategy")) {
    server.strategy = read_strategy_options(*s);
    // Only the adapters' B (and an objective's own parameters) travel: no token rows, no shared
    // optimizer moments; refused, not ignored, as the server refuses them with [post].
    const StrategyOptions& o = server.strategy;
    for (const auto& [key, off] : {std::pair{"row_weighting", !o.weights_rows()},
                                   std::pair{"second_moments", !o.shares_second_moments()},
                                   std::pair{"first_moments", !o.shares_first_moments()},
                                   std::pair{"embedding_lr_scale", o.embedding_lr_scale == 1.0}})
      POLLEN_CHECK(off, s->where(key),
                   ": a post-training federation exchanges only the LoRA adapters' B, which "
                   "has no token rows or shared optimizer moments; leave it out");
    s->finish();
  }
  read_compression(root, server);
  root.finish();
  return c;
}

}  // namespace pollen::fed
