// SFT: the assistant-token mask checked token by token against an independent rendering
// (ChatML and Llama 3), packing equal to the examples one by one (loss and gradients), a short
// run lowering the validation loss, malformed data and unknown keys refused.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <thread>

#include "autograd/tape.h"
#include "base/files.h"
#include "io/checkpoint.h"
#include "io/model_source.h"
#include "tokenizer/open.h"
#include "train/post_config.h"
#include "train/post_fixtures.h"
#include "train/post_run.h"
#include "train/sft.h"
#include "train/trainer.h"

namespace fs = std::filesystem;
using namespace pollen;
using tokenizer::ChatMessage;

namespace {

using test_support::error_of;

struct Fixture : test_support::PostFiles {
  std::shared_ptr<tokenizer::Tokenizer> tok;
};

const Fixture& fixture() {
  static const Fixture f = [] {
    Fixture x{test_support::make_post_files("sft"), nullptr};
    x.tok = std::make_shared<tokenizer::Tokenizer>(tokenizer::open_tokenizer(x.tokenizer_path, ""));
    return x;
  }();
  return f;
}

uint32_t special(const std::string& content) {
  for (const auto& t : fixture().tok->added_tokens())
    if (t.content == content) return t.id;
  ADD_FAILURE() << "no token " << content;
  return 0;
}

// The expected tokens and mask, built piece by piece: each template piece encoded on its own.
struct Expected {
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> scored;
  void add(const std::vector<uint32_t>& ids, bool score) {
    tokens.insert(tokens.end(), ids.begin(), ids.end());
    scored.insert(scored.end(), ids.size(), score ? 1 : 0);
  }
  void add_text(const std::string& text, bool score) { add(fixture().tok->encode(text), score); }
};

const std::vector<ChatMessage> kConversation = {
    {"system", "You answer with a number."},
    {"user", "What is 12 + 30?"},
    {"assistant", "12 + 30 = 42\n#### 42"},
    {"user", "Reverse the letters of 'abc'."},
    {"assistant", "'abc' reversed is 'cba'.\n#### cba"}};

TEST(Sft, MasksExactlyTheAssistantTokensChatML) {
  Expected x;
  for (const auto& m : kConversation) {
    const bool a = m.role == "assistant";
    x.add({special("<|im_start|>")}, false);
    x.add_text(m.role + "\n", false);
    x.add_text(m.content, a);
    x.add({special("<|im_end|>")}, a);
    x.add_text("\n", false);
  }
  const auto e = train::tokenize_conversation(*fixture().tok, {tokenizer::ChatTemplate::chatml, {}},
                                              kConversation, true, "test");
  ASSERT_EQ(e.tokens, x.tokens);
  ASSERT_EQ(e.scored, x.scored);
  EXPECT_GT(e.scored_count(), 10);
  // loss_on = "all": every token but the first.
  const auto all = train::tokenize_conversation(
      *fixture().tok, {tokenizer::ChatTemplate::chatml, {}}, kConversation, false, "test");
  EXPECT_EQ(all.tokens, x.tokens);
  EXPECT_EQ(all.scored_count(), static_cast<int64_t>(x.tokens.size()) - 1);
  EXPECT_EQ(all.scored[0], 0);
}

// Llama 3's rendering of `messages`, the assistant's content and end of turn scored.
Expected llama3_expected(const std::vector<ChatMessage>& messages) {
  Expected x;
  x.add({special("<|begin_of_text|>")}, false);
  for (const auto& m : messages) {
    const bool a = m.role == "assistant";
    x.add({special("<|start_header_id|>")}, false);
    x.add_text(m.role, false);
    x.add({special("<|end_header_id|>")}, false);
    x.add_text("\n\n", false);
    x.add_text(m.content, a);
    x.add({special("<|eot_id|>")}, a);
  }
  return x;
}

TEST(Sft, MasksExactlyTheAssistantTokensLlama3) {
  const Expected x = llama3_expected(kConversation);
  const auto e = train::tokenize_conversation(*fixture().tok, {tokenizer::ChatTemplate::llama3, {}},
                                              kConversation, true, "test");
  ASSERT_EQ(e.tokens, x.tokens);
  ASSERT_EQ(e.scored, x.scored);
}

// A conversation may open with the assistant's message (a greeting): it is trained, with the
// template's opening (Llama 3's <|begin_of_text|>, a default system message) unscored.
TEST(Sft, AConversationThatOpensWithTheAssistantIsTrained) {
  const std::vector<ChatMessage> greeting = {
      {"assistant", "Hello! Ask me a sum."}, {"user", "What is 1 + 2?"}, {"assistant", "#### 3"}};
  const Expected x = llama3_expected(greeting);
  const auto e = train::tokenize_conversation(*fixture().tok, {tokenizer::ChatTemplate::llama3, {}},
                                              greeting, true, "test");
  ASSERT_EQ(e.tokens, x.tokens);
  ASSERT_EQ(e.scored, x.scored);

  Expected y;
  const tokenizer::ChatFormat qwen{tokenizer::ChatTemplate::chatml, "You are helpful."};
  std::vector<ChatMessage> with_system = greeting;
  with_system.insert(with_system.begin(), {"system", "You are helpful."});
  for (const auto& m : with_system) {
    const bool a = m.role == "assistant";
    y.add({special("<|im_start|>")}, false);
    y.add_text(m.role + "\n", false);
    y.add_text(m.content, a);
    y.add({special("<|im_end|>")}, a);
    y.add_text("\n", false);
  }
  const auto q = train::tokenize_conversation(*fixture().tok, qwen, greeting, true, "test");
  ASSERT_EQ(q.tokens, y.tokens);
  ASSERT_EQ(q.scored, y.scored);
}

TEST(Sft, ChatMLDefaultSystemMessageIsNotScored) {
  // Qwen2-style templates add a system message; it is part of the prompt.
  const tokenizer::ChatFormat f{tokenizer::ChatTemplate::chatml, std::string("Be brief.")};
  const std::vector<ChatMessage> conv(kConversation.begin() + 1, kConversation.begin() + 3);
  Expected x;
  std::vector<ChatMessage> with_system = {{"system", "Be brief."}};
  with_system.insert(with_system.end(), conv.begin(), conv.end());
  for (const auto& m : with_system) {
    const bool a = m.role == "assistant";
    x.add({special("<|im_start|>")}, false);
    x.add_text(m.role + "\n", false);
    x.add_text(m.content, a);
    x.add({special("<|im_end|>")}, a);
    x.add_text("\n", false);
  }
  const auto e = train::tokenize_conversation(*fixture().tok, f, conv, true, "test");
  EXPECT_EQ(e.tokens, x.tokens);
  EXPECT_EQ(e.scored, x.scored);
}

// Per-parameter gradients after accumulate_gradients.
std::vector<std::vector<float>> gradients(const model::Llama& m) {
  std::vector<std::vector<float>> out;
  for (const auto& p : m.parameters()) {
    const Tensor g = p.grad();
    out.emplace_back(g.data<float>(), g.data<float>() + g.numel());
  }
  return out;
}

TEST(Sft, PackingGivesTheLossAndGradientsOfTheExamplesOneByOne) {
  const auto& fx = fixture();
  std::vector<train::SftExample> examples;
  for (const auto& task : {"arithmetic", "reverse", "upper"})
    for (const auto& s : train::synth_examples(task, 4, 5))
      examples.push_back(train::tokenize_conversation(
          *fx.tok, {tokenizer::ChatTemplate::chatml, {}},
          {{"user", s.prompt}, {"assistant", s.completion}}, true, "test"));
  std::vector<int64_t> order(examples.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  const auto rows = train::pack_rows(examples, order, 128);
  ASSERT_LE(rows.size(), examples.size() / 2 + 1);  // several examples per row
  const model::Batch packed = train::make_packed_batch(examples, rows);

  // Larger initial weights than usual, so that attention is far from uniform and a leak across
  // examples would change the loss clearly.
  model::LlamaConfig config = io::resolve_model(fx.model_file.string()).config;
  config.initializer_range = 0.3;
  model::Llama m(config, 11);
  for (auto& p : m.parameters()) p.zero_grad();
  const auto a = train::accumulate_gradients(m, {packed});
  const auto ga = gradients(m);
  for (auto& p : m.parameters()) p.zero_grad();
  std::vector<model::Batch> single;
  for (size_t i = 0; i < examples.size(); ++i)
    single.push_back(train::make_packed_batch(examples, {{static_cast<int64_t>(i)}}));
  const auto b = train::accumulate_gradients(m, single);
  const auto gb = gradients(m);
  int64_t scored = 0;
  for (const auto& e : examples) scored += e.scored_count();
  EXPECT_EQ(a.scored, scored);
  EXPECT_EQ(b.scored, scored);
  EXPECT_NEAR(a.loss, b.loss, 1e-5 * std::abs(b.loss));
  double max_diff = 0, max_grad = 0;
  for (size_t i = 0; i < ga.size(); ++i)
    for (size_t j = 0; j < ga[i].size(); ++j) {
      max_diff = std::max(max_diff, static_cast<double>(std::abs(ga[i][j] - gb[i][j])));
      max_grad = std::max(max_grad, static_cast<double>(std::abs(gb[i][j])));
    }
  EXPECT_LT(max_diff, 1e-5 * max_grad + 1e-7);
  for (auto& p : m.parameters()) p.zero_grad();

  // Without the reset at example boundaries the packed loss differs: the test can fail.
  model::Batch leaky = packed;
  leaky.doc_ids = Tensor::zeros(packed.tokens.shape(), DType::i32);
  leaky.positions = model::Batch::contiguous_rows(packed.tokens, packed.targets).positions;
  ag::NoGrad no_grad;
  EXPECT_GT(std::abs(m.loss(leaky).value().item() - b.loss), 1e-3);
}

TEST(Sft, ShortRunLowersTheValidationLoss) {
  const auto& fx = fixture();
  const fs::path dir = test_support::post_temp_dir("sft_run");
  const auto data = test_support::write_sft_data(dir / "train.jsonl", "arithmetic", 300, 1);
  const auto val = test_support::write_sft_data(dir / "val.jsonl", "arithmetic", 40, 2);
  const std::string text =
      test_support::tiny_post_toml(dir / "run", fx.model_file, fx.tokenizer_path, 30,
                                   "[sft]\ndata = \"" + data.string() + "\"\nvalidation = \"" +
                                       val.string() + "\"\nseq = 128\nmicro_batch = 4\n");
  const auto cfg = train::parse_post_config(text, "sft-run.toml", "sft");
  // The validation loss of the base model, as the run starts.
  const auto base = train::resolve_post_base(cfg);
  train::ObjectiveContext ctx{cfg.objective_section(), cfg.base_dir, base.tokenizer.get(),
                              base.chat_format,        cfg.seed,     128};
  train::SftObjective sft(ctx);
  const double before = sft.evaluate(io::load_model(base.source, DType::f32, cfg.seed)).loss;
  train::PostOptions o;
  o.quiet = true;
  o.handle_signals = false;
  const auto r = train::run_post_training(cfg, o, train::make_sft_objective);
  ASSERT_EQ(r.status, train::RunStatus::finished) << r.message;
  EXPECT_LT(r.last_val_loss, before - 1.0) << "before " << before;
  EXPECT_EQ(r.last_val_metrics.at("examples").get<int64_t>(), 40);
}

// As pollen train without validation data: one warning at the start naming the key that gives
// some, then no evaluation (no val_loss record, no "nan" logged or summed up).
TEST(Sft, WithoutValidationDataTheRunWarnsOnceAndNeverEvaluates) {
  const auto& fx = fixture();
  const fs::path dir = test_support::post_temp_dir("sft_no_val");
  const auto data = test_support::write_sft_data(dir / "train.jsonl", "upper", 1, 1);
  const std::string text =
      test_support::tiny_post_toml(dir / "run", fx.model_file, fx.tokenizer_path, 2,
                                   "[sft]\ndata = \"" + data.string() + "\"\nmicro_batch = 1\n");
  const auto cfg = train::parse_post_config(text, "one.toml", "sft");
  train::PostOptions o;
  o.quiet = true;
  o.handle_signals = false;
  ::testing::internal::CaptureStderr();
  const auto r = train::run_post_training(cfg, o, train::make_sft_objective);
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(r.status, train::RunStatus::finished) << r.message << log;
  const std::string warning =
      "no evaluation: sft.validation_fraction (0.05) held out none of 1 examples";
  EXPECT_NE(log.find(warning), std::string::npos) << log;
  EXPECT_EQ(log.find("no evaluation", log.find(warning) + 1), std::string::npos) << log;
  EXPECT_EQ(log.find("nan"), std::string::npos) << log;
  EXPECT_EQ(r.message.find("nan"), std::string::npos) << r.message;
  EXPECT_EQ(read_file(dir / "run" / "metrics.jsonl").find("val_loss"), std::string::npos);
  // An empty validation file is the same: no held-out data, no evaluation, not an error.
  write_file_atomic(dir / "empty.jsonl", "\n");
  const auto empty_cfg = train::parse_post_config(
      test_support::tiny_post_toml(dir / "run-empty", fx.model_file, fx.tokenizer_path, 2,
                                   "[sft]\ndata = \"" + data.string() + "\"\nvalidation = \"" +
                                       (dir / "empty.jsonl").string() + "\"\nmicro_batch = 1\n"),
      "empty.toml", "sft");
  ::testing::internal::CaptureStderr();
  const auto empty = train::run_post_training(empty_cfg, o, train::make_sft_objective);
  const std::string empty_log = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(empty.status, train::RunStatus::finished) << empty.message << empty_log;
  EXPECT_NE(empty_log.find("no evaluation"), std::string::npos) << empty_log;
}

TEST(Sft, MalformedLinesAreRefusedNamingFileLineAndField) {
  const fs::path dir = test_support::post_temp_dir("sft_bad");
  auto check = [&](const std::string& body, const std::vector<std::string>& wanted) {
    const fs::path f = dir / "bad.jsonl";
    std::ofstream(f) << body;
    const std::string e = error_of([&] { train::read_sft_jsonl(f); });
    for (const auto& w : wanted) EXPECT_NE(e.find(w), std::string::npos) << e << " / " << w;
  };
  const std::string good =
      R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})";
  check(
      good + "\n" +
          R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 5}]})" +
          "\n",
      {"bad.jsonl", "line 2", "messages[1].content", "expected a string"});
  check(good + "\n\n{\"messages\": [oops\n", {"line 3", "not valid JSON"});
  check(R"({"prompt": "hi"})", {"line 1", "'completion' is missing"});
  check(R"({"text": "hi"})", {"line 1", "'messages'", "'prompt'"});
  check(R"({"messages": [{"role": "user", "content": "hi"}]})", {"line 1", "assistant"});
  check(R"({"messages": [{"content": "hi"}]})", {"messages[0].role", "missing"});
  // Only the roles the chat templates render, as pollen serve takes them.
  check(
      R"({"messages": [{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "yo"}]})",
      {"bad.jsonl", "line 1", "messages[0].role",
       "expected system, user, assistant or developer (taken as system), got 'bot'"});
  const fs::path dev = dir / "developer.jsonl";
  std::ofstream(dev)
      << R"({"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", )"
      << R"("content": "hi"}, {"role": "assistant", "content": "yo"}]})"
      << "\n";
  EXPECT_EQ(train::read_sft_jsonl(dev)[0].messages[0].role, "system");
  // prompt/completion becomes a user and an assistant message.
  const fs::path f = dir / "pc.jsonl";
  std::ofstream(f) << R"({"prompt": "What is 1 + 1?", "completion": "2"})"
                   << "\n";
  const auto recs = train::read_sft_jsonl(f);
  ASSERT_EQ(recs.size(), 1u);
  ASSERT_EQ(recs[0].messages.size(), 2u);
  EXPECT_EQ(recs[0].messages[1].role, "assistant");
  EXPECT_EQ(recs[0].messages[1].content, "2");
}

