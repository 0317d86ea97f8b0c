#pragma once
// Perplexity of a model over a dataset split, every scored token counted exactly once.
//
// Each document of the split (its tokens as the shards hold them, EOS included) is scored as
// training scores it: every token but the first is predicted from the tokens before it in the
// same document. A document longer than `seq` + 1 tokens is cut into consecutive pieces that
// overlap by one token, so each target is scored once, with the context of its own piece
// (positions restart at 0 in each piece). Pieces are packed into rows of `seq` tokens (a piece
// never spans two rows; each attends only within itself) and run `batch` rows at a time.
#include <cstdint>
#include <filesystem>
#include <string>

#include "model/llama.h"

namespace pollen::eval {

struct PerplexityOptions {
  std::string split = "validation";
  int64_t seq = 128;  // tokens per row (context of a piece at most)
  int64_t batch = 8;  // rows per forward pass
};

struct PerplexityResult {
  double loss = 0;        // mean cross-entropy (nats) over scored tokens
  double perplexity = 0;  // exp(loss)
  int64_t tokens = 0;     // scored tokens
  int64_t documents = 0;
  int64_t pieces = 0;  // documents plus the extra pieces of long ones
  double seconds = 0;
};

PerplexityResult perplexity(const model::Llama& model, const std::filesystem::path& manifest,
                            const PerplexityOptions& options);

// Copies weights into the model from a safetensors file, or from `model.safetensors` in a
// checkpoint folder (of `pollen train` or `pollen fed`). A file in a folder with a checkpoint
// manifest must have the size and SHA-256 it records. Every parameter must be present with its
// shape; an error names the file and the tensor.
void load_weights(const model::Llama& model, const std::filesystem::path& checkpoint);

}  // namespace pollen::eval
