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
  // A rank far past the file's lines is refused before the table of ranks grows to it (it took
  // 512 MiB for this 14-byte file).
  expect_error([&] { tiktoken_from_text("QQ== 16777215\n", "r.tiktoken", pattern, {}); },
               {"r.tiktoken:1", "rank 16777215 is too large for a file of 1 line", "below 65537"});
  expect_error([&] { tiktoken_from_text("QQ== 0\nQg== 70000\nQw== 2", "r.tiktoken", pattern, {}); },
               {"r.tiktoken:2", "rank 70000 is too large for a file of 3 lines", "below 65539"});
  // Ranks that do not form a merge list ("hello" at rank 256 has no pair of lower ranks that
  // makes it) are refused at load, naming the file.
  std::string bytes;
  for (int b = 0; b < 256; ++b) bytes += static_cast<char>(b);
  std::string ranks;
  for (int b = 0; b < 256; ++b)
    ranks +=
        base64_encode(bytes.substr(static_cast<size_t>(b), 1)) + " " + std::to_string(b) + "\n";
  expect_error([&] { tiktoken_from_text(ranks + "aGVsbG8= 256\n", "r.tiktoken", pattern, {}); },
               {"r.tiktoken: token 256 cannot be made by merging two tokens of lower rank"});
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

const std::pair<SplitBehavior, const char*> kSplitBehaviors[] = {
    {SplitBehavior::kRemoved, "removed"},
    {SplitBehavior::kIsolated, "isolated"},
    {SplitBehavior::kMergedWithPrevious, "merged_with_previous"},
    {SplitBehavior::kMergedWithNext, "merged_with_next"},
    {SplitBehavior::kContiguous, "contiguous"}};

std::vector<std::string> split_pieces(const std::string& pattern, SplitBehavior behavior,
                                      std::string_view text) {
  const PreTokenizer p({PreTokenizerStep::split_on(pattern, behavior)});
  std::vector<std::string> out;
  p.run(text, true, [&](std::string_view piece) { out.emplace_back(piece); });
  return out;
}

// HF's pieces of each (pattern, behavior, valid UTF-8 text) case, in order.
std::vector<std::vector<std::string>> hf_split_pieces(const nlohmann::json& cases) {
  const auto result = testing::run_reference({{"mode", "split"}, {"cases", cases}});
  return result["pieces"].get<std::vector<std::vector<std::string>>>();
}

// A literal Split (tokenizer.json's {"String": ...}) matches its text whatever characters it
// holds (a backslash and a letter, \E, operators, a newline), and \h, \H are Oniguruma's hex
// digits: the pieces are HF's.
TEST(HfSemantics, LiteralSplitsAndHexClassesCutAsHfDoes) {
  POLLEN_REQUIRE_PEERS();
  const std::vector<std::pair<std::string, bool>> patterns = {
      {R"(\s)", true}, {R"(a\Eb)", true}, {".+", true},      {"[x]", true},       {"\n", true},
      {"ab", true},    {R"(\h+)", false}, {R"(\H+)", false}, {R"([\h_]+)", false}};
  const std::vector<std::string> texts = {"x\\sy z", "xa\\Eby",  "a.+b..+",
                                          "[x]x[x",  "one\ntwo", "deadbeef xyz 12_f"};
  nlohmann::json cases = nlohmann::json::array();
  std::vector<std::vector<std::string>> ours;
  for (const auto& [pattern, literal] : patterns)
    for (const std::string& text : texts) {
      cases.push_back(
          {{"pattern", pattern}, {"literal", literal}, {"behavior", "isolated"}, {"text", text}});
      ours.push_back(
          split_pieces(literal ? literal_regex(pattern) : pattern, SplitBehavior::kIsolated, text));
    }
  const auto hf = hf_split_pieces(cases);
  for (size_t i = 0; i < ours.size(); ++i) EXPECT_EQ(ours[i], hf[i]) << cases[i].dump();
  // A literal goes back to tokenizer.json as the String it was; a regex as a regex.
  for (const auto& [pattern, literal] : patterns)
    if (literal) EXPECT_EQ(literal_of_regex(literal_regex(pattern)), pattern);
  EXPECT_EQ(literal_of_regex(R"(\h+)"), std::nullopt);
  EXPECT_EQ(literal_of_regex(R"(\d)"), std::nullopt);
}

