// Training: deterministic whatever the thread count, the same merges as HF tokenizers' BPE
// trainer, and a trained tokenizer gives the same ids in pollen, HF tokenizers and tiktoken.
#include <gtest/gtest.h>

#include <cstring>
#include <map>

#include "base/error.h"
#include "base/files.h"
#include "base/hash.h"
#include "base/thread_pool.h"
#include "support/errors.h"
#include "support/process.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/documents.h"
#include "tokenizer/hf_format.h"
#include "tokenizer/peers.h"
#include "tokenizer/tiktoken_format.h"
#include "tokenizer/trainer.h"

namespace pollen::tokenizer {
namespace {

namespace fs = std::filesystem;

constexpr uint32_t kVocab = 1500;
const std::vector<std::string> kSpecials = {"<|endoftext|>", "<|pad|>"};

std::string cl100k() {
  return std::string(known_pattern_regex(KnownPattern::kCl100k));
}

Tokenizer train_on(const fs::path& corpus, int threads) {
  int before = num_threads();
  set_num_threads(threads);
  PieceCounts counts(cl100k());
  counts.add_file(corpus, false, "");
  Tokenizer tok = train_bpe(counts, {kVocab, kSpecials, cl100k()});
  set_num_threads(before);
  return tok;
}

class Trainer : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::temp_dir("trainer");
    corpus_ = dir_ / "corpus.txt";
    // The varied corpus plus pollen's own sources (code), about 200 KB.
    std::string text = testing::corpus_text();
    for (const auto& entry : fs::recursive_directory_iterator(fs::path(POLLEN_SOURCE_DIR) / "src"))
      if (entry.is_regular_file()) text += read_file(entry.path());
    write_file_atomic(corpus_, text);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_, corpus_;
};

TEST_F(Trainer, SameTokenizerAtOneAndTwoThreads) {
  Tokenizer one = train_on(corpus_, 1), two = train_on(corpus_, 2);
  EXPECT_EQ(one.vocab_size(), kVocab);
  EXPECT_EQ(hf_json_text(one), hf_json_text(two));
  EXPECT_EQ(one.fingerprint(), two.fingerprint());
}

TEST_F(Trainer, JsonlTextFieldCountsLikeDocuments) {
  std::string jsonl;
  for (const std::string& doc : testing::varied_corpus())
    jsonl += nlohmann::json({{"id", 1}, {"text", doc}}).dump() + "\n";
  write_file_atomic(dir_ / "docs.jsonl", jsonl);
  PieceCounts counts(cl100k());
  counts.add_file(dir_ / "docs.jsonl", true, "text");
  EXPECT_GT(counts.distinct(), 100u);
  write_file_atomic(dir_ / "bad.jsonl", "{\"text\": \"ok\"}\n{\"body\": 1}\n");
  try {
    counts.add_file(dir_ / "bad.jsonl", true, "text");
    FAIL() << "expected an error";
  } catch (const pollen::Error& e) {
    EXPECT_NE(std::string(e.what()).find("bad.jsonl:2"), std::string::npos) << e.what();
  }
}

// Federated training: silos send count files; the server's merged counts train exactly the
// tokenizer that the concatenated texts would.
TEST_F(Trainer, MergedCountFilesTrainTheSameTokenizerAsConcatenatedText) {
  const std::string text = read_file(corpus_);
  size_t cut = text.find('\n', text.size() / 3) + 1;
  write_file_atomic(dir_ / "a.txt", text.substr(0, cut));
  write_file_atomic(dir_ / "b.txt", text.substr(cut));
  for (const char* silo : {"a", "b"}) {
    PieceCounts c(cl100k());
    c.add_file(dir_ / (std::string(silo) + ".txt"), false, "");
    c.save(dir_ / (std::string(silo) + ".counts"));
  }
  PieceCounts merged(cl100k());
  merged.merge_file(dir_ / "a.counts");
  merged.merge_file(dir_ / "b.counts");
  PieceCounts pooled(cl100k());
  pooled.add_file(corpus_, false, "");
  EXPECT_EQ(merged.sorted(), pooled.sorted());
  EXPECT_EQ(merged.bytes_read(), pooled.bytes_read());
  Tokenizer fed = train_bpe(merged, {kVocab, kSpecials, cl100k()});
  Tokenizer central = train_on(corpus_, 2);
  EXPECT_EQ(hf_json_text(fed), hf_json_text(central));
  EXPECT_EQ(fed.fingerprint(), central.fingerprint());
  EXPECT_EQ(PieceCounts::file_pattern(dir_ / "a.counts"), cl100k());
}

// Rare pieces are dropped by their true count before the noise: noise first would let a piece
// counted once (a name) through whenever its draw was large, as it is for about a third of them at
// stddev 50.
TEST_F(Trainer, NoisyCountsAreReproducibleAndDropRarePieces) {
  PieceCounts exact(cl100k());
  exact.add_file(corpus_, false, "");
  std::map<std::string, uint64_t> true_count;
  for (const auto& [piece, n] : exact.sorted()) true_count[piece] = n;
  auto noisy = [&](double stddev, uint64_t seed) {
    PieceCounts c(cl100k());
    c.add_file(corpus_, false, "");
    c.perturb(stddev, seed, 3);
    return c.sorted();
  };
  const auto a = noisy(2.0, 7), b = noisy(2.0, 7), c = noisy(2.0, 8);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_LT(a.size(), exact.distinct());
  size_t rare = 0;
  for (const auto& [piece, n] : exact.sorted()) rare += n < 3;
  ASSERT_GT(rare, 10u);
  for (const auto& [piece, n] : noisy(50.0, 7)) {
    EXPECT_GE(n, 1u);
    EXPECT_GE(true_count[piece], 3u) << "'" << piece << "' left the silo";
  }
  // stddev 0 and min_count 1 change nothing.
  PieceCounts same(cl100k());
  same.add_file(corpus_, false, "");
  same.perturb(0, 1, 1);
  EXPECT_EQ(same.sorted(), exact.sorted());
}

TEST_F(Trainer, BadCountFilesAreRefusedNamingTheFile) {
  PieceCounts c(cl100k());
  c.add_file(corpus_, false, "");
  c.save(dir_ / "ok.counts");
  std::string bytes = read_file(dir_ / "ok.counts");
  auto expect_error = [&](const std::string& name, const std::string& content,
                          const std::string& pattern, const std::string& what) {
    write_file_atomic(dir_ / name, content);
    PieceCounts into(pattern);
    try {
      into.merge_file(dir_ / name);
      FAIL() << "expected an error for " << name;
    } catch (const pollen::Error& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  std::string flipped = bytes;
  flipped[flipped.size() / 2] ^= 1;
  expect_error("flipped.counts", flipped, cl100k(), "checksum");
  expect_error("short.counts", bytes.substr(0, bytes.size() - 7), cl100k(), "checksum");
  expect_error("text.counts", "not a count file at all, just some text here", cl100k(), "magic");
  expect_error("pattern.counts", bytes, "\\w+", "pattern");
  // A count past 2^48 (the first piece's, the checksum made again): merged counts could wrap.
  const std::string pattern = cl100k();
  const size_t count_at = bytes.find(pattern) + pattern.size() + 16;  // bytes read, pieces
  uint32_t length = 0;
  std::memcpy(&length, bytes.data() + count_at, 4);
  std::string huge = bytes.substr(0, bytes.size() - 32);
  const uint64_t count = (uint64_t{1} << 48) + 1;
  std::memcpy(huge.data() + count_at + 4 + length, &count, 8);
  Sha256 h;
  h.update(huge);
  const auto digest = h.digest();
  huge.append(reinterpret_cast<const char*>(digest.data()), digest.size());
  expect_error("huge.counts", huge, cl100k(), "over 2^48");
}

// Counts that each pass the readers' bound but whose pairs add past 2^63 (one long piece counted
// 2^48 times) would wrap the trainer's pair counts and merge the wrong pairs: refused.
TEST(TrainerCounts, PairCountsThatWouldOverflowAreRefused) {
  PieceCounts c(cl100k());
  c.add_piece(std::string(70000, 'a'), uint64_t{1} << 48);
  c.add_piece("hello", 5);
  try {
    train_bpe(c, {260, {}, cl100k()});
    FAIL() << "trained on counts whose pairs overflow";
  } catch (const pollen::Error& e) {
    EXPECT_NE(std::string(e.what()).find("too large"), std::string::npos) << e.what();
  }
}

// A negative or NaN noise stddev is an error, not exact counts sent as if they were noisy.
TEST(TrainerCounts, ANegativeOrNanNoiseIsRefusedByTheCountCommand) {
  const fs::path dir = testing::temp_dir("noise_cli");
  write_file_atomic(dir / "silo.txt", "some text of a silo\nand another line\n");
  for (const char* noise : {"-5", "nan"}) {
    const std::string cmd = std::string(POLLEN_BINARY) + " tokenizer count --input " +
                            (dir / "silo.txt").string() + " --output " +
                            (dir / "c.counts").string() + " --noise-stddev=" + noise +
                            " > /dev/null 2>&1";
    EXPECT_NE(std::system(cmd.c_str()), 0) << noise;
    EXPECT_FALSE(fs::exists(dir / "c.counts")) << noise;
  }
  fs::remove_all(dir);
}

// A special token spelled like a token of the vocabulary would give one text two ids, and
// tokenizer.json one key two values (it lost the byte 'a' before): refused, as are empty, repeated
// and one-byte specials, before any counting. A fresh spelling trains.
TEST(TrainerCounts, SpecialTokensSpelledLikeTokensAreRefused) {
  PieceCounts c(cl100k());
  c.add_piece("aaab", 50);
  c.add_piece(" the", 40);
  auto refused = [&](std::vector<std::string> specials) {
    return pollen::testing::error_of([&] { train_bpe(c, {300, specials, cl100k()}); });
  };
  EXPECT_NE(refused({"a"}).find("special token 'a' is one byte"), std::string::npos);
  EXPECT_NE(refused({""}).find("must not be empty"), std::string::npos);
  EXPECT_NE(refused({"<|x|>", "<|x|>"}).find("'<|x|>' is listed twice"), std::string::npos);
  EXPECT_NE(refused({"aa"}).find("special token 'aa' is spelled like the trained token"),
            std::string::npos);
  EXPECT_NE(refused({" the"}).find("spelled like the trained token"), std::string::npos);
  // As tokenizer.json spells them, with byte-level characters (a space is "Ġ").
  EXPECT_NE(refused({"\xC4\xA0"}).find("a byte's name in tokenizer.json"), std::string::npos);
  EXPECT_NE(refused({"\xC4\xA0the"}).find("spelled like the trained token"), std::string::npos);
  const Tokenizer tok = train_bpe(c, {300, {"<|x|>"}, cl100k()});
  EXPECT_EQ(tok.added_tokens().size(), 1u);
  const std::string cmd = std::string(POLLEN_BINARY) + " tokenizer train --input /dev/null " +
                          "--output /tmp/never.json --special a 2>&1";
  int status = 0;
  const std::string said = pollen::testing::run_capture(cmd, &status);
  EXPECT_NE(status, 0);
  EXPECT_NE(said.find("--special: special token 'a' is one byte"), std::string::npos) << said;
  // A pattern that does not compile is named by where it came from.
  const std::string bad_pattern = pollen::testing::run_capture(
      std::string(POLLEN_BINARY) +
          " tokenizer train --input /dev/null --output /tmp/never.json --pattern '([a-' 2>&1",
      &status);
  EXPECT_NE(status, 0);
  EXPECT_NE(bad_pattern.find("--pattern: pre-tokenizer regex /([a-/ does not compile"),
            std::string::npos)
      << bad_pattern;
  // bench refuses a repeat count that measures nothing.
  pollen::testing::run_capture(std::string(POLLEN_BINARY) +
                                   " tokenizer bench --tokenizer /dev/null --input /dev/null "
                                   "--repeat 0 2>&1",
                               &status);
  EXPECT_EQ(status, 2);
}

// Ids that cannot be written (a full disk: /dev/full, behind a link so that a writer renaming
// over it replaces only the link) fail the command; text that is not an id is named with its line.
TEST(TrainerCounts, EncodeAndDecodeFailWhenTheirOutputCannotBeWritten) {
  const fs::path dir = testing::temp_dir("encode_full");
  write_file_atomic(dir / "text.txt", "some text\n");
  PieceCounts counts(cl100k());
  counts.add_file(dir / "text.txt", false, "");
  save_hf_json(train_bpe(counts, {270, {}, cl100k()}), dir / "tok.json");
  fs::create_symlink("/dev/full", dir / "full");
  const std::string pollen = std::string(POLLEN_BINARY) + " tokenizer ";
  const std::string tok = " --tokenizer " + (dir / "tok.json").string();
  auto status = [](const std::string& cmd) { return std::system((cmd + " 2>/dev/null").c_str()); };
  EXPECT_NE(status(pollen + "encode" + tok + " --input " + (dir / "text.txt").string() +
                   " --output " + (dir / "full").string()),
            0);
  EXPECT_NE(
      status(pollen + "encode" + tok + " --input " + (dir / "text.txt").string() + " > /dev/full"),
      0);
  write_file_atomic(dir / "ids.txt", "97 98\n");
  EXPECT_NE(
      status(pollen + "decode" + tok + " --input " + (dir / "ids.txt").string() + " > /dev/full"),
      0);
  EXPECT_TRUE(fs::is_symlink(dir / "full"));
  write_file_atomic(dir / "bad.txt", "97 4294967393\n");  // 2^32 + 97: no longer taken as 97
  EXPECT_NE(status(pollen + "decode" + tok + " --input " + (dir / "bad.txt").string()), 0);
  fs::remove_all(dir);
}

// An --output that could not be written is refused before the training or counting whose
// result it was to hold, naming the option and the folder.
TEST(TrainerCounts, AnOutputThatCannotBeWrittenIsRefusedBeforeTheWork) {
  const fs::path dir = testing::temp_dir("output_first");
  write_file_atomic(dir / "text.txt", "some text and more text\n");
  const std::string nowhere = (dir / "nodir" / "out.json").string();
  for (const std::string command : {"train --vocab-size 270", "count"}) {
    int status = 0;
    const std::string said = pollen::testing::run_capture(
        cat(POLLEN_BINARY, " tokenizer ", command, " --input ", (dir / "text.txt").string(),
            " --output ", nowhere, " 2>&1"),
        &status);
    EXPECT_NE(status, 0) << command;
    EXPECT_NE(said.find(cat("--output '", nowhere, "': its folder '", (dir / "nodir").string(),
                            "' does not exist")),
              std::string::npos)
        << said;
    EXPECT_EQ(said.find("merges"), std::string::npos) << said;
    EXPECT_EQ(said.find("counted"), std::string::npos) << said;
  }
  fs::remove_all(dir);
}

// A JSONL field that holds a conversation (SFT data's messages) is its turns' contents, one per
// line, not the record's JSON; anything else there is refused naming the line.
TEST(TrainerCounts, AConversationFieldIsItsTurnsText) {
  const fs::path dir = testing::temp_dir("conversation_docs");
  write_file_atomic(dir / "chats.jsonl",
                    R"({"messages": [{"role": "user", "content": "What is 2 + 2?"}, )"
                    R"({"role": "assistant", "content": "4\n#### 4"}]})"
                    "\n");
  std::vector<std::string> docs;
  for_each_document_batch({dir / "chats.jsonl", true, "messages"}, 1 << 20,
                          [&](std::span<const std::string_view> batch) {
                            docs.insert(docs.end(), batch.begin(), batch.end());
                          });
  EXPECT_EQ(docs, (std::vector<std::string>{"What is 2 + 2?\n4\n#### 4"}));
  // A tool call's null content is no text, parts give their text, no messages an empty document.
  write_file_atomic(dir / "more.jsonl",
                    R"({"messages": [{"role": "assistant", "content": null}, )"
                    R"({"role": "user", "content": [{"type": "text", "text": "hi"}]}]})"
                    "\n"
                    R"({"messages": []})"
                    "\n");
  docs.clear();
  for_each_document_batch({dir / "more.jsonl", true, "messages"}, 1 << 20,
                          [&](std::span<const std::string_view> batch) {
                            docs.insert(docs.end(), batch.begin(), batch.end());
                          });
  EXPECT_EQ(docs, (std::vector<std::string>{"hi", ""}));
  write_file_atomic(dir / "bad.jsonl", R"({"messages": [{"role": "user"}]})"
                                       "\n");
  const std::string e = pollen::testing::error_of([&] {
    for_each_document_batch({dir / "bad.jsonl", true, "messages"}, 1 << 20,
                            [](std::span<const std::string_view>) {});
  });
  EXPECT_NE(e.find("bad.jsonl:1: expected a string field 'messages' (or a list of messages"),
            std::string::npos)
      << e;
  fs::remove_all(dir);
}

// A text line's document is without its line break, "\n" or a Windows "\r\n" (whose '\r'
// would otherwise be encoded as a token); training keeps the line break whole, as HF does.
TEST(TrainerCounts, TextDocumentsLeaveOutCrlfLineBreaks) {
  const fs::path dir = testing::temp_dir("crlf_docs");
  write_file_atomic(dir / "text.txt", "ab\r\ncd\nef\r\r\ng");
  auto documents = [&](bool keep_line_breaks) {
    std::vector<std::string> docs;
    std::vector<size_t> lines;
    for_each_document_batch(
        {dir / "text.txt", false, "text", keep_line_breaks}, 1 << 20,
        [&](std::span<const std::string_view> batch, std::span<const size_t> starts) {
          docs.insert(docs.end(), batch.begin(), batch.end());
          lines.insert(lines.end(), starts.begin(), starts.end());
        });
    EXPECT_EQ(lines, (std::vector<size_t>{1, 2, 3, 4}));
    return docs;
  };
  EXPECT_EQ(documents(false), (std::vector<std::string>{"ab", "cd", "ef\r", "g"}));
  EXPECT_EQ(documents(true), (std::vector<std::string>{"ab\r\n", "cd\n", "ef\r\r\n", "g"}));
  fs::remove_all(dir);
}

// A special token that encode refuses is named with the file and the line of its document (the
// first such document in file order, though documents are encoded on many threads), for text
// and for JSONL.
TEST(TrainerCounts, EncodeNamesTheLineOfARefusedSpecialToken) {
  const fs::path dir = testing::temp_dir("encode_special");
  write_file_atomic(dir / "text.txt", "some text\nmore text\n\nthe <|x|> here\nand <|x|>\n");
  write_file_atomic(dir / "docs.jsonl", "{\"text\": \"some text\"}\n\n{\"text\": \"a\\n<|x|>\"}\n");
  PieceCounts counts(cl100k());
  counts.add_file(dir / "text.txt", false, "");
  save_hf_json(train_bpe(counts, {270, {"<|x|>"}, cl100k()}), dir / "tok.json");
  const std::string encode = std::string(POLLEN_BINARY) + " tokenizer encode --threads 2" +
                             " --tokenizer " + (dir / "tok.json").string() + " --input ";
  int status = 0;
  std::string said = pollen::testing::run_capture(encode + (dir / "text.txt").string(), &status);
  EXPECT_NE(status, 0);
  EXPECT_NE(said.find((dir / "text.txt").string() + ":4: the text contains the special token "
                                                    "'<|x|>'"),
            std::string::npos)
      << said;
  EXPECT_NE(said.find("--special allow"), std::string::npos) << said;
  said = pollen::testing::run_capture(encode + (dir / "docs.jsonl").string() + " --jsonl", &status);
  EXPECT_NE(status, 0);
  EXPECT_NE(said.find((dir / "docs.jsonl").string() + ":3: the text contains the special token"),
            std::string::npos)
      << said;
  fs::remove_all(dir);
}

// HF's trainer breaks ties by the same rule (see trainer.h), so the merges are identical. They
// could differ only where HF's pre-tokenizer and pollen's pattern disagree on a piece, which
// the parity tests rule out for this corpus.
TEST_F(Trainer, SameMergesAsHfBpeTrainer) {
  POLLEN_REQUIRE_PEERS();
  Tokenizer tok = train_on(corpus_, 2);
  auto result = testing::run_reference({{"mode", "train_hf"},
                                        {"kind", "llama3"},
                                        {"pattern", cl100k()},
                                        {"vocab_size", kVocab},
                                        {"special_tokens", kSpecials},
                                        {"files", {corpus_.string()}},
                                        {"output", (dir_ / "hf.json").string()}});
  auto hf_merges = result["merges"].get<std::vector<std::string>>();
  const Vocab& vocab = tok.model().vocab();
  std::vector<std::string> ours;
  for (const Merge& m : tok.model().merges())
    ours.push_back(bytes_to_byte_level(vocab.bytes(m.left)) + " " +
                   bytes_to_byte_level(vocab.bytes(m.right)));
  ASSERT_EQ(ours.size(), hf_merges.size());
  for (size_t i = 0; i < ours.size(); ++i) ASSERT_EQ(ours[i], hf_merges[i]) << "merge " << i;
}

TEST_F(Trainer, TrainedTokenizerSameIdsInPollenHfAndTiktoken) {
  POLLEN_REQUIRE_PEERS();
  Tokenizer tok = train_on(corpus_, 2);
  fs::path json = dir_ / "tokenizer.json", ranks = dir_ / "tok.tiktoken";
  save_hf_json(tok, json);
  save_tiktoken(tok, ranks);
  std::vector<AddedToken> specials(tok.added_tokens());
  Tokenizer from_ranks = load_tiktoken(ranks, cl100k(), specials);
  Tokenizer from_json = load_hf_json(json);
  EXPECT_EQ(from_ranks.fingerprint(), tok.fingerprint());
  EXPECT_EQ(from_json.fingerprint(), tok.fingerprint());

  std::vector<std::string> corpus = testing::varied_corpus();
  nlohmann::json special_ids = nlohmann::json::object();
  for (const AddedToken& t : specials) special_ids[t.content] = t.id;
  auto tiktoken = testing::run_reference({{"mode", "tiktoken"},
                                          {"rank_file", ranks.string()},
                                          {"pat_str", cl100k()},
                                          {"special_tokens", special_ids},
                                          {"allow_special", true},
                                          {"texts", corpus}});
  auto hf = testing::run_reference(
      {{"mode", "hf"}, {"tokenizer_json", json.string()}, {"texts", corpus}});
  EncodeOptions all{SpecialPolicy::allow_all()};
  for (size_t i = 0; i < corpus.size(); ++i) {
    auto ids = tok.encode(corpus[i], all);
    ASSERT_EQ(ids, tiktoken["ids"][i].get<std::vector<uint32_t>>()) << corpus[i];
    ASSERT_EQ(ids, hf["ids"][i].get<std::vector<uint32_t>>()) << corpus[i];
    ASSERT_EQ(ids, from_ranks.encode(corpus[i], all));
    ASSERT_EQ(ids, from_json.encode(corpus[i], all));
    ASSERT_EQ(tok.decode(ids), corpus[i]);
  }
}

}  // namespace
}  // namespace pollen::tokenizer
