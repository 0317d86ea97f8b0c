#include "train/dpo.h"

#include <cstdio>
#include <filesystem>

#include "autograd/sequence_logprob.h"
#include "base/error.h"
#include "base/files.h"
#include "base/hash.h"
#include "train/config.h"
#include "train/jsonl_data.h"

namespace pollen::train {
namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace {

// Every number of the architecture that the forward reads.
std::string architecture_key(const model::LlamaConfig& c) {
  const auto g = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.17g ", v);
    return std::string(buf);
  };
  const ops::RopeScaling& s = c.rope_scaling;
  return cat(c.vocab_size, " ", c.hidden_size, " ", c.intermediate_size, " ", c.num_hidden_layers,
             " ", c.num_attention_heads, " ", c.num_key_value_heads, " ", c.resolved_head_dim(),
             " ", c.max_position_embeddings, " ", c.sliding_window, " ", c.tie_word_embeddings, " ",
             c.attention_bias, " ", static_cast<int>(s.kind), " ",
             s.original_max_position_embeddings, " ", g(c.rope_theta), g(c.rms_norm_eps),
             g(s.factor), g(s.low_freq_factor), g(s.high_freq_factor), g(s.attention_factor),
             g(s.beta_fast), g(s.beta_slow));
}

// SHA-256 over the architecture and every parameter's name and bytes: two models of the same
// weights but another rope_theta score differently.
std::string model_sha256(const model::Llama& model) {
  Sha256 h;
  h.update(architecture_key(model.config()));
  for (const auto& [name, v] : model.named_parameters()) {
    h.update(name);
    const Tensor t = v.value().contiguous();
    h.update(t.raw(), t.nbytes());
  }
  return h.hex_digest();
}

}  // namespace

ag::Var completion_logps(const model::Llama& model, const SequenceBatch& batch) {
  const ag::Var h = model.hidden_states(batch.batch);  // (B*T,C)
  return ag::sequence_logprobs(h, model.head_weight(), batch.batch.targets, batch.rows);
}

DpoObjective::DpoObjective(ObjectiveContext context) : context_(std::move(context)) {
  ConfigTable& s = context_.section;
  data_path_ = resolve_config_path(context_.base_dir, s.require_string("data"));
  const std::string validation = s.get_string("validation", "");
  if (!validation.empty()) eval_path_ = resolve_config_path(context_.base_dir, validation);
  const double validation_fraction = s.get_double("validation_fraction", 0.0);
  POLLEN_CHECK(validation.empty() != (validation_fraction == 0), s.where("validation"),
               ": held-out pairs come from validation (a file) or validation_fraction (of data); "
               "set exactly one");
  loss_.kind = preference_loss_named(s.get_string("loss", "sigmoid"), s.where("loss"));
  loss_.beta = s.get_double("beta", 0.1);
  POLLEN_CHECK(loss_.beta > 0, s.where("beta"), ": expected a positive number");
  loss_.label_smoothing = s.get_double("label_smoothing", 0.0);
  POLLEN_CHECK(loss_.label_smoothing >= 0 && loss_.label_smoothing < 0.5,
               s.where("label_smoothing"), ": expected a number in [0, 0.5)");
  POLLEN_CHECK(loss_.label_smoothing == 0 || loss_.kind == PreferenceLossKind::sigmoid,
               s.where("label_smoothing"), ": applies to the sigmoid loss only");
  batch_pairs_ = s.get_int("batch_pairs", 8);
  POLLEN_CHECK(batch_pairs_ > 0, s.where("batch_pairs"), ": expected a positive integer");
  micro_batch_pairs_ = s.get_int("micro_batch_pairs", 4);
  POLLEN_CHECK(micro_batch_pairs_ > 0, s.where("micro_batch_pairs"),
               ": expected a positive integer");
  s.finish();
  POLLEN_CHECK(context_.tokenizer != nullptr, "dpo: no tokenizer");

  const SequenceFormat format{context_.tokenizer, context_.chat_format, context_.max_seq};
  train_pairs_ = read_preference_pairs(data_path_, format);
  if (!eval_path_.empty()) {
    if (jsonl_has_records(eval_path_)) eval_pairs_ = read_preference_pairs(eval_path_, format);
  } else {
    eval_pairs_ = split_off_validation(train_pairs_, validation_fraction, context_.seed,
                                       s.where("validation_fraction"));
  }
  log_pair_counts("dpo", train_pairs_, eval_pairs_, context_.max_seq);

  // What the references depend on besides the model: the data and how it becomes tokens.
  identity_.emplace("dpo.data", data_path_, "dpo.validation", eval_path_, context_);
  identity_->add("split", "max_seq, dpo.validation_fraction or the seed",
                 std::to_string(context_.max_seq) + " " + std::to_string(validation_fraction) +
                     " " + std::to_string(context_.seed));
}