TEST(Sft, UnknownAndWrongKeysAreRefused) {
  const auto& fx = fixture();
  const fs::path dir = test_support::post_temp_dir("sft_keys");
  const auto data = test_support::write_sft_data(dir / "train.jsonl", "upper", 20, 1);
  auto make = [&](const std::string& sft) {
    const auto cfg = train::parse_post_config(
        test_support::tiny_post_toml(dir / "run", fx.model_file, fx.tokenizer_path, 2,
                                     "[sft]\ndata = \"" + data.string() + "\"\n" + sft),
        "keys.toml", "sft");
    const auto base = train::resolve_post_base(cfg);
    train::ObjectiveContext ctx{cfg.objective_section(), cfg.base_dir, base.tokenizer.get(),
                                base.chat_format,        cfg.seed,     128};
    train::SftObjective s(ctx);
  };
  EXPECT_NO_THROW(make(""));
  std::string e = error_of([&] { make("pakc = true\n"); });
  EXPECT_NE(e.find("keys.toml"), std::string::npos) << e;
  EXPECT_NE(e.find("sft.pakc"), std::string::npos) << e;
  e = error_of([&] { make("loss_on = \"prompt\"\n"); });
  EXPECT_NE(e.find("sft.loss_on"), std::string::npos) << e;
  e = error_of([&] { make("seq = 1000\n"); });
  EXPECT_NE(e.find("sft.seq"), std::string::npos) << e;
  e = error_of([&] { make("too_long = \"cut\"\n"); });
  EXPECT_NE(e.find("sft.too_long"), std::string::npos) << e;
}

