#pragma once
// Text helpers shared by the curation stages (UTF-8 validation and repair are base/utf8.h's):
// character counts, line and word splitting, and the normalisation that dedup and decontamination
// compare texts under.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/utf8.h"  // utf8_valid, utf8_invalid_at, utf8_repair

namespace pollen::data {

// Characters (code points) of valid UTF-8 `s`: what Python's len() counts, which the Gopher and
// C4 word-length rules are defined by. Counts the bytes that do not continue a sequence.
size_t utf8_length(std::string_view s);

// Whitespace (ASCII space, tab, CR, LF, VT, FF) separated words, as views into `s`.
void split_words(std::string_view s, std::vector<std::string_view>& out);
// Lines split on '\n' (a trailing empty line is not reported).
void split_lines(std::string_view s, std::vector<std::string_view>& out);
std::string_view strip(std::string_view s);

// The normalised words of `s` are the lower-cased ASCII letters and digits of each word,
// punctuation removed, empty words dropped: "Hello, World! 42" -> "hello", "world", "42";
// non-ASCII bytes are kept as they are. Writes xxh64(word, seed) of each, without building the
// words as strings.
void normalized_word_hashes(std::string_view s, uint64_t seed, std::vector<uint64_t>& out);

}  // namespace pollen::data
