// Generation: the KV cache against the full forward, greedy with and without the cache, seeded
// sampling, the sampling filters on hand-made logits, stop tokens (and which one ended a row),
// stop strings and budgets, and sampling kept to a tokenizer's ids.
#include "model/generate.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "base/rng.h"
#include "model/continuation.h"
#include "model/generation_batch.h"
#include "support/tiny_lm.h"

namespace pollen {
namespace {

model::LlamaConfig gen_config(bool bias, int64_t window) {
  model::LlamaConfig c;
  c.name = "gen";
  c.vocab_size = 53;
  c.hidden_size = 32;
  c.intermediate_size = 40;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.attention_bias = bias;
  c.sliding_window = window;
  c.rope_scaling = {ops::RopeScaling::Kind::llama3, 4.0, 1.0, 4.0, 8};
  return c;
}

model::Llama random_model(const model::LlamaConfig& c, uint64_t seed) {
  model::Llama m(c, seed);
  Rng rng(seed + 1);
  for (auto& [name, v] : m.named_parameters()) {
    float* p = v.value().data<float>();
    for (int64_t i = 0; i < v.value().numel(); ++i)
      p[i] = static_cast<float>((name.ends_with("norm.weight") ? 1.0 : 0.0) + 0.3 * rng.normal());
  }
  return m;
}

const std::vector<std::vector<uint32_t>> kPrompts = {{1, 2, 3, 4, 5}, {7}, {9, 9, 30, 12}};

TEST(KvCache, LogitsMatchTheFullForward) {
  for (int64_t window : {0, 3}) {
    const model::Llama m = random_model(gen_config(true, window), 3);
    const std::vector<uint32_t> seq = {4, 8, 15, 16, 23, 42, 1, 2};
    model::KvCache cache(m.config(), 1, 16);
    // prefill three tokens, then one at a time
    std::vector<Tensor> steps;
    steps.push_back(cache.forward(m, {{seq.begin(), seq.begin() + 3}}));
    for (size_t i = 3; i < seq.size(); ++i) steps.push_back(cache.forward(m, {{seq[i]}}));
    Tensor ids = Tensor::empty({1, static_cast<int64_t>(seq.size())}, DType::i32);
    for (size_t i = 0; i < seq.size(); ++i) ids.data<int32_t>()[i] = static_cast<int32_t>(seq[i]);
    const Tensor full = m.logits(model::Batch::contiguous_rows(ids, ids));
    const int64_t V = m.config().vocab_size;
    for (size_t s = 0; s < steps.size(); ++s) {
      const int64_t pos = static_cast<int64_t>(s) + 2;
      for (int64_t v = 0; v < V; ++v)
        EXPECT_NEAR(steps[s].data<float>()[v], full.data<float>()[pos * V + v], 1e-4)
            << "window " << window << " position " << pos;
    }
  }
}

// Dynamic rope scaling grows theta with a call's longest position: a short row batched beside
// one past max_position_embeddings must still be rotated as it would be alone.
TEST(KvCache, DynamicScalingRotatesEachRowOnItsOwn) {
  model::LlamaConfig c = gen_config(false, 0);
  c.max_position_embeddings = 8;
  c.rope_scaling = {};
  c.rope_scaling.kind = ops::RopeScaling::Kind::dynamic;
  c.rope_scaling.factor = 2.0;
  c.rope_scaling.original_max_position_embeddings = 8;
  const model::Llama m = random_model(c, 5);
  const std::vector<uint32_t> longer(20, 3), shorter = {1, 2, 3};
  model::KvCache both(m.config(), 2, 32), alone(m.config(), 1, 32);
  const Tensor together = both.forward(m, {longer, shorter});
  const Tensor by_itself = alone.forward(m, {shorter});
  const int64_t V = c.vocab_size;
  for (int64_t v = 0; v < V; ++v)
    EXPECT_NEAR(together.data<float>()[V + v], by_itself.data<float>()[v], 1e-5) << "logit " << v;
}

TEST(Generate, GreedyWithAndWithoutCacheAgree) {
  for (int64_t window : {0, 4}) {
    const model::Llama m = random_model(gen_config(window == 0, window), 5);
    model::SamplingOptions o;
    o.temperature = 0;
    o.max_tokens = 12;
    const auto cached = model::generate(m, kPrompts, o);
    o.use_cache = false;
    const auto plain = model::generate(m, kPrompts, o);
    for (size_t r = 0; r < kPrompts.size(); ++r) {
      EXPECT_EQ(cached[r].tokens, plain[r].tokens) << "row " << r;
      EXPECT_EQ(cached[r].tokens.size(), 12u);
      EXPECT_EQ(cached[r].finish_reason, "length");
    }
  }
}

TEST(Generate, SeededSamplingIsReproducibleAndRowsIndependent) {
  const model::Llama m = random_model(gen_config(false, 0), 7);
  model::SamplingOptions o;
  o.temperature = 0.9;
  o.top_k = 20;
  o.top_p = 0.95;
  o.min_p = 0.01;
  o.repetition_penalty = 1.2;
  o.max_tokens = 10;
  o.seed = 42;
  const auto a = model::generate(m, kPrompts, o), b = model::generate(m, kPrompts, o);
  for (size_t r = 0; r < kPrompts.size(); ++r) EXPECT_EQ(a[r].tokens, b[r].tokens);
  // Row 0 alone draws the same as row 0 in the batch.
  const auto alone = model::generate(m, {kPrompts[0]}, o);
  EXPECT_EQ(alone[0].tokens, a[0].tokens);
  o.seed = 43;
  const auto c = model::generate(m, kPrompts, o);
  bool differs = false;
  for (size_t r = 0; r < kPrompts.size(); ++r) differs |= c[r].tokens != a[r].tokens;
  EXPECT_TRUE(differs);
}

// A row whose cancelled flag is set ends before its next step ("cancelled"); the others go on.
TEST(Generate, ACancelledRowEndsAtTheNextStep) {
  const model::Llama m = random_model(gen_config(false, 0), 7);
  model::SamplingOptions o;
  o.max_tokens = 8;
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  std::vector<model::GenerationRow> rows = {{kPrompts[0], o, Rng(1), cancelled},
                                            {kPrompts[1], o, Rng(2)}};
  const auto out = model::generate_rows(m, rows, {}, [&](size_t row, uint32_t, auto) {
    if (row == 0) cancelled->store(true);  // after its first token
  });
  EXPECT_EQ(out[0].finish_reason, "cancelled");
  EXPECT_EQ(out[0].tokens.size(), 1u);
  EXPECT_EQ(out[1].finish_reason, "length");
  EXPECT_EQ(out[1].tokens, model::generate_rows(m, {{kPrompts[1], o, Rng(2)}})[0].tokens);
}

TEST(Generate, StopTokensStopStringsAndBudget) {
  const model::Llama m = random_model(gen_config(false, 0), 9);
  model::SamplingOptions o;
  o.temperature = 0;
  o.max_tokens = 8;
  const auto free_run = model::generate(m, {kPrompts[0]}, o)[0].tokens;
  ASSERT_EQ(free_run.size(), 8u);
  o.stop_tokens = {free_run[2]};
  const auto stopped = model::generate(m, {kPrompts[0]}, o)[0];
  // Stops at the first occurrence of the stop token, which is not included.
  size_t first = 0;
  while (free_run[first] != free_run[2]) ++first;
  EXPECT_EQ(stopped.tokens, std::vector<uint32_t>(free_run.begin(), free_run.begin() + first));
  EXPECT_EQ(stopped.finish_reason, "stop");
  // Stop strings on a decoder that spells ids as "<id>".
  auto decode = [](std::span<const uint32_t> ids) {
    std::string s;
    for (uint32_t id : ids) s += "<" + std::to_string(id) + ">";
    return s;
  };
  o.stop_tokens.clear();
  o.stop_strings = {"<" + std::to_string(free_run[3]) + ">"};
  const auto by_string = model::generate(m, {kPrompts[0]}, o, decode)[0];
  EXPECT_EQ(by_string.finish_reason, "stop");
  EXPECT_EQ(by_string.text.find(o.stop_strings[0]), std::string::npos);
  EXPECT_EQ(by_string.text,
            decode(std::vector<uint32_t>(free_run.begin(),
                                         free_run.begin() + (by_string.tokens.size() - 1))));
  o.stop_strings.clear();
  o.max_tokens = 0;
  EXPECT_TRUE(model::generate(m, {kPrompts[0]}, o)[0].tokens.empty());
}

TEST(Sampling, FiltersOnHandMadeLogits) {
  // probabilities 0.5, 0.25, 0.125, 0.125
  const std::vector<float> logits = {std::log(4.0f), std::log(2.0f), 0.0f, 0.0f};
  model::SamplingOptions o;
  Rng rng(1);
  o.top_k = 1;
  for (int i = 0; i < 20; ++i) EXPECT_EQ(model::sample_token(logits, {}, o, rng), 0u);
  o.top_k = 0;
  o.top_p = 0.7;  // keeps {0, 1}
  std::vector<int> seen(4, 0);
  for (int i = 0; i < 400; ++i) ++seen[model::sample_token(logits, {}, o, rng)];
  EXPECT_GT(seen[0], 0);
  EXPECT_GT(seen[1], 0);
  EXPECT_EQ(seen[2] + seen[3], 0);
  o.top_p = 1.0;
  o.min_p = 0.3;  // 0.25 / 0.5 = 0.5 >= 0.3 stays, 0.125 / 0.5 = 0.25 goes
  seen.assign(4, 0);
  for (int i = 0; i < 400; ++i) ++seen[model::sample_token(logits, {}, o, rng)];
  EXPECT_EQ(seen[2] + seen[3], 0);
  EXPECT_GT(seen[1], 0);
  // Repetition penalty: token 0's positive logit divided; greedy picks token 1 instead.
  model::SamplingOptions g;
  g.temperature = 0;
  g.repetition_penalty = 3.0;
  const std::vector<uint32_t> history = {0};
  EXPECT_EQ(model::sample_token(logits, history, g, rng), 1u);
}

// As HF's TopKLogitsWarper: tokens tied with the k-th stay in; a negative logit seen before is
// multiplied by the penalty (moved away from the top), a positive one divided.
TEST(Sampling, TopKKeepsTiesAndThePenaltyMovesNegativeLogitsDown) {
  const std::vector<float> tied = {1.0f, 1.0f, 1.0f, 0.0f};
  model::SamplingOptions o;
  o.top_k = 1;
  Rng rng(5);
  std::vector<int> seen(4, 0);
  for (int i = 0; i < 300; ++i) ++seen[model::sample_token(tied, {}, o, rng)];
  EXPECT_GT(seen[0], 0);
  EXPECT_GT(seen[1], 0);
  EXPECT_GT(seen[2], 0);
  EXPECT_EQ(seen[3], 0);
  const std::vector<float> negative = {-1.0f, -1.5f};
  model::SamplingOptions g;
  g.temperature = 0;
  g.repetition_penalty = 2.0;  // token 0: -1 * 2 = -2 < -1.5
  const std::vector<uint32_t> history = {0};
  EXPECT_EQ(model::sample_token(negative, history, g, rng), 1u);
}

// Options out of range are refused with their name, as HF refuses them, rather than sampled with
// (a penalty of 0 made seen logits infinite and the weights NaN); NaN logits too.
TEST(Sampling, OptionsOutOfRangeAndNaNLogitsAreRefused) {
  const std::vector<float> logits = {0.5f, 3.0f};
  Rng rng(1);
  auto error = [&](auto change, std::span<const float> l) {
    model::SamplingOptions o;
    change(o);
    try {
      model::sample_token(l, {}, o, rng);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error([](auto& o) { o.repetition_penalty = 0; }, logits).find("repetition_penalty"),
            std::string::npos);
  EXPECT_NE(error([](auto& o) { o.temperature = -1; }, logits).find("temperature"),
            std::string::npos);
  EXPECT_NE(error([](auto& o) { o.top_k = -2; }, logits).find("top_k"), std::string::npos);
  EXPECT_NE(error([](auto& o) { o.top_p = 0; }, logits).find("top_p"), std::string::npos);
  EXPECT_NE(error([](auto& o) { o.min_p = 1.5; }, logits).find("min_p"), std::string::npos);
  const std::vector<float> nan = {0.5f, std::nanf("")};
  EXPECT_NE(error([](auto&) {}, nan).find("NaN"), std::string::npos);
}

// A temperature above 0 but too small to divide logits by (z / T overflows) samples the most
// likely token, as the limit T -> 0 does, not NaN weights that fall through to the least likely.
TEST(Sampling, ATinyTemperatureIsGreedy) {
  const std::vector<float> logits = {0.5f, 3.0f, -2.0f, 1.0f};
  model::SamplingOptions o;
  Rng rng(3);
  for (const double t : {1e-300, 1e-310, 1e-20}) {
    o.temperature = t;
    for (int i = 0; i < 20; ++i) EXPECT_EQ(model::sample_token(logits, {}, o, rng), 1u) << t;
  }
}

// A text is cut at the earliest stop string in it, whichever comes first in the list: one token
// may complete two of them at once.
TEST(Generate, TheEarliestStopStringCuts) {
  const std::vector<std::string> stops = {"lo", "el", ""};
  EXPECT_EQ(model::first_stop(" hello", stops), 2u);
  EXPECT_EQ(model::first_stop(" hallo", stops), 4u);
  EXPECT_EQ(model::first_stop(" ha", stops), std::string::npos);
  EXPECT_EQ(model::first_stop("", {}), std::string::npos);
}

// A model's vocabulary padded beyond its tokenizer's: ids from options.vocab_size on are never
// sampled, greedily or not, by generate, generate_rows or Continuation, even when the model
// prefers one of them above all.
TEST(Generate, SamplesOnlyIdsBelowVocabSize) {
  const model::Llama m = testing::always_predicting(52, 53);
  model::SamplingOptions o;
  o.max_tokens = 6;
  o.seed = 4;
  EXPECT_EQ(model::generate(m, kPrompts, o)[0].tokens, std::vector<uint32_t>(6, 52));
  o.vocab_size = 50;
  for (double temperature : {0.0, 1.0}) {
    o.temperature = temperature;
    for (const auto& g : model::generate(m, kPrompts, o)) {
      ASSERT_EQ(g.tokens.size(), 6u);
      for (uint32_t id : g.tokens) EXPECT_LT(id, 50u) << "temperature " << temperature;
    }
    model::Continuation session(m, 64, 1);
    for (uint32_t id : session.generate(kPrompts[0], o, {}).tokens) EXPECT_LT(id, 50u);
    // Streaming callers see the whole row (a token's log-probability is over all of V), whose
    // best id below the limit is the one greedy decoding took.
    model::generate_rows(
        m, {{kPrompts[1], o, Rng(2)}}, {},
        [&](size_t, uint32_t token, std::span<const float> logits) {
          ASSERT_EQ(logits.size(), 53u);
          if (temperature == 0)
            EXPECT_EQ(token,
                      std::max_element(logits.begin(), logits.begin() + 50) - logits.begin());
        });
  }
  // On hand-made logits: the best id below the limit, and never one above it.
  const std::vector<float> logits = {0.0f, 1.0f, 0.5f, 9.0f};
  o.vocab_size = 3;
  o.temperature = 0;
  Rng rng(1);
  EXPECT_EQ(model::sample_token(logits, {}, o, rng), 1u);
  o.temperature = 1.0;
  for (int i = 0; i < 200; ++i) EXPECT_LT(model::sample_token(logits, {}, o, rng), 3u);
}

// With several stop tokens, a row that stopped names the one it sampled.
TEST(Generate, ReportsTheStopTokenThatEndedARow) {
  const model::Llama m = testing::always_predicting(7, 53);
  model::SamplingOptions o;
  o.max_tokens = 5;
  o.stop_tokens = {3, 7};
  const model::Generation g = model::generate(m, {kPrompts[0]}, o)[0];
  EXPECT_EQ(g.finish_reason, "stop");
  EXPECT_EQ(g.stop_token, std::optional<uint32_t>(7));
  EXPECT_TRUE(g.tokens.empty());
  model::Continuation session(m, 64, 1);
  EXPECT_EQ(session.generate(kPrompts[0], o, {}).stop_token, std::optional<uint32_t>(7));
  o.stop_tokens = {3};
  const model::Generation cut = model::generate(m, {kPrompts[0]}, o)[0];
  EXPECT_EQ(cut.finish_reason, "length");
  EXPECT_FALSE(cut.stop_token.has_value());
}

TEST(GenerateRows, EachRowAsIfGeneratedAlone) {
  const model::Llama m = random_model(gen_config(false, 0), 5);
  model::SamplingOptions hot, greedy;
  hot.max_tokens = 9;
  hot.temperature = 0.9;
  hot.top_p = 0.8;
  hot.seed = 3;
  greedy.max_tokens = 4;
  greedy.temperature = 0;
  std::vector<model::GenerationRow> rows = {{kPrompts[0], hot, Rng(3).fork(0)},
                                            {kPrompts[1], greedy, Rng(0).fork(0)},
                                            {kPrompts[2], hot, Rng(3).fork(2)}};
  std::vector<std::pair<size_t, uint32_t>> seen;
  const auto out = model::generate_rows(
      m, rows, {}, [&](size_t row, uint32_t token, std::span<const float> logits) {
        EXPECT_EQ(logits.size(), 53u);
        seen.emplace_back(row, token);
      });
  const auto alone_hot = model::generate(m, {kPrompts[0], kPrompts[1], kPrompts[2]}, hot);
  const auto alone_greedy = model::generate(m, {kPrompts[1]}, greedy);
  EXPECT_EQ(out[0].tokens, alone_hot[0].tokens);
  EXPECT_EQ(out[1].tokens, alone_greedy[0].tokens);
  EXPECT_EQ(out[2].tokens, alone_hot[2].tokens);
  EXPECT_EQ(out[1].tokens.size(), 4u);
  size_t kept = 0;
  for (const auto& g : out) kept += g.tokens.size();
  EXPECT_EQ(seen.size(), kept);  // one call per kept token
}

// Continuous batching: rows that join a running batch at later steps, into rows of the cache
// that finished rows left, generate what each generates alone; the cache holds no more rows than
// were live at once, and is freed when the batch runs empty.
TEST(GenerationBatch, RowsJoiningLaterGenerateAsAlone) {
  const model::Llama m = random_model(gen_config(true, 3), 7);
  model::SamplingOptions o;
  o.temperature = 0.8;
  const std::vector<std::vector<uint32_t>> prompts = {
      {1, 2, 3, 4, 5}, {7}, {9, 9, 30, 12}, {40, 41}, {3, 3, 3, 3, 3, 3, 3}};
  const std::vector<int64_t> budgets = {3, 9, 5, 12, 4};
  const auto row = [&](size_t i) {
    model::SamplingOptions oi = o;
    oi.max_tokens = budgets[i];
    return model::GenerationRow{prompts[i], oi, Rng(20 + i), nullptr};
  };
  std::vector<std::vector<uint32_t>> streamed(prompts.size());
  model::GenerationBatch batch(m, {}, [&](size_t id, uint32_t token, std::span<const float>) {
    streamed[id].push_back(token);
  });
  std::vector<model::Generation> got(prompts.size());
  size_t added = 0, steps = 0;
  EXPECT_EQ(batch.add(row(added++)), 0u);
  EXPECT_EQ(batch.add(row(added++)), 1u);
  while (batch.live() > 0) {
    for (auto& f : batch.step()) got[f.id] = std::move(f.generation);
    ++steps;
    // One row joins at step 2, two more whenever fewer than two are live.
    if ((steps == 2 && added == 2) || (added > 2 && added < prompts.size() && batch.live() < 2))
      batch.add(row(added++));
    EXPECT_LE(batch.cache_rows(), 3);
  }
  EXPECT_EQ(added, prompts.size());
  EXPECT_EQ(batch.cache_rows(), 0);  // freed once empty
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto alone = model::generate_rows(m, {row(i)});
    EXPECT_EQ(got[i].tokens, alone[0].tokens) << "row " << i;
    EXPECT_EQ(got[i].finish_reason, "length") << "row " << i;
    EXPECT_EQ(streamed[i], got[i].tokens) << "row " << i;
  }
}

// The KV cache follows what the rows hold, not the budgets they may never use: a row with the
// largest budget there is generates, and stops at its stop token, as with a small budget, and the
// cache's room doubles as the row grows.
TEST(GenerationBatch, TheCacheGrowsWithTheRowsNotTheirBudgets) {
  const model::Llama m = random_model(gen_config(true, 3), 7);
  const std::vector<uint32_t> prompt = {1, 2, 3, 4, 5};
  model::SamplingOptions o;
  o.temperature = 0;
  o.max_tokens = 12;
  const auto ref = model::generate_rows(m, {{prompt, o, Rng(1), nullptr}})[0].tokens;
  ASSERT_EQ(ref.size(), 12u);
  size_t k = 1;  // the first token after the first that has not come before: the stop token
  while (k < ref.size() && std::find(ref.begin(), ref.begin() + static_cast<long>(k), ref[k]) !=
                               ref.begin() + static_cast<long>(k))
    ++k;
  ASSERT_LT(k, ref.size()) << "greedy repeats one token; pick another prompt";
  o.max_tokens = std::numeric_limits<int64_t>::max();
  o.stop_tokens = {ref[k]};
  model::GenerationBatch batch(m);
  batch.add({prompt, o, Rng(1), nullptr});
  std::vector<model::Generation> got;
  for (int64_t held = static_cast<int64_t>(prompt.size()); batch.live() > 0; ++held) {
    for (auto& f : batch.step()) got.push_back(std::move(f.generation));
    if (batch.live() == 0) break;
    EXPECT_GE(batch.cache_capacity(), held);
    EXPECT_LE(batch.cache_capacity(), 2 * held);
  }
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].tokens, std::vector<uint32_t>(ref.begin(), ref.begin() + static_cast<long>(k)));
  EXPECT_EQ(got[0].finish_reason, "stop");
}

