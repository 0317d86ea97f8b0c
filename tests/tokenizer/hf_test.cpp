// pollen's tokenizer.json support against HF tokenizers: GPT-2's tokenizer.json, and files of
// each Llama-family flavour made by HF's own trainer, give every id equal; pollen's saved files
// load in HF with the same ids.
#include <gtest/gtest.h>

#include "base/error.h"
#include "base/files.h"
#include "support/errors.h"
#include "tokenizer/hf_format.h"
#include "tokenizer/peers.h"
#include "tokenizer/tiktoken_format.h"

namespace pollen::tokenizer {
namespace {

namespace fs = std::filesystem;
using testing::varied_corpus;

// Every text of the corpus encodes to HF's ids (with the BOS/EOS template when asked), and
// HF's ids decode to HF's text.
void expect_same_ids_as_hf(const Tokenizer& tok, const fs::path& json_file, bool add_bos_eos) {
  std::vector<std::string> corpus = varied_corpus();
  corpus.push_back(
      "Characters the trainers never saw: \u2603 \U0001D518\U0001D52B \u0416\u03A9 \u00FE");
  auto result = testing::run_reference({{"mode", "hf"},
                                        {"tokenizer_json", json_file.string()},
                                        {"add_special_tokens", add_bos_eos},
                                        {"texts", corpus}});
  EncodeOptions options{SpecialPolicy::allow_all(), add_bos_eos};
  for (size_t i = 0; i < corpus.size(); ++i) {
    auto expected = result["ids"][i].get<std::vector<uint32_t>>();
    ASSERT_EQ(tok.encode(corpus[i], options), expected)
        << json_file << " text " << i << ": " << corpus[i];
    ASSERT_EQ(tok.decode(expected), result["decoded"][i].get<std::string>()) << corpus[i];
  }
}

fs::path write_corpus(const fs::path& dir) {
  fs::path file = dir / "corpus.txt";
  write_file_atomic(file, testing::corpus_text());
  return file;
}

TEST(HfJson, Gpt2FromEncoderJsonAndVocabBpe) {
  POLLEN_REQUIRE_SHARED_TOKENIZERS(shared);
  POLLEN_REQUIRE_PEERS();
  fs::path dir = testing::temp_dir("gpt2_json");
  fs::path file = dir / "tokenizer.json";
  testing::run_reference({{"mode", "gpt2_json"},
                          {"vocab", (shared / "gpt2-encoder.json").string()},
                          {"merges", (shared / "gpt2-vocab.bpe").string()},
                          {"output", file.string()}});
  Tokenizer tok = load_hf_json(file);
  EXPECT_EQ(tok.vocab_size(), 50257u);
  expect_same_ids_as_hf(tok, file, false);
  // pollen's own save of it loads in HF with the same ids.
  fs::path saved = dir / "saved.json";
  save_hf_json(tok, saved);
  Tokenizer again = load_hf_json(saved);
  EXPECT_EQ(again.fingerprint(), tok.fingerprint());
  expect_same_ids_as_hf(again, saved, false);
  fs::remove_all(dir);
}

struct Flavour {
  std::string name;
  nlohmann::json request;
};

class HfTrained : public ::testing::TestWithParam<Flavour> {};

TEST_P(HfTrained, EveryIdEqual) {
  POLLEN_REQUIRE_PEERS();
  fs::path dir = testing::temp_dir("hf_" + GetParam().name);
  fs::path file = dir / "tokenizer.json";
  nlohmann::json request = GetParam().request;
  request["mode"] = "train_hf";
  request["files"] = {write_corpus(dir).string()};
  request["output"] = file.string();
  testing::run_reference(request);
  Tokenizer tok = load_hf_json(file);
  expect_same_ids_as_hf(tok, file, false);
  expect_same_ids_as_hf(tok, file, true);
  fs::path saved = dir / "saved.json";
  save_hf_json(tok, saved);
  Tokenizer again = load_hf_json(saved);
  EXPECT_EQ(again.fingerprint(), tok.fingerprint());
  expect_same_ids_as_hf(again, saved, true);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Flavours, HfTrained,
    ::testing::Values(Flavour{"llama3",
                              {{"kind", "llama3"},
                               {"pattern", known_pattern_regex(KnownPattern::kCl100k)},
                               {"vocab_size", 700},
                               {"special_tokens", {"<|begin_of_text|>", "<|end_of_text|>"}}}},
                      Flavour{"qwen2",
                              {{"kind", "qwen2"},
                               {"pattern", known_pattern_regex(KnownPattern::kQwen2)},
                               {"vocab_size", 700},
                               {"special_tokens", {"<|endoftext|>"}}}},
                      Flavour{"digits_regex",
                              {{"kind", "llama3"},
                               {"digits", true},
                               {"pattern", R"( ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+)"},
                               {"vocab_size", 600}}},
                      Flavour{"gpt2_bytelevel", {{"kind", "gpt2"}, {"vocab_size", 600}}},
                      Flavour{"sentencepiece", {{"kind", "sentencepiece"}, {"vocab_size", 900}}}),
    [](const auto& info) { return info.param.name; });

// A SentencePiece-style tokenizer.json with a Metaspace pre-tokenizer and decoder: `decoder`
// is the decoder's JSON.
nlohmann::json metaspace_json(const nlohmann::json& decoder) {
  const nlohmann::json vocab = {
      {"a", 0},       {"b", 1},        {"\u2581", 2},        {"\u2581a", 3},
      {"\u2581b", 4}, {"a\u2581b", 5}, {"\u2581\u2581a", 6}, {"<s>", 7}};
  nlohmann::json pre = decoder;
  pre["split"] = true;
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens",
           {{{"id", 7},
             {"content", "<s>"},
             {"single_word", false},
             {"lstrip", false},
             {"rstrip", false},
             {"normalized", false},
             {"special", true}}}},
          {"normalizer", nullptr},
          {"pre_tokenizer", pre},
          {"post_processor", nullptr},
          {"decoder", decoder},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr},
            {"fuse_unk", false},
            {"byte_fallback", false},
            {"vocab", vocab},
            {"merges", nlohmann::json::array()}}}};
}

