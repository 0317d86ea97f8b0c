#pragma once
// Decontamination: a document is dropped when it shares a word n-gram (13 by default, over
// normalised words: lower case, punctuation removed) with any evaluation text.
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

namespace pollen::data {

class Decontaminator {
 public:
  explicit Decontaminator(int ngram = 13) : n_(ngram) {}
  // Adds the n-grams of one evaluation text; texts shorter than n words add nothing and are
  // counted in short_texts().
  void add_eval_text(std::string_view text);
  bool contaminated(std::string_view text) const;
  bool empty() const { return grams_.empty(); }
  int64_t eval_texts() const { return texts_; }
  int64_t short_texts() const { return short_; }
  int64_t ngrams() const { return static_cast<int64_t>(grams_.size()); }

 private:
  void grams_of(std::string_view text, std::vector<uint64_t>& out) const;
  int n_;
  std::unordered_set<uint64_t> grams_;
  int64_t texts_ = 0, short_ = 0;
};

}  // namespace pollen::data