TEST(Sft, LongExamplesAreTruncatedOrDropped) {
  const auto& fx = fixture();
  const fs::path dir = test_support::post_temp_dir("sft_long");
  const auto data = test_support::write_sft_data(dir / "train.jsonl", "reverse", 30, 4);
  std::vector<train::SftExample> whole;
  for (const auto& r : train::read_sft_jsonl(data))
    whole.push_back(train::tokenize_conversation(*fx.tok, {tokenizer::ChatTemplate::chatml, {}},
                                                 r.messages, true, "test"));
  std::vector<size_t> lengths;
  for (const auto& e : whole) lengths.push_back(e.tokens.size());
  std::sort(lengths.begin(), lengths.end());
  const int64_t seq = static_cast<int64_t>(lengths[lengths.size() / 2]) - 1;
  size_t fitting = 0;
  for (const auto& e : whole) fitting += static_cast<int64_t>(e.tokens.size()) <= seq + 1;
  ASSERT_GT(fitting, 0u);
  ASSERT_LT(fitting, whole.size());
  auto build = [&](const std::string& extra) {
    const auto cfg = train::parse_post_config(
        test_support::tiny_post_toml(
            dir / "run", fx.model_file, fx.tokenizer_path, 2,
            "[sft]\ndata = \"" + data.string() +
                "\"\nvalidation_fraction = 0\nseq = " + std::to_string(seq) + "\n" + extra),
        "long.toml", "sft");
    const auto base = train::resolve_post_base(cfg);
    train::ObjectiveContext ctx{cfg.objective_section(), cfg.base_dir, base.tokenizer.get(),
                                base.chat_format,        cfg.seed,     128};
    return std::make_unique<train::SftObjective>(ctx);
  };
  const auto cut = build("");
  ASSERT_EQ(cut->train_examples().size(), whole.size());
  for (size_t i = 0; i < whole.size(); ++i) {
    const auto& e = cut->train_examples()[i];
    const size_t n = std::min(whole[i].tokens.size(), static_cast<size_t>(seq + 1));
    ASSERT_EQ(e.tokens.size(), n);
    EXPECT_TRUE(std::equal(e.tokens.begin(), e.tokens.end(), whole[i].tokens.begin()));
    EXPECT_TRUE(std::equal(e.scored.begin(), e.scored.end(), whole[i].scored.begin()));
  }
  EXPECT_EQ(build("too_long = \"drop\"\n")->train_examples().size(), fitting);
}

