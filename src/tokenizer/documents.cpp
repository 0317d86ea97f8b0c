#include "tokenizer/documents.h"

#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "base/error.h"
#include "base/files.h"
#include "base/json_depth.h"

namespace pollen::tokenizer {

namespace {

// A message's text: its "content" as a string, or the "text" of its parts (OpenAI's list of
// {type, text}); empty for a null content (a tool call). Nothing for anything else.
std::optional<std::string> message_text(const nlohmann::json& message) {
  if (!message.is_object() || !message.contains("content")) return std::nullopt;
  const nlohmann::json& content = message["content"];
  if (content.is_null()) return std::string();
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) return std::nullopt;
  std::string text;
  for (const auto& part : content) {
    if (!part.is_object()) return std::nullopt;
    if (part.contains("text") && part["text"].is_string()) text += part["text"].get<std::string>();
  }
  return text;
}

// A record's field as a document: a string as it is; a conversation (a list of messages, as SFT
// data holds them) as its turns' texts, one after another with a line break between (an empty
// list: an empty document). Nothing for anything else.
std::optional<std::string> field_text(const nlohmann::json& field) {
  if (field.is_string()) return field.get<std::string>();
  if (!field.is_array()) return std::nullopt;
  std::string text;
  for (const auto& message : field) {
    const std::optional<std::string> turn = message_text(message);
    if (!turn) return std::nullopt;
    if (turn->empty()) continue;
    if (!text.empty()) text += '\n';
    text += *turn;
  }
  return text;
}

}  // namespace

void for_each_document_batch(const DocumentSource& source, size_t batch_bytes,
                             const std::function<void(std::span<const std::string_view>)>& fn) {
  for_each_document_batch(
      source, batch_bytes,
      [&](std::span<const std::string_view> docs, std::span<const size_t>) { fn(docs); });
}

void for_each_document_batch(
    const DocumentSource& source, size_t batch_bytes,
    const std::function<void(std::span<const std::string_view>, std::span<const size_t>)>& fn) {
  MappedFile file(source.path);
  std::string_view text(reinterpret_cast<const char*>(file.data()), file.size());
  std::vector<std::string_view> views;
  std::vector<std::string> records;
  std::vector<size_t> lines;
  size_t line_number = 0, bytes = 0;
  auto flush = [&] {
    if (source.jsonl) views.assign(records.begin(), records.end());
    if (!views.empty()) fn(views, lines);
    views.clear();
    records.clear();
    lines.clear();
    bytes = 0;
  };
  while (!text.empty()) {
    size_t eol = text.find('\n');
    size_t length = eol == std::string_view::npos ? text.size() : eol + 1;
    std::string_view line = text.substr(0, length);
    text.remove_prefix(length);
    ++line_number;
    bytes += line.size();
    if (!source.jsonl) {
      // The line break is "\n" or, from Windows, "\r\n": neither is part of the document.
      if (!source.keep_line_breaks && line.ends_with('\n')) {
        line.remove_suffix(1);
        if (line.ends_with('\r')) line.remove_suffix(1);
      }
      views.push_back(line);
      lines.push_back(line_number);
    } else if (line.find_first_not_of(" \t\r\n") != std::string_view::npos) {
      nlohmann::json record;
      check_json_depth(line, cat(source.path.string(), ":", line_number));
      try {
        record = nlohmann::json::parse(line);
      } catch (const nlohmann::json::exception& e) {
        fail(source.path.string(), ":", line_number, ": not valid JSON: ", e.what());
      }
      const auto field = record.is_object() ? record.find(source.field) : record.end();
      std::optional<std::string> document;
      if (field != record.end()) document = field_text(*field);
      POLLEN_CHECK(document.has_value(), source.path.string(), ":", line_number,
                   ": expected a string field '", source.field,
                   "' (or a list of messages, each with a string 'content')");
      records.push_back(std::move(*document));
      lines.push_back(line_number);
    }
    if (bytes >= batch_bytes) flush();
  }
  flush();
}

}  // namespace pollen::tokenizer
