#pragma once
// Documents of an input file, in batches: the lines of a text file, or the text field of each
// record of a JSONL file (the curated-text format of the data pipeline; a field holding a list of
// chat messages gives their contents, one per line).
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <string_view>

namespace pollen::tokenizer {

struct DocumentSource {
  std::filesystem::path path;
  bool jsonl = false;
  std::string field = "text";     // JSONL: the field that holds the text, or a conversation
  bool keep_line_breaks = false;  // text: whether a line keeps its '\n' (HF's trainer does)
};

// Calls fn with consecutive batches of about `batch_bytes` of documents, in file order. JSONL
// errors name the file and line. A text line's document is without its line break ("\n" or
// "\r\n") unless keep_line_breaks.
void for_each_document_batch(const DocumentSource& source, size_t batch_bytes,
                             const std::function<void(std::span<const std::string_view>)>& fn);
// The same, with the line (1-based) each document starts on, for errors about a document.
void for_each_document_batch(
    const DocumentSource& source, size_t batch_bytes,
    const std::function<void(std::span<const std::string_view>, std::span<const size_t>)>& fn);

}  // namespace pollen::tokenizer
