#include "model/continuation.h"

#include <algorithm>

#include "base/error.h"

namespace pollen::model {
namespace {

// How many leading bytes of `text` end on a whole UTF-8 character.
size_t whole_utf8_prefix(std::string_view text) {
  const size_t end = text.size();
  for (size_t back = 1; back <= 4 && back <= end; ++back) {
    const auto b = static_cast<unsigned char>(text[end - back]);
    if ((b & 0xc0) == 0x80) continue;  // a continuation byte: look further back
    const size_t need = (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 1;
    return need > back ? end - back : end;
  }
  return end;
}

// The length of the longest end of `text` that could be the start of a stop string.
size_t held_for_stop_strings(std::string_view text, const std::vector<std::string>& stops) {
  size_t hold = 0;
  for (const std::string& s : stops) {
    for (size_t n = std::min(s.empty() ? 0 : s.size() - 1, text.size()); n > hold; --n) {
      if (text.ends_with(std::string_view(s).substr(0, n))) {
        hold = n;
        break;
      }
    }
  }
  return hold;
}

}  // namespace

Continuation::Continuation(const Llama& model, int64_t capacity, uint64_t seed)
    : model_(model), cache_(model.config(), 1, capacity), rng_(Rng(seed).fork(0)) {}

Generation Continuation::generate(const std::vector<uint32_t>& sequence, const SamplingOptions& o,
                                  const Decoder& decode, const TextSink& on_text) {
  POLLEN_CHECK(!sequence.empty(), "generate: the sequence needs at least one token");
  POLLEN_CHECK(o.stop_strings.empty() || decode, "generate: stop strings need a decoder");
  POLLEN_CHECK(o.max_tokens >= 0, "generate: max_tokens must be >= 0");
  POLLEN_CHECK(static_cast<int64_t>(sequence.size()) + o.max_tokens <= cache_.capacity(),
               "generate: ", sequence.size(), " tokens and up to ", o.max_tokens,
               " more would exceed the context of ", cache_.capacity(), " tokens");
  size_t common = 0;
  while (common < cached_.size() && common < sequence.size() && cached_[common] == sequence[common])
    ++common;
  if (common == sequence.size()) --common;  // the last token runs again to give its logits
  cache_.truncate(0, static_cast<int64_t>(common));
  cached_.resize(common);
  reused_ = static_cast<int64_t>(common);

  const size_t V = static_cast<size_t>(model_.config().vocab_size);
  std::vector<uint32_t> feed(sequence.begin() + static_cast<std::ptrdiff_t>(common),
                             sequence.end());
  std::vector<uint32_t> seen = sequence;  // for the repetition penalty
  Generation out;
  out.finish_reason = "length";
  std::string text;
  size_t shown = 0;
  bool cut = false;
  for (int64_t step = 0; step < o.max_tokens; ++step) {
    const Tensor logits = cache_.forward(model_, {feed});
    cached_.insert(cached_.end(), feed.begin(), feed.end());
    const uint32_t next = sample_token({logits.data<float>(), V}, seen, o, rng_);
    if (std::find(o.stop_tokens.begin(), o.stop_tokens.end(), next) != o.stop_tokens.end()) {
      out.finish_reason = "stop";
      out.stop_token = next;
      break;
    }
    seen.push_back(next);
    out.tokens.push_back(next);
    feed = {next};
    if (!decode) continue;
    text = decode(out.tokens);
    if (const size_t at = first_stop(text, o.stop_strings); at != std::string::npos) {
      text.resize(at);
      cut = true;
    }
    if (cut) {
      out.finish_reason = "stop";
      break;
    }
    const size_t ready = std::min(whole_utf8_prefix(text),
                                  text.size() - held_for_stop_strings(text, o.stop_strings));
    if (on_text && ready > shown) {
      on_text(std::string_view(text).substr(shown, ready - shown));
      shown = ready;
    }
  }
  if (decode) {
    if (!cut) text = decode(out.tokens);
    if (on_text && text.size() > shown) on_text(std::string_view(text).substr(shown));
    out.text = std::move(text);
  }
  return out;
}

}  // namespace pollen::model
