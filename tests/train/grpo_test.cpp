// GRPO: the clipped policy-ratio loss and its gradient against values computed here in double
// and float64 finite differences; group-normalised advantages; prompts, sampling (the
// tokenizer's ids only, completions scored with the stop token they sampled), resume, a short run
// on a tiny model that raises the reward, and the synthetic prompts.
#include "train/grpo.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>

#include "base/error.h"
#include "optim/adamw.h"
#include "support/errors.h"
#include "support/gradcheck.h"
#include "support/tiny_lm.h"
#include "tokenizer/open.h"
#include "tokenizer/trainer.h"
#include "train/reward.h"

using pollen::testing::error_of;

namespace pollen::train {
namespace {

// --- the loss on a fixed batch -------------------------------------------------------------

// Two prompts, three completions each, of 2, 3, 1, 2, 1 and 3 tokens (12 in all), laid out with
// two rows that are not completion tokens (weight 0) in between, as padding would be.
struct FixedBatch {
  std::vector<int64_t> lengths = {2, 3, 1, 2, 1, 3};
  std::vector<double> rewards = {1, 0, 1, 0, 0.5, 1};
  // per completion token
  std::vector<double> logp = {-1.0, -0.5, -2.0, -0.3, -1.2, -0.7,
                              -0.9, -1.5, -0.2, -2.2, -0.4, -1.1};
  std::vector<double> old_logp = {-1.05, -0.9, -1.6,  -0.31, -1.0, -0.75,
                                  -0.6,  -1.4, -0.25, -2.0,  -0.8, -1.0};
  std::vector<double> ref_logp = {-1.2, -0.4, -2.1, -0.5, -1.0, -0.9,
                                  -0.8, -1.7, -0.1, -2.0, -0.6, -1.3};
  std::vector<int64_t> rows = {0, 1, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13};  // rows 2 and 10: padding
  int64_t n_rows = 14;
};

// The DeepSeekMath objective written out directly, in double.
double expected_loss(const FixedBatch& b, LossAggregation aggregation, double beta, double eps) {
  std::vector<double> adv(6);
  for (int g = 0; g < 2; ++g) {
    const double* r = &b.rewards[3 * g];
    const double mean = (r[0] + r[1] + r[2]) / 3;
    const double sd = std::sqrt(((r[0] - mean) * (r[0] - mean) + (r[1] - mean) * (r[1] - mean) +
                                 (r[2] - mean) * (r[2] - mean)) /
                                2);
    for (int i = 0; i < 3; ++i) adv[3 * g + i] = (r[i] - mean) / (sd + 1e-4);
  }
  double total = 0, sum_of_means = 0;
  size_t t = 0;
  for (int i = 0; i < 6; ++i) {
    double seq = 0;
    for (int64_t k = 0; k < b.lengths[i]; ++k, ++t) {
      const double ratio = std::exp(b.logp[t] - b.old_logp[t]);
      const double clipped = std::min(std::max(ratio, 1 - eps), 1 + eps);
      const double d = b.ref_logp[t] - b.logp[t];
      const double term =
          -std::min(ratio * adv[i], clipped * adv[i]) + beta * (std::exp(d) - d - 1);
      seq += term;
    }
    total += seq;
    sum_of_means += seq / static_cast<double>(b.lengths[i]);
  }
  switch (aggregation) {
    case LossAggregation::sequence:
      return sum_of_means / 6;
    case LossAggregation::token:
      return total / 12;
    case LossAggregation::constant:
      return total / (6 * 5.0);  // max_completion_tokens = 5
  }
  return 0;
}

struct LossInputs {
  ag::Var logp;
  TokenTerms terms;
};

LossInputs loss_inputs(const FixedBatch& b, LossAggregation aggregation) {
  Tensor logp = Tensor::zeros({b.n_rows}, DType::f64);
  TokenTerms terms;
  terms.old_logp.assign(b.n_rows, 0.0);
  terms.ref_logp.assign(b.n_rows, 0.0);
  terms.advantage.assign(b.n_rows, 0.0);
  terms.weight.assign(b.n_rows, 0.0);
  const std::vector<double> adv = group_advantages(b.rewards, 3, true);
  const std::vector<double> w = token_weights(b.lengths, aggregation, 5);
  size_t t = 0;
  for (int i = 0; i < 6; ++i) {
    for (int64_t k = 0; k < b.lengths[i]; ++k, ++t) {
      const int64_t row = b.rows[t];
      logp.data<double>()[row] = b.logp[t];
      terms.old_logp[row] = b.old_logp[t];
      terms.ref_logp[row] = b.ref_logp[t];
      terms.advantage[row] = adv[i];
      terms.weight[row] = w[t];
    }
  }
  logp.data<double>()[2] = -3.0;  // padding rows hold something; it must not count
  logp.data<double>()[10] = -0.1;
  return {ag::Var(logp, true, "logp"), terms};
}

TEST(GrpoLoss, GroupAdvantagesByHand) {
  const std::vector<double> a =
      group_advantages(std::vector<double>{1, 0, 1, 0.5, 0.5, 0.5}, 3, true);
  const double sd = std::sqrt(1.0 / 3.0);  // sample std of {1, 0, 1}
  EXPECT_NEAR(a[0], (1.0 / 3) / (sd + 1e-4), 1e-12);
  EXPECT_NEAR(a[1], (-2.0 / 3) / (sd + 1e-4), 1e-12);
  EXPECT_EQ(a[3], 0.0);  // a group whose rewards all agree teaches nothing
  EXPECT_EQ(a[5], 0.0);
  const std::vector<double> dr = group_advantages(std::vector<double>{1, 0, 0, 0}, 4, false);
  EXPECT_DOUBLE_EQ(dr[0], 0.75);
  EXPECT_DOUBLE_EQ(dr[1], -0.25);
}

TEST(GrpoLoss, EveryAggregationMatchesHandComputedLossAndFiniteDifferences) {
  const FixedBatch b;
  for (auto aggregation :
       {LossAggregation::sequence, LossAggregation::token, LossAggregation::constant}) {
    for (double beta : {0.0, 0.04}) {
      LossInputs in = loss_inputs(b, aggregation);
      const ClippedLossOptions options{0.2, 0.2, beta};
      ClippedLossStats stats;
      const double loss = clipped_policy_loss(in.logp, in.terms, options, &stats).value().item();
      EXPECT_NEAR(loss, expected_loss(b, aggregation, beta, 0.2), 1e-12)
          << "aggregation " << static_cast<int>(aggregation) << " beta " << beta;
      EXPECT_EQ(stats.tokens, 12);
      std::vector<ag::Var> leaves = {in.logp};
      testing::max_gradcheck_error(
          [&](std::vector<ag::Var>& v) { return clipped_policy_loss(v[0], in.terms, options); },
          leaves);
      // Padding rows get no gradient.
      EXPECT_EQ(leaves[0].grad().data<double>()[2], 0.0);
      EXPECT_EQ(leaves[0].grad().data<double>()[10], 0.0);
    }
  }
}

TEST(GrpoLoss, ClippedTokensAreCountedAndGetNoRatioGradient) {
  const FixedBatch b;
  LossInputs in = loss_inputs(b, LossAggregation::token);
  // By hand: completion 0 (A > 0) token 1 has ratio exp(0.4) = 1.49 > 1.2: clipped. Completion 1
  // (A < 0) token 0: ratio exp(-0.4) = 0.67 < 0.8: clipped. Completion 3 (A < 0): token 0 ratio
  // exp(-0.3) = 0.74: clipped. Completion 5 (A > 0): ratio exp(0.4) = 1.49 at its second token:
  // clipped. Everything else is inside [0.8, 1.2] or on the side where min picks the ratio.
  ClippedLossStats stats;
  std::vector<ag::Var> leaves = {in.logp};
  ag::Tape tape;
  ag::Var loss;
  {
    ag::TapeScope scope(tape);
    loss = clipped_policy_loss(leaves[0], in.terms, {0.2, 0.2, 0.0}, &stats);
  }
  tape.backward(loss);
  EXPECT_EQ(stats.clipped, 4);
  EXPECT_EQ(leaves[0].grad().data<double>()[1], 0.0);  // completion 0, token 1
  EXPECT_EQ(leaves[0].grad().data<double>()[3], 0.0);  // completion 1, token 0
  EXPECT_NE(leaves[0].grad().data<double>()[0], 0.0);
}

// --- prompts, sampling and training on a tiny model -----------------------------------------

struct TinyGrpo {
  std::filesystem::path dir = testing::unique_temp_dir("grpo");
  tokenizer::Tokenizer tok = testing::tiny_tokenizer();

