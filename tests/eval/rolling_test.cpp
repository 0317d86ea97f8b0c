// Rolling log-likelihood windows as lm-evaluation-harness makes them, every token scored once,
// and scores equal to a direct log-softmax of the model's logits.
#include "eval/rolling.h"

#include <gtest/gtest.h>

#include <cmath>

#include "base/rng.h"

namespace pollen {
namespace {

TEST(RollingWindows, MatchLmEvaluationHarness) {
  std::vector<uint32_t> t(10);
  for (uint32_t i = 0; i < 10; ++i) t[i] = i;
  const auto w = eval::rolling_windows(t, 99, 4);
  ASSERT_EQ(w.size(), 3u);
  EXPECT_EQ(w[0].input, (std::vector<uint32_t>{99, 0, 1, 2}));
  EXPECT_EQ(w[0].targets, (std::vector<uint32_t>{0, 1, 2, 3}));
  EXPECT_EQ(w[1].input, (std::vector<uint32_t>{3, 4, 5, 6}));
  EXPECT_EQ(w[1].targets, (std::vector<uint32_t>{4, 5, 6, 7}));
  EXPECT_EQ(w[2].input, (std::vector<uint32_t>{5, 6, 7, 8}));
  EXPECT_EQ(w[2].targets, (std::vector<uint32_t>{8, 9}));
  EXPECT_TRUE(eval::rolling_windows({}, 0, 4).empty());
  const auto one = eval::rolling_windows(std::vector<uint32_t>{5}, 7, 4);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].input, (std::vector<uint32_t>{7}));
  EXPECT_EQ(one[0].targets, (std::vector<uint32_t>{5}));
}

model::Llama small_model() {
  model::LlamaConfig c;
  c.vocab_size = 31;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  model::Llama m(c, 4);
  Rng rng(2);
  for (auto& [n, v] : m.named_parameters()) {
    float* p = v.value().data<float>();
    for (int64_t i = 0; i < v.value().numel(); ++i)
      p[i] = static_cast<float>((n.ends_with("norm.weight") ? 1.0 : 0.0) + 0.3 * rng.normal());
  }
  return m;
}

TEST(TokenLogprobs, OneWindowEqualsTheDirectLogSoftmax) {
  const model::Llama m = small_model();
  const std::vector<uint32_t> t = {3, 1, 4, 1, 5, 9, 2, 6};
  const auto lp = eval::token_logprobs(m, t, 30, 64);
  ASSERT_EQ(lp.size(), t.size());
  Tensor ids = Tensor::empty({1, 8}, DType::i32);
  ids.data<int32_t>()[0] = 30;
  for (int i = 1; i < 8; ++i) ids.data<int32_t>()[i] = static_cast<int32_t>(t[i - 1]);
  const Tensor logits = m.logits(model::Batch::contiguous_rows(ids, ids));
  for (int i = 0; i < 8; ++i) {
    const float* z = logits.data<float>() + i * 31;
    double s = 0;
    for (int v = 0; v < 31; ++v) s += std::exp(static_cast<double>(z[v]));
    EXPECT_NEAR(lp[static_cast<size_t>(i)], z[t[static_cast<size_t>(i)]] - std::log(s), 1e-5);
  }
  // Small windows still score each token once, with less context.
  const auto rolled = eval::token_logprobs(m, t, 30, 3);
  ASSERT_EQ(rolled.size(), t.size());
  for (int i = 0; i < 3; ++i)
    EXPECT_NEAR(rolled[static_cast<size_t>(i)], lp[static_cast<size_t>(i)], 1e-5);
  const auto seq = eval::sequence_logprobs(m, t, 64);
  ASSERT_EQ(seq.size(), t.size());
  EXPECT_FALSE(seq[0].has_value());
  ASSERT_TRUE(seq[1].has_value());
}

// A model whose logits hold NaN cannot score: an error, as sampling gives, not a NaN that JSON
// writes as null ("nothing predicts this token").
TEST(TokenLogprobs, NaNLogitsAreAnError) {
  model::Llama m = small_model();
  for (auto& [n, v] : m.named_parameters())
    if (n == "lm_head.weight" || n == "model.embed_tokens.weight")
      v.value().data<float>()[5 * 16] = std::nanf("");  // one value of token 5's row
  const std::vector<uint32_t> t = {3, 1, 4};
  for (const bool scores : {false, true}) {
    try {
      if (scores)
        eval::sequence_scores(m, t, 64, 2, 31);
      else
        eval::sequence_logprobs(m, t, 64);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("the model's logits hold NaN"), std::string::npos)
          << e.what();
    }
  }
}

TEST(LossTotals, PerplexityAndBitsPerByte) {
  eval::LossTotals t;
  t.nll = 2.0 * std::log(2.0) * 10;
  t.tokens = 10;
  t.bytes = 20;
  EXPECT_NEAR(t.loss(), 2 * std::log(2.0), 1e-12);
  EXPECT_NEAR(t.perplexity(), 4.0, 1e-9);
  EXPECT_NEAR(t.bits_per_byte(), 1.0, 1e-12);
}

}  // namespace
}  // namespace pollen
