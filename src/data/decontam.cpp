#include "data/decontam.h"

#include "base/hash.h"
#include "data/text.h"

namespace pollen::data {

void Decontaminator::grams_of(std::string_view text, std::vector<uint64_t>& out) const {
  thread_local std::vector<uint64_t> wh;
  normalized_word_hashes(text, 13, wh);
  out.clear();
  const size_t n = static_cast<size_t>(n_);
  for (size_t i = 0; i + n <= wh.size(); ++i) out.push_back(xxh64(&wh[i], n * 8, 17));
}

void Decontaminator::add_eval_text(std::string_view text) {
  std::vector<uint64_t> g;
  grams_of(text, g);
  ++texts_;
  if (g.empty()) ++short_;
  grams_.insert(g.begin(), g.end());
}

bool Decontaminator::contaminated(std::string_view text) const {
  if (grams_.empty()) return false;
  thread_local std::vector<uint64_t> g;
  grams_of(text, g);
  for (uint64_t h : g)
    if (grams_.count(h)) return true;
  return false;
}

}  // namespace pollen::data
