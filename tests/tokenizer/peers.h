#pragma once
// Test helpers: the shared tokenizer files, the peer Python (tiktoken, HF tokenizers), and a
// varied corpus. Tests that need what is absent skip with the reason.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/files.h"

namespace pollen::tokenizer::testing {

inline std::optional<std::filesystem::path> shared_tokenizers_dir() {
  std::filesystem::path dir =
      std::filesystem::path(POLLEN_SOURCE_DIR) / ".." / "shared" / "data" / "tokenizers";
  if (std::filesystem::exists(dir / "encodings.json")) return std::filesystem::canonical(dir);
  return std::nullopt;
}

inline std::optional<std::filesystem::path> peers_python() {
  std::filesystem::path python = POLLEN_PEERS_PYTHON;
  if (std::filesystem::exists(python)) return python;
  return std::nullopt;
}

inline std::filesystem::path temp_dir(const std::string& name) {
  std::filesystem::path dir = std::filesystem::temp_directory_path() /
                              ("pollen_tokenizer_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

inline nlohmann::json run_reference(const nlohmann::json& request) {
  std::filesystem::path dir = temp_dir("reference");
  std::filesystem::path in = dir / "request.json", out = dir / "result.json";
  write_file_atomic(in, request.dump());
  std::string command = peers_python()->string() + " " + POLLEN_SOURCE_DIR +
                        "/tests/tokenizer/reference.py " + in.string() + " " + out.string();
  int rc = std::system(command.c_str());
  if (rc != 0) throw std::runtime_error("reference.py failed: " + command);
  auto result = nlohmann::json::parse(read_file(out));
  std::filesystem::remove_all(dir);
  return result;
}

namespace detail {

inline const std::vector<std::string>& snippets() {
  static const std::vector<std::string> s = {
      "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see, they're here "
      "and I'd've thought you'd KNOW. DON'T SHOUT'S",
      "Hello world!  Two spaces,   three spaces,\ttab,\t\ttwo tabs.   \n  trailing   \n\n\n",
      "int main(int argc, char** argv) {\n    for (int i = 0; i < 10; ++i) {\n        "
      "printf(\"%d\\n\", i);\n    }\n    return 0;\n}\n",
      "def f(x):\r\n    return x ** 2  # square\r\n\r\n\tpass\n",
      "Numbers: 1 12 123 1234 12345 3.14159 -42 1,000,000 0x1F 1e-9 ١٢٣ ½ Ⅻ",
      "中文文本测试，包括标点符号。日本語のテキスト、カタカナ。한국어 텍스트입니다.",
      "العربية لغة جميلة، وهذا نص تجريبي. مرحبا بالعالم!",
      "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ 🇫🇷🇯🇵 done.",
      "Combining: e\u0301 a\u0300 n\u0303 o\u0308\u0304 Z\u0351\u0352 café naïve Ångström",
      "Greek Ελληνικά, Cyrillic Русский ТЕКСТ, Hebrew עברית, Devanagari हिन्दी, Thai ไทย",
      "CamelCaseWord HTTPServer XMLHttpRequest iPhone eBay McDonald's O'NEIL's",
      "path/to/file.txt https://example.com/a/b?c=d&e=f#g ../../etc/passwd //comment\n/\n",
      "    \n\t\n \r\n   x   \u00a0\u00a0nbsp\u2003em\u3000ideo\u2028line\u0085nel\v",
      "'s 't 're 've 'm 'll 'd 'S 'T 'RE 'Ve 'M 'LL 'D '' ''s x'sy 'ſ",
      "!!!??? ... --- === +++ ### $$$ %%% ^^^ &&& *** ((( ))) [[[ ]]] {{{ }}}",
      "<|endoftext|> is special; <|fim_prefix|>x<|fim_middle|>y<|fim_suffix|>z",
      "   leading spaces and trailing ones   ",
      "ÀÉÎÕÜ àéîõü ÇçÑñ ßẞ ǅǈ ʰʲ ˈstress ꜰ ＡＢＣ ａｂｃ １２３",
  };
  return s;
}

}  // namespace detail

inline std::vector<std::string> varied_corpus() {
  std::vector<std::string> corpus = detail::snippets();
  std::mt19937 rng(1234);
  const auto& s = detail::snippets();
  static const char* glue[] = {"", " ", "  ", "\n", "\t", " \n ", "'", "\r\n", "1", "\u00e9"};
  for (int doc = 0; doc < 300; ++doc) {
    std::string text;
    int parts = 1 + static_cast<int>(rng() % 6);
    for (int p = 0; p < parts; ++p) {
      const std::string& src = s[rng() % s.size()];
      size_t begin = rng() % src.size(), length = 1 + rng() % 40;
      // Cut on UTF-8 character boundaries so the text stays valid.
      while (begin > 0 && (static_cast<unsigned char>(src[begin]) & 0xC0) == 0x80) --begin;
      size_t end = std::min(src.size(), begin + length);
      while (end < src.size() && (static_cast<unsigned char>(src[end]) & 0xC0) == 0x80) ++end;
      text += src.substr(begin, end - begin);
      text += glue[rng() % std::size(glue)];
    }
    corpus.push_back(text);
  }
  return corpus;
}

inline std::string corpus_text() {
  std::string text;
  for (const std::string& doc : varied_corpus()) text += doc + "\n\n";
  return text;
}

}  // namespace pollen::tokenizer::testing

#define POLLEN_REQUIRE_SHARED_TOKENIZERS(dir)                               \
  auto dir##_found = ::pollen::tokenizer::testing::shared_tokenizers_dir(); \
  if (!dir##_found) GTEST_SKIP() << "../shared/data/tokenizers is absent";  \
  const std::filesystem::path dir = *dir##_found

#define POLLEN_REQUIRE_PEERS()                       \
  if (!::pollen::tokenizer::testing::peers_python()) \
  GTEST_SKIP() << "peer Python absent (run scripts/test-peers)"
