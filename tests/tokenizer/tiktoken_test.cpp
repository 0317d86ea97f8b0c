// pollen's tiktoken-format tokenizers against PyPI tiktoken: every id equal on a varied corpus,
// for the official gpt2, cl100k_base and o200k_base encodings.
#include <gtest/gtest.h>
#include <unistd.h>

#include "base/error.h"
#include "base/files.h"
#include "support/errors.h"
#include "support/process.h"
#include "support/tiny_lm.h"
#include "tokenizer/open.h"
#include "tokenizer/peers.h"
#include "tokenizer/tiktoken_format.h"

namespace pollen::tokenizer {
namespace {

using testing::varied_corpus;

Tokenizer load_official(const std::filesystem::path& dir, KnownPattern pattern) {
  std::string name(known_pattern_name(pattern));
  return load_tiktoken(dir / (name + ".tiktoken"), std::string(known_pattern_regex(pattern)),
                       known_special_tokens(pattern));
}

TEST(Tiktoken, PatternsAndSpecialsMatchEncodingsJson) {
  POLLEN_REQUIRE_SHARED_TOKENIZERS(dir);
  auto encodings = nlohmann::json::parse(read_file(dir / "encodings.json"));
  for (auto pattern : {KnownPattern::kGpt2, KnownPattern::kCl100k, KnownPattern::kO200k}) {
    const auto& e = encodings.at(std::string(known_pattern_name(pattern)));
    EXPECT_EQ(e.at("pat_str").get<std::string>(), known_pattern_regex(pattern));
    std::map<std::string, uint32_t> specials;
    for (const AddedToken& t : known_special_tokens(pattern)) specials[t.content] = t.id;
    auto expected = e.at("special_tokens").get<std::map<std::string, uint32_t>>();
    EXPECT_EQ(expected, specials);
  }
}

class TiktokenParity : public ::testing::TestWithParam<KnownPattern> {};

TEST_P(TiktokenParity, EveryIdEqualOnVariedCorpus) {
  POLLEN_REQUIRE_SHARED_TOKENIZERS(dir);
  POLLEN_REQUIRE_PEERS();
  KnownPattern pattern = GetParam();
  std::string name(known_pattern_name(pattern));
  Tokenizer tok = load_official(dir, pattern);
  std::vector<std::string> corpus = varied_corpus();
  nlohmann::json specials = nlohmann::json::object();
  for (const AddedToken& t : known_special_tokens(pattern)) specials[t.content] = t.id;
  auto result = testing::run_reference({{"mode", "tiktoken"},
                                        {"rank_file", (dir / (name + ".tiktoken")).string()},
                                        {"pat_str", known_pattern_regex(pattern)},
                                        {"special_tokens", specials},
                                        {"allow_special", true},
                                        {"texts", corpus}});
  EncodeOptions all{SpecialPolicy::allow_all()};
  for (size_t i = 0; i < corpus.size(); ++i) {
    auto expected = result["ids"][i].get<std::vector<uint32_t>>();
    ASSERT_EQ(tok.encode(corpus[i], all), expected) << name << " text " << i << ": " << corpus[i];
    ASSERT_EQ(tok.decode(expected), corpus[i]);
  }
}

INSTANTIATE_TEST_SUITE_P(Official, TiktokenParity,
                         ::testing::Values(KnownPattern::kGpt2, KnownPattern::kCl100k,
                                           KnownPattern::kO200k),
                         [](const auto& info) {
                           std::string name(known_pattern_name(info.param));
                           return name.substr(0, name.find('_'));
                         });

TEST(Tiktoken, SpecialTokensAllowedRefusedOrText) {
  POLLEN_REQUIRE_SHARED_TOKENIZERS(dir);
  Tokenizer tok = load_official(dir, KnownPattern::kCl100k);
  std::string text = "a<|endoftext|>b<|fim_prefix|>";
  EXPECT_THROW(tok.encode(text), pollen::Error);
  auto all = tok.encode(text, {SpecialPolicy::allow_all()});
  EXPECT_EQ(std::count(all.begin(), all.end(), 100257u), 1);
  EXPECT_EQ(std::count(all.begin(), all.end(), 100258u), 1);
  SpecialPolicy only_eot{SpecialPolicy::Others::kText, {"<|endoftext|>"}};
  auto some = tok.encode(text, {only_eot});
  EXPECT_EQ(std::count(some.begin(), some.end(), 100257u), 1);
  EXPECT_EQ(std::count(some.begin(), some.end(), 100258u), 0);
  SpecialPolicy refuse_others{SpecialPolicy::Others::kRefuse, {"<|endoftext|>"}};
  EXPECT_THROW(tok.encode(text, {refuse_others}), pollen::Error);
  auto plain = tok.encode(text, {SpecialPolicy::as_text()});
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 100257u), 0);
  EXPECT_EQ(tok.decode(plain), text);
}

