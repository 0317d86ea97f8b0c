#include "tokenizer/chat_template.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/files.h"
#include "base/json_depth.h"
#include "tokenizer/tokenizer.h"

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

size_t leading_python_spaces(std::string_view s) {
  size_t n = 0;
  while (n < s.size()) {
    auto [cp, len] = code_point_at(s, n);
    if (!is_python_space(cp)) break;
    n += len;
  }
  return n;
}

size_t trailing_python_spaces(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t start = end - 1;  // back to the first byte of the last code point
    while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xc0) == 0x80) --start;
    auto [cp, len] = code_point_at(s, start);
    if (start + len != end || !is_python_space(cp)) break;
    end = start;
  }
  return s.size() - end;
}

std::string_view python_strip(std::string_view s) {
  s.remove_prefix(leading_python_spaces(s));
  return s.substr(0, s.size() - trailing_python_spaces(s));
}

bool is_jinja_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

// A tag's code with whitespace outside string literals removed and every literal's escapes
// decoded and requoted with '...', so that the spellings one template takes in different files
// compare equal. An unterminated literal yields text no known template has.
std::string canonical_code(std::string_view text) {
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

// A piece of a Jinja template: a tag ({% %}, {{ }} or {# #}) or the text between two tags.
struct JinjaPart {
  char tag = 0;              // '%', '{' or '#' for a tag; 0 for text
  char left = 0, right = 0;  // a tag's whitespace-control markers: '-', '+' or 0
  std::string text;          // a tag's code (without delimiters and markers), or the text
};

// Where a tag whose code starts at `from` ends (the offset of its closing delimiter), skipping
// string literals in code; npos when it does not end.
size_t jinja_tag_end(std::string_view t, size_t from, char tag) {
  const std::string_view close = tag == '%' ? "%}" : tag == '{' ? "}}" : "#}";
  if (tag == '#') return t.find(close, from);
  for (size_t i = from; i < t.size(); ++i) {
    if (t[i] == '\'' || t[i] == '"') {
      for (const char quote = t[i++]; i < t.size() && t[i] != quote; ++i)
        if (t[i] == '\\') ++i;
    } else if (t.substr(i).starts_with(close)) {
      return i;
    }
  }
  return std::string_view::npos;
}

std::vector<JinjaPart> jinja_parts(std::string_view t) {
  std::vector<JinjaPart> parts;
  for (size_t i = 0; i < t.size();) {
    size_t open = i;
    while (open + 1 < t.size() &&
           !(t[open] == '{' && (t[open + 1] == '%' || t[open + 1] == '{' || t[open + 1] == '#')))
      ++open;
    if (open + 1 >= t.size()) open = t.size();
    if (open > i) parts.push_back({0, 0, 0, std::string(t.substr(i, open - i))});
    if (open == t.size()) break;
    JinjaPart tag{t[open + 1], 0, 0, ""};
    size_t body = open + 2;
    if (body < t.size() && (t[body] == '-' || t[body] == '+')) tag.left = t[body++];
    const size_t close = jinja_tag_end(t, body, tag.tag);
    size_t body_end = std::min(close, t.size());
    if (body_end > body && (t[body_end - 1] == '-' || t[body_end - 1] == '+'))
      tag.right = t[--body_end];
    tag.text = std::string(t.substr(body, body_end - body));
    parts.push_back(std::move(tag));
    i = close == std::string_view::npos ? t.size() : close + 2;
  }
  return parts;
}

// What a text part outputs under Jinja's whitespace control as apply_chat_template sets it up
// (trim_blocks and lstrip_blocks on): a '-' marker strips all whitespace on its side; otherwise
// a block or comment tag drops the one newline after it (unless marked '+'), and one alone on
// its line drops the spaces before it.
std::string jinja_output(const JinjaPart* before, std::string text, const JinjaPart* after) {
  bool line_starting = true;
  if (before && before->right == '-') {
    const size_t n = leading_python_spaces(text);
    line_starting = n > 0 && text[n - 1] == '\n';
    text.erase(0, n);
  } else if (before && before->tag != '{' && before->right != '+' && text.starts_with('\n')) {
    text.erase(0, 1);
  } else if (before) {
    line_starting = false;
  }
  if (after && after->left == '-') {
    text.resize(text.size() - trailing_python_spaces(text));
  } else if (after && after->tag != '{' && after->left != '+') {
    const size_t line = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
    // Jinja strips spaces and tabs only (its lexer's [^ \t] test), not other white space.
    if ((line > 0 || line_starting) && line < text.size() &&
        text.find_first_not_of(" \t", line) == std::string::npos)
      text.resize(line);
  }
  return text;
}

// The template reduced to what decides its output: the code of its tags (see canonical_code)
// and the text they output between them, after Jinja's line-ending normalisation (which also
// drops one final newline) and whitespace control.
std::string canonical_jinja(std::string_view jinja) {
  std::string source;
  for (size_t i = 0; i < jinja.size(); ++i) {
    if (jinja[i] != '\r') {
      source += jinja[i];
    } else {
      source += '\n';
      if (i + 1 < jinja.size() && jinja[i + 1] == '\n') ++i;
    }
  }
  if (source.ends_with('\n')) source.pop_back();
  const std::vector<JinjaPart> parts = jinja_parts(source);
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    const JinjaPart& part = parts[i];
    if (part.tag == '%' || part.tag == '{') {
      const char close = part.tag == '%' ? '%' : '}';
      out.append("{").append(1, part.tag).append(canonical_code(part.text));
      out.append(1, close).append("}");
    } else if (!part.tag) {
      const JinjaPart* before = i > 0 ? &parts[i - 1] : nullptr;
      const JinjaPart* after = i + 1 < parts.size() ? &parts[i + 1] : nullptr;
      // Kept apart from code by a byte no code holds.
      const std::string text = jinja_output(before, part.text, after);
      if (!text.empty()) out.append("\x01").append(text).append("\x01");
    }
  }
  return out;
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

std::vector<std::string_view> chat_markup_tokens(ChatTemplate t) {
  if (t == ChatTemplate::chatml) return {"<|im_start|>", "<|im_end|>"};
  return {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"};
}

std::optional<uint32_t> added_token_id(const Tokenizer& tok, std::string_view content) {
  for (const auto& t : tok.added_tokens())
    if (t.content == content) return t.id;
  return std::nullopt;
}

std::vector<std::string> missing_chat_markup(const Tokenizer& tok, ChatTemplate t) {
  std::vector<std::string> missing;
  for (std::string_view content : chat_markup_tokens(t))
    if (!added_token_id(tok, content)) missing.emplace_back(content);
  return missing;
}

uint32_t end_of_turn_id(const Tokenizer& tok, ChatTemplate t, std::string_view what_to_do) {
  const std::vector<std::string> missing = missing_chat_markup(tok, t);
  if (!missing.empty()) {
    std::string names;
    for (const std::string& m : missing) names += (names.empty() ? "" : ", ") + m;
    const bool unended = !added_token_id(tok, end_of_turn(t));
    fail("the ", chat_template_name(t), " chat template writes ", names,
         ", which the tokenizer does not have (its markup would be encoded as plain bytes",
         unended ? cat(", and no reply could end without ", end_of_turn(t)) : std::string(), "); ",
         what_to_do);
  }
  return *added_token_id(tok, end_of_turn(t));
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
  // The system message's literal holds a placeholder, which cuts the template in two.
  const std::string known =
      canonical_jinja(cat(kChatmlDefaultSystemHead, "\x02", kChatmlDefaultSystemTail));
  const std::string_view open = std::string_view(known).substr(0, known.find('\x02'));
  const std::string_view close = std::string_view(known).substr(open.size() + 1);
  if (text.size() >= open.size() + close.size() && text.starts_with(open) &&
      text.ends_with(close)) {
    std::string system = text.substr(open.size(), text.size() - open.size() - close.size());
    if (system.find('\'') == std::string::npos) return {ChatTemplate::chatml, std::move(system)};
  }
  fail(source,
       ": the chat_template is neither ChatML's nor Llama 3's (pollen renders those two without "
       "running Jinja)");
}

std::filesystem::path chat_template_file(const std::filesystem::path& tokenizer_config) {
  return tokenizer_config.parent_path() / "chat_template.jinja";
}

std::optional<std::string> chat_template_text(const std::filesystem::path& tokenizer_config) {
  const std::filesystem::path jinja = chat_template_file(tokenizer_config);
  if (std::filesystem::is_regular_file(jinja)) return read_file(jinja);
  if (!std::filesystem::exists(tokenizer_config)) return std::nullopt;
  const std::string source = tokenizer_config.string();
  nlohmann::json config;
  const std::string text = read_file(tokenizer_config);
  check_json_depth(text, source);
  try {
    config = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(source, ": not valid JSON: ", e.what());
  }
  POLLEN_CHECK(config.is_object(), source, ": expected a JSON object");
  auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  POLLEN_CHECK(it->is_array(), source,
               ": 'chat_template' must be a string or a list of {name, template}");
  for (const auto& named : *it) {
    POLLEN_CHECK(named.is_object() && named.value("name", nlohmann::json()).is_string() &&
                     named.value("template", nlohmann::json()).is_string(),
                 source, ": each entry of 'chat_template' must be {name, template} strings");
    if (named["name"] == "default") return named["template"].get<std::string>();
  }
  fail(source, ": 'chat_template' lists no template named 'default'");
}

ChatFormat chat_format_from_config(const std::filesystem::path& tokenizer_config) {
  const std::optional<std::string> jinja = chat_template_text(tokenizer_config);
  POLLEN_CHECK(jinja.has_value(), tokenizer_config.string(),
               ": has no 'chat_template' (and no chat_template.jinja is beside it)");
  const std::filesystem::path file = chat_template_file(tokenizer_config);
  return recognise_chat_template(
      *jinja, (std::filesystem::is_regular_file(file) ? file : tokenizer_config).string());
}

ChatFormat choose_chat_format(const std::filesystem::path& model_dir,
                              std::string_view explicit_name) {
  if (!explicit_name.empty()) return {chat_template_named(explicit_name), std::nullopt};
  const std::filesystem::path config = model_dir / "tokenizer_config.json";
  // model_dir is empty for a tokenizer file named without a folder: the current one.
  POLLEN_CHECK(std::filesystem::exists(config) ||
                   std::filesystem::is_regular_file(chat_template_file(config)),
               "no tokenizer_config.json or chat_template.jinja in '",
               model_dir.empty() ? std::string(".") : model_dir.string(),
               "' names a chat template");
  return chat_format_from_config(config);
}

}  // namespace pollen::tokenizer