// The Metaspace decoder decodes as HF's for each prepend scheme (and the older add_prefix_space):
// first tokens with and without "▁", with "▁" inside, and "▁" in later tokens. Saved and loaded
// again, the tokenizer decodes the same.
TEST(HfJson, MetaspaceDecoderDecodesAsHf) {
  POLLEN_REQUIRE_PEERS();
  const std::vector<std::vector<uint32_t>> sequences = {
      {3, 4}, {0, 4}, {5, 3}, {6, 1}, {2, 3}, {7, 3}, {1, 5}, {2}, {0, 2, 2}, {4, 6, 5}};
  const nlohmann::json decoders[] = {
      {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "always"}},
      {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "first"}},
      {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "never"}},
      {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"add_prefix_space", true}}};
  fs::path dir = testing::temp_dir("metaspace_decoder");
  for (const nlohmann::json& decoder : decoders) {
    fs::path file = dir / "tokenizer.json";
    write_file_atomic(file, metaspace_json(decoder).dump());
    auto hf = testing::run_reference(
        {{"mode", "hf_decode"}, {"tokenizer_json", file.string()}, {"ids", sequences}});
    Tokenizer tok = load_hf_json(file);
    Tokenizer saved = hf_from_json_text(hf_json_text(tok), "saved.json");
    for (size_t i = 0; i < sequences.size(); ++i) {
      const std::string expected = hf["texts"][i].get<std::string>();
      EXPECT_EQ(tok.decode(sequences[i]), expected) << decoder.dump() << " sequence " << i;
      EXPECT_EQ(saved.decode(sequences[i]), expected) << decoder.dump() << " sequence " << i;
    }
  }
  fs::remove_all(dir);
}