// An example truncated before its reply has nothing to score: it is left out (steps of such
// examples alone would have no loss and read as divergence), and data where none is left is
// refused, naming the keys.
TEST(Sft, ExamplesLeftWithNoScoredTokenAreLeftOut) {
  const auto& fx = fixture();
  const fs::path dir = test_support::post_temp_dir("sft_unscored");
  const auto data = test_support::write_sft_data(dir / "train.jsonl", "reverse", 30, 4);
  std::vector<int64_t> first_scored;  // the first scored position of each example
  for (const auto& r : train::read_sft_jsonl(data)) {
    const auto e = train::tokenize_conversation(*fx.tok, {tokenizer::ChatTemplate::chatml, {}},
                                                r.messages, true, "test");
    first_scored.push_back(std::find(e.scored.begin(), e.scored.end(), true) - e.scored.begin());
  }
  std::vector<int64_t> sorted = first_scored;
  std::sort(sorted.begin(), sorted.end());
  ASSERT_LT(sorted.front(), sorted.back());
  auto build = [&](int64_t seq, const std::string& extra = "") {
    const auto cfg = train::parse_post_config(
        test_support::tiny_post_toml(
            dir / "run", fx.model_file, fx.tokenizer_path, 2,
            "[sft]\ndata = \"" + data.string() +
                "\"\nvalidation_fraction = 0\nseq = " + std::to_string(seq) + "\n" + extra),
        "unscored.toml", "sft");
    const auto base = train::resolve_post_base(cfg);
    train::ObjectiveContext ctx{cfg.objective_section(), cfg.base_dir, base.tokenizer.get(),
                                base.chat_format,        cfg.seed,     128};
    return std::make_unique<train::SftObjective>(ctx);
  };
  // seq positions keep seq + 1 tokens, of which position p < seq + 1 may be scored.
  const int64_t mixed = sorted[sorted.size() / 2] - 1;
  const auto kept = static_cast<size_t>(std::count_if(first_scored.begin(), first_scored.end(),
                                                      [&](int64_t f) { return f <= mixed; }));
  ASSERT_GT(kept, 0u);
  ASSERT_LT(kept, first_scored.size());
  const auto objective = build(mixed);
  EXPECT_EQ(objective->train_examples().size(), kept);
  for (const auto& e : objective->train_examples()) EXPECT_GT(e.scored_count(), 0);
  const std::string e = error_of([&] { build(sorted.front() - 1); });
  for (const char* key : {"no token to score", "sft.seq = ", "sft.too_long", "sft.loss_on"})
    EXPECT_NE(e.find(key), std::string::npos) << key << ": " << e;
  // Every example dropped for its length: the count and the keys are named too.
  // (sft.data's examples alone: those sft.validation also dropped are not counted in)
  const std::string dropped =
      error_of([&] { build(2, "too_long = \"drop\"\nvalidation = \"" + data.string() + "\"\n"); });
  EXPECT_NE(dropped.find(": 30 dropped for being longer than sft.seq = 2 positions (sft.too_long = "
                         "\"drop\")"),
            std::string::npos)
      << dropped;
}

