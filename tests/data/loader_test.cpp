// Shards, manifests and the training loader.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

#include "base/error.h"
#include "base/files.h"
#include "data/loader.h"
#include "data/shards.h"
#include "support/errors.h"

namespace fs = std::filesystem;
using namespace pollen;
using namespace pollen::data;

namespace {

fs::path temp_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("pollen_data_test_" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

// Documents with lengths 1..40 cycling; token ids encode (doc, position) so that tests can
// check where each token came from: id = (doc * 64 + pos) % 60000 + 1.
fs::path make_dataset(const fs::path& dir, int docs, int64_t shard_tokens, int salt = 0) {
  ShardWriter w(dir, "ds", "train", TokenDType::u16, shard_tokens);
  for (int d = 0; d < docs; ++d) {
    std::vector<uint32_t> ids(static_cast<size_t>(1 + (d * 7 + salt) % 40));
    for (size_t p = 0; p < ids.size(); ++p)
      ids[p] = static_cast<uint32_t>((d * 64 + static_cast<int>(p) + salt * 977) % 60000 + 1);
    w.add_document(ids);
  }
  auto shards = w.finish();
  ShardWriter v(dir, "ds", "validation", TokenDType::u16, shard_tokens);
  v.add_document(std::vector<uint32_t>{1, 2, 3, 4, 5, 6, 7, 8, 9});
  auto vs = v.finish();
  shards.insert(shards.end(), vs.begin(), vs.end());
  nlohmann::json m{{"format", "pollen-shards-v1"}, {"token_dtype", "u16"}, {"vocab_size", 60001}};
  m["shards"] = nlohmann::json::array();
  for (const auto& s : shards) m["shards"].push_back(s.to_json());
  write_file_atomic(dir / "manifest.json", manifest_text(m));
  return dir / "manifest.json";
}

std::vector<int32_t> values(const Tensor& t) {
  return std::vector<int32_t>(t.data<int32_t>(), t.data<int32_t>() + t.numel());
}

}  // namespace

TEST(Shards, WriterRollsOverAndIndexIsExact) {
  fs::path dir = temp_dir("shards");
  make_dataset(dir, 100, 500);
  Manifest m = Manifest::load(dir / "manifest.json");
  auto train = m.split("train");
  ASSERT_GT(train.size(), 1u);
  int64_t docs = 0, tokens = 0;
  for (const auto& s : train) {
    EXPECT_LE(s.num_tokens, 500);
    ShardReader r(dir, s, m.token_dtype);
    EXPECT_EQ(r.doc_starts().size(), static_cast<size_t>(s.num_docs + 1));
    EXPECT_EQ(fs::file_size(dir / s.tokens), static_cast<uintmax_t>(s.num_tokens * 2));
    docs += s.num_docs;
    tokens += s.num_tokens;
  }
  EXPECT_EQ(docs, 100);
  EXPECT_EQ(train[0].tokens, "ds-train-00000.tokens");
  EXPECT_EQ(train[0].index, "ds-train-00000.index");
  // First token of doc 0 is 1, little-endian.
  std::string bytes = read_file(dir / train[0].tokens);
  EXPECT_EQ(static_cast<uint8_t>(bytes[0]), 1);
  EXPECT_EQ(static_cast<uint8_t>(bytes[1]), 0);
}

// A manifest whose counts would wrap the reader's sizes is refused naming the shard and field.
TEST(Shards, NegativeCountsInAManifestAreRefused) {
  fs::path dir = temp_dir("shards_negative");
  make_dataset(dir, 10, 500);
  nlohmann::json m = nlohmann::json::parse(read_file(dir / "manifest.json"));
  for (const char* field : {"num_docs", "num_tokens"}) {
    nlohmann::json bad = m;
    bad["shards"][0][field] = -1;
    write_file_atomic(dir / "bad.json", manifest_text(bad));
    const std::string error =
        pollen::testing::error_of([&] { Manifest::load(dir / "bad.json").split("train"); });
    EXPECT_NE(error.find(cat("has ", field, " -1, expected 0 to 2^50")), std::string::npos)
        << error;
  }
  // An entry without a field names its place; shards that are not a list are refused.
  nlohmann::json missing = m;
  missing["shards"][1].erase("num_docs");
  write_file_atomic(dir / "bad.json", manifest_text(missing));
  std::string error = pollen::testing::error_of([&] { Manifest::load(dir / "bad.json"); });
  EXPECT_NE(error.find("shards[1]: bad shard entry"), std::string::npos) << error;
  nlohmann::json object = m;
  object["shards"] = nlohmann::json::object();
  write_file_atomic(dir / "bad.json", manifest_text(object));
  error = pollen::testing::error_of([&] { Manifest::load(dir / "bad.json"); });
  EXPECT_NE(error.find("\"shards\" must be a list, got object"), std::string::npos) << error;
}

// A process killed after its open shard was closed (renamed into place) but before the next
// resume point was saved resumes that shard from the last point, as if it had not stopped.
TEST(Shards, AResumePointWhoseOpenShardClosedSinceResumesIt) {
  const fs::path killed = temp_dir("shards_killed"), whole = temp_dir("shards_whole");
  const std::vector<std::vector<uint32_t>> docs = {{1, 2}, {3, 4}, {5, 6, 7}, {8}};
  nlohmann::json point;
  {
    ShardWriter w(killed, "x", "train", TokenDType::u32, 5);
    w.add_document(docs[0]);
    point = w.checkpoint();  // shard 0 open, holding the first document
    w.add_document(docs[1]);
    w.add_document(docs[2]);  // closes shard 0 and opens shard 1; then the process dies
  }
  ASSERT_TRUE(fs::exists(killed / "x-train-00000.tokens"));
  ShardWriter resumed(killed, "x", "train", TokenDType::u32, 5);
  resumed.resume(point);
  ShardWriter plain(whole, "x", "train", TokenDType::u32, 5);
  plain.add_document(docs[0]);
  for (size_t i = 1; i < docs.size(); ++i) {
    resumed.add_document(docs[i]);
    plain.add_document(docs[i]);
  }
  const auto got = resumed.finish(), want = plain.finish();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i].to_json(), want[i].to_json());
}

