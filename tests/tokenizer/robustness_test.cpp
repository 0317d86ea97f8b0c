// Robustness: any byte string round-trips (invalid UTF-8 included, by pollen's documented rule),
// and malformed tokenizer files give a clear error naming the file and what is wrong.
#include <gtest/gtest.h>

#include <random>

#include <nlohmann/json.hpp>
#include "base/error.h"
#include "base/files.h"

#include "tokenizer/byte_level.h"
#include "tokenizer/hf_format.h"
#include "tokenizer/pattern.h"
#include "tokenizer/peers.h"
#include "tokenizer/pretokenizer.h"
#include "tokenizer/tiktoken_format.h"

namespace pollen::tokenizer {
namespace {

namespace fs = std::filesystem;

std::string random_bytes(std::mt19937& rng, size_t n) {
  // Mostly ASCII and UTF-8 fragments, so that valid and invalid runs interleave.
  static const std::string pool[] = {"a",
                                     " ",
                                     "\n",
                                     "'s",
                                     "1",
                                     "\xC3\xA9",
                                     "\xE4\xB8\xAD",
                                     "\xF0\x9F\x98\x80",
                                     "\x80",
                                     "\xC3",
                                     "\xFF",
                                     "\xED\xA0\x80",
                                     "\xE2\x80",
                                     "\t",
                                     "Z",
                                     "\xCC\x81"};
  std::string out;
  while (out.size() < n) {
    if (rng() % 4 == 0)
      out += static_cast<char>(rng() % 256);
    else
      out += pool[rng() % std::size(pool)];
  }
  return out;
}

TEST(Robustness, AnyBytesRoundTripForEveryPattern) {
  POLLEN_REQUIRE_SHARED_TOKENIZERS(dir);
  std::mt19937 rng(7);
  for (auto pattern : {KnownPattern::kGpt2, KnownPattern::kCl100k, KnownPattern::kO200k}) {
    std::string name(known_pattern_name(pattern));
    Tokenizer tok =
        load_tiktoken(dir / (name + ".tiktoken"), std::string(known_pattern_regex(pattern)),
                      known_special_tokens(pattern));
    for (int i = 0; i < 300; ++i) {
      std::string bytes = random_bytes(rng, rng() % 200);
      auto ids = tok.encode(bytes, {SpecialPolicy::as_text()});
      ASSERT_EQ(tok.decode(ids), bytes) << name << " case " << i;
    }
  }
}

// The invalid-UTF-8 rule: each invalid byte is a piece of its own, and the valid text on either
// side is pre-tokenised as if the invalid byte were the end or the start of the text.
TEST(Robustness, InvalidBytesArePiecesOfTheirOwn) {
  PatternSplitter splitter(std::string(known_pattern_regex(KnownPattern::kCl100k)));
  std::vector<std::string> pieces;
  splitter.split(
      "ab\xFF"
      "cd  \x80\x80 x",
      [&](std::string_view p, bool) { pieces.emplace_back(p); });
  std::vector<std::string> expected = {"ab", "\xFF", "cd", "  ", "\x80", "\x80", " x"};
  EXPECT_EQ(pieces, expected);
}

// The hand-written matchers agree with ICU's regex engine running the same pattern.
TEST(Robustness, HandWrittenMatchersAgreeWithIcuRegex) {
  for (auto pattern :
       {KnownPattern::kGpt2, KnownPattern::kCl100k, KnownPattern::kO200k, KnownPattern::kQwen2}) {
    PatternSplitter fast(std::string(known_pattern_regex(pattern)));
    // A regex that means the same but is not recognised, so ICU runs it.
    PatternSplitter icu("(?:" + std::string(known_pattern_regex(pattern)) + ")");
    ASSERT_TRUE(fast.known());
    ASSERT_FALSE(icu.known());
    for (const std::string& text : testing::varied_corpus()) {
      std::vector<std::string> a, b;
      fast.split(text, [&](std::string_view p, bool) { a.emplace_back(p); });
      icu.split(text, [&](std::string_view p, bool) { b.emplace_back(p); });
      ASSERT_EQ(a, b) << known_pattern_name(pattern) << ": " << text;
    }
  }
}

void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    FAIL() << "expected an error";
  } catch (const Error& e) {
    for (const std::string& part : parts)
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(Robustness, MalformedRankFilesNameFileAndLine) {
  std::string pattern(known_pattern_regex(KnownPattern::kGpt2));
  expect_error([&] { tiktoken_from_text("YQ== 0\nnot base64! 1\n", "r.tiktoken", pattern, {}); },
               {"r.tiktoken:2", "base64"});
  expect_error([&] { tiktoken_from_text("YQ== x\n", "r.tiktoken", pattern, {}); },
               {"r.tiktoken:1", "rank 'x'"});
  expect_error([&] { tiktoken_from_text("YQ== 0\nYQ== 1\n", "r.tiktoken", pattern, {}); },
               {"r.tiktoken:2", "same as those of id 0"});
  expect_error([&] { tiktoken_from_text("YQ== 0\n", "r.tiktoken", pattern, {}); },
               {"r.tiktoken", "byte 0 has none"});
  expect_error([&] { tiktoken_from_text("", "r.tiktoken", pattern, {}); },
               {"r.tiktoken", "no tokens"});
  expect_error([&] { tiktoken_from_text("YQ== 4294967000\n", "r.tiktoken", pattern, {}); },
               {"r.tiktoken:1", "too large"});
}

// Metaspace's split cuts before every separator but one at the very start, also one inside the
// first three bytes ("a▁b": HF gives "a", "▁b"; the search began after the separator's length).
TEST(HfSemantics, MetaspaceCutsBeforeASeparatorNearTheStart) {
  const PreTokenizer p({PreTokenizerStep::metaspace("\u2581", PrependScheme::kNever, true)});
  auto pieces = [&](std::string_view text) {
    std::vector<std::string> out;
    p.run(text, true, [&](std::string_view piece) { out.emplace_back(piece); });
    return out;
  };
  EXPECT_EQ(pieces("a b"), (std::vector<std::string>{"a", "\u2581b"}));
  EXPECT_EQ(pieces("xa b"), (std::vector<std::string>{"xa", "\u2581b"}));
  EXPECT_EQ(pieces(" a"), (std::vector<std::string>{"\u2581a"}));
}

// A byte-level vocabulary as tokenizer.json holds it: each byte's character, its id the byte.
nlohmann::json byte_level_vocab() {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) {
    std::string c;
    const char32_t cp = byte_level_char(static_cast<unsigned char>(b));
    if (cp < 0x80) {
      c += static_cast<char>(cp);
    } else {
      c += static_cast<char>(0xC0 | (cp >> 6));
      c += static_cast<char>(0x80 | (cp & 0x3F));
    }
    vocab[c] = b;
  }
  return vocab;
}

// A merge listed twice takes its last rank, as HF's merge map does: with merges (b c), (a b),
// (b c), "abc" merges a b first (HF: [257, 99]).
TEST(HfSemantics, AMergeListedTwiceTakesItsLastRank) {
  nlohmann::json vocab = byte_level_vocab();
  vocab["bc"] = 256;
  vocab["ab"] = 257;
  const nlohmann::json j = {
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"b c", "a b", "b c"}}}}};
  const Tokenizer tok = hf_from_json_text(j.dump(), "dupmerge.json");
  EXPECT_EQ(tok.encode("abc", {}), (std::vector<uint32_t>{257, 99}));
}