  std::filesystem::path write(const std::string& name, const std::string& text) {
    std::ofstream(dir / name) << text;
    return dir / name;
  }

  ObjectiveContext context(const std::string& toml) {
    ObjectiveContext c{ConfigTable::parse(toml, "run.toml"), dir, &tok, {}, 5, 256};
    return c;
  }
};

const char* kPrompts =
    R"({"prompt": "The cat sat on", "answer": 1})"
    "\n"
    R"({"messages": [{"role": "user", "content": "what is two plus two?"}], "answer": "4"})"
    "\n"
    R"({"prompt": "Paris is the", "answer": 2.5})"
    "\n";

TEST(Grpo, ReadsPromptsAndRendersConversations) {
  TinyGrpo t;
  t.write("p.jsonl", kPrompts);
  RewardFunction verifier = [](std::string_view, std::string_view, std::string_view) {
    return 0.0;
  };
  const auto prompts = read_grpo_prompts(t.dir / "p.jsonl", t.tok, {}, verifier);
  ASSERT_EQ(prompts.size(), 3u);
  EXPECT_EQ(prompts[0].text, "The cat sat on");
  EXPECT_EQ(prompts[0].answer, "1");
  EXPECT_EQ(prompts[1].text,
            "<|im_start|>user\nwhat is two plus two?<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(prompts[1].answer, "4");
  EXPECT_EQ(prompts[2].answer, "2.5");
  EXPECT_EQ(t.tok.decode(prompts[1].tokens), prompts[1].text);
  // What the template writes after the assistant's reply: a conversation's only.
  EXPECT_EQ(prompts[0].turn_end, "");
  EXPECT_EQ(prompts[1].turn_end, "<|im_end|>\n");
}

TEST(Grpo, BadPromptsAndKeysAreNamed) {
  TinyGrpo t;
  RewardFunction numeric;
  ConfigTable section = ConfigTable::parse("data = \"x\"\n", "run.toml");
  read_grpo_options(section, t.dir, &numeric);
  auto read = [&](const std::string& text) {
    t.write("bad.jsonl", text);
    return error_of([&] { read_grpo_prompts(t.dir / "bad.jsonl", t.tok, {}, numeric); });
  };
  EXPECT_NE(read("{\"prompt\": \"a\", \"answer\": 1}\n{oops\n").find("line 2: not valid JSON"),
            std::string::npos);
  EXPECT_NE(read("{\"prompt\": \"a\"}\n").find("line 1: missing \"answer\""), std::string::npos);
  EXPECT_NE(
      read("{\"prompt\": \"a\", \"answer\": \"four\"}\n").find("\"four\" is not a finite number"),
      std::string::npos);
  // A number past double's range is not valid JSON to us, named by its line.
  EXPECT_NE(read("{\"prompt\": \"a\", \"answer\": 1e400}\n").find("line 1: not valid JSON"),
            std::string::npos);
  EXPECT_EQ(read("{\"prompt\": \"a\", \"answer\": 1e-7}\n"), "");  // an exponent is a number
  EXPECT_NE(read("{\"text\": \"a\", \"answer\": 1}\n").find("expected a \"prompt\""),
            std::string::npos);
  // A folder is named as such; eval_data = "" is none, as when the key is left out.
  EXPECT_NE(error_of([&] {
              read_grpo_prompts(t.dir, t.tok, {}, numeric);
            }).find("' is a folder; expected a JSONL file"),
            std::string::npos);
  ConfigTable no_eval = ConfigTable::parse("data = \"x\"\neval_data = \"\"\n", "run.toml");
  EXPECT_TRUE(read_grpo_options(no_eval, t.dir, &numeric).eval_data.empty());
  t.write("p.jsonl", kPrompts);
  EXPECT_NE(error_of([&] {
              GrpoObjective(t.context("data = \"p.jsonl\"\ngroups = 4\n"));
            }).find("groups"),
            std::string::npos);
  const model::Llama m = testing::tiny_model(t.tok.vocab_size());
  EXPECT_NE(error_of([&] {
              GrpoObjective(t.context("data = \"p.jsonl\"\nbeta = 0.1\n")).train_step(m, 1);
            }).find("needs a reference model"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              GrpoObjective(t.context("data = \"p.jsonl\"\n[verifier]\nkind = \"nope\"\n"));
            }).find("kind"),
            std::string::npos);
  // An empty stop string would stop nothing: refused, naming the key.
  const std::string empty_stop =
      error_of([&] { GrpoObjective(t.context("data = \"p.jsonl\"\nstop = [\"\\n\", \"\"]\n")); });
  EXPECT_NE(empty_stop.find("stop"), std::string::npos) << empty_stop;
  EXPECT_NE(empty_stop.find("may not be empty"), std::string::npos) << empty_stop;
  // A prompt too long for max_completion_tokens is named by its file and line, without its text.
  std::string long_prompt;
  for (int i = 0; i < 200; ++i) long_prompt += "The cat sat on the mat.\\n";
  t.write("long.jsonl",
          std::string(kPrompts) + "{\"prompt\": \"" + long_prompt + "\", \"answer\": 1}\n");
  const std::string too_long = error_of(
      [&] { GrpoObjective(t.context("data = \"long.jsonl\"\nmax_completion_tokens = 6\n")); });
  EXPECT_NE(too_long.find("long.jsonl' line 4"), std::string::npos) << too_long;
  EXPECT_NE(too_long.find("grpo.max_completion_tokens = 6"), std::string::npos) << too_long;
  EXPECT_EQ(too_long.find("The cat"), std::string::npos) << too_long;
}

// Reward for the tiny model: the share of the completion's bytes that are lowercase letters, so
// that random completions differ and there is something to learn.
double lowercase_share(std::string_view, std::string_view completion, std::string_view) {
  if (completion.empty()) return 0.0;
  double n = 0;
  for (char c : completion) n += c >= 'a' && c <= 'z';
  return n / static_cast<double>(completion.size());
}

const char* kTinyRun =
    "data = \"p.jsonl\"\ngroup_size = 6\nprompts_per_step = 2\nmicro_batch = 5\n"
    "max_completion_tokens = 6\n";

TEST(Grpo, SamplingIsAFunctionOfSeedAndStepAndOneUpdateHasRatioOne) {
  TinyGrpo t;
  t.write("p.jsonl", kPrompts);
  const model::Llama m = testing::tiny_model(t.tok.vocab_size());
  GrpoObjective a(t.context(kTinyRun), lowercase_share), b(t.context(kTinyRun), lowercase_share);
  for (const auto& p : m.parameters()) const_cast<ag::Var&>(p).zero_grad();
  const ObjectiveStep sa = a.train_step(m, 3);
  const ObjectiveStep sb = b.train_step(m, 3);
  EXPECT_EQ(a.rollouts().tokens, b.rollouts().tokens);
  EXPECT_EQ(a.rollouts().rewards, b.rollouts().rewards);
  EXPECT_EQ(sa.loss, sb.loss);
  EXPECT_EQ(a.rollouts().tokens.size(), 12u);
  // reward_std as TRL reports it: the mean over the two groups of six of each one's sample
  // standard deviation (not the spread of all twelve, which differing groups would inflate).
  double group_std = 0;
  for (size_t g = 0; g < 2; ++g) {
    double mean = 0, squares = 0;
    for (size_t i = 0; i < 6; ++i) mean += a.rollouts().rewards[6 * g + i] / 6;
    for (size_t i = 0; i < 6; ++i) squares += std::pow(a.rollouts().rewards[6 * g + i] - mean, 2);
    group_std += std::sqrt(squares / 5) / 2;
  }
  EXPECT_NEAR(sa.metrics["reward_std"].get<double>(), group_std, 1e-12);
  // Another step samples other completions; each group holds one prompt.
  a.train_step(m, 4);
  EXPECT_NE(a.rollouts().tokens, b.rollouts().tokens);
  for (size_t i = 0; i < 12; ++i) EXPECT_EQ(a.rollouts().prompt[i], a.rollouts().prompt[i / 6 * 6]);
  // The sampling policy is the trained one: the ratio is 1 everywhere, nothing is clipped, and
  // with per-sequence averaging the loss is minus the mean advantage, 0.
  EXPECT_EQ(sa.metrics["clip_fraction"].get<double>(), 0.0);
  EXPECT_NEAR(sa.loss, 0.0, 1e-6);
  EXPECT_GT(sa.metrics["reward_std"].get<double>(), 0.0);
}

// A LoRA adapter on lm_head is part of the policy that is scored and trained, as it is of the
// one that samples: with B non-zero, both A and B of the head get a gradient.
TEST(Grpo, AnAdapterOnTheHeadIsTrained) {
  TinyGrpo t;
  t.write("p.jsonl", kPrompts);
  model::Llama m = testing::tiny_model(t.tok.vocab_size());
  const auto lora = testing::attach_random_lora(m, {model::LoraTarget::lm_head}, 5);
  for (auto& [name, v] : lora->named_tensors()) const_cast<ag::Var&>(v).zero_grad();
  GrpoObjective objective(t.context(kTinyRun), lowercase_share);
  objective.train_step(m, 3);
  for (const auto& [name, v] : lora->named_tensors()) {
    ASSERT_TRUE(v.grad().defined()) << name;
    double norm = 0;
    for (double g : v.grad().to_doubles()) norm += g * g;
    EXPECT_GT(norm, 0.0) << name;
  }
}

TEST(Grpo, ModelVocabularyLargerThanTheTokenizers) {
  // Models pad their vocabulary; ids the tokenizer does not know have no text and are never
  // sampled, not even by a model that prefers one of them above all.
  TinyGrpo t;
  t.write("p.jsonl", kPrompts);
  const uint32_t known = t.tok.vocab_size();
  const model::Llama m = testing::always_predicting(known + 100, known + 200);
  GrpoObjective objective(t.context(kTinyRun), lowercase_share);
  objective.train_step(m, 1);
  for (const auto& tokens : objective.rollouts().tokens) {
    EXPECT_FALSE(tokens.empty());
    for (uint32_t id : tokens) EXPECT_LT(id, known);
  }
}

// The log-probabilities are over the ids completions are drawn from: a model whose vocabulary is
// padded beyond its tokenizer's scores as the same model without the padding rows does (before,
// the padding's mass entered every log-probability and so the policy gradient).
TEST(Grpo, APaddedVocabularyScoresAsTheTokenizersIds) {
  TinyGrpo t;
  t.write("p.jsonl", kPrompts);
  const uint32_t known = t.tok.vocab_size();
  const model::Llama padded = testing::tiny_model(known + 64, 3);
  model::Llama trimmed(testing::tiny_config(known), 1);
  const auto from = padded.named_parameters();
  const auto to = trimmed.named_parameters();
  ASSERT_EQ(from.size(), to.size());
  for (size_t i = 0; i < from.size(); ++i) {  // the same weights, the tables' first rows
    const Tensor& src = from[i].second.value();
    const Tensor& dst = to[i].second.value();
    std::copy_n(src.data<float>(), dst.numel(), dst.data<float>());
  }
  const std::string run = std::string(kTinyRun) + "updates_per_batch = 2\ntemperature = 0.7\n";
  GrpoObjective a(t.context(run), lowercase_share), b(t.context(run), lowercase_share);
  for (const model::Llama* m : {&padded, static_cast<const model::Llama*>(&trimmed)})
    for (const auto& p : m->parameters()) const_cast<ag::Var&>(p).zero_grad();
  a.train_step(padded, 1);
  b.train_step(trimmed, 1);
  ASSERT_EQ(a.rollouts().tokens, b.rollouts().tokens);
  // The same gradients, the padding rows' zero: the padding takes no part in the policy.
  for (size_t i = 0; i < from.size(); ++i) {
    const std::vector<double> g = from[i].second.grad().to_doubles();
    const std::vector<double> want = to[i].second.grad().to_doubles();
    ASSERT_GE(g.size(), want.size());
    for (size_t k = 0; k < g.size(); ++k)
      EXPECT_NEAR(g[k], k < want.size() ? want[k] : 0.0, 1e-5) << from[i].first << " " << k;
  }
  ASSERT_EQ(a.rollouts().old_logp.size(), b.rollouts().old_logp.size());
  for (size_t i = 0; i < a.rollouts().old_logp.size(); ++i)
    for (size_t k = 0; k < a.rollouts().old_logp[i].size(); ++k)
      EXPECT_NEAR(a.rollouts().old_logp[i][k], b.rollouts().old_logp[i][k], 1e-5) << i << " " << k;
}

TEST(Grpo, ACompletionIsScoredWithTheStopTokenItSampled) {
  TinyGrpo t;
  t.write("p.jsonl", kPrompts);
  const tokenizer::EncodeOptions specials{tokenizer::SpecialPolicy::allow_all(), false};
  const uint32_t eot = t.tok.encode("<|endoftext|>", specials)[0];
  const uint32_t im_end = t.tok.encode("<|im_end|>", specials)[0];
  const model::Llama m = testing::always_predicting(im_end, t.tok.vocab_size());
  GrpoOptions o;
  o.group_size = 2;
  o.prompts_per_step = 2;
  o.max_completion_tokens = 4;
  GrpoObjective objective(o, read_grpo_prompts(t.dir / "p.jsonl", t.tok, {}, lowercase_share), {},
                          lowercase_share, t.tok, {eot, im_end}, 5);
  objective.train_step(m, 1);
  ASSERT_EQ(objective.rollouts().tokens.size(), 4u);
  for (const auto& tokens : objective.rollouts().tokens)
    EXPECT_EQ(tokens, std::vector<uint32_t>{im_end});
}

// Completions stop where generate and chat stop: at the tokenizer's EOS (here <|endoftext|>, not
// the template's end of turn) and at the model's own end ids (generation_config.json's), so that no
// text after an EOS is scored.
TEST(Grpo, CompletionsStopAtTheTokenizersAndTheModelsEos) {
  TinyGrpo t;
  t.write("p.jsonl", kPrompts);
  const tokenizer::EncodeOptions specials{tokenizer::SpecialPolicy::allow_all(), false};
  const uint32_t eos = t.tok.encode("<|endoftext|>", specials)[0];
  const model::Llama m = testing::always_predicting(eos, t.tok.vocab_size());
  GrpoObjective objective(t.context(kTinyRun), lowercase_share);
  objective.train_step(m, 1);
  for (const auto& tokens : objective.rollouts().tokens)
    EXPECT_EQ(tokens, std::vector<uint32_t>{eos});

  const uint32_t configured = t.tok.encode(" cat", specials).back();  // a generation config's
  const model::Llama n = testing::always_predicting(configured, t.tok.vocab_size());
  ObjectiveContext context = t.context(kTinyRun);
  context.end_tokens = {configured, eos};
  GrpoObjective with_config(context, lowercase_share);
  with_config.train_step(n, 1);
  for (const auto& tokens : with_config.rollouts().tokens)
    EXPECT_EQ(tokens, std::vector<uint32_t>{configured});
}

// beta = 0 has no KL term, and the reference is not even read: a reference that cannot be loaded
// is no error then.
TEST(Grpo, BetaZeroNeverLoadsTheReference) {
  TinyGrpo t;
  t.write("p.jsonl", kPrompts);
  const std::string missing = "reference = \"" + (t.dir / "no-such-model").string() + "\"\n";
  GrpoObjective objective(t.context(std::string(kTinyRun) + "beta = 0\n" + missing),
                          lowercase_share);
  EXPECT_EQ(objective.options().loss.beta, 0.0);
  EXPECT_NE(error_of([&] {
              GrpoObjective(t.context(std::string(kTinyRun) + "beta = 0.1\n" + missing),
                            lowercase_share);
            }).find("no-such-model"),
            std::string::npos);
}

// Runs `steps` GRPO steps with AdamW at `lr`; returns the mean reward of the last `last` steps.
double hand_loop(TinyGrpo& t, const std::string& toml, double lr, int steps, int last) {
  model::Llama m = testing::tiny_model(t.tok.vocab_size());
  GrpoObjective objective(t.context(toml), lowercase_share);
  optim::AdamW adamw(m.parameters(), {lr, 0.9, 0.99, 1e-8, 0.0, 1.0});
  double reward = 0;
  for (int step = 1; step <= steps; ++step) {
    adamw.zero_grad();
    const ObjectiveStep s = objective.train_step(m, step);
    adamw.step(lr);
    if (step > steps - last) reward += s.metrics["reward"].get<double>() / last;
  }
  return reward;
}

TEST(Grpo, ShortRunRaisesTheRewardBeyondLearningRateZero) {
  TinyGrpo t;
  t.write("p.jsonl", kPrompts);
  const double trained = hand_loop(t, kTinyRun, 2e-2, 24, 4);
  const double frozen = hand_loop(t, kTinyRun, 0.0, 24, 4);
  std::printf("mean reward over the last 4 of 24 steps: lr 2e-2 %.4f, lr 0 %.4f\n", trained,
              frozen);
  EXPECT_GT(trained, frozen + 0.15);
}

TEST(Grpo, ResumesInsideABatchFromItsState) {
  TinyGrpo t;
  t.write("p.jsonl", kPrompts);
  const std::string toml = std::string(kTinyRun) + "updates_per_batch = 2\nbeta = 0.05\n";
  auto reference = std::make_shared<model::Llama>(testing::tiny_model(t.tok.vocab_size(), 9));
  model::Llama m = testing::tiny_model(t.tok.vocab_size());
  GrpoObjective whole(t.context(toml), lowercase_share);
  whole.set_reference(reference);
  optim::AdamW adamw(m.parameters(), {1e-2, 0.9, 0.99, 1e-8, 0.0, 1.0});
  adamw.zero_grad();
  whole.train_step(m, 1);
  adamw.step(1e-2);
  const nlohmann::ordered_json state = whole.state();
  adamw.zero_grad();
  const ObjectiveStep second = whole.train_step(m, 2);
  const std::vector<ag::Var> params = m.parameters();
  const std::vector<double> grad = params[3].grad().to_doubles();

  GrpoObjective resumed(t.context(toml), lowercase_share);
  resumed.set_reference(reference);
  resumed.restore(nlohmann::ordered_json::parse(state.dump()));  // as a checkpoint stores it
  adamw.zero_grad();
  const ObjectiveStep again = resumed.train_step(m, 2);
  EXPECT_EQ(again.loss, second.loss);
  EXPECT_EQ(params[3].grad().to_doubles(), grad);
  // The second update on a batch sees the policy moved: ratios differ from 1, and KL is reported.
  EXPECT_NE(second.loss, 0.0);
  EXPECT_GT(second.metrics["kl"].get<double>(), 0.0);
  // Without the state, step 2 cannot be run (its batch was sampled by the step-1 policy).
  GrpoObjective fresh(t.context(toml), lowercase_share);
  fresh.set_reference(reference);
  EXPECT_NE(error_of([&] { fresh.train_step(m, 2); }).find("not restored"), std::string::npos);
}

// A reward model reads the policy's token ids: one trained with another tokenizer would score
// other text than the policy wrote, so it is refused; one with the policy's is taken.
TEST(Grpo, ARewardModelWithAnotherTokenizerIsRefused) {
  TinyGrpo t;
  t.write("p.jsonl", "{\"prompt\": \"The cat sat on\"}\n");
  const model::Llama rm_decoder = testing::tiny_model(t.tok.vocab_size(), 11);
  const Tensor w = Tensor::zeros({1, rm_decoder.config().hidden_size}, DType::f32);
  // Another tokenizer: other documents, other added tokens.
  const std::string pattern(tokenizer::known_pattern_regex(tokenizer::KnownPattern::kGpt2));
  tokenizer::PieceCounts counts(pattern);
  const std::vector<std::string_view> docs = {"The cat sat on the mat.", "Bees make honey."};
  counts.add_documents(docs);
  std::filesystem::create_directories(t.dir / "other");
  tokenizer::save_tokenizer(tokenizer::train_bpe(counts, {280, {"<|eot|>"}, pattern}),
                            t.dir / "other" / "tokenizer.json");
  export_reward_model(rm_decoder, ag::Var(w, false), 0, t.dir / "rm-other",
                      {t.dir / "other" / "tokenizer.json"});
  const std::string error = error_of(
      [&] { GrpoObjective(t.context(std::string(kTinyRun) + "reward_model = \"rm-other\"\n")); });
  EXPECT_NE(error.find("another tokenizer"), std::string::npos) << error;

  std::filesystem::create_directories(t.dir / "policy");
  tokenizer::save_tokenizer(t.tok, t.dir / "policy" / "tokenizer.json");
  export_reward_model(rm_decoder, ag::Var(w, false), 0, t.dir / "rm-same",
                      {t.dir / "policy" / "tokenizer.json"});
  ASSERT_TRUE(std::filesystem::exists(t.dir / "rm-same" / "tokenizer.json"));
  GrpoObjective same(t.context(std::string(kTinyRun) + "reward_model = \"rm-same\"\n"));
  // A path that holds no reward model is named by its key before anything is loaded.
  const std::string missing = error_of(
      [&] { GrpoObjective(t.context(std::string(kTinyRun) + "reward_model = \"no\"\n")); });
  EXPECT_NE(missing.find("reward_model"), std::string::npos) << missing;
  EXPECT_NE(missing.find("not a reward model's folder"), std::string::npos) << missing;
}

TEST(Grpo, RewardsFromARewardModelAreItsScores) {
  TinyGrpo t;
  // Prompts without answers: the reward model alone scores them. A conversation's completion is
  // scored as the whole assistant turn, its end included, as the reward model read chat pairs.
  t.write("p.jsonl",
          "{\"prompt\": \"The cat sat on\"}\n"
          "{\"messages\": [{\"role\": \"user\", \"content\": \"Paris is the\"}]}\n");
  const model::Llama rm_decoder = testing::tiny_model(t.tok.vocab_size(), 11);
  Tensor w = Tensor::empty({1, rm_decoder.config().hidden_size}, DType::f32);
  for (int64_t i = 0; i < w.numel(); ++i)
    w.data<float>()[i] = static_cast<float>(std::sin(1.0 + i));
  export_reward_model(rm_decoder, ag::Var(w, false), 0, t.dir / "rm");

  GrpoObjective objective(t.context(std::string(kTinyRun) + "reward_model = \"rm\"\n"));
  const model::Llama m = testing::tiny_model(t.tok.vocab_size());
  objective.train_step(m, 1);
  const Rollouts& r = objective.rollouts();
  ASSERT_EQ(r.rewards.size(), 12u);

  // Each reward is the reward model's score of the prompt's tokens followed by the completion's
  // text encoded (random completions are not always valid UTF-8, so not through JSONL).
  const tokenizer::EncodeOptions specials{tokenizer::SpecialPolicy::allow_all(), false};
  const std::vector<uint32_t> stop = {t.tok.encode("<|endoftext|>", specials)[0],
                                      t.tok.encode("<|im_end|>", specials)[0]};
  const auto prompts = read_grpo_prompts(t.dir / "p.jsonl", t.tok, {}, {});
  std::vector<ScoredSequence> sequences;
  for (size_t i = 0; i < r.tokens.size(); ++i) {
    std::vector<uint32_t> tokens = r.tokens[i];
    if (!tokens.empty() && std::count(stop.begin(), stop.end(), tokens.back())) tokens.pop_back();
    ScoredSequence s;
    s.ids = prompts[r.prompt[i]].tokens;
    s.prompt_tokens = static_cast<int64_t>(s.ids.size());
    const std::vector<uint32_t> reply =
        t.tok.encode(t.tok.decode(tokens) + prompts[r.prompt[i]].turn_end, specials);
    s.ids.insert(s.ids.end(), reply.begin(), reply.end());
    sequences.push_back(std::move(s));
  }
  const RewardModel rm = load_reward_model(t.dir / "rm");
  const std::vector<double> scores = score_sequences(*rm.decoder, rm.score, sequences, 4);
  std::set<double> distinct;
  for (size_t i = 0; i < scores.size(); ++i) {
    EXPECT_NEAR(r.rewards[i], scores[i], 1e-5) << "completion " << i;
    distinct.insert(r.rewards[i]);
  }
  EXPECT_GE(distinct.size(), 4u);  // scores that differ: advantages that are not all zero

  // With [grpo.verifier] too, the verifier's reward is added (here a regex every completion
  // meets) and the prompts need their answers again.
  t.write("p.jsonl",
          "{\"prompt\": \"The cat sat on\", \"answer\": 1}\n"
          "{\"messages\": [{\"role\": \"user\", \"content\": \"Paris is the\"}], "
          "\"answer\": 2}\n");
  GrpoObjective both(t.context(std::string(kTinyRun) +
                               "reward_model = \"rm\"\n[verifier]\nkind = \"regex\"\n"
                               "pattern = \"\"\n"));
  both.train_step(m, 1);
  for (size_t k = 0; k < r.rewards.size(); ++k)
    EXPECT_DOUBLE_EQ(both.rollouts().rewards[k], r.rewards[k] + 1.0);
}

TEST(Grpo, SynthPromptsAskWhatSftDataOfTheSameTaskAnswers) {
  TinyGrpo t;
  const std::vector<SynthExample> examples = synth_examples("arithmetic", 50, 3);
  std::string text;
  for (const auto& e : examples) text += grpo_jsonl_line(e) + "\n";
  t.write("a.jsonl", text);
  ConfigTable section = ConfigTable::parse("data = \"a.jsonl\"\n", "run.toml");
  RewardFunction numeric;
  read_grpo_options(section, t.dir, &numeric);
  const auto prompts = read_grpo_prompts(t.dir / "a.jsonl", t.tok, {}, numeric);
  ASSERT_EQ(prompts.size(), 50u);
  for (size_t i = 0; i < prompts.size(); ++i) {
    // The prompt is the SFT conversation's user turn, ready for the assistant's reply ...
    EXPECT_EQ(prompts[i].text,
              "<|im_start|>user\n" + examples[i].prompt + "<|im_end|>\n<|im_start|>assistant\n");
    // ... and the reply SFT teaches earns the full reward, a wrong sum none.
    EXPECT_EQ(numeric(prompts[i].text, examples[i].completion, prompts[i].answer), 1.0);
    EXPECT_EQ(numeric(prompts[i].text, "#### " + prompts[i].answer + "1", prompts[i].answer), 0.0);
  }
}

// `digits` bounds the operands of arithmetic: one digit gives sums and differences of 0 to 9;
// the default two digits reach up to 99.
TEST(Grpo, SynthArithmeticOperandsHaveAtMostTheGivenDigits) {
  const auto largest_operand = [](const std::vector<SynthExample>& examples) {
    int largest = 0;
    for (const auto& e : examples) {
      int a = 0, b = 0;
      char op = 0;
      EXPECT_EQ(std::sscanf(e.prompt.c_str(), "What is %d %c %d?", &a, &op, &b), 3) << e.prompt;
      EXPECT_EQ(std::to_string(op == '+' ? a + b : a - b), e.answer) << e.prompt;
      largest = std::max({largest, a, b});
    }
    return largest;
  };
  EXPECT_EQ(largest_operand(synth_examples("arithmetic", 300, 4, 1)), 9);
  EXPECT_GT(largest_operand(synth_examples("arithmetic", 300, 4)), 90);
  EXPECT_THROW(synth_examples("arithmetic", 3, 4, 0), Error);
}

}  // namespace
}  // namespace pollen::train
