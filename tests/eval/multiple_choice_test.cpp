// Multiple-choice scoring as lm-evaluation-harness defines it: acc and acc_norm (length in
// characters) with their standard errors on hand-computed cases where they disagree, the split of
// (context, continuation) into tokens, continuation scores against a direct log-softmax, batching,
// few-shot prefixes and the task file's errors.
#include "eval/multiple_choice.h"

#include <gtest/gtest.h>

#include <cmath>

#include "support/errors.h"
#include "support/tiny_lm.h"

namespace pollen {
namespace {

eval::ChoiceItem item(std::vector<std::string> choices, int64_t gold) {
  return {"ctx", std::move(choices), gold};
}

TEST(MultipleChoice, AccAndAccNormOnHandComputedCases) {
  // acc picks the highest summed logprob; acc_norm divides by the length in characters.
  const auto a = item({"a", "bbbb"}, 1);       // -2 vs -4: acc 0; -2/1 vs -4/4 = -1: acc_norm 1
  const auto b = item({"yes", "no"}, 0);       // -3 vs -2.5: acc 0; -1 vs -1.25: acc_norm 1
  const auto c = item({"\xc3\xa9", "ab"}, 0);  // "é" is 1 character (2 bytes): -1.5 vs -1
  const auto d = item({"x", "y", "z"}, 2);     // both right
  std::vector<eval::ItemResult> r = {eval::judge(a, {-2, -4}), eval::judge(b, {-3, -2.5}),
                                     eval::judge(c, {-1.5, -2.0}), eval::judge(d, {-1, -1, -0.5})};
  EXPECT_EQ(r[0].pred, 0);
  EXPECT_EQ(r[0].pred_norm, 1);
  EXPECT_EQ(r[1].pred, 1);
  EXPECT_EQ(r[1].pred_norm, 0);
  EXPECT_EQ(r[2].lengths, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(r[2].pred, 0);
  EXPECT_EQ(r[2].pred_norm, 1);  // by bytes it would be 0 (-0.75 vs -1)
  EXPECT_EQ(r[3].pred, 2);
  EXPECT_EQ(r[3].pred_norm, 2);
  const eval::ChoiceMetrics m = eval::summarize(r);
  EXPECT_EQ(m.items, 4);
  EXPECT_DOUBLE_EQ(m.acc, 0.5);        // [0, 0, 1, 1]
  EXPECT_DOUBLE_EQ(m.acc_norm, 0.75);  // [1, 1, 0, 1]
  // sample standard deviation / sqrt(n): sqrt(1/3)/2 and sqrt(0.75/3)/2
  EXPECT_NEAR(*m.acc_stderr, std::sqrt(1.0 / 3.0) / 2.0, 1e-15);
  EXPECT_NEAR(*m.acc_norm_stderr, 0.25, 1e-15);
  // Ties go to the first choice, as numpy's argmax.
  EXPECT_EQ(eval::judge(item({"p", "q"}, 1), {-1, -1}).pred, 0);
  EXPECT_FALSE(eval::summarize(std::vector<eval::ItemResult>{r[0]}).acc_stderr.has_value());
}

TEST(MultipleChoice, EncodePairMovesTrailingSpaceToTheContinuation) {
  const auto tok = testing::tiny_tokenizer();
  tokenizer::EncodeOptions eo;
  eo.special = tokenizer::SpecialPolicy::allow_all();
  const auto p = eval::encode_pair(tok, "Question: what is two plus two? Answer: ", "four.", 999);
  EXPECT_EQ(p.context, tok.encode("Question: what is two plus two? Answer:", eo));
  std::vector<uint32_t> whole = p.context;
  whole.insert(whole.end(), p.continuation.begin(), p.continuation.end());
  EXPECT_EQ(whole, tok.encode("Question: what is two plus two? Answer: four.", eo));
  // The moved space is the continuation's: " four." starts with a space token or piece.
  EXPECT_EQ(tok.decode(p.continuation), " four.");
  const auto empty = eval::encode_pair(tok, "", " cat", 42);
  EXPECT_EQ(empty.context, std::vector<uint32_t>{42});
  EXPECT_EQ(empty.continuation, tok.encode(" cat", eo));
  // A context of whitespace alone leaves no token to predict the first: it is scored as an empty
  // one, the whitespace moved to the continuation (before, an empty context made the scorer
  // read the logits before its row).
  const auto blank = eval::encode_pair(tok, " \n", " cat", 42);
  EXPECT_EQ(blank.context, std::vector<uint32_t>{42});
  EXPECT_EQ(blank.continuation, tok.encode(" \n cat", eo));
  EXPECT_THROW(eval::continuation_logprobs(testing::tiny_model(tok.vocab_size()),
                                           std::vector<eval::TokenPair>{{{}, {5, 6}}}, 16, 1),
               Error);
}

TEST(MultipleChoice, ContinuationScoresEqualTheDirectLogSoftmaxInAnyBatch) {
  const auto tok = testing::tiny_tokenizer();
  const model::Llama m = testing::tiny_model(tok.vocab_size());
  const int64_t V = m.config().vocab_size;
  std::vector<eval::TokenPair> pairs = {
      eval::encode_pair(tok, "The cat sat on the", " mat.", 0),
      eval::encode_pair(tok, "Paris is the capital of", " France.", 0),
      eval::encode_pair(tok, "Bees", " make honey", 0)};
  const auto one = eval::continuation_logprobs(m, pairs, 256, 1);
  const auto all = eval::continuation_logprobs(m, pairs, 256, 3);
  for (size_t i = 0; i < pairs.size(); ++i) {
    std::vector<uint32_t> seq = pairs[i].context;
    seq.insert(seq.end(), pairs[i].continuation.begin(), pairs[i].continuation.end());
    const int64_t t = static_cast<int64_t>(seq.size());
    Tensor ids = Tensor::empty({1, t}, DType::i32);
    for (int64_t k = 0; k < t; ++k) ids.data<int32_t>()[k] = static_cast<int32_t>(seq[k]);
    const Tensor logits = m.logits(model::Batch::contiguous_rows(ids, ids));
    double expected = 0;
    const int64_t n = static_cast<int64_t>(pairs[i].continuation.size());
    for (int64_t k = t - n - 1; k < t - 1; ++k) {
      const float* z = logits.data<float>() + k * V;
      double s = 0;
      for (int64_t v = 0; v < V; ++v) s += std::exp(static_cast<double>(z[v]));
      expected += z[seq[static_cast<size_t>(k + 1)]] - std::log(s);
    }
    EXPECT_NEAR(one[i], expected, 1e-4) << i;
    EXPECT_NEAR(all[i], one[i], 1e-5) << i;
  }
  // A short max_len keeps the last tokens: the score then differs from the full context's.
  size_t longest = 0;
  for (const auto& p : pairs) longest = std::max(longest, p.continuation.size());
  const auto cut = eval::continuation_logprobs(m, pairs, static_cast<int64_t>(longest) + 1, 3);
  EXPECT_GT(std::abs(cut[1] - one[1]), 1e-6);
}

// A model whose logits hold NaN scores nothing: an error, as perplexity gives, not an accuracy
// made of the items whose gold is the first choice (every prediction picking choice 0).
TEST(MultipleChoice, NaNLogitsAreAnError) {
  const auto tok = testing::tiny_tokenizer();
  model::Llama m = testing::tiny_model(tok.vocab_size());
  for (auto& [name, v] : m.named_parameters())
    if (name == "lm_head.weight" || name == "model.embed_tokens.weight")
      v.value().fill_(std::nanf(""));
  const std::vector<eval::TokenPair> pairs = {eval::encode_pair(tok, "Bees", " make honey", 0)};
  const std::string e = testing::error_of([&] { eval::continuation_logprobs(m, pairs, 256, 1); });
  EXPECT_NE(e.find("the model's logits hold NaN"), std::string::npos) << e;
}

TEST(MultipleChoice, FewShotPrefixAndPicks) {
  const std::vector<eval::ChoiceItem> items = {
      {"Q1", {"a", "b"}, 1}, {"Q2", {"c", "d"}, 0}, {"Q3", {"e", "f"}, 1}, {"Q4", {"g", "h"}, 0}};
  const eval::ChoiceItem* ex[] = {&items[0], &items[1]};
  EXPECT_EQ(eval::fewshot_prefix(ex), "Q1 b\n\nQ2 c\n\n");
  for (size_t i = 0; i < 4; ++i) {
    const auto picks = eval::pick_fewshot(items, items[i], static_cast<int64_t>(i), 3, 5);
    ASSERT_EQ(picks.size(), 3u);
    for (const auto* p : picks) EXPECT_NE(p, &items[i]);
    EXPECT_EQ(picks, eval::pick_fewshot(items, items[i], static_cast<int64_t>(i), 3, 5));
  }
  EXPECT_THROW(eval::pick_fewshot(items, items[0], 0, 4, 5), Error);
  // A pool read from another file that holds the item (the task file again): never its own
  // example, with its answer.
  const std::vector<eval::ChoiceItem> copy = items;
  for (size_t i = 0; i < 4; ++i)
    for (const auto* p : eval::pick_fewshot(copy, items[i], static_cast<int64_t>(i), 3, 5))
      EXPECT_NE(p->context, items[i].context);
  EXPECT_THROW(eval::pick_fewshot(copy, items[0], 0, 4, 5), Error);
}

TEST(MultipleChoice, EvaluateEqualsItsParts) {
  const auto tok = testing::tiny_tokenizer();
  const model::Llama m = testing::tiny_model(tok.vocab_size());
  const std::vector<eval::ChoiceItem> items = {
      {"The cat sat on the", {"mat.", "honey flowers", "log"}, 0},
      {"Paris is the capital of", {"France.", "Italy.", "the sun"}, 0},
      {"Water boils at one hundred", {"degrees.", "bees"}, 0}};
  eval::ChoiceEvalOptions o;
  o.batch = 2;
  o.max_len = 256;
  const auto r = eval::evaluate_choices(m, tok, items, o);
  ASSERT_EQ(r.items.size(), 3u);
  for (size_t i = 0; i < items.size(); ++i) {
    std::vector<eval::TokenPair> pairs;
    for (const auto& c : items[i].choices)
      pairs.push_back(eval::encode_pair(tok, items[i].context, " " + c, 0));
    const auto lps = eval::continuation_logprobs(m, pairs, 256, 1);
    for (size_t c = 0; c < lps.size(); ++c) EXPECT_NEAR(r.items[i].logprobs[c], lps[c], 1e-5);
    EXPECT_EQ(r.contexts[i], items[i].context);
  }
  o.fewshot = 1;
  const auto shot = eval::evaluate_choices(m, tok, items, o);
  for (size_t i = 0; i < items.size(); ++i) {
    EXPECT_TRUE(shot.contexts[i].ends_with("\n\n" + items[i].context));
    EXPECT_NE(shot.contexts[i], items[i].context);
  }
}

TEST(MultipleChoice, TaskFileErrorsNameLineAndField) {
  const auto dir = testing::unique_temp_dir("mc_task");
  const auto path = dir / "task.jsonl";
  write_file_atomic(path,
                    "{\"context\": \"a\", \"choices\": [\"x\", \"y\"], \"gold\": 1}\n\n"
                    "{\"context\": \"b\", \"choices\": [\"x\"], \"gold\": 3}\n");
  try {
    eval::read_choice_items(path);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("line 3"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("gold"), std::string::npos) << e.what();
  }
  write_file_atomic(path, "{\"context\": \"a\", \"choices\": \"x\", \"gold\": 0}\n");
  EXPECT_THROW(eval::read_choice_items(path), Error);
  // A gold past int64 is named as written, not as the number it wraps to.
  write_file_atomic(path,
                    "{\"context\": \"a\", \"choices\": [\"x\"], \"gold\": 18446744073709551615}\n");
  const std::string wrapped = pollen::testing::error_of([&] { eval::read_choice_items(path); });
  EXPECT_NE(wrapped.find("\"gold\" is 18446744073709551615, outside the 1"), std::string::npos)
      << wrapped;
  write_file_atomic(path, "{\"context\": \"a\", \"choices\": [\"x\", \"y\"], \"gold\": 1}\n");
  // Invalid UTF-8 is named as such, not as a line that is no object.
  write_file_atomic(path, "{\"context\": \"\xff\", \"choices\": [\"x\"], \"gold\": 0}\n");
  try {
    eval::read_choice_items(path);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("line 1: not valid JSON"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("UTF-8"), std::string::npos) << e.what();
  }
  write_file_atomic(path,
                    "{\"context\": \"a\", \"choices\": [\"x\", \"y\"], \"gold\": 1}\n"
                    "{\"context\": \"b\", \"choices\": [\"x\", \"a much longer choice\"], "
                    "\"gold\": 1}\n");
  const auto items = eval::read_choice_items(path);
  ASSERT_EQ(items.size(), 2u);
  EXPECT_EQ(items[0].choices[1], "y");
  // A choice the window cannot score is named by its line and choice, before any scoring.
  const auto tok = testing::tiny_tokenizer();
  eval::ChoiceEvalOptions o;
  o.max_len = 3;
  try {
    eval::evaluate_choices(testing::tiny_model(tok.vocab_size()), tok, items, o);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("task.jsonl' line 2 choice 1: the choice is"),
              std::string::npos)
        << e.what();
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace pollen
