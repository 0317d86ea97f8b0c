#include "tokenizer/pretokenizer.h"

#include <deque>

#include "base/error.h"

namespace pollen::tokenizer {

namespace {

struct Piece {
  std::string_view text;
  bool at_start;
};

using Emit = std::function<void(Piece)>;

// A splitter reports each invalid UTF-8 byte as a piece of one byte; no valid piece is a single
// byte of 0x80 or more.
bool is_invalid_byte(std::string_view piece) {
  return piece.size() == 1 && static_cast<unsigned char>(piece[0]) >= 0x80;
}

// Applies a split behaviour to the stream of (piece, matched) that a splitter produces. The
// pieces are adjacent views of one string, so merging two is widening a view.
class BehaviorJoiner {
 public:
  BehaviorJoiner(SplitBehavior behavior, bool at_start, const Emit& emit)
      : behavior_(behavior), at_start_(at_start), emit_(emit) {}

  // As HF does: a match joins its neighbour only when that neighbour is not a match itself. An
  // empty match cuts. An invalid byte is a piece of its own, and the text after it starts
  // afresh, as if it began the text.
  void add(std::string_view piece, bool matched) {
    if (is_invalid_byte(piece)) {
      start(piece);
      flush_pending();
      pending_matched_ = false;
      return;
    }
    switch (behavior_) {
      case SplitBehavior::kIsolated:
        start(piece);
        break;
      case SplitBehavior::kRemoved:
        flush_pending();
        if (!matched)
          pending_ = piece;
        else if (!piece.empty())
          at_start_ = false;
        break;
      case SplitBehavior::kMergedWithPrevious:
        if (matched && !pending_.empty() && !pending_matched_)
          extend(piece);
        else
          start(piece);
        break;
      case SplitBehavior::kMergedWithNext:
        if (!matched && pending_matched_)
          extend(piece);
        else
          start(piece);
        break;
      case SplitBehavior::kContiguous:
        if (matched && pending_matched_)
          extend(piece);
        else
          start(piece);
        break;
    }
    pending_matched_ = matched;
  }

  void finish() { flush_pending(); }

 private:
  void extend(std::string_view piece) {
    pending_ = std::string_view(pending_.data(), pending_.size() + piece.size());
  }
  void start(std::string_view piece) {
    flush_pending();
    pending_ = piece;
  }
  void flush_pending() {
    if (pending_.empty()) return;
    emit_({pending_, at_start_});
    at_start_ = false;
    pending_ = {};
  }

  SplitBehavior behavior_;
  bool at_start_;
  const Emit& emit_;
  std::string_view pending_;
  bool pending_matched_ = false;
};

void split_with(const PatternSplitter& splitter, SplitBehavior behavior, Piece piece,
                const Emit& emit) {
  if (behavior == SplitBehavior::kIsolated) {
    bool first = piece.at_start;
    splitter.split(piece.text, [&](std::string_view p, bool) {
      if (p.empty()) return;
      emit({p, first});
      first = false;
    });
    return;
  }
  BehaviorJoiner joiner(behavior, piece.at_start, emit);
  splitter.split(piece.text, [&](std::string_view p, bool matched) { joiner.add(p, matched); });
  joiner.finish();
}

// Splits on every occurrence of `sep`, each joined to the text after it.
void split_before(std::string_view text, std::string_view sep, bool at_start, const Emit& emit) {
  size_t begin = 0;
  // From offset 1: a separator at 0 starts the first piece, one anywhere after cuts.
  for (size_t at = text.find(sep, 1); at != std::string_view::npos;
       at = text.find(sep, at + sep.size())) {
    if (at > begin) emit({text.substr(begin, at - begin), at_start && begin == 0});
    begin = at;
  }
  if (begin < text.size()) emit({text.substr(begin), at_start && begin == 0});
}

std::string replace_all(std::string_view text, char from, std::string_view to) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    if (c == from)
      out += to;
    else
      out += c;
  }
  return out;
}

void apply_step(const PreTokenizerStep& step, Piece piece, std::deque<std::string>& storage,
                const Emit& emit) {
  using Kind = PreTokenizerStep::Kind;
  switch (step.kind) {
    case Kind::kSplit:
    case Kind::kDigits:
      split_with(*step.splitter, step.behavior, piece, emit);
      return;
    case Kind::kByteLevel:
      if (step.add_prefix_space && !piece.text.starts_with(' ')) {
        piece.text = storage.emplace_back(cat(" ", piece.text));
      }
      if (step.splitter)
        split_with(*step.splitter, SplitBehavior::kIsolated, piece, emit);
      else
        emit(piece);
      return;
    case Kind::kMetaspace: {
      std::string text = replace_all(piece.text, ' ', step.replacement);
      bool prepend = step.prepend_scheme == PrependScheme::kAlways ||
                     (step.prepend_scheme == PrependScheme::kFirst && piece.at_start);
      if (prepend && !std::string_view(text).starts_with(step.replacement))
        text.insert(0, step.replacement);
      std::string_view stored = storage.emplace_back(std::move(text));
      if (step.split)
        split_before(stored, step.replacement, piece.at_start, emit);
      else
        emit({stored, piece.at_start});
      return;
    }
  }
}

}  // namespace

PreTokenizerStep PreTokenizerStep::split_on(std::string regex, SplitBehavior behavior) {
  PreTokenizerStep step;
  step.kind = Kind::kSplit;
  step.splitter = std::make_shared<PatternSplitter>(std::move(regex));
  step.behavior = behavior;
  return step;
}

PreTokenizerStep PreTokenizerStep::split_on_text(std::string_view text, SplitBehavior behavior) {
  PreTokenizerStep step = split_on(literal_regex(text), behavior);
  step.literal = true;
  return step;
}

PreTokenizerStep PreTokenizerStep::byte_level(bool add_prefix_space, bool use_regex) {
  PreTokenizerStep step;
  step.kind = Kind::kByteLevel;
  step.add_prefix_space = add_prefix_space;
  if (use_regex)
    step.splitter =
        std::make_shared<PatternSplitter>(std::string(known_pattern_regex(KnownPattern::kGpt2)));
  return step;
}

PreTokenizerStep PreTokenizerStep::digits(bool individual) {
  PreTokenizerStep step;
  step.kind = Kind::kDigits;
  step.individual_digits = individual;
  step.splitter = std::make_shared<PatternSplitter>(individual ? "\\p{N}" : "\\p{N}+");
  step.behavior = SplitBehavior::kIsolated;
  return step;
}

PreTokenizerStep PreTokenizerStep::metaspace(std::string replacement, PrependScheme scheme,
                                             bool split) {
  POLLEN_CHECK(!replacement.empty(), "Metaspace: the replacement must not be empty");
  PreTokenizerStep step;
  step.kind = Kind::kMetaspace;
  step.replacement = std::move(replacement);
  step.prepend_scheme = scheme;
  step.split = split;
  return step;
}

void PreTokenizer::run(std::string_view text, bool at_start,
                       const std::function<void(std::string_view)>& sink) const {
  if (text.empty()) return;
  if (steps_.empty()) {
    sink(text);
    return;
  }
  std::deque<std::string> storage;
  std::vector<Piece> current{{text, at_start}}, next;
  for (size_t i = 0; i < steps_.size(); ++i) {
    bool last = i + 1 == steps_.size();
    Emit emit =
        last ? Emit([&](Piece p) { sink(p.text); }) : Emit([&](Piece p) { next.push_back(p); });
    for (const Piece& piece : current) apply_step(steps_[i], piece, storage, emit);
    current.swap(next);
    next.clear();
  }
}

}  // namespace pollen::tokenizer
