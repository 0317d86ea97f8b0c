#pragma once
// Continuous batching: rows join and leave a running batch between steps. Each step is one
// forward for every live row (a row that has just joined runs its prompt, or a chunk of it,
// beside the others' last tokens) and one sampling step per row whose prompt is all in. A row's
// tokens are those of generate_rows() of it alone with its rng: rows share the GEMMs, not each
// other's arithmetic (up to float rounding, which a GEMM's row count can move in the last bits).
#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <vector>

#include "model/generate.h"

namespace pollen::model {

class GenerationBatch {
 public:
  // use_cache false: each step recomputes every row's whole sequence (a reference); every row
  // added must agree. prefill_chunk > 0: a step runs at most that many prompt tokens over all rows
  // (a long prompt that joins then takes several steps, and the rows already generating do not
  // wait for all of it); 0, or a model with dynamic rope scaling (whose rotation depends on the
  // tokens run together): whole prompts.
  GenerationBatch(const Llama& model, Decoder decode = {}, OnToken on_token = {},
                  bool use_cache = true, int64_t prefill_chunk = 0);

  // Queues a row for the next step (checked by check_generation_row); returns its id: 0, 1,
  // 2, ... in the order rows are added. on_token is called with this id.
  size_t add(GenerationRow row);
  size_t live() const { return live_.size(); }  // added and not finished
  // Rows of KV cache held (the most rows live at once since the batch last ran empty).
  int64_t cache_rows() const { return cache_ ? cache_->rows() : 0; }
  // Tokens each row of the cache has room for: what the rows hold, doubled as they grow, up to
  // the longest prompt and budget.
  int64_t cache_capacity() const { return cache_ ? cache_->capacity() : 0; }

  struct Finished {
    size_t id;
    Generation generation;
    std::exception_ptr error;  // set when sampling this row failed (its generation is partial)
  };
  // One forward and one sampling step for every live row; returns the rows that finished (a row
  // with no budget or cancelled finishes before its forward). Once no row is live the KV cache
  // is freed. Throws only when the forward fails (every row is then lost).
  std::vector<Finished> step();

 private:
  struct Live {
    size_t id;
    GenerationRow row;
    std::vector<uint32_t> seq;  // the prompt and the tokens kept
    size_t cached = 0;          // tokens of seq in the KV cache
    Generation out;
    int64_t slot = -1;  // its row of the KV cache, once it has one
    bool cut = false;   // out.text already cut at a stop string
  };
  // (live, V): the logits after each live row's tokens run so far; `ready[i]`: row i's whole
  // sequence has run, so its logits are for its next token.
  Tensor forward(std::vector<bool>& ready);
  // Samples row `r`'s next token from its logits; true when the row finished (its
  // finish_reason set).
  bool sample(Live& r, std::span<const float> logits);
  Finished finish(Live& r);  // gives back its row of the cache

  const Llama& model_;
  Decoder decode_;
  OnToken on_token_;
  bool use_cache_;
  int64_t prefill_chunk_;
  std::optional<KvCache> cache_;
  std::vector<Live> live_;  // in the order added
  std::vector<int64_t> free_slots_;
  size_t next_id_ = 0;
};

}  // namespace pollen::model