// A Split whose pattern can match the empty string cuts at the empty matches as HF does, with
// every behavior.
TEST(HfSemantics, SplitCutsAtEmptyMatchesAsHfDoes) {
  POLLEN_REQUIRE_PEERS();
  const std::vector<std::string> patterns = {"x*", R"(\s*)", "(?=b)", R"(\b)", "a|", "a?", ""};
  const std::vector<std::string> texts = {"abxxc d", "ab bb", "xx", " a  b ", "b"};
  nlohmann::json cases = nlohmann::json::array();
  std::vector<std::vector<std::string>> ours;
  for (const std::string& pattern : patterns)
    for (const auto& [behavior, name] : kSplitBehaviors)
      for (const std::string& text : texts) {
        cases.push_back({{"pattern", pattern}, {"behavior", name}, {"text", text}});
        ours.push_back(split_pieces(pattern, behavior, text));
      }
  const auto hf = hf_split_pieces(cases);
  for (size_t i = 0; i < ours.size(); ++i) EXPECT_EQ(ours[i], hf[i]) << cases[i].dump();
}

// \w, \W, \b and \B mean what HF's engine (Oniguruma) means: Alphabetic (circled letters too),
// marks, decimal digits and connectors, without the joiners U+200C/D that ICU's \w adds, and
// outside a class Latin-1's superscripts and fractions too; [\b] is a backspace.
TEST(HfSemantics, WordClassesAndBoundariesAreOnigurumas) {
  POLLEN_REQUIRE_PEERS();
  // In sets too: []\w] opens with a literal ']', and in [a-c-\W] the second '-' is a literal.
  const std::vector<std::string> patterns = {R"( ?\w+|\W)",        R"(\b)",        R"(\B)",
                                             R"([\w']+|[^\w\s]+)", R"([\b\w]+|.)", R"([]\w]+|.)",
                                             R"([a-c-\W]+|.)"};
  const std::vector<std::string> texts = {"s \u200d",
                                          "a\u200db c",
                                          "x\u00b2 \u00bd\u2167\u2460",
                                          "\u24b6b \u0663\u0664",
                                          "e\u0301 \u20dd",
                                          "snake_case",
                                          "\u00aa\u02b0 \u200cz",
                                          "9\u200b \u20ddv\b!",
                                          "a-b.c ] x\u00b2y 9z [q-r"};
  nlohmann::json cases = nlohmann::json::array();
  std::vector<std::vector<std::string>> ours;
  for (const std::string& pattern : patterns)
    for (const std::string& text : texts) {
      cases.push_back({{"pattern", pattern}, {"behavior", "isolated"}, {"text", text}});
      ours.push_back(split_pieces(pattern, SplitBehavior::kIsolated, text));
    }
  const auto hf = hf_split_pieces(cases);
  for (size_t i = 0; i < ours.size(); ++i) EXPECT_EQ(ours[i], hf[i]) << cases[i].dump();
}

// pollen's rule for invalid UTF-8 holds for Split with every behavior: each invalid byte is a
// piece of its own (never removed nor merged), and the valid text on either side is split as HF
// splits it alone.
TEST(HfSemantics, SplitKeepsInvalidBytesAsPiecesOfTheirOwn) {
  POLLEN_REQUIRE_PEERS();
  const std::vector<std::string> runs = {"ab", "cd  e", " f", "x"};
  const std::string text =
      "ab\xFF"
      "cd  e\x80\x80 f\xC3"
      "x";
  const std::vector<std::string> invalid_after = {"\xFF", "\x80\x80", "\xC3", ""};
  for (const std::string& pattern : {std::string(" "), std::string(R"(\s+|x)")}) {
    nlohmann::json cases = nlohmann::json::array();
    for (const auto& [behavior, name] : kSplitBehaviors)
      for (const std::string& run : runs)
        cases.push_back({{"pattern", pattern}, {"behavior", name}, {"text", run}});
    const auto hf = hf_split_pieces(cases);
    size_t next = 0;
    for (const auto& [behavior, name] : kSplitBehaviors) {
      std::vector<std::string> expected;
      for (size_t r = 0; r < runs.size(); ++r) {
        const auto& pieces = hf[next++];
        expected.insert(expected.end(), pieces.begin(), pieces.end());
        for (char byte : invalid_after[r]) expected.emplace_back(1, byte);
      }
      EXPECT_EQ(split_pieces(pattern, behavior, text), expected) << pattern << " " << name;
    }
  }
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

// Exports the tokenizer.json as a tiktoken rank file and expects either a refusal that names
// `reasons`, or a rank file that tiktoken reads to HF's ids for `texts`.
void expect_rank_file_encodes_as_hf(const nlohmann::json& tokenizer_json,
                                    const std::vector<std::string>& texts,
                                    const std::vector<std::string>& reasons) {
  const fs::path dir = testing::temp_dir("rank_export");
  const fs::path json_file = dir / "tokenizer.json", rank_file = dir / "ranks.tiktoken";
  write_file_atomic(json_file, tokenizer_json.dump());
  const Tokenizer tok = load_hf_json(json_file);
  std::string ranks;
  try {
    ranks = tiktoken_text(tok);
  } catch (const Error& e) {
    for (const std::string& reason : reasons)
      EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
    fs::remove_all(dir);
    return;
  }
  write_file_atomic(rank_file, ranks);
  const auto hf = testing::run_reference(
      {{"mode", "hf"}, {"tokenizer_json", json_file.string()}, {"texts", texts}});
  const auto tiktoken = testing::run_reference({{"mode", "tiktoken"},
                                                {"rank_file", rank_file.string()},
                                                {"pat_str", tok.pattern()},
                                                {"texts", texts}});
  EXPECT_EQ(tiktoken["ids"], hf["ids"]) << "the rank file encodes otherwise; expected a refusal";
  fs::remove_all(dir);
}

nlohmann::json byte_level_bpe_json(const nlohmann::json& tokens, const nlohmann::json& merges,
                                   bool ignore_merges) {
  nlohmann::json vocab = byte_level_vocab();
  vocab.update(tokens);
  const nlohmann::json byte_level = {{"type", "ByteLevel"},
                                     {"add_prefix_space", false},
                                     {"trim_offsets", true},
                                     {"use_regex", true}};
  return {
      {"pre_tokenizer", byte_level},
      {"decoder", byte_level},
      {"model",
       {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}, {"ignore_merges", ignore_merges}}}};
}

