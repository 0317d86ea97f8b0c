#include "tokenizer/trainer.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <queue>
#include <set>
#include <unordered_map>

#include "base/error.h"
#include "base/files.h"
#include "base/hash.h"
#include "base/log.h"
#include "base/rng.h"
#include "base/thread_pool.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/documents.h"

namespace pollen::tokenizer {

struct PieceCounts::Map {
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return XXH3_64bits(s.data(), s.size()); }
  };
  std::unordered_map<std::string, uint64_t, Hash, std::equal_to<>> counts;

  void add(std::string_view piece, uint64_t n) {
    auto it = counts.find(piece);
    if (it == counts.end())
      counts.emplace(std::string(piece), n);
    else
      it->second += n;
  }
};

PieceCounts::PieceCounts(std::string pattern)
    : pattern_(std::move(pattern)),
      pre_tokenizer_({PreTokenizerStep::split_on(pattern_, SplitBehavior::kIsolated)}),
      counts_(std::make_shared<Map>()) {}

void PieceCounts::add_documents(std::span<const std::string_view> documents) {
  int chunks = std::max(1, std::min<int>(num_threads(), static_cast<int>(documents.size())));
  std::vector<Map> partial(chunks);
  pool().run_chunks(static_cast<int64_t>(documents.size()), chunks,
                    [&](int64_t begin, int64_t end, int chunk) {
                      Map& map = partial[chunk];
                      for (int64_t i = begin; i < end; ++i)
                        pre_tokenizer_.run(documents[i], true,
                                           [&](std::string_view piece) { map.add(piece, 1); });
                    });
  for (const Map& map : partial) {
    for (const auto& [piece, n] : map.counts) counts_->add(piece, n);
  }
  for (std::string_view d : documents) bytes_read_ += d.size();
}

void PieceCounts::add_file(const std::filesystem::path& path, bool jsonl,
                           const std::string& field) {
  constexpr size_t kBatchBytes = 64 << 20;
  for_each_document_batch({path, jsonl, field, true}, kBatchBytes,
                          [&](std::span<const std::string_view> docs) { add_documents(docs); });
}

void PieceCounts::add_piece(std::string_view piece, uint64_t n) {
  if (n > 0) counts_->add(piece, n);
}

namespace {
// The most a count file may hold for one piece (readers refuse more).
constexpr uint64_t kMaxPieceCount = uint64_t{1} << 48;
}  // namespace

void PieceCounts::perturb(double stddev, uint64_t seed, uint64_t min_count) {
  POLLEN_CHECK(stddev >= 0 && std::isfinite(stddev), "noise stddev ", stddev,
               ": expected a finite value >= 0");
  min_count = std::max<uint64_t>(min_count, 1);
  Rng rng(seed);
  auto pieces = sorted();
  std::vector<std::pair<std::string, uint64_t>> noisy;  // the counts are replaced once all passed
  for (auto& [piece, n] : pieces) {
    // A piece is kept by its true count: noise first would let a rare one (a name) through
    // whenever its draw was large.
    if (n < min_count) continue;
    double v = static_cast<double>(n);
    if (stddev > 0) v += std::round(stddev * rng.normal());
    // Noise so large that a count would pass 2^48 (which no reader accepts) is refused.
    POLLEN_CHECK(v <= static_cast<double>(kMaxPieceCount), "noise stddev ", stddev,
                 ": a noisy count reached ", v, ", over 2^48");
    if (v >= 1) noisy.emplace_back(std::move(piece), uint64_t(v));
  }
  counts_->counts.clear();
  for (auto& [piece, v] : noisy) counts_->counts.emplace(std::move(piece), v);
}

