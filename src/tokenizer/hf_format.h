#pragma once
// HF tokenizer.json, for the BPE families Llama-family models use: byte-level BPE (GPT-2,
// Llama 3, Qwen2: ByteLevel, Split, Digits pre-tokenizers, NFC) and SentencePiece-style BPE
// (Llama 2, Mistral: Metaspace or Prepend/Replace normalizers, <0xNN> byte fallback).
// Anything else in the file is refused with an error that names the file and the key.
#include <filesystem>
#include <string>
#include <string_view>

#include "tokenizer/tokenizer.h"

namespace pollen::tokenizer {

Tokenizer load_hf_json(const std::filesystem::path& path);
// `source` names the text in error messages (usually its file).
Tokenizer hf_from_json_text(std::string_view text, std::string_view source);

std::string hf_json_text(const Tokenizer& tokenizer);
void save_hf_json(const Tokenizer& tokenizer, const std::filesystem::path& path);

}  // namespace pollen::tokenizer
