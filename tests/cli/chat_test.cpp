// `pollen chat` driven through a pipe: each line is a user message, each reply is what greedy
// generation gives on the whole conversation so far rendered with the model's chat template,
// and the errors for templates the model cannot use.
#include <gtest/gtest.h>

#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "base/files.h"
#include "base/rng.h"
#include "base/utf8.h"
#include "io/hf.h"
#include "model/generate.h"
#include "support/tiny_lm.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/open.h"
#include "tokenizer/trainer.h"

namespace fs = std::filesystem;
using namespace pollen;

namespace {

struct PollenRun {
  int status;
  std::string output;
};

// stdout only (stderr too when `with_stderr`, else into `stderr_file` when given), with `input`
// on stdin.
PollenRun run_pollen(const std::string& args, const fs::path& input, bool with_stderr = false,
                     const fs::path& stderr_file = "/dev/null") {
  const std::string cmd = std::string(POLLEN_BINARY) + " " + args + " < " + input.string() +
                          (with_stderr ? " 2>&1" : " 2>" + stderr_file.string());
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf{};
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  const int status = pclose(p);
  return {WEXITSTATUS(status), out};
}

struct ChatModel {
  fs::path dir;
  tokenizer::Tokenizer tok;
  model::Llama model;
};

// An HF directory with a small trained tokenizer (ChatML's special tokens among its own), a
// random model of its vocabulary, and Qwen2's tokenizer_config.json.
ChatModel make_chat_model(const fs::path& root) {
  tokenizer::PieceCounts counts(tokenizer::pattern_regex("gpt2"));
  std::vector<std::string> texts = {"hello there, how are you today?",
                                    "the quick brown fox jumps over the lazy dog",
                                    "and again and again, we talk and talk"};
  std::vector<std::string_view> views(texts.begin(), texts.end());
  counts.add_documents(views);
  tokenizer::Tokenizer tok = tokenizer::train_bpe(
      counts, {300, {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}, counts.pattern()});
  const fs::path staging = root / "staging";
  fs::create_directories(staging);
  tokenizer::save_tokenizer(tok, staging / "tokenizer.json");
  fs::copy_file(fs::path(POLLEN_SOURCE_DIR) / "tests/tokenizer/chat_configs/qwen2.json",
                staging / "tokenizer_config.json");
  model::LlamaConfig c;
  c.name = "chat";
  c.vocab_size = tok.vocab_size();
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 256;
  model::Llama m(c, 1);
  Rng rng(2);
  for (auto& [name, v] : m.named_parameters()) {
    float* p = v.value().data<float>();
    for (int64_t i = 0; i < v.value().numel(); ++i)
      p[i] = static_cast<float>((name.ends_with("norm.weight") ? 1.0 : 0.0) + 0.5 * rng.normal());
  }
  io::HfExportOptions o;
  o.extra_files = {staging / "tokenizer.json", staging / "tokenizer_config.json"};
  io::export_hf(m, root / "model", o);
  return {root / "model", std::move(tok), std::move(m)};
}

uint32_t id_of(const tokenizer::Tokenizer& tok, const std::string& content) {
  for (const auto& t : tok.added_tokens())
    if (t.content == content) return t.id;
  throw std::runtime_error("no token " + content);
}

}  // namespace