namespace {

constexpr char kCountMagic[8] = {'P', 'O', 'L', 'L', 'E', 'N', 'P', 'C'};
constexpr uint32_t kCountVersion = 1;

template <typename T>
void put(std::string& out, T v) {
  char b[sizeof(T)];
  for (size_t i = 0; i < sizeof(T); ++i) b[i] = static_cast<char>((uint64_t(v) >> (8 * i)) & 0xff);
  out.append(b, sizeof(T));
}

// Reads a count file front to back, checking every size against what is left.
class CountReader {
 public:
  explicit CountReader(const std::filesystem::path& path) : path_(path), data_(read_file(path)) {
    fail_if(data_.size() < sizeof(kCountMagic) + 4 + 32, "too short to be a count file");
    fail_if(data_.compare(0, 8, kCountMagic, 8) != 0, "not a pollen count file (bad magic)");
    const std::string_view body(data_.data(), data_.size() - 32);
    Sha256 h;
    h.update(body);
    const auto d = h.digest();
    fail_if(std::memcmp(d.data(), data_.data() + body.size(), 32) != 0,
            "checksum mismatch (the file is corrupt or truncated)");
    end_ = body.size();
    pos_ = 8;
    uint32_t version = get<uint32_t>();
    fail_if(version != kCountVersion,
            "version " + std::to_string(version) + ", this build reads version 1");
    pattern_ = bytes(get<uint32_t>());
    bytes_read_ = get<uint64_t>();
    pieces_ = get<uint64_t>();
  }
  template <typename T>
  T get() {
    fail_if(end_ - pos_ < sizeof(T), "truncated");
    uint64_t v = 0;
    for (size_t i = 0; i < sizeof(T); ++i)
      v |= uint64_t(static_cast<unsigned char>(data_[pos_ + i])) << (8 * i);
    pos_ += sizeof(T);
    return static_cast<T>(v);
  }
  std::string_view bytes(uint64_t n) {
    fail_if(end_ - pos_ < n, "truncated");
    std::string_view s(data_.data() + pos_, n);
    pos_ += n;
    return s;
  }
  void fail_if(bool bad, const std::string& what) const {
    if (bad) fail("count file '", path_.string(), "': ", what);
  }
  bool at_end() const { return pos_ == end_; }
  std::string pattern_;
  uint64_t bytes_read_ = 0, pieces_ = 0;

 private:
  std::filesystem::path path_;
  std::string data_;
  size_t pos_ = 0, end_ = 0;
};

}  // namespace

void PieceCounts::save(const std::filesystem::path& path) const {
  const auto pieces = sorted();
  std::string out(kCountMagic, sizeof(kCountMagic));
  put<uint32_t>(out, kCountVersion);
  put<uint32_t>(out, static_cast<uint32_t>(pattern_.size()));
  out += pattern_;
  put<uint64_t>(out, bytes_read_);
  put<uint64_t>(out, pieces.size());
  for (const auto& [piece, n] : pieces) {
    put<uint32_t>(out, static_cast<uint32_t>(piece.size()));
    out += piece;
    put<uint64_t>(out, n);
  }
  Sha256 h;
  h.update(out);
  const auto d = h.digest();
  out.append(reinterpret_cast<const char*>(d.data()), d.size());
  write_file_atomic(path, out);
}

std::string PieceCounts::file_pattern(const std::filesystem::path& path) {
  return CountReader(path).pattern_;
}

void PieceCounts::merge_file(const std::filesystem::path& path) {
  CountReader r(path);
  r.fail_if(r.pattern_ != pattern_,
            "made with pre-tokenisation pattern '" + r.pattern_ + "', expected '" + pattern_ + "'");
  std::string previous;
  for (uint64_t i = 0; i < r.pieces_; ++i) {
    std::string_view piece = r.bytes(r.get<uint32_t>());
    const uint64_t n = r.get<uint64_t>();
    r.fail_if(piece.empty() || n == 0, "piece " + std::to_string(i) + " is empty or has count 0");
    // 2^48 occurrences of one piece is far past any corpus; bounded, the merged counts of up to
    // 2^14 files cannot wrap (the trainer bounds the pair counts they make: MergeTrainer).
    r.fail_if(n > kMaxPieceCount,
              "piece " + std::to_string(i) + " has count " + std::to_string(n) + ", over 2^48");
    r.fail_if(i > 0 && !(previous < piece),
              "piece " + std::to_string(i) + " is out of order (pieces are sorted and unique)");
    previous.assign(piece);
    counts_->add(piece, n);
  }
  r.fail_if(!r.at_end(), "bytes after the last piece");
  r.fail_if(__builtin_add_overflow(bytes_read_, r.bytes_read_, &bytes_read_),
            "its bytes read (" + std::to_string(r.bytes_read_) + ") overflow the total");
}

std::vector<std::pair<std::string, uint64_t>> PieceCounts::sorted() const {
  std::vector<std::pair<std::string, uint64_t>> out(counts_->counts.begin(), counts_->counts.end());
  std::sort(out.begin(), out.end());
  return out;
}

uint64_t PieceCounts::pair_bound() const {
  uint64_t total = 0;
  for (const auto& [piece, count] : counts_->counts) {
    uint64_t pairs = 0;
    if (piece.size() < 2) continue;
    if (__builtin_mul_overflow(count, uint64_t{piece.size() - 1}, &pairs) ||
        __builtin_add_overflow(total, pairs, &total))
      return UINT64_MAX;
  }
  return total;
}

size_t PieceCounts::distinct() const {
  return counts_->counts.size();
}