TEST(Loader, WindowsPositionsDocIdsAndMaskedTargets) {
  fs::path dir = temp_dir("windows");
  // Three docs: [10 11 12] [20 21] [30 31 32 33 34]
  ShardWriter w(dir, "x", "train", TokenDType::u32, 1000);
  w.add_document(std::vector<uint32_t>{10, 11, 12});
  w.add_document(std::vector<uint32_t>{20, 21});
  w.add_document(std::vector<uint32_t>{30, 31, 32, 33, 34});
  auto shards = w.finish();
  nlohmann::json m{{"format", "pollen-shards-v1"}, {"token_dtype", "u32"}, {"vocab_size", 70000}};
  m["shards"] = {shards[0].to_json()};
  write_file_atomic(dir / "manifest.json", manifest_text(m));
  LoaderOptions o;
  o.manifests = {dir / "manifest.json"};
  o.batch = 1;
  o.seq = 9;  // one window of all 10 tokens
  Loader l(o);
  EXPECT_EQ(l.windows_per_epoch(), 1);
  model::Batch b = l.next();
  EXPECT_EQ(values(b.tokens), (std::vector<int32_t>{10, 11, 12, 20, 21, 30, 31, 32, 33}));
  EXPECT_EQ(values(b.targets), (std::vector<int32_t>{11, 12, -100, 21, -100, 31, 32, 33, 34}));
  EXPECT_EQ(values(b.positions), (std::vector<int32_t>{0, 1, 2, 0, 1, 0, 1, 2, 3}));
  EXPECT_EQ(values(b.doc_ids), (std::vector<int32_t>{0, 0, 0, 1, 1, 2, 2, 2, 2}));
}

TEST(Loader, RanksAreDisjointAndCoverEachGlobalBatch) {
  fs::path dir = temp_dir("ranks");
  auto manifest = make_dataset(dir, 400, 1000);
  LoaderOptions o;
  o.manifests = {manifest};
  o.batch = 8;
  o.seq = 16;
  o.seed = 3;
  Loader whole(o);
  o.world = 4;
  std::vector<std::unique_ptr<Loader>> ranks;
  for (int r = 0; r < 4; ++r) {
    o.rank = r;
    ranks.push_back(std::make_unique<Loader>(o));
  }
  std::set<std::vector<int32_t>> seen;
  const int64_t steps = whole.windows_per_epoch() / 8 + 3;  // cross an epoch boundary
  for (int64_t step = 0; step < steps; ++step) {
    auto g = values(whole.next().tokens);
    std::vector<int32_t> joined;
    for (auto& r : ranks) {
      auto part = values(r->next().tokens);
      EXPECT_EQ(part.size(), 2u * 16u);
      joined.insert(joined.end(), part.begin(), part.end());
    }
    EXPECT_EQ(joined, g) << "step " << step;
    if (step < whole.windows_per_epoch() / 8)
      for (int row = 0; row < 8; ++row) {
        std::vector<int32_t> r(g.begin() + row * 16, g.begin() + (row + 1) * 16);
        EXPECT_TRUE(seen.insert(r).second) << "window read twice in one epoch";
      }
  }
  EXPECT_EQ(whole.state().epoch, 1u);
}

