#include "data/minhash.h"

#include <algorithm>
#include <numeric>

#include "base/error.h"
#include "base/hash.h"
#include "base/rng.h"
#include "base/thread_pool.h"
#include "data/text.h"

namespace pollen::data {

MinHasher::MinHasher(const MinHashOptions& o) : options_(o) {
  POLLEN_CHECK(o.ngram > 0 && o.bands > 0 && o.rows > 0,
               "minhash: ngram, bands and rows must be "
               "positive");
  Rng rng(o.seed);
  for (int i = 0; i < o.signature_size(); ++i) {
    a_.push_back(rng.next_u64() | 1);
    b_.push_back(rng.next_u64());
  }
}

void MinHasher::signature(std::string_view text, uint32_t* sig) const {
  const int m = options_.signature_size();
  thread_local std::vector<uint64_t> wh;
  normalized_word_hashes(text, 0x5bd1e995, wh);
  const size_t n = static_cast<size_t>(options_.ngram);
  thread_local std::vector<uint64_t> mins;
  mins.assign(static_cast<size_t>(m), ~0ull);
  const uint64_t* a = a_.data();
  const uint64_t* b = b_.data();
  uint64_t* mn = mins.data();
  // A shingle seen twice changes no minimum, so shingles need no deduplication.
  auto add = [&](uint64_t x) {
    for (int i = 0; i < m; ++i) {
      uint64_t h = (a[i] * x + b[i]) >> 32;
      mn[i] = h < mn[i] ? h : mn[i];
    }
  };
  if (wh.size() < n) {
    if (!wh.empty()) add(xxh64(wh.data(), wh.size() * 8, 7));
  } else {
    for (size_t i = 0; i + n <= wh.size(); ++i) add(xxh64(&wh[i], n * 8, 7));
  }
  for (int i = 0; i < m; ++i) sig[i] = static_cast<uint32_t>(mins[static_cast<size_t>(i)]);
}

double signature_similarity(const uint32_t* x, const uint32_t* y, int n) {
  int eq = 0;
  for (int i = 0; i < n; ++i) eq += x[i] == y[i];
  return static_cast<double>(eq) / n;
}

namespace {
struct UnionFind {
  std::vector<int64_t> parent;
  explicit UnionFind(int64_t n) : parent(static_cast<size_t>(n)) {
    std::iota(parent.begin(), parent.end(), int64_t{0});
  }
  int64_t find(int64_t x) {
    while (parent[static_cast<size_t>(x)] != x) {
      parent[static_cast<size_t>(x)] = parent[static_cast<size_t>(parent[static_cast<size_t>(x)])];
      x = parent[static_cast<size_t>(x)];
    }
    return x;
  }
  // The lower index becomes the root, so a cluster's root is its first document.
  bool unite(int64_t x, int64_t y) {
    x = find(x);
    y = find(y);
    if (x == y) return false;
    if (y < x) std::swap(x, y);
    parent[static_cast<size_t>(y)] = x;
    return true;
  }
};
}  // namespace

NearDupResult find_near_duplicates(const std::vector<uint32_t>& sigs, int64_t n,
                                   const MinHashOptions& o) {
  const int m = o.signature_size();
  POLLEN_ASSERT(static_cast<int64_t>(sigs.size()) == n * m);
  NearDupResult r;
  UnionFind uf(n);
  // A document without words has no shingles and so the empty signature (every value 2^32 - 1):
  // it resembles nothing, and joins no bucket (else every such document would be one cluster).
  std::vector<int64_t> shingled;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t* sig = &sigs[static_cast<size_t>(i * m)];
    if (!std::all_of(sig, sig + m, [](uint32_t v) { return v == ~0u; })) shingled.push_back(i);
  }
  std::vector<std::pair<uint64_t, int64_t>> bucket(shingled.size());
  for (int band = 0; band < o.bands; ++band) {
    parallel_for(static_cast<int64_t>(shingled.size()), 4096, [&](int64_t b, int64_t e) {
      for (int64_t k = b; k < e; ++k) {
        const int64_t i = shingled[static_cast<size_t>(k)];
        bucket[static_cast<size_t>(k)] = {
            xxh64(&sigs[static_cast<size_t>(i * m + band * o.rows)],
                  static_cast<size_t>(o.rows) * 4, static_cast<uint64_t>(band)),
            i};
      }
    });
    std::sort(bucket.begin(), bucket.end());
    for (size_t s = 0; s < bucket.size();) {
      size_t e = s + 1;
      while (e < bucket.size() && bucket[e].first == bucket[s].first) ++e;
      // Members in index order; each is compared with up to max_bucket_compare earlier ones.
      for (size_t i = s + 1; i < e; ++i) {
        int64_t di = bucket[i].second;
        size_t lo = (o.max_bucket_compare > 0 && i - s > static_cast<size_t>(o.max_bucket_compare))
                        ? i - static_cast<size_t>(o.max_bucket_compare)
                        : s;
        for (size_t j = lo; j < i; ++j) {
          int64_t dj = bucket[j].second;
          if (uf.find(di) == uf.find(dj)) continue;
          ++r.candidate_pairs;
          if (o.verify && signature_similarity(&sigs[static_cast<size_t>(di * m)],
                                               &sigs[static_cast<size_t>(dj * m)], m) < o.threshold)
            continue;
          ++r.verified_pairs;
          uf.unite(di, dj);
          if (!o.verify) break;  // joined this bucket's component
        }
      }
      s = e;
    }
  }
  r.cluster.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    r.cluster[static_cast<size_t>(i)] = uf.find(i);
    r.duplicates += uf.find(i) != i;
  }
  return r;
}

}  // namespace pollen::data
