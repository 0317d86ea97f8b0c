#pragma once
// Near-duplicate detection by MinHash LSH (Broder 1997; Leskovec et al., Mining of Massive
// Datasets, ch. 3). A document's shingles are its normalised word n-grams (5 by default); its
// signature is bands * rows minimum hash values, one per hash function h_i(x) = (a_i x + b_i)
// >> 32 (multiply-shift) over the 64-bit shingle hashes. Documents whose signatures agree on
// every row of some band are candidates; a candidate pair is verified when the share of equal
// signature entries (the Jaccard estimate) reaches the threshold. Clusters are the connected
// components of the verified pairs, and the first document (lowest index) of each is kept. A
// document without words (no shingles) is nobody's near duplicate; exact dedup finds its copies.
#include <cstdint>
#include <string_view>
#include <vector>

namespace pollen::data {

struct MinHashOptions {
  bool enabled = true;
  int ngram = 5;
  int bands = 14;
  int rows = 8;
  bool verify = true;  // false: every candidate pair is a duplicate (plain LSH)
  double threshold = 0.75;
  uint64_t seed = 1;
  int64_t max_bucket_compare = 256;  // in a bucket, each doc is compared to at most this many
  int signature_size() const { return bands * rows; }
};

class MinHasher {
 public:
  explicit MinHasher(const MinHashOptions& options);
  // Writes signature_size() values to `sig`.
  void signature(std::string_view text, uint32_t* sig) const;
  const MinHashOptions& options() const { return options_; }

 private:
  MinHashOptions options_;
  std::vector<uint64_t> a_, b_;
};

double signature_similarity(const uint32_t* x, const uint32_t* y, int n);

struct NearDupResult {
  std::vector<int64_t> cluster;  // per document: the index of its cluster's kept document
  int64_t candidate_pairs = 0;
  int64_t verified_pairs = 0;
  int64_t duplicates = 0;  // documents that are not their cluster's kept one
};

// `signatures` holds n * signature_size() values.
NearDupResult find_near_duplicates(const std::vector<uint32_t>& signatures, int64_t n,
                                   const MinHashOptions& options);

}  // namespace pollen::data