// ByteFallback decodes <0xXY> (two hex digits) as that byte and leaves any other <0x..> token
// as its text, as HF's does.
TEST(HfJson, ByteFallbackDecodesOnlyHexBytesAsHf) {
  POLLEN_REQUIRE_PEERS();
  const nlohmann::json metaspace = {
      {"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "always"}};
  nlohmann::json j = metaspace_json(metaspace);
  j["decoder"] = {{"type", "Sequence"},
                  {"decoders", {metaspace, {{"type", "ByteFallback"}}, {{"type", "Fuse"}}}}};
  j["model"]["byte_fallback"] = true;
  j["model"]["vocab"] = {{"a", 0},      {"b", 1},      {"\u2581", 2}, {"\u2581a", 3},
                         {"<0x41>", 4}, {"<0xZZ>", 5}, {"<0x4G>", 6}, {"<s>", 7},
                         {"<0xE2>", 8}, {"<0x82>", 9}, {"<0xac>", 10}};
  const std::vector<std::vector<uint32_t>> sequences = {{4}, {5}, {6}, {3, 5, 4}, {8, 9, 10, 3}};
  fs::path dir = testing::temp_dir("byte_fallback");
  const fs::path file = dir / "tokenizer.json";
  write_file_atomic(file, j.dump());
  auto hf = testing::run_reference(
      {{"mode", "hf_decode"}, {"tokenizer_json", file.string()}, {"ids", sequences}});
  Tokenizer tok = load_hf_json(file);
  for (size_t i = 0; i < sequences.size(); ++i)
    EXPECT_EQ(tok.decode(sequences[i]), hf["texts"][i].get<std::string>()) << "sequence " << i;
  EXPECT_EQ(tok.decode(std::vector<uint32_t>{5, 6}), "<0xZZ><0x4G>");
  // ByteFallback without a space marker decodes the bytes too, as HF's.
  j["decoder"] = {{"type", "Sequence"},
                  {"decoders", {{{"type", "ByteFallback"}}, {{"type", "Fuse"}}}}};
  write_file_atomic(file, j.dump());
  hf = testing::run_reference(
      {{"mode", "hf_decode"}, {"tokenizer_json", file.string()}, {"ids", sequences}});
  tok = load_hf_json(file);
  for (size_t i = 0; i < sequences.size(); ++i)
    EXPECT_EQ(tok.decode(sequences[i]), hf["texts"][i].get<std::string>()) << "sequence " << i;
  EXPECT_EQ(tok.decode(std::vector<uint32_t>{8, 9, 10}), "\u20ac");
  fs::remove_all(dir);
}

// Strip before Fuse strips every token in HF; pollen strips the text's start, so it is refused.
// truncation and padding, which pollen does not apply, are named in a warning.
TEST(HfJson, StripBeforeFuseIsRefusedAndTruncationIsNamed) {
  const nlohmann::json metaspace = {
      {"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "always"}};
  nlohmann::json j = metaspace_json(metaspace);
  const nlohmann::json strip = {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}};
  j["decoder"] = {{"type", "Sequence"}, {"decoders", {strip, {{"type", "Fuse"}}}}};
  const std::string e = pollen::testing::error_of([&] { hf_from_json_text(j.dump(), "t.json"); });
  EXPECT_NE(e.find("decoder.decoders[0]"), std::string::npos) << e;
  EXPECT_NE(e.find("only Strip after Fuse"), std::string::npos) << e;
  j["decoder"] = {{"type", "Sequence"}, {"decoders", {{{"type", "Fuse"}}, strip}}};
  j["truncation"] = {{"max_length", 8}};
  ::testing::internal::CaptureStderr();
  hf_from_json_text(j.dump(), "t.json");
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("t.json: 'truncation' is set"), std::string::npos) << log;
}

// Another JSON file (GPT-2's encoder.json: a vocabulary alone, whose "padding" and "model" are
// tokens) is refused as what it is, with no warning taken from its entries.
TEST(HfJson, AJsonFileThatIsNoTokenizerIsNamedAsSuch) {
  const nlohmann::json vocabulary = {{"padding", 39231}, {"model", 19849}, {"the", 1169}};
  ::testing::internal::CaptureStderr();
  const std::string e =
      pollen::testing::error_of([&] { hf_from_json_text(vocabulary.dump(), "encoder.json"); });
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  EXPECT_NE(e.find("encoder.json: not an HF tokenizer.json: it has no \"model\" object"),
            std::string::npos)
      << e;
}

// Generated text is decoded after its prompt: the text of the ids after the first k, decoded as a
// continuation, is what they add to HF's decoding of the whole (the first token's marker and
// Llama-2's Strip belong to the start of the whole text), for Metaspace and Llama-2's decoder.
// As generated text, special tokens (<s>) are left out, as HF's skip_special_tokens leaves them,
// and added tokens that are not special (<x>) kept.
TEST(HfJson, AContinuationDecodesToWhatItAddsToTheWholeText) {
  POLLEN_REQUIRE_PEERS();
  const nlohmann::json metaspace = {
      {"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "first"}};
  const nlohmann::json llama2 = {
      {"type", "Sequence"},
      {"decoders",
       {{{"type", "Replace"}, {"pattern", {{"String", "\u2581"}}}, {"content", " "}},
        {{"type", "ByteFallback"}},
        {{"type", "Fuse"}},
        {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}};
  const std::vector<std::vector<uint32_t>> sequences = {
      {3, 4}, {0, 4}, {5, 3}, {1, 6, 5}, {7, 3, 4}, {0, 2, 2, 3}, {4, 6, 5}, {3, 7, 8, 4}};
  fs::path dir = testing::temp_dir("continuation_decode");
  for (const nlohmann::json& decoder : {metaspace, llama2}) {
    nlohmann::json j = metaspace_json(metaspace);
    j["decoder"] = decoder;
    j["model"]["byte_fallback"] = true;
    j["added_tokens"].push_back({{"id", 8},
                                 {"content", "<x>"},
                                 {"single_word", false},
                                 {"lstrip", false},
                                 {"rstrip", false},
                                 {"normalized", false},
                                 {"special", false}});
    const fs::path file = dir / "tokenizer.json";
    write_file_atomic(file, j.dump());
    auto hf = testing::run_reference(
        {{"mode", "hf_decode"}, {"tokenizer_json", file.string()}, {"ids", sequences}});
    auto hf_skipped = testing::run_reference({{"mode", "hf_decode"},
                                              {"tokenizer_json", file.string()},
                                              {"ids", sequences},
                                              {"skip_special", true}});
    const Tokenizer tok = load_hf_json(file);
    for (size_t i = 0; i < sequences.size(); ++i) {
      const std::string whole = hf["texts"][i].get<std::string>();
      ASSERT_EQ(tok.decode(sequences[i]), whole) << decoder.dump() << " sequence " << i;
      for (size_t k = 1; k < sequences[i].size(); ++k) {
        const std::span<const uint32_t> ids(sequences[i]);
        const std::string prompt = tok.decode(ids.first(k));
        EXPECT_EQ(prompt + tok.decode_continuation(ids.subspan(k)), whole)
            << decoder.dump() << " sequence " << i << " after " << k;
        if (std::find(ids.begin(), ids.begin() + k, 7u) == ids.begin() + k)
          EXPECT_EQ(prompt + tok.generated_text(ids.subspan(k)),
                    hf_skipped["texts"][i].get<std::string>())
              << decoder.dump() << " sequence " << i << " after " << k;
      }
    }
  }
  fs::remove_all(dir);
}

TEST(HfJson, TiktokenSavedAsJsonKeepsIdsAndFingerprint) {
  POLLEN_REQUIRE_SHARED_TOKENIZERS(shared);
  POLLEN_REQUIRE_PEERS();
  Tokenizer ranks = load_tiktoken(shared / "cl100k_base.tiktoken",
                                  std::string(known_pattern_regex(KnownPattern::kCl100k)),
                                  known_special_tokens(KnownPattern::kCl100k));
  fs::path dir = testing::temp_dir("cl100k_json");
  fs::path file = dir / "tokenizer.json";
  save_hf_json(ranks, file);
  Tokenizer json = load_hf_json(file);
  EXPECT_EQ(json.fingerprint(), ranks.fingerprint());
  expect_same_ids_as_hf(json, file, false);
  for (const std::string& text : varied_corpus())
    ASSERT_EQ(json.encode(text, {SpecialPolicy::allow_all()}),
              ranks.encode(text, {SpecialPolicy::allow_all()}));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace pollen::tokenizer