// Without generation_config.json, config.json's eos_token_id ends generation, as HF derives its
// generation config from config.json.
TEST(Generate, ConfigJsonsEosEndsGenerationWithoutAGenerationConfig) {
  const fs::path root = fs::temp_directory_path() / ("pollen_gen_eos_" + std::to_string(getpid()));
  fs::remove_all(root);
  const ChatModel cm = make_chat_model(root);
  ASSERT_FALSE(fs::exists(cm.dir / "generation_config.json"));
  write_file_atomic(root / "none.txt", "");
  const std::string args =
      "generate --model " + cm.dir.string() + " --prompt 'hello there' --greedy --json ";
  const PollenRun before = run_pollen(args + "--max-tokens 5", root / "none.txt");
  ASSERT_EQ(before.status, 0) << before.output;
  const nlohmann::json first = nlohmann::json::parse(before.output);
  ASSERT_FALSE(first["tokens"].empty()) << before.output;  // the first token ends nothing yet
  nlohmann::json config = nlohmann::json::parse(read_file(cm.dir / "config.json"));
  config["eos_token_id"] = first["tokens"][0];
  write_file_atomic(cm.dir / "config.json", config.dump());
  const PollenRun after = run_pollen(args + "--max-tokens 5", root / "none.txt");
  ASSERT_EQ(after.status, 0) << after.output;
  const nlohmann::json stopped = nlohmann::json::parse(after.output);
  EXPECT_EQ(stopped["finish_reason"], "stop") << after.output;
  EXPECT_TRUE(stopped["tokens"].empty()) << after.output;
  fs::remove_all(root);
}

// Plain output is the prompt and the whole generated text (a NUL byte does not end it), bytes
// that are not UTF-8 written as U+FFFD, as HF's decode gives them; special tokens left out.
TEST(Generate, PlainOutputIsTheWholeTextInUtf8) {
  const fs::path root = fs::temp_directory_path() / ("pollen_gen_text_" + std::to_string(getpid()));
  fs::remove_all(root);
  const ChatModel cm = make_chat_model(root);
  write_file_atomic(root / "none.txt", "");
  const std::string args = "generate --model " + cm.dir.string() +
                           " --prompt 'hello' --ignore-eos --max-tokens 200 --temperature 2 ";
  bool raw_invalid = false, nul = false, special = false;
  for (int seed = 1; seed <= 3; ++seed) {
    const std::string seeded = args + "--seed " + std::to_string(seed);
    const PollenRun json = run_pollen(seeded + " --json", root / "none.txt");
    const PollenRun plain = run_pollen(seeded, root / "none.txt");
    ASSERT_EQ(json.status, 0) << json.output;
    ASSERT_EQ(plain.status, 0) << plain.output;
    const auto tokens = nlohmann::json::parse(json.output)["tokens"].get<std::vector<uint32_t>>();
    const std::string text = cm.tok.generated_text(tokens);
    std::string expected;
    utf8_repair("hello" + text + "\n", expected);
    EXPECT_EQ(plain.output, expected) << seed;
    raw_invalid |= !utf8_valid(text);
    nul |= text.find('\0') != std::string::npos;
    special |=
        std::find(tokens.begin(), tokens.end(), id_of(cm.tok, "<|im_start|>")) != tokens.end();
  }
  EXPECT_TRUE(raw_invalid && nul && special) << raw_invalid << nul << special;  // cases covered
  fs::remove_all(root);
}

