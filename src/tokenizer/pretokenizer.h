#pragma once
// Pre-tokenisation: a sequence of steps that cut (and, for a few, edit) text into the pieces
// that BPE encodes one at a time. The steps are those of HF tokenizer.json; a tiktoken
// encoding is a single Split step with its pattern.
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/pattern.h"

namespace pollen::tokenizer {

// What a Split step does with the matches of its pattern (HF's SplitDelimiterBehavior).
enum class SplitBehavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext, kContiguous };

enum class PrependScheme { kAlways, kFirst, kNever };

struct PreTokenizerStep {
  enum class Kind { kSplit, kByteLevel, kDigits, kMetaspace };
  Kind kind = Kind::kSplit;
  // kSplit: the pattern; kByteLevel with use_regex: GPT-2's; kDigits: \p{N} or \p{N}+.
  std::shared_ptr<const PatternSplitter> splitter;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool add_prefix_space = false;                          // kByteLevel
  bool individual_digits = false;                         // kDigits
  std::string replacement;                                // kMetaspace, usually "▁"
  PrependScheme prepend_scheme = PrependScheme::kAlways;  // kMetaspace
  bool split = true;     // kMetaspace: split on the replacement character
  bool literal = false;  // kSplit: the regex is literal_regex of a text (tokenizer.json's String)

  static PreTokenizerStep split_on(std::string regex, SplitBehavior behavior);
  // A split on `text` as it is: literal_regex(text), remembered as a literal.
  static PreTokenizerStep split_on_text(std::string_view text, SplitBehavior behavior);
  static PreTokenizerStep byte_level(bool add_prefix_space, bool use_regex);
  static PreTokenizerStep digits(bool individual);
  static PreTokenizerStep metaspace(std::string replacement, PrependScheme scheme, bool split);
};

class PreTokenizer {
 public:
  PreTokenizer() = default;
  explicit PreTokenizer(std::vector<PreTokenizerStep> steps) : steps_(std::move(steps)) {}

  const std::vector<PreTokenizerStep>& steps() const { return steps_; }

  // Calls sink(piece) for each piece of `text`, in order. `at_start` says whether `text` begins
  // the input (Metaspace's "first" prepend scheme depends on it).
  void run(std::string_view text, bool at_start,
           const std::function<void(std::string_view)>& sink) const;

 private:
  std::vector<PreTokenizerStep> steps_;
};

}  // namespace pollen::tokenizer