// An optimizer step of 8 rows is the same 8 windows whether 1, 2 or 4 ranks read it (1 rank
// accumulating 4 micro-batches of 2, 2 ranks 2 of 4, 4 ranks 1 of 8), also across epoch ends
// where the epoch's windows are not a multiple of the step: the epoch ends between steps, never
// inside one.
TEST(Loader, StepsAreTheSameRowsAtAnyWorldSizeAcrossEpochs) {
  fs::path dir = temp_dir("steps");
  LoaderOptions o;
  o.manifests = {make_dataset(dir, 400, 1000)};
  o.seq = 16;
  o.seed = 5;
  o.step_batch = 8;
  auto steps_read = [&](int world) {
    std::vector<std::unique_ptr<Loader>> ranks;
    LoaderOptions r = o;
    r.world = world;
    r.batch = 2 * world;
    for (int k = 0; k < world; ++k) {
      r.rank = k;
      ranks.push_back(std::make_unique<Loader>(r));
    }
    const int64_t per_epoch = ranks[0]->windows_per_epoch();
    EXPECT_GE(per_epoch % 8, 2) << "the epoch must end inside a step's worth of windows";
    std::vector<std::vector<int32_t>> steps;
    for (int64_t step = 0; step < 2 * (per_epoch / 8) + 3; ++step) {  // past two epoch ends
      std::vector<int32_t> rows;
      for (int micro = 0; micro < 4 / world; ++micro)
        for (auto& rank : ranks) {
          const auto part = values(rank->next().tokens);
          rows.insert(rows.end(), part.begin(), part.end());
        }
      steps.push_back(rows);
    }
    EXPECT_EQ(ranks[0]->state().epoch, 2u);
    return steps;
  };
  const auto one = steps_read(1);
  EXPECT_EQ(steps_read(2), one);
  EXPECT_EQ(steps_read(4), one);
  // A state saved before epochs ended between steps may sit off a step boundary: it resumes at
  // the next epoch's start, so that every step after it reads one epoch's windows (and never
  // past the end of this one).
  LoaderOptions r = o;
  r.batch = 2;
  Loader old(r);
  const auto windows = static_cast<uint64_t>(old.windows_per_epoch());
  old.restore({o.seed, 0, windows - 1});
  EXPECT_EQ(old.state(), (LoaderState{o.seed, 1, 0}));
  old.restore({o.seed, 0, 16});  // between steps: kept
  EXPECT_EQ(old.state(), (LoaderState{o.seed, 0, 16}));
  fs::remove_all(dir);
}

TEST(Loader, ResumeIsBitwiseAlsoWithAnotherWorldSize) {
  fs::path dir = temp_dir("resume");
  auto manifest = make_dataset(dir, 300, 700);
  LoaderOptions o;
  o.manifests = {manifest};
  o.batch = 4;
  o.seq = 32;
  o.seed = 11;
  Loader ref(o);
  std::vector<std::vector<int32_t>> want;
  for (int i = 0; i < 40; ++i) {
    auto b = ref.next();
    auto t = values(b.targets), p = values(b.positions);
    auto v = values(b.tokens);
    v.insert(v.end(), t.begin(), t.end());
    v.insert(v.end(), p.begin(), p.end());
    want.push_back(v);
  }
  Loader first(o);
  for (int i = 0; i < 17; ++i) first.next();
  auto saved = LoaderState::from_json(nlohmann::json::parse(first.state().to_json().dump()));
  // Resume on 2 ranks.
  o.world = 2;
  std::vector<std::unique_ptr<Loader>> ranks;
  for (int r = 0; r < 2; ++r) {
    o.rank = r;
    o.seed = 999;  // the state's seed wins
    ranks.push_back(std::make_unique<Loader>(o));
    ranks.back()->restore(saved);
  }
  for (int i = 17; i < 40; ++i) {
    std::vector<int32_t> tok, tgt, pos;
    for (auto& r : ranks) {
      auto b = r->next();
      auto a = values(b.tokens), c = values(b.targets), d = values(b.positions);
      tok.insert(tok.end(), a.begin(), a.end());
      tgt.insert(tgt.end(), c.begin(), c.end());
      pos.insert(pos.end(), d.begin(), d.end());
    }
    tok.insert(tok.end(), tgt.begin(), tgt.end());
    tok.insert(tok.end(), pos.begin(), pos.end());
    EXPECT_EQ(tok, want[static_cast<size_t>(i)]) << "step " << i;
  }
}

