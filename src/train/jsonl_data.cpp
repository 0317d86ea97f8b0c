#include "train/jsonl_data.h"

#include <fstream>

#include "base/error.h"
#include "base/json_depth.h"

namespace pollen::train {

bool jsonl_has_records(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in.good() || !std::filesystem::is_regular_file(path)) return true;
  std::string line;
  while (std::getline(in, line))
    if (line.find_first_not_of(" \t\r") != std::string::npos) return true;
  return false;
}

void for_each_jsonl_object(
    const std::filesystem::path& path, const std::string& what,
    const std::function<void(const nlohmann::json&, int64_t, const std::string&)>& fn) {
  POLLEN_CHECK(!std::filesystem::is_directory(path), what, " '", path.string(),
               "' is a folder; expected a JSONL file");
  std::ifstream in(path, std::ios::binary);
  POLLEN_CHECK(in.good(), "cannot read ", what, " '", path.string(), "'");
  std::string line;
  int64_t records = 0;
  for (int64_t line_no = 1; std::getline(in, line); ++line_no) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    std::string where = "'";  // built step by step: gcc 12 warns falsely on "'" + string
    where += path.string();
    where += "' line ";
    where += std::to_string(line_no);
    fn(parse_json_object(line, where), line_no, where);
    ++records;
  }
  POLLEN_CHECK(records > 0, what, " '", path.string(), "' holds no records");
}

std::string string_field(const nlohmann::json& record, const std::string& key,
                         const std::string& field, const std::string& where) {
  const auto it = record.find(key);
  POLLEN_CHECK(it != record.end(), where, ", field '", field, "' is missing");
  POLLEN_CHECK(it->is_string(), where, ", field '", field, "': expected a string, got ",
               it->type_name());
  return it->get<std::string>();
}

std::vector<tokenizer::ChatMessage> read_messages(const nlohmann::json& value,
                                                  const std::string& field,
                                                  const std::string& where) {
  POLLEN_CHECK(value.is_array() && !value.empty(), where, ", field '", field,
               "': expected a non-empty array of {\"role\", \"content\"}");
  std::vector<tokenizer::ChatMessage> out;
  for (size_t i = 0; i < value.size(); ++i) {
    const std::string element = cat(field, "[", i, "]");
    POLLEN_CHECK(value[i].is_object(), where, ", field '", element,
                 "': expected an object with \"role\" and \"content\"");
    std::string role = string_field(value[i], "role", element + ".role", where);
    // The roles the chat templates render, as pollen serve takes them: OpenAI's "developer" is
    // the system message of newer models. Any other would be rendered as a turn the model was
    // never trained on (a typo such as "bot" would train the reply unscored).
    POLLEN_CHECK(role == "system" || role == "user" || role == "assistant" || role == "developer",
                 where, ", field '", element, ".role': expected system, user, assistant or ",
                 "developer (taken as system), got '", role, "'");
    if (role == "developer") role = "system";
    out.push_back(
        {std::move(role), string_field(value[i], "content", element + ".content", where)});
  }
  return out;
}

}  // namespace pollen::train
