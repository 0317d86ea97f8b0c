#pragma once
// GPT-2's byte-to-character map, used by HF byte-level tokenizer.json files: every byte is
// written as a printable Unicode character (space as 'Ġ', newline as 'Ċ', ...).
#include <optional>
#include <string>
#include <string_view>

namespace pollen::tokenizer {

// The printable character that stands for one byte.
char32_t byte_level_char(unsigned char byte);
// The printable form of raw bytes.
std::string bytes_to_byte_level(std::string_view bytes);
// The raw bytes of a printable form; nullopt when a character is not in the map.
std::optional<std::string> byte_level_to_bytes(std::string_view text);

}  // namespace pollen::tokenizer
