#pragma once
// GGUF v3 out, for llama.cpp: the llama architecture's keys, the tokenizer's keys
// (tokenizer.ggml.model "gpt2": byte-level BPE) and tensors named and laid out as llama.cpp's
// convert_hf_to_gguf.py writes them (q and k rows permuted from HF's rotate-half order to
// llama.cpp's interleaved pairs; Llama 3.1 rope scaling as the rope_freqs tensor).
//
// File layout: "GGUF", version 3, tensor count and key count (u64), the keys (string, type,
// value), the tensor infos (name, dims innermost first, ggml type, offset), then the tensor data,
// everything aligned to 32 bytes. Matrices are stored in the chosen type (q8_0: blocks of 32
// int8 values with an f16 scale; matrices whose rows are not a multiple of 32 fall back to f16);
// vectors (norms, biases, rope_freqs) stay f32.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/llama.h"
#include "tokenizer/tokenizer.h"

namespace pollen::io {

enum class GgufType { f32, f16, bf16, q8_0 };
GgufType gguf_type_named(std::string_view name);  // f32, f16, bf16, q8_0

struct GgufExportOptions {
  GgufType type = GgufType::f32;
  std::optional<uint32_t> bos_token_id, eos_token_id;
  std::optional<std::string> chat_template;  // Jinja text, as tokenizer.chat_template
};

struct GgufExportResult {
  size_t tensors = 0;
  uint64_t bytes = 0;
  std::string pre_tokenizer;  // tokenizer.ggml.pre
};

// Refuses an output path that holds something other than a GGUF file (a folder, a model's
// weights, any other file): an export replaces only an earlier export.
void check_gguf_output(const std::filesystem::path& file);

// Writes `file` (through a temporary beside it, renamed when complete). Refused with an error
// naming the reason: sliding windows and dynamic rope scaling (llama.cpp's llama architecture
// has neither), SentencePiece-style tokenizers, a tokenizer larger than the model's vocabulary,
// and a pre-tokenization that no llama.cpp pre-tokenizer reproduces (naming the step).
GgufExportResult export_gguf(const model::Llama& model, const tokenizer::Tokenizer& tok,
                             const std::filesystem::path& file, const GgufExportOptions& options);

// q8_0 blocks of `values` (a multiple of 32): per block an f16 scale d = max|x| / 127 and
// round(x / d) as int8, 34 bytes a block, as ggml's quantize_row_q8_0.
std::string quantize_q8_0(std::span<const float> values);

}  // namespace pollen::io