// A rank is the merge priority in a rank file: merges whose tokens' ids run against the merge
// order (b c before a b, with "ab" the lower id) would merge "abc" otherwise.
TEST(HfSemantics, RankFileExportRefusesIdsAgainstTheMergeOrder) {
  POLLEN_REQUIRE_PEERS();
  expect_rank_file_encodes_as_hf(
      byte_level_bpe_json({{"ab", 256}, {"bc", 257}}, {"b c", "a b"}, false), {"abc", "xabcab"},
      {"model.merges[1]", "'a' 'b'", "'ab' (id 256)", "'bc' (id 257)"});
}

// A token its merge does not make the way tiktoken would ("abc" from "a bc", where the lower
// ranks reach "ab" + "c"): HF without ignore_merges never makes it from "abc", tiktoken takes a
// piece that is a token whole; with ignore_merges, tiktoken still makes it inside "xabc".
TEST(HfSemantics, RankFileExportRefusesTokensTiktokenWouldMakeOtherwise) {
  POLLEN_REQUIRE_PEERS();
  const nlohmann::json tokens = {{"ab", 256}, {"bc", 257}, {"abc", 258}};
  const nlohmann::json merges = {"a b", "b c", "a bc"};
  expect_rank_file_encodes_as_hf(byte_level_bpe_json(tokens, merges, false), {"abc", "xabc"},
                                 {"ignore_merges", "'abc' (id 258)", "[256, 99]"});
  expect_rank_file_encodes_as_hf(byte_level_bpe_json(tokens, merges, true), {"abc", "xabc"},
                                 {"'abc' (id 258)", "'a' 'bc'", "'ab' 'c'"});
  // A multi-byte token that no merge makes, which tiktoken makes from "ab" + "c".
  expect_rank_file_encodes_as_hf(byte_level_bpe_json({{"ab", 256}, {"abc", 257}}, {"a b"}, true),
                                 {"abc", "xabc"}, {"'abc' (id 257)", "no merge", "'ab' 'c'"});
}

// A Split on a literal string is written back as {"String": ...}, the String it was.
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
  // Its fingerprint is the one it had when literals were held as \Q...\E.
  nlohmann::json old = j;
  old["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Regex", "\\Qab\\E"}};
  EXPECT_EQ(hf_from_json_text(old.dump(), "old.json").fingerprint(), tok.fingerprint());
  // A Regex that reads as a literal stays a Regex, with the fingerprint of its own text.
  nlohmann::json regex = j;
  regex["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Regex", "ab"}};
  const Tokenizer as_regex = hf_from_json_text(regex.dump(), "regex.json");
  EXPECT_NE(as_regex.fingerprint(), tok.fingerprint());
  EXPECT_EQ(
      nlohmann::json::parse(hf_json_text(as_regex))["pre_tokenizer"]["pretokenizers"][0]["pattern"],
      (nlohmann::json{{"Regex", "ab"}}));
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
               {"t.json", "added_tokens[1].id", "expected 2 for '<y>'", "got 1"});
  // HF numbers added tokens itself: past the vocabulary without a gap, or as model.vocab does.
  expect_error(load(R"([{"id": 5, "content": "<x>"}])"),
               {"added_tokens[0].id", "expected 1 for '<x>'", "next id past the vocabulary"});
  expect_error(load(R"([{"id": 3, "content": "a"}])"),
               {"added_tokens[0].id", "expected 0 for 'a'", "its id in model.vocab"});
  expect_error(load(R"([{"id": 1, "content": "<x>"}, {"id": 2, "content": "<x>"}])"),
               {"'<x>' is given twice"});
}