TEST(Loader, MixingFollowsWeights) {
  fs::path a = temp_dir("mix_a"), b = temp_dir("mix_b");
  auto ma = make_dataset(a, 300, 100000, 0);
  auto mb = make_dataset(b, 300, 100000, 5);
  LoaderOptions o;
  o.manifests = {ma, mb};
  o.weights = {3, 1};
  o.batch = 4;
  o.seq = 8;
  Loader l(o);
  Loader plain({.manifests = {ma, mb}, .batch = 4, .seq = 8});
  EXPECT_EQ(l.windows_per_epoch(), plain.windows_per_epoch());
  // Tokens of dataset b carry salt * 977 offsets: count rows by which dataset they came from
  // using the first token's membership in dataset a's id set.
  std::set<int32_t> ids_a;
  {
    Loader only_a({.manifests = {ma}, .batch = 1, .seq = 8});
    for (int64_t i = 0; i < only_a.windows_per_epoch(); ++i)
      for (int32_t v : values(only_a.next().tokens)) ids_a.insert(v);
  }
  int64_t from_a = 0, rows = 0;
  for (int64_t s = 0; s < l.windows_per_epoch() / 4; ++s) {
    auto t = values(l.next().tokens);
    for (int r = 0; r < 4; ++r, ++rows) {
      bool all_a = true;
      for (int k = 0; k < 8; ++k) all_a &= ids_a.count(t[static_cast<size_t>(r * 8 + k)]) > 0;
      from_a += all_a;
    }
  }
  double share = static_cast<double>(from_a) / static_cast<double>(rows);
  EXPECT_NEAR(share, 0.75, 0.05);
  // A manifest without windows of the split is left out of an evaluation's mixture, but refused
  // where every manifest must count (training), naming it and its splits.
  // (one document of 2 tokens: no window of 9)
  LoaderOptions unfit{
      .manifests = {ma, make_dataset(temp_dir("mix_small"), 1, 100000, 1)}, .batch = 1, .seq = 8};
  EXPECT_NO_THROW(Loader{unfit});
  unfit.every_manifest = true;
  const std::string e = pollen::testing::error_of([&] { Loader{unfit}; });
  EXPECT_NE(e.find("manifest '" + unfit.manifests[1].string() + "' has no window"),
            std::string::npos)
      << e;
}

TEST(Loader, ShaMismatchNamesTheFile) {
  fs::path dir = temp_dir("sha");
  auto manifest = make_dataset(dir, 50, 100000);
  fs::path shard = dir / "ds-train-00000.tokens";
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(10);
    f.put('\x7f');
  }
  LoaderOptions o;
  o.manifests = {manifest};
  o.batch = 1;
  o.seq = 4;
  try {
    Loader l(o);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ds-train-00000.tokens"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("SHA-256"), std::string::npos) << e.what();
  }
}

