#pragma once
// Generation that continues one growing sequence, as a chat does turn after turn: the KV cache
// keeps what it has run, and each call runs only the part of the new sequence after the longest
// prefix it shares with the cached tokens (a conversation re-rendered with the last reply and a
// new message usually shares all of the earlier turns).
#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include "base/rng.h"
#include "model/generate.h"

namespace pollen::model {

// Receives text as generation goes: complete UTF-8 characters, never part of a stop string.
using TextSink = std::function<void(std::string_view)>;

class Continuation {
 public:
  // `capacity`: the most tokens a sequence and its generation may hold together. Sampling draws
  // from one stream across calls, Rng(seed).fork(0): the first call samples as row 0 of
  // generate with that seed does.
  Continuation(const Llama& model, int64_t capacity, uint64_t seed);

  // Generates after `sequence` (non-empty) with `options` (its seed and use_cache are not used).
  Generation generate(const std::vector<uint32_t>& sequence, const SamplingOptions& options,
                      const Decoder& decode, const TextSink& on_text = {});

  // How many tokens of the last call's sequence came from the cache instead of being run.
  int64_t reused_tokens() const { return reused_; }

 private:
  const Llama& model_;
  KvCache cache_;
  std::vector<uint32_t> cached_;  // the tokens whose keys and values the cache holds
  Rng rng_;
  int64_t reused_ = 0;
};

}  // namespace pollen::model
