#include "tokenizer/chat_template.h"

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/files.h"

namespace pollen::tokenizer {

namespace {

constexpr std::string_view kChatmlJinja =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|im_start|>assistant\\n' }}{% endif %}";

// Qwen2's and SmolLM2's: ChatML that opens with a system message when there is none.
constexpr std::string_view kChatmlDefaultSystemHead =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
    "'<|im_start|>system\\n";
constexpr std::string_view kChatmlDefaultSystemTail =
    "<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|im_start|>assistant\\n' }}{% endif %}";

// Meta-Llama-3-8B-Instruct's.
constexpr std::string_view kLlama3Jinja =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% "
    "endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";

bool is_jinja_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

// The template with whitespace outside string literals removed and every literal's escapes
// decoded and requoted with '...', so that the spellings one template takes in different files
// compare equal. An unterminated literal yields text no known template has.
std::string canonical_jinja(std::string_view text) {
  std::string out;
  for (size_t i = 0; i < text.size();) {
    const char c = text[i];
    if (c == '\'' || c == '"') {
      out += '\'';
      for (++i; i < text.size() && text[i] != c;) {
        if (text[i] == '\\' && i + 1 < text.size()) {
          const char e = text[i + 1];
          out += e == 'n' ? '\n' : e == 't' ? '\t' : e == 'r' ? '\r' : e;
          i += 2;
        } else {
          out += text[i++];
        }
      }
      out += '\'';
      ++i;
    } else {
      if (!is_jinja_space(c)) out += c;
      ++i;
    }
  }
  return out;
}

// The code point at `at` in UTF-8 text and its length; invalid bytes count as themselves.
std::pair<char32_t, size_t> code_point_at(std::string_view s, size_t at) {
  const auto b = static_cast<unsigned char>(s[at]);
  size_t len = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 1;
  if (at + len > s.size()) return {b, 1};
  char32_t cp = len == 1 ? b : len == 2 ? b & 0x1f : len == 3 ? b & 0x0f : b & 0x07;
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[at + k]) & 0x3f);
  return {cp, len};
}

// Python's str.isspace, which Jinja's trim filter (str.strip) uses.
bool is_python_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f ||
         c == 0x205f || c == 0x3000;
}

std::string_view python_strip(std::string_view s) {
  size_t begin = 0;
  while (begin < s.size()) {
    auto [cp, len] = code_point_at(s, begin);
    if (!is_python_space(cp)) break;
    begin += len;
  }
  size_t end = s.size();
  while (end > begin) {
    size_t start = end - 1;  // back to the first byte of the last code point
    while (start > begin && (static_cast<unsigned char>(s[start]) & 0xc0) == 0x80) --start;
    auto [cp, len] = code_point_at(s, start);
    if (start + len != end || !is_python_space(cp)) break;
    end = start;
  }
  return s.substr(begin, end - begin);
}

std::string render_chatml(const std::vector<ChatMessage>& messages,
                          const std::optional<std::string>& default_system,
                          bool add_generation_prompt) {
  std::string out;
  auto turn = [&](std::string_view role, std::string_view content) {
    out.append("<|im_start|>").append(role).append("\n").append(content).append("<|im_end|>\n");
  };
  if (default_system && !messages.empty() && messages[0].role != "system")
    turn("system", *default_system);
  for (const ChatMessage& m : messages) turn(m.role, m.content);
  if (add_generation_prompt) out += "<|im_start|>assistant\n";
  return out;
}

std::string render_llama3(const std::vector<ChatMessage>& messages, bool add_generation_prompt) {
  std::string out;
  if (!messages.empty()) out += "<|begin_of_text|>";
  for (const ChatMessage& m : messages) {
    out.append("<|start_header_id|>").append(m.role).append("<|end_header_id|>\n\n");
    out.append(python_strip(m.content)).append("<|eot_id|>");
  }
  if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
  return out;
}

}  // namespace

std::string render_chat(const ChatFormat& format, const std::vector<ChatMessage>& messages,
                        bool add_generation_prompt) {
  switch (format.kind) {
    case ChatTemplate::chatml:
      return render_chatml(messages, format.default_system, add_generation_prompt);
    case ChatTemplate::llama3:
      return render_llama3(messages, add_generation_prompt);
  }
  POLLEN_ASSERT(false);
}