fs::path DpoObjective::cache_path(const std::string& file) const {
  return context_.run_dir / file;
}

void DpoObjective::load_cache(const fs::path& path, const std::string& data_key) {
  json cache;
  try {
    cache = json::parse(read_file(path));
  } catch (const json::exception& e) {
    fail("'", path.string(), "' is not valid JSON: ", e.what());
  }
  POLLEN_CHECK(cache.value("format", "") == "pollen-dpo-reference-v1", "'", path.string(),
               "': expected format \"pollen-dpo-reference-v1\"");
  POLLEN_CHECK(cache.value("data_key", "") == data_key, "'", path.string(),
               "' holds reference log-probabilities of other data: the data files, tokenizer or "
               "sequence length changed since the run started");
  auto refs = std::make_unique<ReferenceLogps>();
  refs->train = cache.at("train").get<std::vector<double>>();
  refs->eval = cache.at("eval").get<std::vector<double>>();
  POLLEN_CHECK(
      refs->train.size() == 2 * train_pairs_.size() && refs->eval.size() == 2 * eval_pairs_.size(),
      "'", path.string(), "': expected ", 2 * train_pairs_.size(), " and ", 2 * eval_pairs_.size(),
      " reference log-probabilities");
  references_ = std::move(refs);
}

const ReferenceLogps& DpoObjective::references(const model::Llama& model) {
  if (references_) return *references_;
  const std::string model_hash = model_sha256(model);
  cache_file_ =
      "dpo_reference_" + sha256_hex(identity_->key() + model_hash).substr(0, 16) + ".json";
  // Under several ranks, which compute the references together, only when every rank sees it.
  std::vector<double> cached{
      !context_.run_dir.empty() && fs::exists(cache_path(cache_file_)) ? 1.0 : 0.0};
  share_.sum(cached, "whether every rank has the DPO reference cache");
  if (cached[0] == (share_.comm ? share_.comm->world() : 1)) {
    load_cache(cache_path(cache_file_), identity_->key());
    return *references_;
  }
  // Each pair's chosen and rejected completions under the starting model, without gradients.
  // Under LoRA that is the frozen base (the adapters disabled), whatever the adapters hold now.
  // Ranks split the micro-batches round robin and gather the values by summing.
  const model::Llama reference = model.lora() ? model.without_lora() : model;
  auto compute = [&](const std::vector<PreferencePair>& pairs) {
    ag::NoGrad no_grad;
    std::vector<double> out(2 * pairs.size(), 0.0);
    std::vector<size_t> all(pairs.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    const auto chunks = micro_batches(all, micro_batch_pairs_);
    for (size_t c = 0; c < chunks.size(); ++c) {
      if (!share_.owns(c)) continue;
      const std::vector<size_t>& chunk = chunks[c];
      const std::vector<double> logps =
          completion_logps(reference, pair_batch(pairs, chunk, 0)).value().to_doubles();
      for (size_t j = 0; j < chunk.size(); ++j) {
        out[chunk[j]] = logps[j];
        out[pairs.size() + chunk[j]] = logps[chunk.size() + j];
      }
    }
    share_.sum(out, "the reference log-probabilities");
    return out;
  };
  auto refs = std::make_unique<ReferenceLogps>();
  refs->train = compute(train_pairs_);
  refs->eval = compute(eval_pairs_);
  references_ = std::move(refs);
  if (!context_.run_dir.empty() && (!share_.comm || share_.comm->rank() == 0)) {
    json cache{{"format", "pollen-dpo-reference-v1"},
               {"data_key", identity_->key()},
               {"model_sha256", model_hash},
               {"data", data_path_.string()},
               {"validation", eval_path_.string()},
               {"train", references_->train},
               {"eval", references_->eval}};
    fs::create_directories(context_.run_dir);
    write_file_atomic(cache_path(cache_file_), cache.dump());
  }
  return *references_;
}

PreferenceStats DpoObjective::run_pairs(const model::Llama& model,
                                        const std::vector<PreferencePair>& pairs,
                                        const std::vector<double>& ref,
                                        const std::vector<size_t>& indices, double scale,
                                        bool backward, int64_t* tokens) const {
  PreferenceStats stats;
  const auto chunks = micro_batches(indices, micro_batch_pairs_);
  for (size_t c = 0; c < chunks.size(); ++c) {
    const std::vector<size_t>& chunk = chunks[c];
    if (!share_.runs(c, model)) continue;
    const SequenceBatch batch = pair_batch(pairs, chunk, 0);
    std::vector<double> chunk_ref;  // (2m): chosen, then rejected
    for (size_t i : chunk) chunk_ref.push_back(ref[i]);
    for (size_t i : chunk) chunk_ref.push_back(ref[pairs.size() + i]);
    *tokens += batch.tokens;
    if (backward) {
      ag::Tape tape;
      ag::Var loss;
      {
        ag::TapeScope scope(tape);
        loss = preference_loss(completion_logps(model, batch), chunk_ref, batch.completion_tokens,
                               loss_, scale, &stats);
      }
      tape.backward(loss);
    } else {
      ag::NoGrad no_grad;
      preference_loss(completion_logps(model, batch), chunk_ref, batch.completion_tokens, loss_,
                      scale, &stats);
    }
  }
  if (share_.comm) {
    if (backward) share_.reducer->finish();  // the gradients summed over the ranks
    stats.sum_over(*share_.comm, *tokens);
  }
  return stats;
}

namespace {
ObjectiveStep step_report(const PreferenceStats& stats, int64_t tokens) {
  ObjectiveStep out;
  out.loss = stats.loss / static_cast<double>(std::max<int64_t>(stats.pairs, 1));
  out.tokens = tokens;
  for (const auto& [k, v] : stats.means()) out.metrics[k] = v;
  return out;
}
}  // namespace

ObjectiveStep DpoObjective::train_step(const model::Llama& model, int64_t step) {
  const ReferenceLogps& refs = references(model);
  const auto indices = pairs_of_step(train_pairs_.size(), batch_pairs_, step, context_.seed);
  int64_t tokens = 0;
  // The step's loss is the mean over its pairs, whichever micro-batch each is in.
  const PreferenceStats stats = run_pairs(model, train_pairs_, refs.train, indices,
                                          1.0 / static_cast<double>(batch_pairs_), true, &tokens);
  return step_report(stats, tokens);
}

ObjectiveStep DpoObjective::evaluate(const model::Llama& model) {
  const ReferenceLogps& refs = references(model);
  std::vector<size_t> all(eval_pairs_.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  int64_t tokens = 0;
  const PreferenceStats stats =
      run_pairs(model, eval_pairs_, refs.eval, all, 1.0 / static_cast<double>(eval_pairs_.size()),
                false, &tokens);
  return step_report(stats, tokens);
}

json DpoObjective::state() const {
  json state = {{"reference_cache", cache_file_}};
  state.update(identity_->state());
  return state;
}

void DpoObjective::restore(const json& state) {
  identity_->check(state, "dpo");
  cache_file_ = state.value("reference_cache", "");
  if (cache_file_.empty()) return;  // saved before the references were known
  POLLEN_CHECK(!context_.run_dir.empty(), "dpo: resuming needs the run folder's reference cache");
  const fs::path path = cache_path(cache_file_);
  POLLEN_CHECK(fs::exists(path), "dpo: the run's reference log-probabilities '", path.string(),
               "' are missing; they cannot be recomputed from a trained model");
  load_cache(path, identity_->key());
}

std::unique_ptr<Objective> make_dpo_objective(ObjectiveContext context) {
  return std::make_unique<DpoObjective>(std::move(context));
}

}  // namespace pollen::train