// A tokenizer that one pattern cannot describe, or with a non-special added token, is refused as
// a tiktoken rank file instead of written to encode otherwise (digits split apart first here).
TEST(HfSemantics, TokenizersARankFileCannotHoldAreRefused) {
  const nlohmann::json model = {
      {"type", "BPE"}, {"vocab", byte_level_vocab()}, {"merges", nlohmann::json::array()}};
  const nlohmann::json digits_first = {
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Digits"}, {"individual_digits", true}},
          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}}}}},
      {"model", model}};
  expect_error([&] { tiktoken_text(hf_from_json_text(digits_first.dump(), "d.json")); },
               {"not one pattern"});
  const nlohmann::json plain_added = {
      {"added_tokens", {{{"id", 256}, {"content", "<x>"}, {"special", false}}}},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"model", model}};
  expect_error([&] { tiktoken_text(hf_from_json_text(plain_added.dump(), "a.json")); },
               {"'<x>'", "not special"});
}

// A Split on a literal string is written back as {"String": ...}: as a regex its ICU spelling
// (\Q..\E) means other text to HF's engine.
TEST(HfSemantics, ALiteralSplitIsSavedAsAString) {
  const nlohmann::json j = {
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"}, {"pattern", {{"String", "ab"}}}, {"behavior", "Isolated"}},
          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}}},
      {"model",
       {{"type", "BPE"}, {"vocab", byte_level_vocab()}, {"merges", nlohmann::json::array()}}}};
  const Tokenizer tok = hf_from_json_text(j.dump(), "s.json");
  const nlohmann::json saved = nlohmann::json::parse(hf_json_text(tok));
  EXPECT_EQ(saved["pre_tokenizer"]["pretokenizers"][0]["pattern"],
            (nlohmann::json{{"String", "ab"}}))
      << saved["pre_tokenizer"].dump();
  EXPECT_EQ(hf_from_json_text(saved.dump(), "saved.json").encode("xabyab"), tok.encode("xabyab"));
}

