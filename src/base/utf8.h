#pragma once
// UTF-8 validation and repair, for text that reaches files readers decode strictly (JSON,
// TensorBoard's protobufs) and for the curation stages.
#include <cstddef>
#include <string>
#include <string_view>

namespace pollen {

// True when `s` is valid UTF-8 (no overlongs, no surrogates, nothing above U+10FFFF).
bool utf8_valid(std::string_view s);
// The offset of the first byte of the first invalid sequence, or std::string_view::npos.
size_t utf8_invalid_at(std::string_view s);
// Replaces each maximal invalid subsequence by U+FFFD (as Python's errors="replace" and
// WHATWG decoders do); returns how many replacements were made.
size_t utf8_repair(std::string_view s, std::string& out);

}  // namespace pollen
