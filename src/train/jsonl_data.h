#pragma once
// The JSONL data files of post-training (SFT conversations, preference pairs, GRPO prompts): one
// JSON object per non-blank line, conversations as OpenAI-style messages; every error names the
// file, the line and the field.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tokenizer/chat_template.h"

namespace pollen::train {

// Whether `path` holds a line that is not blank (a file that cannot be read: true, so that its
// reader says why). Held-out data may be empty: the run then evaluates nothing, as documented.
bool jsonl_has_records(const std::filesystem::path& path);

// Calls fn(record, line, where) for each non-blank line of `path` (line: 1-based; where: "'<path>'
// line N"). A line that is not a JSON object, and a file that cannot be read or holds no
// records, are errors; `what` names the file in them ("SFT data").
void for_each_jsonl_object(
    const std::filesystem::path& path, const std::string& what,
    const std::function<void(const nlohmann::json&, int64_t, const std::string&)>& fn);

// The string at `key` of a record, named `field` in errors.
std::string string_field(const nlohmann::json& record, const std::string& key,
                         const std::string& field, const std::string& where);

// A non-empty array of {"role": string, "content": string}, the value of field `field`.
std::vector<tokenizer::ChatMessage> read_messages(const nlohmann::json& value,
                                                  const std::string& field,
                                                  const std::string& where);

}  // namespace pollen::train
