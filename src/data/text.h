#pragma once
// Text helpers shared by the curation stages: UTF-8 validation and repair, line and word
// splitting, and the normalisation that dedup and decontamination compare texts under.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace pollen::data {

// True when `s` is valid UTF-8 (no overlongs, no surrogates, nothing above U+10FFFF).
bool utf8_valid(std::string_view s);
// Replaces each maximal invalid subsequence by U+FFFD (as Python's errors="replace" and
// WHATWG decoders do); returns how many replacements were made.
size_t utf8_repair(std::string_view s, std::string& out);

// Whitespace (ASCII space, tab, CR, LF, VT, FF) separated words, as views into `s`.
void split_words(std::string_view s, std::vector<std::string_view>& out);
// Lines split on '\n' (a trailing empty line is not reported).
void split_lines(std::string_view s, std::vector<std::string_view>& out);
std::string_view strip(std::string_view s);

// Lower-cased ASCII letters and digits of each word, punctuation removed, empty words dropped:
// "Hello, World! 42" -> {"hello", "world", "42"}. Non-ASCII bytes are kept as they are.
void normalized_words(std::string_view s, std::vector<std::string>& out);

}  // namespace pollen::data
