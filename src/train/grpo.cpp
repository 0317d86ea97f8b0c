#include "train/grpo.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <span>

#include "autograd/functions.h"
#include "autograd/token_logprobs.h"
#include "base/error.h"
#include "base/log.h"
#include "base/rng.h"
#include "io/model_source.h"
#include "model/generate.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/open.h"
#include "train/config.h"
#include "train/jsonl_data.h"
#include "train/reward.h"

namespace pollen::train {
namespace {

constexpr uint64_t kOrderStream = 0x6772706f6f726472ULL;   // prompt order per epoch
constexpr uint64_t kSampleStream = 0x6772706f73616d70ULL;  // completions

LossAggregation aggregation_named(ConfigTable& section) {
  const std::string name = section.get_string("loss_aggregation", "sequence");
  if (name == "sequence") return LossAggregation::sequence;
  if (name == "token") return LossAggregation::token;
  if (name == "constant") return LossAggregation::constant;
  fail(section.where("loss_aggregation"),
       ": expected \"sequence\", \"token\" or \"constant\", got \"", name, "\"");
}

int64_t positive(ConfigTable& section, const std::string& key, int64_t fallback) {
  const int64_t v = section.get_int(key, fallback);
  POLLEN_CHECK(v >= 1, section.where(key), ": must be >= 1, got ", v);
  return v;
}

// The model's input and targets for a group of completions: row r is prompt + completion, its
// targets the next tokens with the prompt's masked (-100), padded to the longest row.
struct ScoredRows {
  model::Batch batch;
  std::vector<int64_t> first;  // per row: the flat index (r*T + t) of its first completion token
};

ScoredRows scored_rows(const std::vector<const std::vector<uint32_t>*>& prompts,
                       const std::vector<const std::vector<uint32_t>*>& completions) {
  const int64_t rows = static_cast<int64_t>(prompts.size());
  int64_t t_max = 1;
  for (int64_t r = 0; r < rows; ++r)
    t_max = std::max<int64_t>(t_max, prompts[r]->size() + completions[r]->size() - 1);
  Tensor tokens = Tensor::zeros({rows, t_max}, DType::i32);
  Tensor targets = Tensor::full({rows, t_max}, -100.0, DType::i32);
  ScoredRows out;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<uint32_t> seq = *prompts[r];
    seq.insert(seq.end(), completions[r]->begin(), completions[r]->end());
    const int64_t p = static_cast<int64_t>(prompts[r]->size());
    int32_t* tk = tokens.data<int32_t>() + r * t_max;
    int32_t* tg = targets.data<int32_t>() + r * t_max;
    for (int64_t t = 0; t + 1 < static_cast<int64_t>(seq.size()); ++t) {
      tk[t] = static_cast<int32_t>(seq[t]);
      if (t + 1 >= p) tg[t] = static_cast<int32_t>(seq[t + 1]);
    }
    out.first.push_back(r * t_max + p - 1);
  }
  out.batch = model::Batch::contiguous_rows(tokens, targets);
  return out;
}

// first[i]: the index of completion i's first token among all the batch's tokens, in order;
// first[n]: their count.
std::vector<size_t> token_offsets(const std::vector<std::vector<uint32_t>>& completions) {
  std::vector<size_t> first(completions.size() + 1, 0);
  for (size_t i = 0; i < completions.size(); ++i) first[i + 1] = first[i] + completions[i].size();
  return first;
}

// Fills r.tokens and r.rewards for every completion of r.prompt from the ranks that sampled
// them: this rank's completions `mine` (ascending) hold `tokens` and `rewards`. Each value is
// summed with the other ranks' zeros, so every rank ends with the batch one process samples.
void gather_completions(const RankShare& share, const std::vector<size_t>& mine,
                        const std::vector<std::vector<uint32_t>>& tokens,
                        const std::vector<double>& rewards, Rollouts& r) {
  const size_t n = r.prompt.size();
  std::vector<double> heads(2 * n, 0.0);  // per completion: its length and its reward
  for (size_t m = 0; m < mine.size(); ++m) {
    heads[2 * mine[m]] = static_cast<double>(tokens[m].size());
    heads[2 * mine[m] + 1] = rewards[m];
  }
  share.sum(heads, "the sampled completions' lengths and rewards");
  r.tokens.assign(n, {});
  for (size_t i = 0; i < n; ++i) r.tokens[i].resize(static_cast<size_t>(heads[2 * i]));
  const std::vector<size_t> first = token_offsets(r.tokens);
  std::vector<double> ids(first[n], 0.0);
  for (size_t m = 0; m < mine.size(); ++m)
    std::copy(tokens[m].begin(), tokens[m].end(),
              ids.begin() + static_cast<std::ptrdiff_t>(first[mine[m]]));
  share.sum(ids, "the sampled completions' tokens");
  r.rewards.clear();
  for (size_t i = 0; i < n; ++i) {
    for (size_t t = 0; t < r.tokens[i].size(); ++t)
      r.tokens[i][t] = static_cast<uint32_t>(ids[first[i] + t]);
    r.rewards.push_back(heads[2 * i + 1]);
  }
}

double mean_of(const std::vector<double>& v) {
  return v.empty() ? 0.0 : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

// A reward of (prompt text, completion, answer) as a rollout's.
RolloutReward rollout_reward(RewardFunction f) {
  return [f = std::move(f)](const GrpoPrompt& p, std::string_view completion) {
    return f(p.text, completion, p.answer);
  };
}

// The mean over groups (of `group` consecutive rewards) of each group's sample standard deviation,
// as TRL reports reward_std: the spread the advantages see, 0 when every group agrees.
double mean_group_std(const std::vector<double>& rewards, int64_t group) {
  const size_t g = static_cast<size_t>(group);
  if (g < 2 || rewards.size() < g) return 0.0;
  double sum = 0;
  const size_t groups = rewards.size() / g;
  for (size_t k = 0; k < groups; ++k) {
    const std::span<const double> one(rewards.data() + k * g, g);
    const double m = std::accumulate(one.begin(), one.end(), 0.0) / static_cast<double>(g);
    double s = 0;
    for (double x : one) s += (x - m) * (x - m);
    sum += std::sqrt(s / static_cast<double>(g - 1));
  }
  return sum / static_cast<double>(groups);
}

// Where a completion ends: where generate and chat stop for the model (its EOS ids), and at the
// chat template's end of turn and the EOS the post-processor appends.
std::vector<uint32_t> stop_tokens_for(const tokenizer::Tokenizer& tokenizer,
                                      const tokenizer::ChatFormat& chat_format,
                                      const std::vector<uint32_t>& end_tokens) {
  std::vector<uint32_t> stop =
      end_tokens.empty() ? io::model_stop_tokens(io::ModelSource{}, tokenizer) : end_tokens;
  auto add = [&](uint32_t id) {
    if (std::find(stop.begin(), stop.end(), id) == stop.end()) stop.push_back(id);
  };
  if (const auto eot =
          tokenizer::added_token_id(tokenizer, tokenizer::end_of_turn(chat_format.kind)))
    add(*eot);
  for (uint32_t id : tokenizer.bos_eos().suffix) add(id);
  return stop;
}

}  // namespace

GrpoOptions read_grpo_options(ConfigTable& section, const std::filesystem::path& base_dir,
                              RewardFunction* verifier) {
  GrpoOptions o;
  o.data = resolve_config_path(base_dir, section.require_string("data"));
  const std::string eval_data = section.get_string("eval_data", "");  // "": none, the default
  if (!eval_data.empty()) o.eval_data = resolve_config_path(base_dir, eval_data);
  o.eval_prompts = section.get_int("eval_prompts", 0);
  POLLEN_CHECK(o.eval_prompts >= 0, section.where("eval_prompts"), ": must be >= 0");
  o.group_size = positive(section, "group_size", o.group_size);
  POLLEN_CHECK(o.group_size >= 2, section.where("group_size"),
               ": must be >= 2 (advantages compare completions of one prompt), got ", o.group_size);
  o.prompts_per_step = positive(section, "prompts_per_step", o.prompts_per_step);
  o.updates_per_batch = positive(section, "updates_per_batch", o.updates_per_batch);
  o.micro_batch = positive(section, "micro_batch", o.micro_batch);
  o.max_completion_tokens = positive(section, "max_completion_tokens", o.max_completion_tokens);
  o.temperature = section.get_double("temperature", o.temperature);
  POLLEN_CHECK(o.temperature > 0, section.where("temperature"),
               ": must be > 0 (completions are sampled), got ", o.temperature);
  o.top_k = section.get_int("top_k", o.top_k);
  POLLEN_CHECK(o.top_k >= 0, section.where("top_k"), ": must be >= 0");
  o.top_p = section.get_double("top_p", o.top_p);
  POLLEN_CHECK(o.top_p > 0 && o.top_p <= 1, section.where("top_p"), ": must be in (0, 1]");
  o.stop = section.get_strings("stop");
  for (const std::string& stop : o.stop)
    POLLEN_CHECK(!stop.empty(), section.where("stop"),
                 ": a stop string may not be empty (it would stop nothing); remove it");
  o.loss.clip_low = section.get_double("clip_epsilon", o.loss.clip_low);
  o.loss.clip_high = section.get_double("clip_epsilon_high", o.loss.clip_low);
  POLLEN_CHECK(o.loss.clip_low > 0 && o.loss.clip_low < 1, section.where("clip_epsilon"),
               ": must be in (0, 1), got ", o.loss.clip_low);
  POLLEN_CHECK(o.loss.clip_high > 0, section.where("clip_epsilon_high"), ": must be > 0");
  o.loss.beta = section.get_double("beta", o.loss.beta);
  POLLEN_CHECK(o.loss.beta >= 0, section.where("beta"), ": must be >= 0, got ", o.loss.beta);
  o.aggregation = aggregation_named(section);
  o.scale_rewards = section.get_bool("scale_rewards", o.scale_rewards);
  o.reference = section.get_string("reference", "");
  if (!o.reference.empty() && std::filesystem::exists(resolve_config_path(base_dir, o.reference)))
    o.reference = resolve_config_path(base_dir, o.reference);

  if (section.has("reward_model")) {
    o.reward_model = resolve_config_path(base_dir, section.get_string("reward_model", ""));
    POLLEN_CHECK(std::filesystem::is_regular_file(o.reward_model / "config.json"),
                 section.where("reward_model"), ": '", o.reward_model.string(),
                 "' is not a reward model's folder (no config.json; `pollen rm` writes one as "
                 "RUN/reward_model)");
  }

  std::optional<ConfigTable> table = section.table("verifier");
  if (table) {
    *verifier = make_verifier(*table);
    table->finish();
  } else if (o.reward_model.empty()) {
    ConfigTable defaults = ConfigTable::parse("", section.where("verifier"));
    *verifier = make_verifier(defaults);
  }
  return o;
}

std::vector<GrpoPrompt> read_grpo_prompts(const std::filesystem::path& path,
                                          const tokenizer::Tokenizer& tokenizer,
                                          const tokenizer::ChatFormat& chat_format,
                                          const RewardFunction& verifier, PromptLimit limit) {
  std::vector<GrpoPrompt> prompts;
  bool warned_turn_end = false;
  for_each_jsonl_object(
      path, "GRPO prompts", [&](const nlohmann::json& record, int64_t, const std::string& where) {
        GrpoPrompt p;
        if (record.contains("prompt")) {
          POLLEN_CHECK(record["prompt"].is_string(), where, ": \"prompt\" must be a string");
          POLLEN_CHECK(!record.contains("messages"), where,
                       ": has both \"prompt\" and \"messages\"; give one");
          p.text = record["prompt"].get<std::string>();
        } else if (record.contains("messages")) {
          const auto chat = read_messages(record["messages"], "messages", where);
          POLLEN_CHECK(chat.back().role != "assistant", where,
                       ": the last message is the assistant's; the completion is what is sampled");
          p.text = tokenizer::render_chat(chat_format, chat, true);
          // The turn's end: what the template writes after a reply, found around a marker.
          const std::string marker = "pollen-reply-marker";
          auto replied = chat;
          replied.push_back({"assistant", marker});
          const std::string full = tokenizer::render_chat(chat_format, replied, false);
          if (full.starts_with(p.text + marker)) {
            p.turn_end = full.substr(p.text.size() + marker.size());
          } else if (!warned_turn_end) {
            log::warn_job(where, ": the chat template does not write a reply as it is after the ",
                          "prompt; a reward model scores the replies without the end of turn");
            warned_turn_end = true;
          }
        } else {
          fail(where, ": expected a \"prompt\" (text) or \"messages\" (a conversation)");
        }
        POLLEN_CHECK(record.contains("answer") || !verifier, where, ": missing \"answer\"");
        if (record.contains("answer")) {
          const nlohmann::json& answer = record["answer"];
          POLLEN_CHECK(answer.is_string() || answer.is_number(), where,
                       ": \"answer\" must be a string or a number");
          p.answer = answer.is_string() ? answer.get<std::string>() : answer.dump();
        }
        p.tokens = tokenizer.encode(p.text, {tokenizer::SpecialPolicy::allow_all(), false});
        POLLEN_CHECK(!p.tokens.empty(), where, ": the prompt is empty");
        POLLEN_CHECK(
            limit.positions <= 0 ||
                static_cast<int64_t>(p.tokens.size()) + limit.completion_tokens <= limit.positions,
            where, ": the prompt's ", p.tokens.size(),
            " tokens plus grpo.max_completion_tokens = ", limit.completion_tokens,
            " exceed the model's ", limit.positions,
            " positions; shorten the prompt or lower max_completion_tokens");
        try {
          if (verifier) verifier(p.text, "", p.answer);
        } catch (const Error& e) {
          fail(where, ": ", e.what());
        }
        prompts.push_back(std::move(p));
      });
  return prompts;
}

GrpoObjective::GrpoObjective(const ObjectiveContext& context, RewardFunction reward)
    : tokenizer_(context.tokenizer), seed_(context.seed) {
  POLLEN_CHECK(tokenizer_ != nullptr, "grpo: needs a tokenizer");
  ConfigTable section = context.section;
  RewardFunction verifier;
  options_ = read_grpo_options(section, context.base_dir, &verifier);
  section.finish();
  if (reward)
    reward_ = rollout_reward(std::move(reward));
  else if (!options_.reward_model.empty())
    reward_ = reward_model_reward(options_.reward_model, *tokenizer_, verifier);
  else
    reward_ = rollout_reward(verifier);
  const PromptLimit limit{context.max_seq, options_.max_completion_tokens};
  prompts_ = read_grpo_prompts(options_.data, *tokenizer_, context.chat_format, verifier, limit);
  if (!options_.eval_data.empty() && jsonl_has_records(options_.eval_data))
    eval_prompts_ =
        read_grpo_prompts(options_.eval_data, *tokenizer_, context.chat_format, verifier, limit);
  identity_.emplace("grpo.data", options_.data, "grpo.eval_data", options_.eval_data,
                    context);  // the files read well
  stop_tokens_ = stop_tokens_for(*tokenizer_, context.chat_format, context.end_tokens);
  // beta = 0 has no KL term: the reference is not loaded at all.
  if (options_.loss.beta > 0 && !options_.reference.empty()) {
    try {
      load_reference(options_.reference);
    } catch (const Error& e) {
      fail("grpo.reference: ", e.what());
    }
  }
}

void GrpoObjective::load_reference(const std::string& spec) {
  const io::ModelSource source = io::resolve_model(spec);
  pinned_reference_ = io::pinned_model_spec(spec, source);
  set_reference(std::make_shared<model::Llama>(io::load_model(source, DType::f32, seed_)));
}

GrpoObjective::GrpoObjective(const GrpoOptions& options, std::vector<GrpoPrompt> prompts,
                             std::vector<GrpoPrompt> eval_prompts, RewardFunction reward,
                             const tokenizer::Tokenizer& tokenizer,
                             std::vector<uint32_t> stop_tokens, uint64_t seed)
    : options_(options),
      prompts_(std::move(prompts)),
      eval_prompts_(std::move(eval_prompts)),
      reward_(rollout_reward(std::move(reward))),
      tokenizer_(&tokenizer),
      stop_tokens_(std::move(stop_tokens)),
      seed_(seed) {
  POLLEN_CHECK(!prompts_.empty(), "grpo: no prompts");
}

void GrpoObjective::set_reference(std::shared_ptr<const model::Llama> reference) {
  reference_ = std::move(reference);
}

// Slot k of the run (batch b, slot j: k = b * prompts_per_step + j) takes position k mod n of
// epoch k / n's shuffled order.
std::vector<int64_t> GrpoObjective::batch_prompts(int64_t batch) const {
  const int64_t n = static_cast<int64_t>(prompts_.size());
  std::vector<int64_t> out;
  int64_t epoch = -1;
  std::vector<int64_t> order;
  for (int64_t j = 0; j < options_.prompts_per_step; ++j) {
    const int64_t k = batch * options_.prompts_per_step + j;
    if (k / n != epoch) {
      epoch = k / n;
      order.resize(static_cast<size_t>(n));
      std::iota(order.begin(), order.end(), 0);
      Rng rng = Rng(seed_).fork(kOrderStream).fork(static_cast<uint64_t>(epoch));
      for (int64_t i = n - 1; i > 0; --i)
        std::swap(order[i], order[rng.below(static_cast<uint64_t>(i + 1))]);
    }
    out.push_back(order[k % n]);
  }
  return out;
}

Rollouts GrpoObjective::sample(const model::Llama& model, int64_t batch) const {
  Rollouts r;
  r.batch = batch;
  const std::vector<int64_t> prompt_ids = batch_prompts(batch);
  const int64_t g_size = options_.group_size;
  model::SamplingOptions sampling;
  sampling.max_tokens = options_.max_completion_tokens;
  sampling.temperature = options_.temperature;
  sampling.top_k = options_.top_k;
  sampling.top_p = options_.top_p;
  sampling.stop_tokens = stop_tokens_;
  sampling.stop_strings = options_.stop;
  sampling.vocab_size = static_cast<int64_t>(tokenizer_->vocab_size());
  const Rng batch_rng = Rng(seed_).fork(kSampleStream).fork(static_cast<uint64_t>(batch));
  std::vector<size_t> mine;  // the completions this rank samples and scores
  std::vector<model::GenerationRow> rows;
  for (size_t j = 0; j < prompt_ids.size(); ++j) {
    for (int64_t g = 0; g < g_size; ++g) {
      const size_t k = r.prompt.size();
      r.prompt.push_back(prompt_ids[j]);
      if (!share_.owns(k)) continue;
      mine.push_back(k);
      rows.push_back({prompts_[prompt_ids[j]].tokens, sampling,
                      batch_rng.fork(static_cast<uint64_t>(j) * g_size + g), nullptr});
    }
  }
  const std::vector<model::Generation> gens = model::generate_rows(
      model, std::move(rows),
      [this](std::span<const uint32_t> ids) { return tokenizer_->decode(ids); });
  std::vector<std::vector<uint32_t>> tokens;
  std::vector<double> rewards;
  for (size_t m = 0; m < gens.size(); ++m) {
    tokens.push_back(gens[m].tokens);
    // A row that ended on a stop token (not a stop string) is scored with the one it sampled,
    // so that the policy learns to stop.
    if (gens[m].stop_token) tokens.back().push_back(*gens[m].stop_token);
    const GrpoPrompt& p = prompts_[r.prompt[mine[m]]];
    rewards.push_back(reward_(p, gens[m].text));
  }
  gather_completions(share_, mine, tokens, rewards, r);
  r.advantages = group_advantages(r.rewards, g_size, options_.scale_rewards);
  if (options_.updates_per_batch > 1) r.old_logp = completion_logprobs(model, r);
  if (options_.loss.beta > 0) {
    POLLEN_CHECK(reference_ != nullptr,
                 "grpo: beta > 0 needs a reference model ([grpo] reference, or the run's base)");
    r.ref_logp = completion_logprobs(*reference_, r);
  }
  return r;
}

ag::Var GrpoObjective::sampled_head(const model::Llama& model) const {
  const ag::Var head = model.head_weight();
  const auto known = static_cast<int64_t>(tokenizer_->vocab_size());
  return head.size(0) > known ? ag::leading_rows(head, known) : head;
}

std::vector<std::vector<double>> GrpoObjective::completion_logprobs(const model::Llama& model,
                                                                    const Rollouts& r) const {
  ag::NoGrad no_grad;
  const size_t n = r.tokens.size();
  const std::vector<size_t> first_token = token_offsets(r.tokens);
  std::vector<double> flat(first_token[n], 0.0);  // every completion token's, in order
  const size_t micro = static_cast<size_t>(options_.micro_batch);
  for (size_t m0 = 0, c = 0; m0 < n; m0 += micro, ++c) {
    if (!share_.runs(c, model)) continue;
    const size_t m1 = std::min(n, m0 + micro);
    std::vector<const std::vector<uint32_t>*> prompts, completions;
    for (size_t i = m0; i < m1; ++i) {
      prompts.push_back(&prompts_[r.prompt[i]].tokens);
      completions.push_back(&r.tokens[i]);
    }
    const ScoredRows rows = scored_rows(prompts, completions);
    // At the sampling temperature, as TRL scores: the distribution the completions came from.
    const ag::Var logp = ag::token_logprobs(model.hidden_states(rows.batch), sampled_head(model),
                                            rows.batch.targets, options_.temperature);
    for (size_t i = m0; i < m1; ++i)
      for (size_t t = 0; t < r.tokens[i].size(); ++t)
        flat[first_token[i] + t] =
            logp.value().data<float>()[rows.first[i - m0] + static_cast<int64_t>(t)];
  }
  share_.sum(flat, "the completions' log-probabilities");
  std::vector<std::vector<double>> out;
  for (size_t i = 0; i < n; ++i)
    out.emplace_back(flat.begin() + static_cast<std::ptrdiff_t>(first_token[i]),
                     flat.begin() + static_cast<std::ptrdiff_t>(first_token[i + 1]));
  return out;
}

ObjectiveStep GrpoObjective::train_step(const model::Llama& model, int64_t step) {
  POLLEN_CHECK(step >= 1, "grpo: steps count from 1, got ", step);
  const int64_t batch = (step - 1) / options_.updates_per_batch;
  if (rollouts_.batch != batch) {
    // A resumed run restores a batch it was in the middle of; anything else starts a new one.
    POLLEN_CHECK((step - 1) % options_.updates_per_batch == 0, "grpo: step ", step,
                 " is inside batch ", batch, ", which was not restored");
    rollouts_ = sample(model, batch);
  }
  const Rollouts& r = rollouts_;
  std::vector<int64_t> lengths;
  for (const auto& t : r.tokens) lengths.push_back(static_cast<int64_t>(t.size()));
  const std::vector<double> weights =
      token_weights(lengths, options_.aggregation, options_.max_completion_tokens);

  ObjectiveStep out;
  ClippedLossStats total;
  const size_t n = r.tokens.size();
  const std::vector<size_t> first_token = token_offsets(r.tokens);  // indices into `weights`
  const size_t micro = static_cast<size_t>(options_.micro_batch);
  for (size_t m0 = 0, c = 0; m0 < n; m0 += micro, ++c) {
    if (!share_.runs(c, model)) continue;
    const size_t m1 = std::min(n, m0 + micro);
    std::vector<const std::vector<uint32_t>*> prompts, completions;
    for (size_t i = m0; i < m1; ++i) {
      prompts.push_back(&prompts_[r.prompt[i]].tokens);
      completions.push_back(&r.tokens[i]);
    }
    const ScoredRows rows = scored_rows(prompts, completions);
    ag::Tape tape;
    ag::Var loss;
    ClippedLossStats stats;
    {
      ag::TapeScope scope(tape);
      const ag::Var logp = ag::token_logprobs(model.hidden_states(rows.batch), sampled_head(model),
                                              rows.batch.targets, options_.temperature);
      const int64_t flat = logp.value().numel();
      TokenTerms terms;
      terms.old_logp.assign(flat, 0.0);
      terms.advantage.assign(flat, 0.0);
      terms.weight.assign(flat, 0.0);
      if (options_.loss.beta > 0) terms.ref_logp.assign(flat, 0.0);
      for (size_t i = m0; i < m1; ++i) {
        const int64_t first = rows.first[i - m0];
        for (size_t t = 0; t < r.tokens[i].size(); ++t) {
          const int64_t at = first + static_cast<int64_t>(t);
          // One update per batch: the sampling policy is the current one, so its log-probs are
          // these very values (ratio 1, the gradient the policy gradient).
          terms.old_logp[at] =
              r.old_logp.empty() ? logp.value().data<float>()[at] : r.old_logp[i][t];
          if (options_.loss.beta > 0) terms.ref_logp[at] = r.ref_logp[i][t];
          terms.advantage[at] = r.advantages[i];
          terms.weight[at] = weights[first_token[i] + t];
        }
      }
      loss = clipped_policy_loss(logp, terms, options_.loss, &stats);
    }
    tape.backward(loss);
    out.loss += loss.value().item();
    total.tokens += stats.tokens;
    total.clipped += stats.clipped;
    total.kl_sum += stats.kl_sum;
    for (size_t i = m0; i < m1; ++i)
      out.tokens += static_cast<int64_t>(prompts_[r.prompt[i]].tokens.size() + r.tokens[i].size());
  }
  if (share_.comm) {
    share_.reducer->finish();  // the gradients summed over the ranks
    std::vector<double> sums{out.loss, static_cast<double>(out.tokens),
                             static_cast<double>(total.tokens), static_cast<double>(total.clipped),
                             total.kl_sum};
    share_.sum(sums, "the step's policy loss and token counts");
    out.loss = sums[0];
    out.tokens = static_cast<int64_t>(sums[1]);
    total.tokens = static_cast<int64_t>(sums[2]);
    total.clipped = static_cast<int64_t>(sums[3]);
    total.kl_sum = sums[4];
  }

  int64_t correct = 0;
  for (double reward : r.rewards) correct += reward >= 1.0;
  out.metrics["reward"] = mean_of(r.rewards);
  out.metrics["reward_std"] = mean_group_std(r.rewards, options_.group_size);
  out.metrics["accuracy"] = static_cast<double>(correct) / static_cast<double>(n);
  out.metrics["completion_length"] = static_cast<double>(total.tokens) / static_cast<double>(n);
  if (options_.loss.beta > 0)
    out.metrics["kl"] = total.kl_sum / static_cast<double>(std::max<int64_t>(total.tokens, 1));
  out.metrics["clip_fraction"] =
      static_cast<double>(total.clipped) / static_cast<double>(std::max<int64_t>(total.tokens, 1));
  return out;
}

ObjectiveStep GrpoObjective::evaluate(const model::Llama& model) {
  ObjectiveStep out;
  if (eval_prompts_.empty()) return out;
  const size_t n = options_.eval_prompts > 0
                       ? std::min(eval_prompts_.size(), static_cast<size_t>(options_.eval_prompts))
                       : eval_prompts_.size();
  std::vector<size_t> mine;  // the prompts this rank answers
  std::vector<std::vector<uint32_t>> prompts;
  for (size_t i = 0; i < n; ++i) {
    if (!share_.owns(i)) continue;
    mine.push_back(i);
    prompts.push_back(eval_prompts_[i].tokens);
  }
  model::SamplingOptions greedy;
  greedy.temperature = 0;
  greedy.max_tokens = options_.max_completion_tokens;
  greedy.stop_tokens = stop_tokens_;
  greedy.stop_strings = options_.stop;
  greedy.vocab_size = static_cast<int64_t>(tokenizer_->vocab_size());
  const std::vector<model::Generation> gens =
      model::generate(model, prompts, greedy,
                      [this](std::span<const uint32_t> ids) { return tokenizer_->decode(ids); });
  std::vector<double> rewards(n + 1, 0.0);  // per prompt, then the tokens run
  for (size_t m = 0; m < mine.size(); ++m) {
    const GrpoPrompt& p = eval_prompts_[mine[m]];
    rewards[mine[m]] = reward_(p, gens[m].text);
    rewards[n] += static_cast<double>(prompts[m].size() + gens[m].tokens.size());
  }
  share_.sum(rewards, "the held-out rewards");
  const int64_t tokens = static_cast<int64_t>(rewards[n]);
  rewards.pop_back();
  const int64_t correct =
      std::count_if(rewards.begin(), rewards.end(), [](double reward) { return reward >= 1.0; });
  // Evaluation has no policy loss: the negated mean reward (+ 0.0: 0, not -0, for no reward).
  out.loss = -mean_of(rewards) + 0.0;
  out.tokens = tokens;
  out.metrics["reward"] = mean_of(rewards);
  out.metrics["accuracy"] = static_cast<double>(correct) / static_cast<double>(n);
  return out;
}

nlohmann::ordered_json GrpoObjective::state() const {
  // The prompts and random streams of every batch follow from the seed and the step, so only a
  // batch that later steps still train on (updates_per_batch > 1) needs saving.
  nlohmann::ordered_json s = nlohmann::ordered_json::object();
  if (identity_) s.update(identity_->state());  // what the batches' prompt numbers index
  if (!pinned_reference_.empty()) s["reference"] = pinned_reference_;
  if (options_.updates_per_batch > 1 && rollouts_.batch >= 0) {
    s["batch"] = rollouts_.batch;
    s["prompt"] = rollouts_.prompt;
    s["tokens"] = rollouts_.tokens;
    s["rewards"] = rollouts_.rewards;
    s["advantages"] = rollouts_.advantages;
    s["old_logp"] = rollouts_.old_logp;
    s["ref_logp"] = rollouts_.ref_logp;
  }
  return s;
}

void GrpoObjective::restore(const nlohmann::ordered_json& state) {
  if (identity_) identity_->check(state, "grpo");
  // The KL reference the run began with, also when grpo.reference names a run folder that has
  // moved on since.
  if (state.contains("reference") && !pinned_reference_.empty()) {
    POLLEN_CHECK(state["reference"].is_string(),
                 "grpo: the checkpoint's objective state has a reference that is not a string");
    const std::string pinned = state["reference"].get<std::string>();
    if (pinned != pinned_reference_) {
      try {
        load_reference(pinned);
      } catch (const Error& e) {
        fail("grpo: cannot load the KL reference the run began with (grpo.reference '",
             options_.reference, "' was then '", pinned, "'): ", e.what());
      }
    }
  }
  rollouts_ = Rollouts();
  if (!state.contains("batch")) return;
  try {
    rollouts_.batch = state.at("batch").get<int64_t>();
    rollouts_.prompt = state.at("prompt").get<std::vector<int64_t>>();
    rollouts_.tokens = state.at("tokens").get<std::vector<std::vector<uint32_t>>>();
    rollouts_.rewards = state.at("rewards").get<std::vector<double>>();
    rollouts_.advantages = state.at("advantages").get<std::vector<double>>();
    rollouts_.old_logp = state.at("old_logp").get<std::vector<std::vector<double>>>();
    rollouts_.ref_logp = state.at("ref_logp").get<std::vector<std::vector<double>>>();
  } catch (const nlohmann::json::exception& e) {
    fail("grpo: the checkpoint's objective state is malformed (", e.what(), ")");
  }
  for (int64_t p : rollouts_.prompt)
    POLLEN_CHECK(p >= 0 && p < static_cast<int64_t>(prompts_.size()),
                 "grpo: the checkpoint's batch names prompt ", p, " but the data has ",
                 prompts_.size(), " (a different data file?)");
}

RolloutReward reward_model_reward(const std::filesystem::path& reward_model,
                                  const tokenizer::Tokenizer& tokenizer, RewardFunction verifier) {
  auto rm = std::make_shared<const RewardModel>(load_reward_model(reward_model));
  // The reward model reads the policy's token ids: its own tokenizer must be the policy's.
  const std::filesystem::path rm_tokenizer = reward_model / "tokenizer.json";
  if (std::filesystem::exists(rm_tokenizer)) {
    const std::string theirs = tokenizer::open_tokenizer(rm_tokenizer, "").fingerprint();
    POLLEN_CHECK(theirs == tokenizer.fingerprint(), "grpo: the reward model '",
                 reward_model.string(), "' was trained with another tokenizer (fingerprint ",
                 theirs.substr(0, 16), ", the policy's ", tokenizer.fingerprint().substr(0, 16),
                 "); grpo.reward_model must share the policy's tokenizer");
  }
  POLLEN_CHECK(rm->decoder->config().vocab_size >= static_cast<int64_t>(tokenizer.vocab_size()),
               "grpo: the reward model '", reward_model.string(), "' knows ",
               rm->decoder->config().vocab_size, " token ids, the policy's tokenizer ",
               tokenizer.vocab_size(), " (the reward model must share the policy's tokenizer)");
  return [rm, &tokenizer, verifier = std::move(verifier)](const GrpoPrompt& prompt,
                                                          std::string_view completion) {
    const tokenizer::EncodeOptions options{tokenizer::SpecialPolicy::allow_all(), false};
    ScoredSequence s;
    s.ids = tokenizer.encode(prompt.text, options);
    s.prompt_tokens = static_cast<int64_t>(s.ids.size());
    const std::vector<uint32_t> reply =
        tokenizer.encode(std::string(completion) + prompt.turn_end, options);
    s.ids.insert(s.ids.end(), reply.begin(), reply.end());
    double reward = score_sequences(*rm->decoder, rm->score, {s}, 1)[0];
    if (verifier) reward += verifier(prompt.text, completion, prompt.answer);
    return reward;
  };
}

std::unique_ptr<Objective> make_grpo_objective(const ObjectiveContext& context,
                                               const std::string& base) {
  auto objective = std::make_unique<GrpoObjective>(context);
  const GrpoOptions& o = objective->options();
  if (o.loss.beta > 0 && o.reference.empty()) {
    try {
      objective->set_reference(std::make_shared<model::Llama>(
          io::load_model(io::resolve_model(base), DType::f32, context.seed)));
    } catch (const Error& e) {
      fail("grpo: beta > 0 with no grpo.reference takes the run's base '", base,
           "' as the KL reference, which cannot be loaded: ", e.what());
    }
  }
  return objective;
}

std::string grpo_jsonl_line(const SynthExample& example) {
  const nlohmann::ordered_json line{{"messages", {{{"role", "user"}, {"content", example.prompt}}}},
                                    {"answer", example.answer}};
  return line.dump();
}

}  // namespace pollen::train
