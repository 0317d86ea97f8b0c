#include "tokenizer/bpe.h"

#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <queue>
#include <string>
#include <unordered_map>

#include "base/error.h"
#include "tokenizer/unicode.h"

namespace pollen::tokenizer {

// Adjacent pair (left, right) -> the rank of merging them and the token it makes.
struct BpeModel::PairTable {
  struct Slot {
    uint64_t key = kEmpty;
    uint32_t rank = 0;
    uint32_t result = 0;
  };
  static constexpr uint64_t kEmpty = ~uint64_t{0};

  std::vector<Slot> slots;
  size_t count = 0;
  int shift = 64;

  static uint64_t key_of(uint32_t left, uint32_t right) { return uint64_t{left} << 32 | right; }
  size_t home(uint64_t key) const {
    return shift == 64 ? 0 : static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift);
  }

  void reserve(size_t n) {
    size_t capacity = 16;
    int bits = 4;
    while (capacity < n * 2) capacity *= 2, ++bits;
    slots.assign(capacity, Slot{});
    shift = 64 - bits;
  }

  // A pair inserted again keeps its first rank and result, or takes the new ones when
  // `replace`.
  void insert(uint32_t left, uint32_t right, uint32_t rank, uint32_t result, bool replace = false) {
    uint64_t key = key_of(left, right);
    size_t mask = slots.size() - 1;
    for (size_t i = home(key);; i = (i + 1) & mask) {
      if (slots[i].key == key) {
        if (replace) slots[i] = {key, rank, result};
        return;
      }
      if (slots[i].key == kEmpty) {
        slots[i] = {key, rank, result};
        ++count;
        return;
      }
    }
  }

  const Slot* find(uint32_t left, uint32_t right) const {
    uint64_t key = key_of(left, right);
    size_t mask = slots.size() - 1;
    for (size_t i = home(key);; i = (i + 1) & mask) {
      if (slots[i].key == key) return &slots[i];
      if (slots[i].key == kEmpty) return nullptr;
    }
  }
};

namespace {

std::atomic<uint64_t> next_serial{1};

// Pieces that needed merging, per thread, for the model that used them last.
struct PieceCache {
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return XXH3_64bits(s.data(), s.size()); }
  };
  static constexpr size_t kMaxEntries = 1 << 16;
  uint64_t owner = 0;
  std::unordered_map<std::string, std::vector<uint32_t>, Hash, std::equal_to<>> map;
};

thread_local PieceCache piece_cache;

constexpr uint32_t kNoRank = UINT32_MAX;
constexpr size_t kShortPiece = 64;

}  // namespace

BpeModel::BpeModel(Vocab vocab, std::vector<Merge> merges, BpeOptions options)
    : vocab_(std::move(vocab)),
      options_(options),
      pairs_(std::make_unique<PairTable>()),
      serial_(next_serial++),
      merges_once_(std::make_unique<std::once_flag>()) {
  for (int b = 0; b < 256; ++b) byte_tokens_[b] = vocab_.find(std::string(1, static_cast<char>(b)));
  if (options_.rule == MergeRule::kMergeList) {
    pairs_->reserve(merges.size());
    for (uint32_t rank = 0; rank < merges.size(); ++rank) {
      const Merge& m = merges[rank];
      std::string joined = cat(vocab_.bytes(m.left), vocab_.bytes(m.right));
      auto result = vocab_.find(joined);
      POLLEN_CHECK(result, "merge ", rank, " makes a token that is not in the vocabulary");
      // A merge listed twice takes its last rank, as HF's merge map does.
      pairs_->insert(m.left, m.right, rank, *result, /*replace=*/true);
    }
    merges_ = std::move(merges);
    std::call_once(*merges_once_, [] {});
    return;
  }
  // kRankedBytes: every split of a token into two tokens is a pair that makes it.
  size_t splits = 0;
  for (uint32_t id = 0; id < vocab_.id_end(); ++id)
    if (vocab_.contains(id)) splits += vocab_.bytes(id).size();
  pairs_->reserve(splits);
  for (uint32_t id = 0; id < vocab_.id_end(); ++id) {
    if (!vocab_.contains(id)) continue;
    std::string_view bytes = vocab_.bytes(id);
    for (size_t k = 1; k < bytes.size(); ++k) {
      auto left = vocab_.find(bytes.substr(0, k));
      if (!left) continue;
      if (auto right = vocab_.find(bytes.substr(k))) pairs_->insert(*left, *right, id, id);
    }
  }
}

