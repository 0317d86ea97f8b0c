// Continuation: a growing sequence generated turn after turn reuses the KV cache for the prefix
// it shares with what ran before, and gives the tokens generate() gives on the whole sequence;
// streamed text adds up to the reply and never shows part of a stop string.
#include "model/continuation.h"

#include <gtest/gtest.h>

#include "base/error.h"
#include "base/rng.h"

namespace pollen {
namespace {

model::Llama random_model(uint64_t seed) {
  model::LlamaConfig c;
  c.name = "continuation";
  c.vocab_size = 53;
  c.hidden_size = 32;
  c.intermediate_size = 40;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  model::Llama m(c, seed);
  Rng rng(seed + 1);
  for (auto& [name, v] : m.named_parameters()) {
    float* p = v.value().data<float>();
    for (int64_t i = 0; i < v.value().numel(); ++i)
      p[i] = static_cast<float>((name.ends_with("norm.weight") ? 1.0 : 0.0) + 0.3 * rng.normal());
  }
  return m;
}

// Each id as one letter, so that stop strings can be made from known output.
std::string letters(std::span<const uint32_t> ids) {
  std::string s;
  for (uint32_t id : ids) s += static_cast<char>('A' + id % 26);
  return s;
}

// Two characters a token: its letter in lower then upper case.
std::string letter_pairs(std::span<const uint32_t> ids) {
  std::string s;
  for (uint32_t id : ids) {
    s += static_cast<char>('a' + id % 26);
    s += static_cast<char>('A' + id % 26);
  }
  return s;
}

TEST(Continuation, TurnsReuseTheCacheAndMatchGenerate) {
  const model::Llama m = random_model(5);
  model::SamplingOptions o;
  o.temperature = 0;
  o.max_tokens = 6;
  model::Continuation session(m, 64, 0);
  std::vector<uint32_t> conversation = {1, 2, 3, 4, 5};
  for (int turn = 0; turn < 3; ++turn) {
    const auto reply = session.generate(conversation, o, letters);
    const auto expected = model::generate(m, {conversation}, o, letters)[0];
    EXPECT_EQ(reply.tokens, expected.tokens) << "turn " << turn;
    EXPECT_EQ(reply.text, expected.text);
    if (turn == 0) EXPECT_EQ(session.reused_tokens(), 0);
    // All of the earlier turn ran already: the prompt and the reply but its last token,
    // which was sampled and never run.
    if (turn > 0) EXPECT_EQ(session.reused_tokens(), static_cast<int64_t>(conversation.size()) - 4);
    conversation.insert(conversation.end(), reply.tokens.begin(), reply.tokens.end());
    conversation.insert(conversation.end(), {7, 8, 9});
  }
  // Sampled, the first reply is row 0 of generate with the session's seed (and so choice 0 of a
  // serve request with that seed): pollen chat, generate and serve agree on a first reply.
  o.temperature = 1;
  o.seed = 17;
  EXPECT_EQ(model::Continuation(m, 64, 17).generate({1, 2, 3}, o, letters).tokens,
            model::generate(m, {{1, 2, 3}}, o)[0].tokens);
  o.temperature = 0;
  // A sequence that departs from the cached one early runs again from there.
  conversation[2] = 40;
  const auto reply = session.generate(conversation, o, letters);
  EXPECT_EQ(session.reused_tokens(), 2);
  EXPECT_EQ(reply.tokens, model::generate(m, {conversation}, o)[0].tokens);
}

TEST(Continuation, StreamsTheReplyAndHoldsBackStopStrings) {
  const model::Llama m = random_model(9);
  model::SamplingOptions o;
  o.temperature = 0;
  o.max_tokens = 12;
  const std::vector<uint32_t> prompt = {3, 1, 4, 1, 5};
  const std::string free_text = model::Continuation(m, 64, 0).generate(prompt, o, letters).text;
  ASSERT_EQ(free_text.size(), 12u);
  o.stop_strings = {free_text.substr(6, 3)};
  std::string streamed;
  std::vector<std::string> pieces;
  model::Continuation session(m, 64, 0);
  const auto reply = session.generate(prompt, o, letters, [&](std::string_view t) {
    streamed += t;
    pieces.emplace_back(t);
  });
  const size_t at = free_text.find(o.stop_strings[0]);
  EXPECT_EQ(reply.text, free_text.substr(0, at));
  EXPECT_EQ(reply.finish_reason, "stop");
  EXPECT_EQ(streamed, reply.text);
  EXPECT_GE(pieces.size(), 2u);  // streamed as it went, not at the end only
  // One token that completes two stop strings is cut at the earlier of them, whichever the list
  // names first: the text never keeps a stop string.
  o.stop_strings.clear();
  const std::string pairs = model::Continuation(m, 64, 0).generate(prompt, o, letter_pairs).text;
  size_t k = 1;  // a token whose letter no earlier token has, so that it completes both
  while (k < pairs.size() / 2 && pairs.substr(0, 2 * k).find(pairs[2 * k]) != std::string::npos)
    ++k;
  ASSERT_LT(k, pairs.size() / 2) << pairs;
  o.stop_strings = {pairs.substr(2 * k + 1, 1), pairs.substr(2 * k, 1)};  // upper, then lower
  const auto cut = model::Continuation(m, 64, 0).generate(prompt, o, letter_pairs);
  EXPECT_EQ(cut.text, pairs.substr(0, 2 * k));
  // Sequences that would outgrow the context are refused.
  model::Continuation small(m, 8, 0);
  EXPECT_THROW(small.generate(prompt, o, letters), Error);
}

}  // namespace
}  // namespace pollen
