#include "base/json_depth.h"

#include "base/error.h"

namespace pollen {

bool json_depth_within(std::string_view text, int most) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\')
        ++i;  // the escaped character, a quote or a backslash among them
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > most) return false;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return true;
}

void check_json_depth(std::string_view text, std::string_view what) {
  POLLEN_CHECK(json_depth_within(text), what, ": JSON nested more than ", kMaxJsonDepth,
               " arrays and objects deep, deeper than pollen reads");
}

nlohmann::json parse_json_object(std::string_view text, std::string_view where) {
  check_json_depth(text, where);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(where, ": not valid JSON (", e.what(), ")");
  }
  POLLEN_CHECK(j.is_object(), where, ": expected a JSON object, got ", j.type_name());
  return j;
}

}  // namespace pollen