// A prompt and --max-tokens that need more positions than the model has (256 here) are
// refused, naming the option and how many tokens fit.
TEST(Generate, MoreTokensThanTheModelHasPositionsForAreRefused) {
  const fs::path root = fs::temp_directory_path() / ("pollen_gen_ctx_" + std::to_string(getpid()));
  fs::remove_all(root);
  const ChatModel cm = make_chat_model(root);
  write_file_atomic(root / "none.txt", "");
  const std::string args = "generate --model " + cm.dir.string() + " --prompt 'hello there' ";
  const PollenRun over = run_pollen(args + "--max-tokens 300", root / "none.txt", true);
  EXPECT_NE(over.status, 0) << over.output;
  EXPECT_NE(over.output.find("--max-tokens 300"), std::string::npos) << over.output;
  EXPECT_NE(over.output.find("the model has 256 (max_position_embeddings)"), std::string::npos)
      << over.output;
  const size_t at = over.output.find("ask for at most ");
  ASSERT_NE(at, std::string::npos) << over.output;
  const int64_t fits = std::stoll(over.output.substr(at + 16));
  EXPECT_LT(fits, 256);
  EXPECT_GT(fits, 240);
  const PollenRun within = run_pollen(
      args + "--ignore-eos --json --max-tokens " + std::to_string(fits), root / "none.txt");
  ASSERT_EQ(within.status, 0) << within.output;
  EXPECT_EQ(nlohmann::json::parse(within.output)["tokens"].size(), static_cast<size_t>(fits));
  // A prompt that alone fills the positions: no number of tokens would fit.
  std::string words;
  for (int i = 0; i < 300; ++i) words += "hello ";
  const PollenRun long_prompt =
      run_pollen("generate --model " + cm.dir.string() + " --prompt '" + words + "' --max-tokens 0",
                 root / "none.txt", true);
  EXPECT_NE(long_prompt.status, 0) << long_prompt.output;
  EXPECT_NE(long_prompt.output.find("tokens, and the model has 256 positions "
                                    "(max_position_embeddings): shorten the prompt"),
            std::string::npos)
      << long_prompt.output;
  // pollen chat's --context cannot hold more than the model's positions either.
  const PollenRun chat =
      run_pollen("chat --model " + cm.dir.string() + " --context 1000", root / "none.txt", true);
  EXPECT_NE(chat.status, 0) << chat.output;
  EXPECT_NE(chat.output.find("--context 1000 is more than the model's 256 positions"),
            std::string::npos)
      << chat.output;
  EXPECT_NE(run_pollen("chat --model " + cm.dir.string() + " --context 0", root / "none.txt", true)
                .status,
            0);
  fs::remove_all(root);
}

TEST(Chat, RepliesToEachLineWithTheWholeConversation) {
  const fs::path root = fs::temp_directory_path() / ("pollen_chat_" + std::to_string(getpid()));
  fs::remove_all(root);
  const ChatModel cm = make_chat_model(root);
  const std::vector<std::string> lines = {"hello there", "and again, how are you?"};
  write_file_atomic(root / "input.txt", lines[0] + "\n\n" + lines[1] + "\n");

  const PollenRun run = run_pollen(
      "chat --model " + cm.dir.string() + " --greedy --max-tokens 8 " + "--system 'Talk.'",
      root / "input.txt");
  ASSERT_EQ(run.status, 0) << run.output;

  // The same conversation generated from scratch each turn.
  model::SamplingOptions o;
  o.temperature = 0;
  o.max_tokens = 8;
  o.stop_tokens = {id_of(cm.tok, "<|endoftext|>"), id_of(cm.tok, "<|im_end|>")};
  tokenizer::EncodeOptions eo;
  eo.special = tokenizer::SpecialPolicy::allow_all();
  const tokenizer::ChatFormat format{tokenizer::ChatTemplate::chatml,
                                     "You are a helpful assistant."};
  std::vector<tokenizer::ChatMessage> messages = {{"system", "Talk."}};
  std::string expected;
  for (const std::string& line : lines) {
    messages.push_back({"user", line});
    const auto ids = cm.tok.encode(tokenizer::render_chat(format, messages, true), eo);
    const auto reply = model::generate(cm.model, {ids}, o, [&](std::span<const uint32_t> t) {
      return cm.tok.generated_text(t);
    })[0];
    std::string shown;  // bytes that are not UTF-8 shown as U+FFFD
    utf8_repair(reply.text + "\n", shown);
    expected += shown;
    messages.push_back({"assistant", reply.text});
  }
  EXPECT_EQ(run.output, expected);

  // Llama 3's template needs <|eot_id|>, which this tokenizer lacks.
  const PollenRun llama3 = run_pollen("chat --model " + cm.dir.string() + " --chat-template llama3",
                                      root / "input.txt", true);
  EXPECT_NE(llama3.status, 0);
  EXPECT_NE(llama3.output.find("<|eot_id|>"), std::string::npos) << llama3.output;
  // Without a tokenizer_config.json the user is told to choose.
  fs::remove(cm.dir / "tokenizer_config.json");
  const PollenRun none = run_pollen("chat --model " + cm.dir.string(), root / "input.txt", true);
  EXPECT_NE(none.status, 0);
  EXPECT_NE(none.output.find("--chat-template"), std::string::npos) << none.output;
  fs::remove_all(root);
}

