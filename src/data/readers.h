#pragma once
// Input readers: files and folders of plain text (one document per file), delimiter-split text
// (fortune files' "%" lines), and JSONL with a chosen text field; each may be gzip (.gz) or
// zstd (.zst) compressed. Bad input (a missing file, an unreadable or corrupt one, an invalid
// JSON line, a record without its text field, an over-long line) is reported as a Problem that
// names the file and line, and reading goes on. The reading thread only splits the bytes into
// documents (JSONL lines, delimited documents), reusing its buffers; decode_record parses a
// JSONL record on whichever thread processes the document.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace pollen::data {

struct SourceSpec {
  std::string name;                       // names the source in document ids and the report
  std::vector<std::string> paths;         // files or folders, relative to the config's folder
  std::string format = "text";            // "text", "delimited" or "jsonl"
  std::string delimiter = "%";            // delimited: a line equal to this ends a document
  std::string text_field = "text";        // jsonl
  std::string id_field;                   // jsonl: take ids from this field ("" = file:line)
  std::vector<std::string> include{"*"};  // file name patterns (fnmatch) in folders
  std::vector<std::string> exclude;
};

struct InputFile {
  int source = 0;              // index into the sources
  std::filesystem::path path;  // where it is read from
  std::string name;            // "<source>/<path relative to the listed path>": no absolute paths
  bool missing = false;
  std::filesystem::path listed;  // the source's path it was found under, as the config gives it
};

struct Problem {
  std::string file;    // InputFile::name
  int64_t line = 0;    // 1-based, 0 when not about a line
  std::string reason;  // snake_case, counted in the manifest
  std::string detail;
  int64_t bytes = 0;  // of the record, when known
};

// A document as read. A JSONL record comes as its raw line (`json` set, `id` empty) until
// decode_record turns it into text and id.
struct RawDoc {
  std::string id;
  std::string text;
  int64_t line = 1;  // the document's first line in its file (1-based)
  bool json = false;
};

// A file's extension in lower case: "DATA.JSONL.GZ" is gzip-compressed as "data.jsonl.gz" is.
std::string lower_extension(const std::filesystem::path& path);

// Every input file of every source in a fixed order (sources in order; within a listed path,
// files sorted by name). Paths are resolved against `base`.
std::vector<InputFile> list_inputs(const std::vector<SourceSpec>& sources,
                                   const std::filesystem::path& base);

struct ReadLimits {
  int64_t max_line_bytes = 64 << 20;  // longer lines (JSONL records, text lines) are dropped
  int64_t max_doc_bytes = 64 << 20;   // longer documents are dropped
};

// Reads one file, calling on_doc for each document and on_problem for each bad record. Returns
// the raw (compressed) bytes read and their SHA-256 through `bytes` and `sha256`. A line longer
// than max_line_bytes is skipped without being held in memory. The document passed to on_doc
// is the reader's, reused for the next one: copy or swap out what is kept. An error thrown by
// on_doc or on_problem propagates (it is not reported as a problem of the file). A .gz or .zst
// file is checked to its end (CRC, checksum, frame end) before its first document is handed
// on: a file reported unreadable hands on nothing.
void read_input(const InputFile& file, const SourceSpec& spec, const ReadLimits& limits,
                const std::function<void(RawDoc&)>& on_doc,
                const std::function<void(Problem&&)>& on_problem, int64_t& bytes,
                std::string& sha256);

// A JSONL file read in blocks of whole lines, so that splitting them into records and decoding
// those can run on other threads (split_jsonl_lines): on_block gets each block (the file's last
// line may lack its '\n') and the number of its first line; the view is valid during the call.
// Blocks are read block_bytes at a time (a block holds more when a line is longer).
// The reading thread only reads (decompressing) and hashes the bytes and finds the last line
// end of each block. A line that grows over max_line_bytes before its end is read is skipped
// and reported here, without being held. As read_input, a compressed file is checked to its end
// before its first block is handed on.
void read_jsonl_blocks(const InputFile& file, const ReadLimits& limits, size_t block_bytes,
                       const std::function<void(std::string_view, int64_t)>& on_block,
                       const std::function<void(Problem&&)>& on_problem, int64_t& bytes,
                       std::string& sha256);

// A line of a block: a record (trailing '\r' and spaces removed), or one over max_line_bytes.
struct JsonlLine {
  size_t begin = 0, size = 0;  // the record in the block
  int64_t line = 0;            // its line number in the file
  int64_t too_long_bytes = 0;  // > 0: the line is over max_line_bytes (its bytes with the '\n')
};
// Appends the lines of `block` (whole lines starting at line `first_line`) that are records or
// too long; blank lines are skipped. Returns the number of lines, blank ones included.
int64_t split_jsonl_lines(std::string_view block, int64_t first_line, int64_t max_line_bytes,
                          std::vector<JsonlLine>& out);
// The line_too_long problem of a JSONL line.
Problem line_too_long(const std::string& file_name, int64_t line, int64_t bytes,
                      int64_t max_line_bytes);

// Decodes the JSONL record at `line` of a file: its text field into `text`, its id field or
// "<file>:<line>" into `id`. Returns false and fills `problem` (invalid_json, missing_field)
// when the record is bad. `record` may be a view of `text` (it is read before `text` is
// written).
bool decode_record(std::string_view record, int64_t line, const SourceSpec& spec,
                   const std::string& file_name, std::string& id, std::string& text,
                   Problem& problem);

}  // namespace pollen::data