// A manifest edited or written inconsistently is refused naming it: a vocab_size below the ids
// its shards hold (which would otherwise fail inside the embedding, naming no file), one its
// token_dtype cannot hold, and manifests of different tokenizers mixed into one stream.
TEST(Loader, ManifestsThatDisagreeWithTheirTokensAreRefused) {
  const fs::path dir = temp_dir("vocab");
  const fs::path a = make_dataset(dir / "a", 20, 100000), b = make_dataset(dir / "b", 20, 100000);
  auto edit = [](const fs::path& manifest, const std::function<void(nlohmann::json&)>& change) {
    auto m = nlohmann::json::parse(read_file(manifest));
    change(m);
    write_file_atomic(manifest, manifest_text(m));
  };
  auto error = [](const std::vector<fs::path>& manifests) {
    LoaderOptions o;
    o.manifests = {manifests.begin(), manifests.end()};
    o.batch = 1;
    o.seq = 4;
    try {
      Loader l(o);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("loaded");
  };
  EXPECT_EQ(error({a, b}), "loaded");
  // One with end tokens appended mixes with one without (eos_id null), not with another EOS.
  edit(a, [](nlohmann::json& m) { m["eos_id"] = 2; });
  edit(b, [](nlohmann::json& m) { m["eos_id"] = nullptr; });
  EXPECT_EQ(error({a, b}), "loaded");
  edit(b, [](nlohmann::json& m) { m["eos_id"] = 3; });
  EXPECT_NE(error({a, b}).find("was tokenized unlike"), std::string::npos);
  edit(b, [](nlohmann::json& m) { m["eos_id"] = 2; });
  edit(b, [](nlohmann::json& m) { m["tokenizer"] = {{"fingerprint", "0123456789abcdef0"}}; });
  std::string e = error({a, b});
  EXPECT_NE(e.find("was tokenized unlike"), std::string::npos) << e;
  EXPECT_NE(e.find((dir / "b" / "manifest.json").string()), std::string::npos) << e;
  edit(a, [](nlohmann::json& m) { m["vocab_size"] = 1000; });  // the shards hold ids to 60000
  e = error({a});
  EXPECT_NE(e.find("ds-train-00000.tokens' holds token id"), std::string::npos) << e;
  EXPECT_NE(e.find("not below its manifest's vocab_size 1000"), std::string::npos) << e;
  edit(a, [](nlohmann::json& m) { m["vocab_size"] = 100000; });  // u16 holds ids to 65535
  e = error({a});
  EXPECT_NE(e.find("vocab_size 100000 does not fit its token_dtype u16"), std::string::npos) << e;
  // Prepared without tokenizing (vocab_size 0): a manifest to inspect, not to train on.
  edit(a, [](nlohmann::json& m) { m["vocab_size"] = 0; });
  EXPECT_NO_THROW(Manifest::load(a));
  EXPECT_NE(error({a}).find("holds no tokens"), std::string::npos);
  // Beside a tokenized one it is named as what it is, not as tokenized otherwise.
  e = pollen::testing::error_of([&] { check_same_tokens(Manifest::load(b), Manifest::load(a)); });
  EXPECT_NE(e.find("manifest '" + a.string() + "' holds no tokens (prepared without [tokenize])"),
            std::string::npos)
      << e;
  fs::remove_all(dir);
}

// A model scores only data its own tokenizer wrote; data that records no tokenizer passes.
TEST(Loader, DataIsCheckedAgainstTheTokenizerOfTheModelThatScoresIt) {
  const fs::path dir = temp_dir("tokenized_by");
  const fs::path a = make_dataset(dir / "a", 20, 1000);
  EXPECT_NO_THROW(check_tokenized_by(Manifest::load(a), "feedface", "m/tokenizer.json"));
  auto m = nlohmann::json::parse(read_file(a));
  m["tokenizer"] = {{"fingerprint", "0123456789abcdef0123"}};
  write_file_atomic(a, manifest_text(m));
  EXPECT_NO_THROW(
      check_tokenized_by(Manifest::load(a), "0123456789abcdef0123", "m/tokenizer.json"));
  try {
    check_tokenized_by(Manifest::load(a), "feedfacefeedface99", "m/tokenizer.json");
    ADD_FAILURE() << "data of another tokenizer passed";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(a.string()), std::string::npos) << what;
    EXPECT_NE(what.find("tokenized by tokenizer 0123456789abcdef, not by the model's "
                        "'m/tokenizer.json' (feedfacefeedface)"),
              std::string::npos)
        << what;
  }
  fs::remove_all(dir);
}

TEST(Loader, ValidationSplitAndTooSmall) {
  fs::path dir = temp_dir("val");
  auto manifest = make_dataset(dir, 20, 100000);
  LoaderOptions o;
  o.manifests = {manifest};
  o.split = "validation";
  o.batch = 1;
  o.seq = 8;
  Loader l(o);
  EXPECT_EQ(l.windows_per_epoch(), 1);
  EXPECT_EQ(values(l.next().tokens), (std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8}));
  o.batch = 2;
  EXPECT_THROW(Loader{o}, Error);
}