// Chunked prefill: a long prompt joining the batch runs a few tokens a step, so a row already
// generating gets its token every step meanwhile; both generate what they generate alone.
TEST(GenerationBatch, ALongPromptJoinsInChunksAndTheOthersKeepGenerating) {
  const model::Llama m = random_model(gen_config(false, 0), 9);
  model::SamplingOptions o;
  o.temperature = 0.9;
  o.max_tokens = 16;
  const std::vector<uint32_t> short_prompt = {3, 4},
                              long_prompt = {5, 9, 2, 7, 7, 1, 30, 12, 8, 40, 41, 6, 2};
  std::vector<size_t> tokens_of(2, 0);
  model::GenerationBatch batch(
      m, {}, [&](size_t id, uint32_t, std::span<const float>) { ++tokens_of[id]; }, true, 4);
  std::vector<model::Generation> got(2);
  batch.add({short_prompt, o, Rng(1), nullptr});
  for (int s = 0; s < 2; ++s) batch.step();
  ASSERT_EQ(tokens_of[0], 2u);
  batch.add({long_prompt, o, Rng(2), nullptr});
  // 13 prompt tokens at most 4 a step (the short row's one token is not a prompt's): 4 steps.
  for (int s = 1; s <= 4; ++s) {
    for (auto& f : batch.step()) got[f.id] = std::move(f.generation);
    EXPECT_EQ(tokens_of[0], 2u + static_cast<size_t>(s)) << "step " << s;
    EXPECT_EQ(tokens_of[1], s < 4 ? 0u : 1u) << "step " << s;
  }
  while (batch.live() > 0)
    for (auto& f : batch.step()) got[f.id] = std::move(f.generation);
  EXPECT_EQ(got[0].tokens, model::generate_rows(m, {{short_prompt, o, Rng(1), nullptr}})[0].tokens);
  EXPECT_EQ(got[1].tokens, model::generate_rows(m, {{long_prompt, o, Rng(2), nullptr}})[0].tokens);
}

}  // namespace
}  // namespace pollen