namespace {

uint64_t pair_key(uint32_t left, uint32_t right) {
  return uint64_t{left} << 32 | right;
}

// The merge loop over the distinct pieces ("words").
class MergeTrainer {
 public:
  explicit MergeTrainer(const std::vector<std::pair<std::string, uint64_t>>& pieces) {
    // Tie-break order: bytes by their byte-level character, then merges as they are made.
    std::vector<uint32_t> bytes(256);
    for (uint32_t b = 0; b < 256; ++b) bytes[b] = b;
    std::sort(bytes.begin(), bytes.end(), [](uint32_t a, uint32_t b) {
      return byte_level_char(static_cast<unsigned char>(a)) <
             byte_level_char(static_cast<unsigned char>(b));
    });
    order_.resize(256);
    for (uint32_t i = 0; i < 256; ++i) order_[bytes[i]] = i;
    for (uint32_t b = 0; b < 256; ++b) add_token(std::string(1, static_cast<char>(b)));
    // Every pair count the merges make is at most the sum of count x (length - 1) over the
    // pieces: bounded, the signed counts cannot overflow.
    uint64_t pairs_total = 0;
    for (const auto& [piece, count] : pieces) {
      uint64_t pairs = 0;
      POLLEN_CHECK(
          piece.size() < 2 || (!__builtin_mul_overflow(count, uint64_t{piece.size() - 1}, &pairs) &&
                               !__builtin_add_overflow(pairs_total, pairs, &pairs_total) &&
                               pairs_total <= uint64_t{INT64_MAX}),
          "tokenizer training: the piece counts are too large (their pairs would "
          "overflow 2^63); are the count files corrupt?");
    }
    for (const auto& [piece, count] : pieces) {
      Word w{{}, count};
      for (unsigned char c : piece) w.symbols.push_back(c);
      words_.push_back(std::move(w));
    }
    for (uint32_t i = 0; i < words_.size(); ++i) {
      const Word& w = words_[i];
      for (size_t k = 0; k + 1 < w.symbols.size(); ++k) {
        uint64_t key = pair_key(w.symbols[k], w.symbols[k + 1]);
        counts_[key] += static_cast<int64_t>(w.count);
        where_[key].push_back(i);
      }
    }
    for (const auto& [key, count] : counts_) push(key);
  }

  // Merges until there are `vocab_size` tokens or no pair is left; returns the merges in order.
  // A merge that spells an existing token (two paths to the same bytes) makes no new token.
  std::vector<Merge> run(size_t vocab_size) {
    std::vector<Merge> merges;
    while (tokens_.size() < vocab_size && !heap_.empty()) {
      Candidate top = heap_.top();
      heap_.pop();
      int64_t current = count_of(top.key);
      if (current != top.count) {
        if (current > 0) push(top.key);
        continue;
      }
      if (current < 1) break;
      Merge m{static_cast<uint32_t>(top.key >> 32), static_cast<uint32_t>(top.key)};
      merges.push_back(m);
      apply(m, add_token(cat(tokens_[m.left], tokens_[m.right])));
    }
    return merges;
  }

  const std::vector<std::string>& tokens() const { return tokens_; }

 private:
  uint32_t add_token(std::string bytes) {
    auto [it, inserted] = id_of_.emplace(bytes, static_cast<uint32_t>(tokens_.size()));
    if (inserted) {
      tokens_.push_back(std::move(bytes));
      if (tokens_.size() > 256) order_.push_back(static_cast<uint32_t>(tokens_.size() - 1));
    }
    return it->second;
  }

  struct Word {
    std::vector<uint32_t> symbols;
    uint64_t count;
  };
  struct Candidate {
    int64_t count;
    uint32_t left_order, right_order;
    uint64_t key;
    // Max-heap: more frequent first, then the smaller pair in tie-break order.
    bool operator<(const Candidate& o) const {
      if (count != o.count) return count < o.count;
      if (left_order != o.left_order) return left_order > o.left_order;
      return right_order > o.right_order;
    }
  };

  int64_t count_of(uint64_t key) const {
    auto it = counts_.find(key);
    return it == counts_.end() ? 0 : it->second;
  }

  void push(uint64_t key) {
    heap_.push({count_of(key), order_[key >> 32], order_[static_cast<uint32_t>(key)], key});
  }

  void change(uint64_t key, int64_t delta, uint32_t word, std::vector<uint64_t>& touched) {
    counts_[key] += delta;
    if (delta > 0) {
      where_[key].push_back(word);
      touched.push_back(key);
    }
  }

