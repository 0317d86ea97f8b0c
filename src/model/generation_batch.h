#pragma once
// Continuous batching: rows join and leave a running batch between steps. Each step is one
// forward for every live row (a row that has just joined runs its whole prompt beside the others'
// last tokens) and one sampling step per row. A row's result equals generate_rows() of it alone
// with its rng: rows share the GEMMs, not each other's arithmetic, so a row does not depend on
// when it joined or on whom it ran beside.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "model/generate.h"

namespace pollen::model {

class GenerationBatch {
 public:
  // use_cache false: each step recomputes every row's whole sequence (a reference); every row
  // added must agree.
  GenerationBatch(const Llama& model, Decoder decode = {}, OnToken on_token = {},
                  bool use_cache = true);

  // Queues a row for the next step (checked by check_generation_row); returns its id: 0, 1,
  // 2, ... in the order rows are added. on_token is called with this id.
  size_t add(GenerationRow row);
  size_t live() const { return live_.size(); }  // added and not finished
  // Rows of KV cache held (the most rows live at once since the batch last ran empty).
  int64_t cache_rows() const { return cache_ ? cache_->rows() : 0; }

  struct Finished {
    size_t id;
    Generation generation;
  };
  // One forward and one sampling step for every live row; returns the rows that finished (a row
  // with no budget or cancelled finishes before its forward). Once no row is live the KV cache
  // is freed.
  std::vector<Finished> step();

 private:
  struct Live {
    size_t id;
    GenerationRow row;
    std::vector<uint32_t> seq;   // the prompt and the tokens kept
    std::vector<uint32_t> feed;  // what the next forward runs for this row
    Generation out;
    int64_t slot = -1;  // its row of the KV cache, once it has one
    bool cut = false;   // out.text already cut at a stop string
  };
  Tensor forward();  // (live, V): each live row's logits for its next token
  // Samples row `r`'s next token from its logits; true when the row finished (its
  // finish_reason set).
  bool sample(Live& r, std::span<const float> logits);
  Finished finish(Live& r);  // gives back its row of the cache

  const Llama& model_;
  Decoder decode_;
  OnToken on_token_;
  bool use_cache_;
  std::optional<KvCache> cache_;
  std::vector<Live> live_;  // in the order added
  std::vector<int64_t> free_slots_;
  size_t next_id_ = 0;
};

}  // namespace pollen::model