// A conversation that outgrows --context goes on without its oldest exchanges, and a message that
// does not fit alone gets an empty reply and a notice; the chat goes on after both.
TEST(Chat, AConversationThatOutgrowsTheContextLeavesOutItsOldestExchanges) {
  const fs::path root = fs::temp_directory_path() / ("pollen_chat_ctx_" + std::to_string(getpid()));
  fs::remove_all(root);
  const ChatModel cm = make_chat_model(root);
  std::string input;
  for (int i = 0; i < 6; ++i) input += "hello there, how are you today?\n";
  std::string long_line;
  for (int i = 0; i < 20; ++i) long_line += "the quick brown fox jumps over the lazy dog ";
  input += long_line + "\nand again\n";
  write_file_atomic(root / "input.txt", input);
  const PollenRun run =
      run_pollen("chat --model " + cm.dir.string() + " --greedy --max-tokens 40 --context 96",
                 root / "input.txt", false, root / "err.txt");
  ASSERT_EQ(run.status, 0) << read_file(root / "err.txt");
  EXPECT_EQ(std::count(run.output.begin(), run.output.end(), '\n'), 8) << run.output;
  const std::string err = read_file(root / "err.txt");
  EXPECT_NE(err.find("oldest exchange"), std::string::npos) << err;
  EXPECT_NE(err.find("not sent: this message takes"), std::string::npos) << err;
  // A message not sent leaves the conversation as it was: the next reply is the one the chat
  // without that message gives.
  write_file_atomic(root / "with.txt",
                    "hello there\nhow are you today\n" + long_line + "\nand again\n");
  write_file_atomic(root / "without.txt", "hello there\nhow are you today\nand again\n");
  const std::string args =
      "chat --model " + cm.dir.string() + " --greedy --max-tokens 8 --context 200";
  const PollenRun with = run_pollen(args, root / "with.txt");
  const PollenRun without = run_pollen(args, root / "without.txt");
  ASSERT_EQ(with.status, 0);
  ASSERT_EQ(without.status, 0);
  const auto last_line = [](const std::string& out) {
    const size_t end = out.find_last_of('\n');
    return out.substr(out.find_last_of('\n', end - 1) + 1);
  };
  EXPECT_EQ(last_line(with.output), last_line(without.output)) << with.output << without.output;
  fs::remove_all(root);
}

// A model's vocabulary padded beyond its tokenizer's (the llama-tiny preset's 4096 logits against
// a 512-id tokenizer): `pollen generate` and `pollen chat` sample only ids the tokenizer knows,
// even from a model that prefers an unknown one above all.
TEST(Generate, APaddedVocabularySamplesOnlyTheTokenizersIds) {
  const fs::path root = fs::temp_directory_path() / ("pollen_padded_" + std::to_string(getpid()));
  fs::remove_all(root);
  const tokenizer::Tokenizer tok = pollen::testing::tiny_tokenizer();
  pollen::testing::write_hf_dir(
      pollen::testing::always_predicting(tok.vocab_size() + 10, tok.vocab_size() + 40), tok,
      root / "model");
  write_file_atomic(root / "input.txt", "hello\n");
  const std::string model = " --model " + (root / "model").string() + " --max-tokens 6";
  const PollenRun generated =
      run_pollen("generate --json --prompt 'The cat'" + model, root / "input.txt");
  ASSERT_EQ(generated.status, 0) << generated.output;
  const auto j = nlohmann::json::parse(generated.output);
  EXPECT_FALSE(j["tokens"].empty()) << generated.output;
  for (const auto& id : j["tokens"]) EXPECT_LT(id.get<uint32_t>(), tok.vocab_size());
  const PollenRun chat =
      run_pollen("chat --chat-template chatml" + model, root / "input.txt", true);
  EXPECT_EQ(chat.status, 0) << chat.output;
  fs::remove_all(root);
}
