#pragma once
// One JSONL record checked and read in a single pass, without building a JSON tree: the whole
// line is validated as one JSON object (RFC 8259 grammar, nesting to any depth) and only the
// wanted top-level fields are decoded (escapes, \u surrogate pairs). Bytes of 0x80 and above
// inside strings are passed through as they are, so invalid UTF-8 reaches the utf8 stage
// (repaired or dropped, counted) instead of making the record unreadable.
#include <string>
#include <string_view>

namespace pollen::data {

struct RecordFields {
  std::string text;       // the text field's decoded value
  bool has_text = false;  // the text field is present and a string
  std::string id;         // the id field: a string's value, or a number's JSON text
  bool has_id = false;    // the id field is present and a string or number
};

// Returns "" when `line` is one valid JSON object (surrounded by whitespace at most), else what
// is wrong and at which byte. When a key appears twice, the last value counts (as nlohmann's
// parser does). `id_field` may be empty.
std::string parse_record(std::string_view line, std::string_view text_field,
                         std::string_view id_field, RecordFields& out);

// Appends `v` as a JSON string literal. `v` must be valid UTF-8; only '"', '\\' and control
// characters are escaped.
void append_json_string(std::string& out, std::string_view v);

}  // namespace pollen::data