// The binary as a user runs it: `sft synth` is deterministic, SIGTERM is a preemption (exit 3)
// with a checkpoint, and --resume finishes the run.
TEST(SftCli, SynthThenPreemptThenResume) {
  const auto& fx = fixture();
  const fs::path dir = test_support::post_temp_dir("sft_cli");
  auto pollen = [&](const std::string& args) {
    const std::string cmd = std::string(POLLEN_BINARY) + " " + args + " > /dev/null 2>&1";
    return WEXITSTATUS(std::system(cmd.c_str()));
  };
  const std::string synth = "sft synth --task upper --count 200 --seed 4 --out ";
  ASSERT_EQ(pollen(synth + (dir / "a.jsonl").string()), 0);
  ASSERT_EQ(pollen(synth + (dir / "b.jsonl").string()), 0);
  ASSERT_EQ(
      pollen("sft synth --task upper --count 200 --seed 5 --out " + (dir / "c.jsonl").string()), 0);
  EXPECT_EQ(read_file(dir / "a.jsonl"), read_file(dir / "b.jsonl"));
  EXPECT_NE(read_file(dir / "a.jsonl"), read_file(dir / "c.jsonl"));
  EXPECT_NE(pollen("sft synth --task poetry --out " + (dir / "d.jsonl").string()), 0);

  const fs::path cfg = dir / "run.toml";
  write_file_atomic(cfg, test_support::tiny_post_toml(
                             dir / "run", fx.model_file, fx.tokenizer_path, 400,
                             "[sft]\ndata = \"" + (dir / "a.jsonl").string() + "\"\nseq = 64\n"));
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string out = (dir / "log.txt").string();
    std::freopen(out.c_str(), "w", stdout);
    std::freopen(out.c_str(), "w", stderr);
    std::string bin = POLLEN_BINARY, sft = "sft", config = "--config", path = cfg.string();
    char* argv[] = {bin.data(), sft.data(), config.data(), path.data(), nullptr};
    execv(POLLEN_BINARY, argv);
    _exit(127);
  }
  // Stop it once it has taken a step.
  for (int i = 0; i < 600 && !(fs::exists(dir / "run/metrics.jsonl") &&
                               fs::file_size(dir / "run/metrics.jsonl") > 0);
       ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 3) << read_file(dir / "log.txt");
  const auto ckpts = io::list_checkpoints(dir / "run/checkpoints");
  ASSERT_FALSE(ckpts.empty());
  const int64_t stopped = io::checkpoint_step(ckpts.back());  // the preemption's checkpoint
  EXPECT_LT(stopped, 400);
  EXPECT_EQ(pollen("sft --config " + cfg.string()), 1);  // a fresh start over checkpoints
  EXPECT_EQ(pollen("sft --config " + cfg.string() +
                   " --resume --set train.steps=" + std::to_string(stopped + 2)),
            0);
  const auto st = nlohmann::json::parse(
      read_file(io::list_checkpoints(dir / "run/checkpoints").back() / "state.json"));
  EXPECT_EQ(st.at("step").get<int64_t>(), stopped + 2);
}

}  // namespace