// HF matches the added tokens that are not normalized first and the normalized ones between
// them ("x<tool>call" is <tool> then "call" when <tool> is not normalized and <tool>call is):
// pollen's one pass would give <tool>call, so a pair of the two kinds that can overlap is refused.
TEST(HfSemantics, AddedTokensOfBothKindsThatOverlapAreRefused) {
  const auto file = [](const std::string& a, const std::string& b) {
    return R"({"added_tokens": [{"id": 1, "content": ")" + a +
           R"(", "normalized": false}, {"id": 2, "content": ")" + b +
           R"(", "normalized": true}], "model": {"vocab": {"a": 0}, "merges": []}})";
  };
  expect_error([&] { hf_from_json_text(file("<tool>", "<tool>call"), "t.json"); },
               {"t.json", "added_tokens[1].normalized", "'<tool>call' (normalized) can overlap",
                "'<tool>' (added_tokens[0], not normalized)"});
  expect_error([&] { hf_from_json_text(file(">cd", "ab>"), "t.json"); }, {"can overlap"});
  // Tokens that cannot overlap load, and so do pairs where the one not normalized holds the
  // normalized one or begins before it: one pass matches them as HF does.
  const Tokenizer apart = hf_from_json_text(file("<|im_start|>", "<|im_end|>"), "t.json");
  EXPECT_EQ(apart.encode("<|im_start|><|im_end|>", {SpecialPolicy::allow_all(), false}),
            (std::vector<uint32_t>{1, 2}));
  const Tokenizer inside = hf_from_json_text(file("<tool>", "tool"), "t.json");
  EXPECT_EQ(inside.encode("<tool>tool", {SpecialPolicy::allow_all(), false}),
            (std::vector<uint32_t>{1, 2}));
  EXPECT_NO_THROW(hf_from_json_text(file("ab>", ">cd"), "t.json"));
}

// HF matches an added token with "normalized": true on the normalized text, against its content
// normalized ("\uFB01le" is "file" under NFKC, so HF gives "file" its id): matched on the text
// as written, pollen would give other ids, so such a token is refused under a normalizer. Without
// a normalizer (GPT-2's <|endoftext|> is normalized) the two agree and it loads.
TEST(HfSemantics, NormalizedAddedTokensUnderANormalizerAreRefused) {
  const std::string added =
      R"("added_tokens": [{"id": 1, "content": "<x>", "normalized": false},
                          {"id": 2, "content": "\uFB01le", "normalized": true}],
         "model": {"vocab": {"a": 0}, "merges": []})";
  expect_error(
      [&] { hf_from_json_text(R"({"normalizer": {"type": "NFKC"}, )" + added + "}", "t.json"); },
      {"t.json", "added_tokens[1].normalized", "expected false", "normalizer"});
  const Tokenizer plain = hf_from_json_text("{" + added + "}", "t.json");
  EXPECT_EQ(plain.encode("\uFB01le"), (std::vector<uint32_t>{2}));
  const std::string not_normalized =
      R"("normalizer": {"type": "NFKC"},
         "added_tokens": [{"id": 1, "content": "<x>", "normalized": false}],
         "model": {"vocab": {"a": 0}, "merges": []})";
  EXPECT_EQ(hf_from_json_text("{" + not_normalized + "}", "t.json").encode("<x>"),
            (std::vector<uint32_t>{1}));
}

TEST(Robustness, MalformedTokenizerJsonNamesFileAndKey) {
  auto load = [](const std::string& text) { return [text] { hf_from_json_text(text, "t.json"); }; };
  expect_error(load("{"), {"t.json", "not valid JSON"});
  expect_error(load(R"({"model": {"type": "WordPiece", "vocab": {}}})"), {"t.json", "model.type"});
  expect_error(load(R"({"model": {"vocab": {"a": "x"}, "merges": []}})"),
               {"t.json", "model.vocab.a", "expected a token id"});
  // Ids far past the file's token count would allocate a table of empty entries (past 2^32
  // they used to wrap).
  expect_error(load(R"({"model": {"vocab": {"a": 4294967000}, "merges": []}})"),
               {"t.json", "model.vocab.a", "below 65537 (the file's 1 tokens plus 65536)"});
  expect_error(load(R"({"model": {"vocab": {"a": 4294967297}, "merges": []}})"),
               {"t.json", "model.vocab.a", "below 65537"});
  expect_error(load(R"({"added_tokens": [{"id": 70000, "content": "<x>"}],
                        "model": {"vocab": {"a": 0}, "merges": []}})"),
               {"t.json", "added_tokens[0].id", "below 65538"});
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