// Added tokens with ids past 2^24, two sharing an id, or one given twice are refused (the
// vocabulary size would wrap, or one of them could never be encoded).
TEST(HfSemantics, AddedTokensWithBadIdsAreRefused) {
  const std::string base = R"("model": {"vocab": {"a": 0}, "merges": []})";
  auto load = [&](const std::string& added) {
    return [text = "{\"added_tokens\": " + added + ", " + base + "}"] {
      hf_from_json_text(text, "t.json");
    };
  };
  expect_error(load(R"([{"id": 1, "content": "<x>"}, {"id": 1, "content": "<y>"}])"),
               {"share id 1"});
  expect_error(load(R"([{"id": 1, "content": "<x>"}, {"id": 2, "content": "<x>"}])"),
               {"'<x>' is given twice"});
}

TEST(Robustness, MalformedTokenizerJsonNamesFileAndKey) {
  auto load = [](const std::string& text) { return [text] { hf_from_json_text(text, "t.json"); }; };
  expect_error(load("{"), {"t.json", "not valid JSON"});
  expect_error(load(R"({"model": {"type": "WordPiece", "vocab": {}}})"), {"t.json", "model.type"});
  expect_error(load(R"({"model": {"vocab": {"a": "x"}, "merges": []}})"),
               {"t.json", "model.vocab.a", "expected a token id"});
  // Ids past 2^24 would allocate a table of billions of entries; past 2^32 they used to wrap.
  expect_error(load(R"({"model": {"vocab": {"a": 4294967000}, "merges": []}})"),
               {"t.json", "model.vocab.a", "below 16777216"});
  expect_error(load(R"({"model": {"vocab": {"a": 4294967297}, "merges": []}})"),
               {"t.json", "model.vocab.a", "below 16777216"});
  expect_error(load(R"({"added_tokens": [{"id": "x", "content": "a"}],
                        "model": {"vocab": {"a": 0}, "merges": []}})"),
               {"t.json", "added_tokens[0].id", "expected a token id"});
  expect_error(load(R"({"added_tokens": {"id": 0},
                        "model": {"vocab": {"a": 0}, "merges": []}})"),
               {"t.json", "added_tokens", "expected a list"});
  expect_error(load(R"({"model": {"vocab": {"a": 0}, "merges": {"a": "b"}}})"),
               {"t.json", "model.merges", "expected a list"});
  expect_error(load(R"({"normalizer": {"type": "Replace", "pattern": {"String": 1}},
                        "model": {"vocab": {"a": 0}, "merges": []}})"),
               {"t.json", "normalizer.pattern.String", "expected a string"});
  expect_error(load(R"({"post_processor": {"type": "TemplateProcessing",
                          "single": [{"SpecialToken": {"id": "<s>"}}],
                          "special_tokens": {"<s>": {"ids": [-1]}}},
                        "model": {"vocab": {"a": 0}, "merges": []}})"),
               {"t.json", "post_processor.special_tokens.<s>.ids", "expected a token id"});
  expect_error(load(R"({"model": {"vocab": {"a": 0}, "merges": ["a b"]}})"),
               {"t.json", "model.merges[0]", "not in the vocabulary"});
  expect_error(load(R"({"model": {"vocab": {"a": 0}, "merges": [1]}})"),
               {"t.json", "model.merges[0]"});
  expect_error(load(R"({"pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(x"}},
                        "model": {"vocab": {"a": 0}, "merges": []}})"),
               {"t.json", "pre_tokenizer.pattern", "does not compile"});
  expect_error(load(R"({"normalizer": {"type": "Lowercase"},
                        "model": {"vocab": {"a": 0}, "merges": []}})"),
               {"t.json", "normalizer.type", "Lowercase"});
  expect_error(load(R"({"model": {"vocab": {}, "merges": []}})"), {"t.json", "model.vocab"});
}

}  // namespace
}  // namespace pollen::tokenizer