TEST(Tiktoken, SaveAndLoadRoundTrips) {
  POLLEN_REQUIRE_SHARED_TOKENIZERS(dir);
  Tokenizer tok = load_official(dir, KnownPattern::kGpt2);
  std::string text = tiktoken_text(tok);
  EXPECT_EQ(text, read_file(dir / "gpt2.tiktoken"));
}

// convert prints the fingerprint of the file it wrote, opened as it will be: the source's when the
// two formats state the tokenizer alike, and otherwise the written one's, saying so (a
// tokenizer.json merging by rank where a rank file looks whole pieces up first).
TEST(Tiktoken, ConvertPrintsTheWrittenFilesFingerprint) {
  POLLEN_REQUIRE_SHARED_TOKENIZERS(dir);
  const std::string official = load_official(dir, KnownPattern::kGpt2).fingerprint();
  const auto out = pollen::testing::unique_temp_dir("convert");
  int status = 0;
  std::string said = pollen::testing::run_capture(
      cat(POLLEN_BINARY, " tokenizer convert --tokenizer ", (dir / "gpt2.tiktoken").string(),
          " --pattern gpt2 --add-special '<|endoftext|>=50256' --output ",
          (out / "g.json").string(), " 2>&1"),
      &status);
  ASSERT_EQ(status, 0) << said;
  EXPECT_NE(said.find("(fingerprint " + official + ")"), std::string::npos) << said;
  EXPECT_EQ(said.find("reads back"), std::string::npos) << said;
  auto json = nlohmann::json::parse(read_file(out / "g.json"));
  json["model"]["ignore_merges"] = false;
  write_file_atomic(out / "ranked.json", json.dump());
  const std::string ranked = open_tokenizer(out / "ranked.json", "").fingerprint();
  ASSERT_NE(ranked, official);
  said = pollen::testing::run_capture(
      cat(POLLEN_BINARY, " tokenizer convert --tokenizer ", (out / "ranked.json").string(),
          " --output ", (out / "g.tiktoken").string(), " 2>&1"),
      &status);
  ASSERT_EQ(status, 0) << said;
  EXPECT_NE(said.find("reads back with fingerprint " + official + ", not the source's " + ranked),
            std::string::npos)
      << said;
  EXPECT_NE(said.find("wrote " + (out / "g.tiktoken").string() + " (fingerprint " + official),
            std::string::npos)
      << said;
  EXPECT_EQ(read_file(out / "g.tiktoken"), read_file(dir / "gpt2.tiktoken"));
  // A special token far past the ranks opens with the rank file, but would make a tokenizer.json
  // no reader takes: writing one is refused, naming the token.
  const Tokenizer far = open_tokenizer(dir / "gpt2.tiktoken", "gpt2", {{200000, "<|x|>"}});
  const std::string refused =
      pollen::testing::error_of([&] { save_tokenizer(far, out / "far.json"); });
  EXPECT_NE(refused.find("far.json': added token '<|x|>' has id 200000, and a tokenizer.json's "
                         "ids are below 115794"),
            std::string::npos)
      << refused;
  EXPECT_FALSE(std::filesystem::exists(out / "far.json"));
  std::filesystem::remove_all(out);
}

