// Chat templates: conversations rendered as HF transformers' apply_chat_template renders the real
// Jinja templates of ChatML, Qwen2, SmolLM2 and Llama 3 (tests/tokenizer/chat_configs), the
// template picked from a tokenizer_config.json, and the errors for templates pollen cannot render.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

#include "base/error.h"
#include "base/files.h"
#include "support/errors.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/open.h"
#include "tokenizer/trainer.h"

using pollen::testing::error_of;

namespace fs = std::filesystem;
using namespace pollen;
using namespace pollen::tokenizer;
using nlohmann::json;

namespace {

fs::path configs_dir() {
  return fs::path(POLLEN_SOURCE_DIR) / "tests" / "tokenizer" / "chat_configs";
}

fs::path temp_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("pollen_chat_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

bool transformers_available() {
  static const bool ok = fs::exists(POLLEN_HF_PEERS_PYTHON) &&
                         std::system((std::string(POLLEN_HF_PEERS_PYTHON) +
                                      " -c 'import transformers, jinja2' 2>/dev/null")
                                         .c_str()) == 0;
  return ok;
}

// Conversations where a wrong rendering shows: with and without a system message, one turn and
// several, contents with surrounding whitespace (Unicode spaces too, which Llama 3's trim
// strips), inner newlines, an empty content and non-ASCII text.
std::vector<std::vector<ChatMessage>> conversations() {
  return {
      {{"user", "Hello!"}},
      {{"system", "You are terse."}, {"user", "What is 2+2?"}},
      {{"system", "Be kind."},
       {"user", "  Hi there\n"},
       {"assistant", "Hello.\n\nHow can I help?"},
       {"user", "\u00a0\u3000Tell me a joke\t \u2003"}},
      {{"user", "first"}, {"assistant", ""}, {"user", "caf\u00e9 \u2014 \u65e5\u672c"}},
  };
}

json to_json(const std::vector<ChatMessage>& messages) {
  json out = json::array();
  for (const auto& m : messages) out.push_back({{"role", m.role}, {"content", m.content}});
  return out;
}

}  // namespace

TEST(ChatTemplate, RendersKnownTextWithoutPeers) {
  const std::vector<ChatMessage> chat = {{"system", "S"}, {"user", " U "}};
  EXPECT_EQ(render_chat(ChatTemplate::chatml, chat, true),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n U <|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(render_chat(ChatTemplate::llama3, chat, false),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>");
  EXPECT_EQ(render_chat(ChatFormat{ChatTemplate::chatml, "D"}, {{"user", "u"}}, false),
            "<|im_start|>system\nD<|im_end|>\n<|im_start|>user\nu<|im_end|>\n");
  EXPECT_EQ(end_of_turn(ChatTemplate::chatml), "<|im_end|>");
  EXPECT_EQ(end_of_turn(ChatTemplate::llama3), "<|eot_id|>");
}

// A tokenizer that has Llama 3's end of turn but not its <|begin_of_text|> would encode that as
// plain bytes, a prompt the model never saw: refused as a missing end of turn is, naming it.
TEST(ChatTemplate, ATokenizerWithoutTheWholeMarkupIsRefused) {
  const std::string pattern = pattern_regex("gpt2");
  PieceCounts counts(pattern);
  const std::vector<std::string_view> docs = {"hello there", "general kenobi"};
  counts.add_documents(docs);
  const Tokenizer tok =
      train_bpe(counts, {280, {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}, pattern});
  const std::string e =
      error_of([&] { end_of_turn_id(tok, ChatTemplate::llama3, "choose another"); });
  EXPECT_NE(e.find("writes <|begin_of_text|>, which the tokenizer does not have"),
            std::string::npos)
      << e;
  EXPECT_EQ(e.find("no reply could end"), std::string::npos) << e;  // it has <|eot_id|>
  const std::string chatml =
      error_of([&] { end_of_turn_id(tok, ChatTemplate::chatml, "choose another"); });
  EXPECT_NE(chatml.find("no reply could end without <|im_end|>"), std::string::npos) << chatml;
  const Tokenizer whole = train_bpe(
      counts, {280,
               {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"},
               pattern});
  EXPECT_EQ(end_of_turn_id(whole, ChatTemplate::llama3, "-"), *added_token_id(whole, "<|eot_id|>"));
}

TEST(ChatTemplate, RecognisesTheTemplatesOfRealConfigs) {
  EXPECT_EQ(chat_format_from_config(configs_dir() / "chatml.json"),
            (ChatFormat{ChatTemplate::chatml, std::nullopt}));
  EXPECT_EQ(chat_format_from_config(configs_dir() / "qwen2.json"),
            (ChatFormat{ChatTemplate::chatml, "You are a helpful assistant."}));
  EXPECT_EQ(chat_format_from_config(configs_dir() / "smollm2.json"),
            (ChatFormat{ChatTemplate::chatml,
                        "You are a helpful AI assistant named SmolLM, trained by "
                        "Hugging Face"}));
  EXPECT_EQ(chat_format_from_config(configs_dir() / "llama3.json"),
            (ChatFormat{ChatTemplate::llama3, std::nullopt}));
}

TEST(ChatTemplate, RefusesTemplatesItCannotRender) {
  const std::string mistral =
      error_of([] { chat_format_from_config(configs_dir() / "mistral.json"); });
  EXPECT_NE(mistral.find("mistral.json"), std::string::npos) << mistral;
  EXPECT_NE(mistral.find("neither ChatML's nor Llama 3's"), std::string::npos) << mistral;
  // One character off ChatML is not ChatML.
  std::string near = read_file(configs_dir() / "chatml.json");
  near.replace(near.find("'<|im_end|>'"), 12, "'<|im_stop|>'");
  const fs::path dir = temp_dir("near");
  write_file_atomic(dir / "tokenizer_config.json", near);
  EXPECT_NE(error_of([&] { choose_chat_format(dir, ""); }).find("neither ChatML"),
            std::string::npos);
  // Explicit choices win over the config; unknown names and missing configs are errors.
  EXPECT_EQ(choose_chat_format(dir, "llama3").kind, ChatTemplate::llama3);
  EXPECT_NE(error_of([&] { choose_chat_format(dir, "zephyr"); }).find("expected chatml or llama3"),
            std::string::npos);
  fs::remove(dir / "tokenizer_config.json");
  // (The caller says how its user chooses one: --chat-template, model.chat_template.)
  EXPECT_EQ(error_of([&] { choose_chat_format(dir, ""); }),
            "no tokenizer_config.json or chat_template.jinja in '" + dir.string() +
                "' names a chat template");
  // transformers' newer place for it: chat_template.jinja, read alone or before the config's.
  write_file_atomic(dir / "chat_template.jinja",
                    std::string(chat_template_jinja(ChatTemplate::chatml)));
  EXPECT_EQ(choose_chat_format(dir, "").kind, ChatTemplate::chatml);
  fs::remove(dir / "chat_template.jinja");
  write_file_atomic(dir / "tokenizer_config.json", R"({"bos_token": "<s>"})");
  EXPECT_NE(error_of([&] { choose_chat_format(dir, ""); }).find("has no 'chat_template'"),
            std::string::npos);
  // A list of named templates: the one named "default" is taken.
  const json llama3 = json::parse(read_file(configs_dir() / "llama3.json"))["chat_template"];
  json named = json::array();
  named.push_back({{"name", "tool_use"}, {"template", "{{ tools }}"}});
  named.push_back({{"name", "default"}, {"template", llama3}});
  write_file_atomic(dir / "tokenizer_config.json", json{{"chat_template", named}}.dump());
  EXPECT_EQ(choose_chat_format(dir, "").kind, ChatTemplate::llama3);
  fs::remove_all(dir);
}

TEST(ChatTemplate, MatchesTransformersApplyChatTemplate) {
  if (!transformers_available())
    GTEST_SKIP() << "HF transformers not importable by " << POLLEN_HF_PEERS_PYTHON;
  json request = {{"cases", json::array()}};
  std::vector<std::string> ours;
  for (const char* name : {"chatml", "qwen2", "smollm2", "llama3"}) {
    const fs::path config = configs_dir() / (std::string(name) + ".json");
    const ChatFormat format = chat_format_from_config(config);
    for (const auto& chat : conversations()) {
      for (bool add_generation_prompt : {false, true}) {
        request["cases"].push_back({{"config", config.string()},
                                    {"messages", to_json(chat)},
                                    {"add_generation_prompt", add_generation_prompt}});
        ours.push_back(render_chat(format, chat, add_generation_prompt));
      }
    }
  }
  const fs::path dir = temp_dir("reference");
  write_file_atomic(dir / "request.json", request.dump());
  const std::string command = std::string(POLLEN_HF_PEERS_PYTHON) + " " + POLLEN_SOURCE_DIR +
                              "/tests/tokenizer/chat_reference.py " +
                              (dir / "request.json").string() + " " +
                              (dir / "result.json").string();
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  const json texts = json::parse(read_file(dir / "result.json"))["texts"];
  ASSERT_EQ(texts.size(), ours.size());
  for (size_t i = 0; i < ours.size(); ++i)
    EXPECT_EQ(ours[i], texts[i].get<std::string>()) << "case " << request["cases"][i].dump();
  fs::remove_all(dir);
}

// ChatML written with whitespace between the tags. Jinja's whitespace control ('-' markers,
// and the trim_blocks and lstrip_blocks that apply_chat_template sets) removes some of it, and
// what remains is text the template outputs. pollen recognises a template only where its output
// is ChatML's, and renders it as transformers does.
TEST(ChatTemplate, WhitespaceBetweenTagsAsTransformersRendersIt) {
  if (!transformers_available())
    GTEST_SKIP() << "HF transformers not importable by " << POLLEN_HF_PEERS_PYTHON;
  const std::string turn =
      "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}";
  const std::string prompt =
      "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
  struct Variant {
    std::string name, jinja;
    bool chatml;  // renders as ChatML, so pollen must recognise it
  };
  const std::vector<Variant> variants = {
      {"dashes",
       "{%- for message in messages %}\n    {{- '<|im_start|>' + message['role'] + '\\n' + "
       "message['content'] + '<|im_end|>' + '\\n' }}\n{%- endfor %}\n{%- if "
       "add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n",
       true},
      {"blocks_on_lines",
       "{% for message in messages %}\n" + turn + "{% endfor %}\n  " + prompt + "\n", true},
      {"comment", "{# ChatML #}\n{% for message in messages %}" + turn + "{% endfor %}" + prompt,
       true},
      {"crlf", "{% for message in messages %}\r\n" + turn + "{% endfor %}\r\n" + prompt, true},
      {"newline_after_output", "{% for message in messages %}" + turn + "\n{% endfor %}" + prompt,
       false},
      {"indented_output", "{% for message in messages %}\n  " + turn + "{% endfor %}" + prompt,
       false},
      {"keep_marker", "{% for message in messages +%}\n" + turn + "{% endfor %}" + prompt, false},
      {"dash_keeps_text",
       "{% for message in messages %}x\n{{- " + turn.substr(2) + "{% endfor %}" + prompt, false},
  };
  const fs::path dir = temp_dir("whitespace");
  json request = {{"cases", json::array()}};
  std::vector<std::optional<ChatFormat>> formats;
  for (const Variant& v : variants) {
    const fs::path config = dir / (v.name + ".json");
    write_file_atomic(config, json{{"chat_template", v.jinja}}.dump());
    std::optional<ChatFormat> format;
    try {
      format = chat_format_from_config(config);
    } catch (const Error&) {
    }
    if (v.chatml) EXPECT_TRUE(format) << v.name << " is ChatML once Jinja trims its whitespace";
    for (const auto& chat : conversations()) {
      request["cases"].push_back({{"config", config.string()},
                                  {"messages", to_json(chat)},
                                  {"add_generation_prompt", true}});
      formats.push_back(format);
    }
  }
  write_file_atomic(dir / "request.json", request.dump());
  const std::string command = std::string(POLLEN_HF_PEERS_PYTHON) + " " + POLLEN_SOURCE_DIR +
                              "/tests/tokenizer/chat_reference.py " +
                              (dir / "request.json").string() + " " +
                              (dir / "result.json").string() + " 2>/dev/null";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  const json texts = json::parse(read_file(dir / "result.json"))["texts"];
  const auto chats = conversations();
  for (size_t i = 0; i < formats.size(); ++i) {
    if (!formats[i]) continue;  // refused: pollen does not render what it cannot
    const auto& chat = chats[i % chats.size()];
    EXPECT_EQ(render_chat(*formats[i], chat, true), texts[i].get<std::string>())
        << variants[i / chats.size()].name;
  }
  fs::remove_all(dir);
}
