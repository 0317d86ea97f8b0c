// The JSONL record reader against nlohmann's parser: the same verdict on valid and invalid
// lines, the same decoded text (escapes, surrogate pairs), and the word hashes of MinHash.
#include <gtest/gtest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "base/hash.h"
#include "data/json_record.h"
#include "data/text.h"

using namespace pollen;
using namespace pollen::data;

namespace {

// nlohmann's verdict and text for a line, as the reader used to take them.
bool reference(const std::string& line, std::string& text) {
  auto j = nlohmann::json::parse(line, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return false;
  auto it = j.find("text");
  text = it != j.end() && it->is_string() ? it->get<std::string>() : "<missing>";
  return true;
}

}  // namespace

TEST(JsonRecord, AgreesWithNlohmannOnValidRecords) {
  const std::string lines[] = {
      R"({"text": "plain"})",
      R"(  {"a": 1, "text": "x\"y\\z\/w\b\f\n\r\t", "b": [1, 2.5e-3, -0, true, false, null]} )",
      R"({"text": "caf\u00e9 \u20ac \ud83d\ude00 \u0000 end"})",
      R"({"nested": {"text": "not this", "deep": [[[{"k": "v"}]]]}, "text": "this"})",
      R"({"text": "first", "text": "last wins"})",
      R"({"text": 5})",
      R"({"other": "no text"})",
      R"({})",
      "{\"text\": \"raw \xc3\xa9 UTF-8 and a long run of plain ascii characters here\"}",
      R"({"te\u0078t": "escaped key"})",
  };
  for (const auto& line : lines) {
    std::string want;
    ASSERT_TRUE(reference(line, want)) << line;
    RecordFields f;
    EXPECT_EQ(parse_record(line, "text", "", f), "") << line;
    EXPECT_EQ(f.has_text ? f.text : "<missing>", want) << line;
  }
}

TEST(JsonRecord, RejectsWhatNlohmannRejects) {
  const std::string lines[] = {
      "{not json",
      R"({"text": "unterminated)",
      R"({"text": "bad escape \q"})",
      R"({"text": "lone high \ud800 surrogate"})",
      R"({"text": "lone low \udc00 surrogate"})",
      R"({"text": "high then not low \ud800\u0041"})",
      R"({"text": "short \u12"})",
      "{\"text\": \"raw\tcontrol\"}",
      R"({"text": "x",})",
      R"({"text": "x"} trailing)",
      R"(["text", "x"])",
      R"("just a string")",
      R"({"a": 01})",
      R"({"a": 1.})",
      R"({"a": tru})",
      R"({"a": [1 2]})",
      R"({"a" 1})",
      R"({"a": {"b": 1]})",
      "",
  };
  for (const auto& line : lines) {
    std::string ignored;
    ASSERT_FALSE(reference(line, ignored)) << line;
    RecordFields f;
    std::string error = parse_record(line, "text", "", f);
    EXPECT_NE(error.find("invalid JSON at byte"), std::string::npos) << line << " -> " << error;
  }
}

TEST(JsonRecord, DeepNestingAndIds) {
  std::string deep = "{\"a\": " + std::string(200000, '[') + std::string(200000, ']') +
                     ", \"text\": \"ok\", \"id\": 17}";
  RecordFields f;
  EXPECT_EQ(parse_record(deep, "text", "id", f), "");
  EXPECT_EQ(f.text, "ok");
  EXPECT_TRUE(f.has_id);
  EXPECT_EQ(f.id, "17");
  std::string unbalanced = "{\"a\": " + std::string(1000, '[') + ", \"text\": \"x\"}";
  EXPECT_NE(parse_record(unbalanced, "text", "id", f), "");
  EXPECT_EQ(parse_record(R"({"id": "doc-\u00e9", "text": "t"})", "text", "id", f), "");
  EXPECT_EQ(f.id, "doc-\xc3\xa9");
  EXPECT_EQ(parse_record(R"({"id": 2.50, "text": "t"})", "text", "id", f), "");
  EXPECT_EQ(f.id, nlohmann::json::parse("2.50").dump());
  EXPECT_EQ(parse_record(R"({"id": null, "text": "t"})", "text", "id", f), "");
  EXPECT_FALSE(f.has_id);
  // An empty id names nothing: the record keeps file:line, as one without an id.
  EXPECT_EQ(parse_record(R"({"id": "", "text": "t"})", "text", "id", f), "");
  EXPECT_FALSE(f.has_id);
}

TEST(JsonRecord, WriterRoundTripsThroughTheReader) {
  std::string text = "quote \" backslash \\ newline \n tab \t bell \x07 nul";
  text += '\0';
  text += " caf\xc3\xa9";
  std::string line = "{\"text\":";
  append_json_string(line, text);
  line += "}";
  RecordFields f;
  ASSERT_EQ(parse_record(line, "text", "", f), "");
  EXPECT_EQ(f.text, text);
  EXPECT_EQ(nlohmann::json::parse(line)["text"].get<std::string>(), text);
}

TEST(Text, NormalizedWordHashes) {
  std::vector<uint64_t> h;
  normalized_word_hashes("  Hello, World!\n42 ... caf\xc3\xa9 -- x", 9, h);
  std::vector<uint64_t> want;
  for (std::string w : {"hello", "world", "42", "caf\xc3\xa9", "x"})
    want.push_back(xxh64(w.data(), w.size(), 9));
  EXPECT_EQ(h, want);
}

TEST(JsonRecord, PassesInvalidUtf8ThroughForTheUtf8Stage) {
  // nlohmann refuses such a line; the reader keeps it so that the utf8 stage repairs or drops
  // the text and counts it.
  RecordFields f;
  EXPECT_EQ(parse_record("{\"text\": \"bad \xff"
                         " byte\"}",
                         "text", "", f),
            "");
  EXPECT_EQ(f.text, "bad \xff byte");
}

TEST(Text, SplitWordsMatchesAByteByByteSplit) {
  // Random texts over letters and every kind of whitespace, long enough for the 64-byte path.
  const char alphabet[] = {'a', 'b', ' ', '\t', '\n', '\r', '\v', '\f', '\x80', '\x08', '\x0e'};
  uint64_t x = 12345;
  std::vector<std::string_view> got;
  for (int t = 0; t < 500; ++t) {
    std::string s;
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    const size_t len = (x >> 33) % 300;
    for (size_t i = 0; i < len; ++i) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      s += alphabet[(x >> 33) % (t % 2 ? 3 : sizeof alphabet)];
    }
    std::vector<std::string> want;
    std::string w;
    for (char c : s + " ") {
      if (c == ' ' || (c >= '\t' && c <= '\r')) {
        if (!w.empty()) want.push_back(w);
        w.clear();
      } else {
        w += c;
      }
    }
    split_words(s, got);
    EXPECT_EQ(std::vector<std::string>(got.begin(), got.end()), want) << s;
  }
}