std::string render_chat(ChatTemplate t, const std::vector<ChatMessage>& messages,
                        bool add_generation_prompt) {
  return render_chat(ChatFormat{t, std::nullopt}, messages, add_generation_prompt);
}

std::string_view end_of_turn(ChatTemplate t) {
  return t == ChatTemplate::chatml ? "<|im_end|>" : "<|eot_id|>";
}

ChatTemplate chat_template_named(std::string_view name) {
  if (name == "chatml") return ChatTemplate::chatml;
  if (name == "llama3") return ChatTemplate::llama3;
  fail("unknown chat template '", name, "': expected chatml or llama3");
}

std::string_view chat_template_name(ChatTemplate t) {
  return t == ChatTemplate::chatml ? "chatml" : "llama3";
}

std::string_view chat_template_jinja(ChatTemplate t) {
  return t == ChatTemplate::llama3 ? kLlama3Jinja : kChatmlJinja;
}

ChatFormat recognise_chat_template(std::string_view jinja, std::string_view source) {
  const std::string text = canonical_jinja(jinja);
  if (text == canonical_jinja(kChatmlJinja)) return {ChatTemplate::chatml, std::nullopt};
  if (text == canonical_jinja(kLlama3Jinja)) return {ChatTemplate::llama3, std::nullopt};
  const std::string head = canonical_jinja(std::string(kChatmlDefaultSystemHead) + "'");
  const std::string tail = canonical_jinja("'" + std::string(kChatmlDefaultSystemTail));
  // Without the quotes added to close and open the system message's literal:
  const std::string_view open = std::string_view(head).substr(0, head.size() - 1);
  const std::string_view close = std::string_view(tail).substr(1);
  if (text.size() >= open.size() + close.size() && text.starts_with(open) &&
      text.ends_with(close)) {
    std::string system = text.substr(open.size(), text.size() - open.size() - close.size());
    if (system.find('\'') == std::string::npos) return {ChatTemplate::chatml, std::move(system)};
  }
  fail(source,
       ": the chat_template is neither ChatML's nor Llama 3's (pollen renders those two without "
       "running Jinja); pass --chat-template chatml or --chat-template llama3 to choose one");
}

ChatFormat chat_format_from_config(const std::filesystem::path& tokenizer_config) {
  const std::string source = tokenizer_config.string();
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(read_file(tokenizer_config));
  } catch (const nlohmann::json::exception& e) {
    fail(source, ": not valid JSON: ", e.what());
  }
  POLLEN_CHECK(config.is_object(), source, ": expected a JSON object");
  auto it = config.find("chat_template");
  POLLEN_CHECK(it != config.end() && !it->is_null(), source,
               ": has no 'chat_template'; pass --chat-template chatml or --chat-template llama3");
  if (it->is_string()) return recognise_chat_template(it->get<std::string>(), source);
  POLLEN_CHECK(it->is_array(), source,
               ": 'chat_template' must be a string or a list of {name, template}");
  for (const auto& named : *it) {
    POLLEN_CHECK(named.is_object() && named.value("name", nlohmann::json()).is_string() &&
                     named.value("template", nlohmann::json()).is_string(),
                 source, ": each entry of 'chat_template' must be {name, template} strings");
    if (named["name"] == "default")
      return recognise_chat_template(named["template"].get<std::string>(), source);
  }
  fail(source, ": 'chat_template' lists no template named 'default'");
}

ChatFormat choose_chat_format(const std::filesystem::path& model_dir,
                              std::string_view explicit_name) {
  if (!explicit_name.empty()) return {chat_template_named(explicit_name), std::nullopt};
  const std::filesystem::path config = model_dir / "tokenizer_config.json";
  POLLEN_CHECK(std::filesystem::exists(config), model_dir.string(),
               ": no tokenizer_config.json names a chat template; pass --chat-template chatml or "
               "--chat-template llama3");
  return chat_format_from_config(config);
}

}  // namespace pollen::tokenizer
