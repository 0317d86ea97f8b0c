#pragma once
// A bound on the nesting of JSON read from outside (files, requests, peers' messages).
// nlohmann's parser takes any depth, but copying, printing or comparing a value recurses once a
// level, so a few hundred kilobytes of brackets would exhaust a thread's stack: text is checked
// with these before it is parsed.
#include <string_view>

#include <nlohmann/json.hpp>

namespace pollen {

// Deeper than any model config, tokenizer, manifest or request pollen reads (they nest a few
// levels), far below what a thread's stack takes.
constexpr int kMaxJsonDepth = 512;

// Whether no more than `most` arrays and objects open inside one another in `text`, brackets
// inside strings aside. Malformed text is left to the parser.
bool json_depth_within(std::string_view text, int most = kMaxJsonDepth);

// Throws pollen::Error naming `what` when `text` nests deeper than kMaxJsonDepth.
void check_json_depth(std::string_view text, std::string_view what);

// One JSON object read from outside (a JSONL line): depth checked, then parsed; throws naming
// `where` and what the parser found (invalid UTF-8, a missing brace, ...) or the type it got.
nlohmann::json parse_json_object(std::string_view text, std::string_view where);

}  // namespace pollen