BpeModel::BpeModel(BpeModel&&) noexcept = default;
BpeModel& BpeModel::operator=(BpeModel&&) noexcept = default;
BpeModel::~BpeModel() = default;

const std::vector<Merge>& BpeModel::merges() const {
  std::call_once(*merges_once_, [this] {
    // A rank is an id: visiting the ids in order lists the merges in rank order.
    std::vector<uint32_t> symbols;
    for (uint32_t id = 0; id < vocab_.id_end(); ++id) {
      if (!vocab_.contains(id) || vocab_.bytes(id).size() < 2) continue;
      symbols.clear();
      symbols_of(vocab_.bytes(id), symbols);
      merge_symbols(symbols, id);
      POLLEN_CHECK(symbols.size() == 2, "token ", id, " cannot be made by merging two tokens of ",
                   "lower rank, so the ranks do not form a BPE merge list");
      merges_.push_back(Merge{symbols[0], symbols[1]});
    }
  });
  return merges_;
}

void BpeModel::symbols_of(std::string_view piece, std::vector<uint32_t>& symbols) const {
  auto* p = reinterpret_cast<const unsigned char*>(piece.data());
  auto* end = p + piece.size();
  auto push_unknown = [&] {
    if (!options_.unk) return;  // as HF does: without an unknown token the character is dropped
    if (options_.fuse_unk && !symbols.empty() && symbols.back() == *options_.unk) return;
    symbols.push_back(*options_.unk);
  };
  if (options_.alphabet == Alphabet::kBytes) {
    for (; p < end; ++p) {
      if (byte_tokens_[*p])
        symbols.push_back(*byte_tokens_[*p]);
      else
        push_unknown();
    }
    return;
  }
  while (p < end) {
    Decoded d = decode_utf8(p, end);
    int length = d.length ? d.length : 1;
    std::string_view ch(reinterpret_cast<const char*>(p), length);
    if (auto id = vocab_.find(ch)) {
      symbols.push_back(*id);
    } else if (options_.byte_fallback) {
      size_t before = symbols.size();
      for (int i = 0; i < length; ++i) {
        char name[8];
        std::snprintf(name, sizeof name, "<0x%02X>", p[i]);
        auto byte_id = vocab_.find(name);
        if (!byte_id) {
          symbols.resize(before);
          push_unknown();
          break;
        }
        symbols.push_back(*byte_id);
      }
    } else {
      push_unknown();
    }
    p += length;
  }
}

void BpeModel::merge_symbols(std::vector<uint32_t>& symbols, uint32_t rank_limit) const {
  if (symbols.size() < 2) return;
  if (symbols.size() <= kShortPiece)
    merge_short(symbols, rank_limit);
  else
    merge_long(symbols, rank_limit);
}