  // Merges every occurrence of m, left to right without overlap, in every word that has it.
  void apply(const Merge& m, uint32_t made) {
    uint64_t key = pair_key(m.left, m.right);
    std::vector<uint32_t> words = std::move(where_[key]);
    where_.erase(key);
    std::sort(words.begin(), words.end());
    words.erase(std::unique(words.begin(), words.end()), words.end());
    std::vector<uint64_t> touched;
    for (uint32_t wi : words) {
      Word& w = words_[wi];
      auto c = static_cast<int64_t>(w.count);
      // One pass that writes the merged word over itself at `o` (an erase per occurrence was
      // quadratic in a long word): the left neighbour is the last symbol written (a token just
      // made, perhaps), the right one still the input's.
      std::vector<uint32_t>& s = w.symbols;
      size_t o = 0;
      for (size_t i = 0; i < s.size();) {
        if (i + 1 >= s.size() || s[i] != m.left || s[i + 1] != m.right) {
          s[o++] = s[i++];
          continue;
        }
        if (o > 0) {
          change(pair_key(s[o - 1], m.left), -c, wi, touched);
          change(pair_key(s[o - 1], made), c, wi, touched);
        }
        if (i + 2 < s.size()) {
          change(pair_key(m.right, s[i + 2]), -c, wi, touched);
          change(pair_key(made, s[i + 2]), c, wi, touched);
        }
        change(key, -c, wi, touched);
        s[o++] = made;
        i += 2;
      }
      s.resize(o);
    }
    std::sort(touched.begin(), touched.end());
    touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
    for (uint64_t t : touched) push(t);
  }

  std::vector<Word> words_;
  std::vector<std::string> tokens_;
  std::unordered_map<std::string, uint32_t> id_of_;
  std::vector<uint32_t> order_;
  std::unordered_map<uint64_t, int64_t> counts_;
  std::unordered_map<uint64_t, std::vector<uint32_t>> where_;
  std::priority_queue<Candidate> heap_;
};

}  // namespace

void check_special_tokens(const std::vector<std::string>& special_tokens, uint64_t vocab_size,
                          const std::string& where) {
  // tokenizer.json names each byte by its byte-level character (a space is "Ġ"): those spellings
  // are taken too.
  std::set<std::string> byte_names;
  for (int b = 0; b < 256; ++b)
    byte_names.insert(bytes_to_byte_level(std::string(1, static_cast<char>(b))));
  std::set<std::string_view> seen;
  for (const std::string& s : special_tokens) {
    POLLEN_CHECK(!s.empty(), where, ": a special token must not be empty");
    POLLEN_CHECK(s.size() > 1 && !byte_names.contains(s), where, ": special token '", s,
                 "' is one byte, or a byte's name in tokenizer.json, which is a token already: ",
                 "its text would have two ids");
    POLLEN_CHECK(seen.insert(s).second, where, ": special token '", s, "' is listed twice");
  }
  POLLEN_CHECK(vocab_size >= 256 + special_tokens.size(), where, ": vocab size ", vocab_size,
               " is smaller than the 256 bytes plus ", special_tokens.size(), " special tokens");
}

Tokenizer train_bpe(const PieceCounts& counts, const TrainOptions& options) {
  check_special_tokens(options.special_tokens, options.vocab_size, "tokenizer training");
  MergeTrainer trainer(counts.sorted());
  std::vector<Merge> merges = trainer.run(options.vocab_size - options.special_tokens.size());
  log::info("tokenizer: ", merges.size(), " merges from ", counts.distinct(),
            " distinct pieces of ", counts.bytes_read(), " bytes");

  Vocab vocab;
  for (uint32_t id = 0; id < trainer.tokens().size(); ++id) vocab.add(id, trainer.tokens()[id]);
  // A special spelled like a trained token, as bytes or as tokenizer.json names it (byte-level
  // characters), would give one text two ids (and tokenizer.json one key two values).
  std::unordered_map<std::string, uint32_t> token_ids;
  for (uint32_t id = 0; id < trainer.tokens().size(); ++id) {
    token_ids[trainer.tokens()[id]] = id;
    token_ids[bytes_to_byte_level(trainer.tokens()[id])] = id;
  }
  std::vector<AddedToken> added;
  for (const std::string& s : options.special_tokens) {
    const auto same = token_ids.find(s);
    POLLEN_CHECK(same == token_ids.end(), "tokenizer training: special token '", s,
                 "' is spelled like the trained token ", same->second,
                 "; choose a spelling the text does not make (such as <|name|>)");
    added.push_back({static_cast<uint32_t>(vocab.id_end() + added.size()), s, true});
  }
  BpeOptions bpe;
  bpe.rule = MergeRule::kMergeList;
  bpe.ignore_merges = true;  // a piece that is a token is that token, as in tiktoken
  std::vector<PreTokenizerStep> steps{
      PreTokenizerStep::split_on(counts.pattern(), SplitBehavior::kIsolated)};
  return Tokenizer(BpeModel(std::move(vocab), std::move(merges), bpe), Normalizer{},
                   PreTokenizer(std::move(steps)), std::move(added), BosEosTemplate{},
                   DecoderSpec{});
}

}  // namespace pollen::tokenizer
