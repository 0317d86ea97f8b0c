#pragma once
// Text normalisation before pre-tokenisation, as HF tokenizer.json normalizers describe it.
#include <string>
#include <string_view>
#include <vector>

namespace pollen::tokenizer {

struct NormalizerStep {
  enum class Kind { kNfc, kNfkc, kPrepend, kReplace };
  Kind kind;
  std::string pattern;  // kReplace: the literal text to replace
  std::string content;  // kPrepend: the prefix; kReplace: the replacement
};

class Normalizer {
 public:
  Normalizer() = default;
  explicit Normalizer(std::vector<NormalizerStep> steps) : steps_(std::move(steps)) {}

  bool empty() const { return steps_.empty(); }
  const std::vector<NormalizerStep>& steps() const { return steps_; }
  std::string apply(std::string_view text) const;

 private:
  std::vector<NormalizerStep> steps_;
};

}  // namespace pollen::tokenizer