// Quadratic but cache-friendly: the lowest rank is found by a scan after every merge.
void BpeModel::merge_short(std::vector<uint32_t>& symbols, uint32_t rank_limit) const {
  size_t n = symbols.size();
  uint32_t ranks[kShortPiece], results[kShortPiece];
  auto look = [&](size_t i) {
    const PairTable::Slot* s = pairs_->find(symbols[i], symbols[i + 1]);
    if (s && s->rank < rank_limit) {
      ranks[i] = s->rank;
      results[i] = s->result;
    } else {
      ranks[i] = kNoRank;
    }
  };
  for (size_t i = 0; i + 1 < n; ++i) look(i);
  while (n > 1) {
    size_t best = 0;
    for (size_t i = 1; i + 1 < n; ++i)
      if (ranks[i] < ranks[best]) best = i;
    if (ranks[best] == kNoRank) break;
    symbols[best] = results[best];
    for (size_t i = best + 1; i + 1 < n; ++i) symbols[i] = symbols[i + 1];
    for (size_t i = best + 1; i + 2 < n; ++i) {
      ranks[i] = ranks[i + 1];
      results[i] = results[i + 1];
    }
    --n;
    if (best > 0) look(best - 1);
    if (best + 1 < n) look(best);
  }
  symbols.resize(n);
}

// A heap of candidate pairs over a linked list of symbols; stale candidates are skipped.
void BpeModel::merge_long(std::vector<uint32_t>& symbols, uint32_t rank_limit) const {
  struct Node {
    uint32_t id;
    int32_t prev, next;
  };
  struct Candidate {
    uint32_t rank, pos, left, right, result;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  constexpr uint32_t kDead = UINT32_MAX;
  size_t n = symbols.size();
  std::vector<Node> nodes(n);
  for (size_t i = 0; i < n; ++i)
    nodes[i] = {symbols[i], static_cast<int32_t>(i) - 1,
                i + 1 < n ? static_cast<int32_t>(i + 1) : -1};
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto offer = [&](int32_t pos) {
    if (pos < 0 || nodes[pos].next < 0) return;
    uint32_t left = nodes[pos].id, right = nodes[nodes[pos].next].id;
    const PairTable::Slot* s = pairs_->find(left, right);
    if (s && s->rank < rank_limit)
      heap.push({s->rank, static_cast<uint32_t>(pos), left, right, s->result});
  };
  for (size_t i = 0; i + 1 < n; ++i) offer(static_cast<int32_t>(i));
  while (!heap.empty()) {
    Candidate c = heap.top();
    heap.pop();
    Node& node = nodes[c.pos];
    if (node.id != c.left || node.next < 0 || nodes[node.next].id != c.right) continue;
    Node& gone = nodes[node.next];
    gone.id = kDead;
    node.id = c.result;
    node.next = gone.next;
    if (gone.next >= 0) nodes[gone.next].prev = static_cast<int32_t>(c.pos);
    offer(node.prev);
    offer(static_cast<int32_t>(c.pos));
  }
  symbols.clear();
  for (int32_t i = 0; i >= 0; i = nodes[i].next) symbols.push_back(nodes[i].id);
}

void BpeModel::encode_uncached(std::string_view piece, std::vector<uint32_t>& out) const {
  std::vector<uint32_t> symbols;
  symbols_of(piece, symbols);
  merge_symbols(symbols, kNoRank);
  out.insert(out.end(), symbols.begin(), symbols.end());
}

void BpeModel::encode(std::string_view piece, std::vector<uint32_t>& out) const {
  if (piece.empty()) return;
  if (options_.rule == MergeRule::kRankedBytes || options_.ignore_merges) {
    if (auto id = vocab_.find(piece)) {
      out.push_back(*id);
      return;
    }
  }
  if (piece.size() == 1 && options_.alphabet == Alphabet::kBytes) {
    symbols_of(piece, out);
    return;
  }
  PieceCache& cache = piece_cache;
  if (cache.owner != serial_) {
    cache.map.clear();
    cache.owner = serial_;
  }
  if (auto it = cache.map.find(piece); it != cache.map.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  size_t start = out.size();
  encode_uncached(piece, out);
  if (cache.map.size() >= PieceCache::kMaxEntries) cache.map.clear();
  cache.map.emplace(std::string(piece),
                    std::vector<uint32_t>(out.begin() + static_cast<ptrdiff_t>(start), out.end()));
}

}  // namespace pollen::tokenizer