// A pattern name brings its encoding's special tokens with that encoding's own rank file, whose
// ranks they follow, and not with another file made with the same pattern.
TEST(Tiktoken, APatternNameBringsItsSpecialTokensOnlyWithItsOwnRankFile) {
  POLLEN_REQUIRE_SHARED_TOKENIZERS(dir);
  const Tokenizer official = open_tokenizer(dir / "cl100k_base.tiktoken", "cl100k_base");
  EXPECT_EQ(official.vocab_size(), 100277u);
  EXPECT_EQ(official.encode("<|endoftext|>", {SpecialPolicy::allow_all(), false}),
            std::vector<uint32_t>{100257});
  // The first 300 ranks of cl100k: a rank file of another size.
  const std::string text = read_file(dir / "cl100k_base.tiktoken");
  size_t end = 0;
  for (int i = 0; i < 300; ++i) end = text.find('\n', end) + 1;
  const auto small = std::filesystem::temp_directory_path() / "pollen_small_cl100k.tiktoken";
  write_file_atomic(small, text.substr(0, end));
  const Tokenizer mine = open_tokenizer(small, "cl100k_base");
  EXPECT_EQ(mine.vocab_size(), 300u);
  EXPECT_TRUE(mine.added_tokens().empty());
  const Tokenizer with_eot = open_tokenizer(small, "cl100k_base", {{300, "<|endoftext|>"}});
  EXPECT_EQ(with_eot.encode("<|endoftext|>", {SpecialPolicy::allow_all(), false}),
            std::vector<uint32_t>{300});
  std::filesystem::remove(small);
  // The official tokens given again by hand, as `convert` names them, are taken once.
  std::vector<AddedToken> again = known_special_tokens(KnownPattern::kCl100k);
  EXPECT_EQ(open_tokenizer(dir / "cl100k_base.tiktoken", "cl100k_base", again).fingerprint(),
            official.fingerprint());
  // A tokenizer.json takes no pattern.
  const std::string e = pollen::testing::error_of([&] { open_tokenizer("x.json", "cl100k_base"); });
  EXPECT_NE(e.find("a pattern is for rank files only"), std::string::npos) << e;
}

// A rank file of Qwen's size (here the first 151643 ranks of o200k) opened with the qwen2 pattern
// gets the special tokens Qwen's and Qwen2's tokenizers share.
TEST(Tiktoken, Qwen2BringsItsChatTokensWithARankFileOfItsSize) {
  POLLEN_REQUIRE_SHARED_TOKENIZERS(dir);
  const std::string text = read_file(dir / "o200k_base.tiktoken");
  size_t end = 0;
  for (int i = 0; i < 151643; ++i) end = text.find('\n', end) + 1;
  const auto file = std::filesystem::temp_directory_path() /
                    ("pollen_qwen_size_" + std::to_string(::getpid()) + ".tiktoken");
  write_file_atomic(file, text.substr(0, end));
  const Tokenizer tok = open_tokenizer(file, "qwen2");
  EXPECT_EQ(tok.encode("<|im_start|>a<|im_end|><|endoftext|>", {SpecialPolicy::allow_all(), false}),
            (std::vector<uint32_t>{151644, tok.encode("a")[0], 151645, 151643}));
  std::filesystem::remove(file);
}

TEST(Base64, EncodesAndRejects) {
  EXPECT_EQ(base64_encode("ab"), "YWI=");
  EXPECT_EQ(*base64_decode("YWI="), "ab");
  EXPECT_EQ(*base64_decode("YWJj"), "abc");
  EXPECT_FALSE(base64_decode("YW=I"));
  EXPECT_FALSE(base64_decode("YWI"));
  EXPECT_FALSE(base64_decode("Y*I="));
}

}  // namespace
}  // namespace pollen::tokenizer
