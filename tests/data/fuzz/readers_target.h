#pragma once
// What the data-readers fuzz target runs on each input: the input is written to a file (plain
// text, delimited text or JSONL; stored as it is, gzip or zstd compressed) and read back with
// small limits through read_input or read_jsonl_blocks, and each JSONL record through
// decode_record. Bad input must come back as Problems naming the file and the line; nothing
// may be thrown but the error a callback throws, and every byte of the file must be accounted
// for: where the file's content is known (stored as it is, or compressed here), the documents
// and problems read must be exactly those the content holds, in order. Anything else (an
// exception, a crash, a sanitizer report, a hang, a difference) is a finding, thrown as
// std::logic_error. Shared by the libFuzzer target and the deterministic corpus test.
//
// Input: five header bytes, then the content.
//   byte 0  bits 0-1  what reads it: 0 text, 1 delimited, 2 jsonl (read_input), 3 jsonl
//                     (read_jsonl_blocks, split_jsonl_lines)
//           bits 2-3  how it is stored: 0 as it is, 1 gzip, 2 zstd (compressed here), 3 as it
//                     is under a compressed name (bit 4: .zst, else .gz), so that the content is
//                     itself the compressed (or corrupt) stream
//           bit 5     jsonl: take ids from the field "id"
//           bit 6     delimited: the delimiter is the empty line, else "%"
//   byte 1  max_line_bytes (0: 1 MiB)
//   byte 2  max_doc_bytes / 4 (0: 1 MiB)
//   byte 3  bits 0-5: read_jsonl_blocks' block_bytes - 1; bits 6-7: compressed here, the content
//           is split into that many + 1 gzip members or zstd frames
//   byte 4  bit 0: zstd frames carry a checksum; bits 1-7: when not 0, the callback throws at
//           that event, and the error must reach the caller
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/hash.h"
#include "data/readers.h"
#include "tokenizer/unicode.h"

namespace pollen::fuzz {

namespace data_readers {

// What a reader handed on, in order: a document ('d': id, text, first line) or a problem ('p':
// reason, line, bytes).
struct Event {
  char kind = 'd';
  std::string id_or_reason;
  std::string text;
  int64_t line = 0;
  int64_t bytes = 0;
  bool operator==(const Event&) const = default;
};

inline std::string shown(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < 60; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  if (s.size() > 60) out += "...";
  return out;
}

inline std::string shown(const Event& e) {
  return cat(e.kind == 'd' ? "document '" : "problem '", shown(e.id_or_reason), "' line ", e.line,
             e.kind == 'd' ? " text '" : " bytes ",
             e.kind == 'd' ? shown(e.text) + "'" : std::to_string(e.bytes));
}

[[noreturn]] inline void finding(const std::string& what) {
  throw std::logic_error(what);
}

// The error the callbacks throw on request; it must reach the caller.
constexpr const char* kStop = "fuzz: stop requested by the callback";

// ---- What the content holds, per format (the readers' promise, written plainly) ----

// Lines as LineReader sees them: split at '\n'; a last line without '\n' counts when not empty.
inline std::vector<std::string_view> lines_of(std::string_view c, std::vector<bool>* newline) {
  std::vector<std::string_view> out;
  size_t b = 0;
  while (b < c.size()) {
    size_t e = c.find('\n', b);
    const bool nl = e != std::string_view::npos;
    if (!nl) e = c.size();
    out.push_back(c.substr(b, e - b));
    if (newline) newline->push_back(nl);
    b = e + 1;
  }
  return out;
}

inline std::vector<Event> expected_text(std::string_view c, size_t stored, const std::string& name,
                                        const data::ReadLimits& limits) {
  if (c.empty() && stored == 0) return {{'p', "empty_file", "", 0, 0}};
  if (static_cast<int64_t>(c.size()) > limits.max_doc_bytes)
    return {{'p', "document_too_large", "", 0, static_cast<int64_t>(c.size())}};
  return {{'d', name, std::string(c), 1, 0}};
}

inline std::vector<Event> expected_delimited(std::string_view c, const std::string& delimiter,
                                             const std::string& name,
                                             const data::ReadLimits& limits) {
  std::vector<Event> out;
  std::vector<bool> newline;
  const auto lines = lines_of(c, &newline);
  if (lines.empty()) return {{'p', "empty_file", "", 0, 0}};
  std::string doc;
  bool started = false, bad = false;
  int64_t n = 0, doc_line = 1, doc_bytes = 0;  // its lines' bytes with their line breaks
  const auto flush = [&] {
    ++n;
    if (bad || static_cast<int64_t>(doc.size()) > limits.max_doc_bytes)
      out.push_back({'p', "document_too_large", "", doc_line, doc_bytes});
    else
      out.push_back({'d', name + "#" + std::to_string(n), doc, doc_line, 0});
    doc.clear();
    started = bad = false;
    doc_bytes = 0;
  };
  for (size_t i = 0; i < lines.size(); ++i) {
    std::string_view l = lines[i];
    const bool too_long = static_cast<int64_t>(l.size()) > limits.max_line_bytes;
    if (!l.empty() && l.back() == '\r') l.remove_suffix(1);
    if (!too_long && l == delimiter) {
      flush();
      doc_line = static_cast<int64_t>(i) + 2;
      continue;
    }
    doc_bytes += static_cast<int64_t>(lines[i].size()) + (newline[i] ? 1 : 0);
    if (too_long) bad = true;
    if (started) doc += '\n';
    doc.append(l);
    started = true;
  }
  if (started || bad) flush();
  return out;
}

inline std::vector<Event> expected_jsonl(std::string_view c, const data::ReadLimits& limits) {
  std::vector<Event> out;
  if (c.empty()) return {{'p', "empty_file", "", 0, 0}};
  std::vector<bool> newline;
  const auto lines = lines_of(c, &newline);
  for (size_t i = 0; i < lines.size(); ++i) {
    const auto line = static_cast<int64_t>(i) + 1;
    std::string_view l = lines[i];
    if (static_cast<int64_t>(l.size()) > limits.max_line_bytes) {
      out.push_back(
          {'p', "line_too_long", "", line, static_cast<int64_t>(l.size()) + (newline[i] ? 1 : 0)});
      continue;
    }
    while (!l.empty() && (l.back() == '\r' || l.back() == ' ')) l.remove_suffix(1);
    if (!l.empty()) out.push_back({'d', "", std::string(l), line, 0});
  }
  return out;
}

// ---- decode_record against nlohmann's parser ----

// Why nlohmann's parser refuses a text (its exception id, 0 when it does not).
struct Refusal {
  int id = 0;
  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(int64_t) { return true; }
  bool number_unsigned(uint64_t) { return true; }
  bool number_float(double, const std::string&) { return true; }
  bool string(std::string&) { return true; }
  bool binary(nlohmann::json::binary_t&) { return true; }
  bool start_object(size_t) { return true; }
  bool key(std::string&) { return true; }
  bool end_object() { return true; }
  bool start_array(size_t) { return true; }
  bool end_array() { return true; }
  template <typename Exception>
  bool parse_error(size_t, const std::string&, const Exception& e) {
    id = e.id;
    return false;
  }
};

inline void check_record(std::string_view record, int64_t line, const data::SourceSpec& spec,
                         const std::string& name) {
  std::string id = "stale id", text = "stale text";
  data::Problem problem;
  const bool ok = data::decode_record(record, line, spec, name, id, text, problem);
  // The record may be a view of the text it is decoded into.
  std::string same(record), same_id;
  data::Problem same_problem;
  const bool same_ok = data::decode_record(same, line, spec, name, same_id, same, same_problem);
  if (same_ok != ok || (ok && (same != text || same_id != id)) ||
      (!ok && same_problem.detail != problem.detail))
    finding(cat("decode_record of line ", line, " differs when the record is a view of the text"));
  if (!ok) {
    if (problem.file != name || problem.line != line ||
        (problem.reason != "invalid_json" && problem.reason != "missing_field") ||
        problem.detail.empty() || problem.bytes != static_cast<int64_t>(record.size()))
      finding(cat("decode_record's problem for line ", line, " is '", problem.reason, "' at ",
                  problem.file, ":", problem.line, " bytes ", problem.bytes));
  }
  // Where the record is valid UTF-8, nlohmann's parser is the reference; but it takes a NUL
  // byte for the end of the text, and skips a leading UTF-8 byte order mark that decode_record
  // refuses inside a file (as RFC 8259 allows; at a file's start the reader drops it).
  if (tokenizer::valid_utf8_prefix(record) != record.size() ||
      record.find('\0') != std::string_view::npos || record.starts_with("\xef\xbb\xbf"))
    return;
  const auto j = nlohmann::json::parse(record, nullptr, false);
  const bool object = !j.is_discarded() && j.is_object();
  const bool has_text = object && j.contains(spec.text_field) && j[spec.text_field].is_string();
  if (j.is_discarded()) {
    // nlohmann refuses a number beyond double's range, which the JSON grammar allows.
    Refusal r;
    nlohmann::json::sax_parse(record, &r);
    if (r.id == 406) return;
  }
  if (!object) {
    if (ok || problem.reason != "invalid_json")
      finding(cat("line ", line, ": nlohmann refuses '", shown(record), "', decode_record ",
                  ok ? "took it" : "says " + problem.reason));
    return;
  }
  if (!has_text) {
    if (ok || problem.reason != "missing_field")
      finding(cat("line ", line, ": no string '", spec.text_field, "' in '", shown(record),
                  "', decode_record ",
                  ok ? "took it" : "says " + problem.reason + ": " + problem.detail));
    return;
  }
  if (!ok)
    finding(cat("line ", line, ": nlohmann takes '", shown(record), "', decode_record says ",
                problem.reason, ": ", problem.detail));
  if (text != j[spec.text_field].get<std::string>())
    finding(cat("line ", line, ": text '", shown(text), "' is not '",
                shown(j[spec.text_field].get<std::string>()), "'"));
  std::string want_id = cat(name, ":", line);
  if (!spec.id_field.empty() && j.contains(spec.id_field)) {
    const auto& v = j[spec.id_field];
    if (v.is_string())
      want_id = v.get<std::string>();
    else if (v.is_number())
      want_id = v.dump();
  }
  if (id != want_id)
    finding(cat("line ", line, ": id '", shown(id), "' is not '", shown(want_id), "'"));
}

// ---- Storing the content ----

inline std::string gzip(std::string_view c) {
  z_stream z{};
  if (deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK)
    finding("deflateInit2 failed");
  std::string out(deflateBound(&z, static_cast<uLong>(c.size())), '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(c.data()));
  z.avail_in = static_cast<uInt>(c.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  const int rc = deflate(&z, Z_FINISH);
  out.resize(out.size() - z.avail_out);
  deflateEnd(&z);
  if (rc != Z_STREAM_END) finding("deflate failed");
  return out;
}

inline std::string zstd(std::string_view c, bool checksum) {
  ZSTD_CCtx* cx = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(cx, ZSTD_c_checksumFlag, checksum ? 1 : 0);
  std::string out(ZSTD_compressBound(c.size()), '\0');
  const size_t n = ZSTD_compress2(cx, out.data(), out.size(), c.data(), c.size());
  ZSTD_freeCCtx(cx);
  if (ZSTD_isError(n)) finding("ZSTD_compress2 failed");
  out.resize(n);
  return out;
}

// A folder of this process for the files read, removed when the process exits.
inline const std::filesystem::path& folder() {
  struct Folder {
    std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                ("pollen_fuzz_readers_" + std::to_string(getpid()));
    Folder() { std::filesystem::create_directories(dir); }
    ~Folder() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  };
  static const Folder f;
  return f.dir;
}

inline void write_bytes(const std::filesystem::path& path, std::string_view bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) finding("cannot write " + path.string());
  const size_t n = bytes.empty() ? 0 : std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
  if (n != bytes.size()) finding("short write to " + path.string());
}

}  // namespace data_readers

// True when the file gave at least one document.
inline bool read_untrusted_input(const uint8_t* data, size_t size) {
  using namespace data_readers;
  if (size < 5) return false;
  const int format = data[0] & 3, storage = (data[0] >> 2) & 3;
  data::SourceSpec spec;
  spec.name = "fuzz";
  spec.format = format == 0 ? "text" : format == 1 ? "delimited" : "jsonl";
  spec.delimiter = (data[0] & 0x40) ? "" : "%";
  spec.id_field = (data[0] & 0x20) ? "id" : "";
  data::ReadLimits limits;
  limits.max_line_bytes = data[1] ? data[1] : 1 << 20;
  limits.max_doc_bytes = data[2] ? 4 * data[2] : 1 << 20;
  const size_t block_bytes = 1 + (data[3] & 63);
  const size_t pieces = 1 + (data[3] >> 6);
  const bool checksum = data[4] & 1;
  const int stop_at = data[4] >> 1;
  const std::string_view content(reinterpret_cast<const char*>(data + 5), size - 5);

  std::string stored;
  std::string ext = format <= 1 ? ".txt" : ".jsonl";
  if (storage == 0 || storage == 3) {
    stored = content;
    if (storage == 3) ext += (data[0] & 0x10) ? ".zst" : ".gz";
  } else {
    // The content split into members or frames, as concatenated files are.
    for (size_t i = 0; i < pieces; ++i) {
      const std::string_view part =
          content.substr(content.size() * i / pieces,
                         content.size() * (i + 1) / pieces - content.size() * i / pieces);
      stored += storage == 1 ? gzip(part) : zstd(part, checksum);
    }
    ext += storage == 1 ? ".gz" : ".zst";
  }
  const bool known = storage != 3;  // the content read must be `content`

  data::InputFile file;
  file.path = folder() / ("input" + ext);
  file.name = "fuzz/input" + ext;
  write_bytes(file.path, stored);

  std::vector<Event> got;
  int events = 0;
  int64_t output = 0;  // bytes handed on, to end a decompression bomb early
  const auto count = [&](size_t n) {
    output += static_cast<int64_t>(n);
    if (++events == stop_at) throw Error(kStop);
    if (output > (int64_t{64} << 20) || events > 1000000) throw Error(kStop);
  };
  int64_t next_line = 1;  // read_jsonl_blocks: the next line a block or a problem may be about
  bool last_block = false;
  const auto on_problem = [&](data::Problem&& p) {
    if (p.file != file.name) finding(cat("a problem names '", p.file, "', not ", file.name));
    if (p.line < 0 || p.detail.empty())
      finding(cat("problem '", p.reason, "' at line ", p.line, ": '", p.detail, "'"));
    if (p.reason == "line_too_long") {
      if (format == 3) {
        if (p.line < next_line)
          finding(cat("line_too_long at line ", p.line, " after line ", next_line - 1));
        next_line = p.line + 1;
      }
      if (p.bytes <= limits.max_line_bytes)
        finding(cat("line_too_long of ", p.bytes, " bytes under ", limits.max_line_bytes));
    }
    if (!got.empty() && got.back().kind == 'p' && got.back().id_or_reason == "unreadable_file")
      finding("a problem after unreadable_file");
    got.push_back({'p', p.reason, "", p.line, p.bytes});
    if (p.reason != "unreadable_file") count(0);
  };
  int64_t bytes = -1;
  std::string sha = "unset";
  bool stopped = false;
  try {
    if (format == 3) {
      std::vector<data::JsonlLine> lines;
      data::read_jsonl_blocks(
          file, limits, block_bytes,
          [&](std::string_view block, int64_t first) {
            if (block.empty() || last_block || first != next_line)
              finding(cat("a block at line ", first, " of ", block.size(), " bytes where line ",
                          next_line, " was next"));
            last_block = block.back() != '\n';
            lines.clear();
            const int64_t n = data::split_jsonl_lines(block, first, limits.max_line_bytes, lines);
            for (const data::JsonlLine& l : lines) {
              if (l.line < first || l.line >= first + n)
                finding(
                    cat("line ", l.line, " in a block of lines ", first, " to ", first + n - 1));
              if (l.too_long_bytes)
                on_problem(data::line_too_long(file.name, l.line, l.too_long_bytes,
                                               limits.max_line_bytes));
              else
                got.push_back({'d', "", std::string(block.substr(l.begin, l.size)), l.line, 0});
            }
            next_line = first + n;
            count(block.size());
          },
          on_problem, bytes, sha);
    } else {
      data::read_input(
          file, spec, limits,
          [&](data::RawDoc& d) {
            if (d.json != (format == 2)) finding("a document's json flag is wrong");
            got.push_back({'d', d.id, d.text, d.line, 0});
            count(d.text.size());
          },
          on_problem, bytes, sha);
    }
  } catch (const Error& e) {
    if (std::string_view(e.what()) != kStop) throw;
    stopped = true;
  }
  if (!stopped && stop_at && stop_at <= events)
    finding(cat("the callback's error at event ", stop_at, " did not reach the caller"));

  // Limits and the file's bytes.
  bool unreadable = false;
  for (const Event& e : got) {
    if (e.kind == 'p') {
      unreadable |= e.id_or_reason == "unreadable_file";
      if (e.id_or_reason == "unreadable_file" && e.bytes != 0) finding("unreadable_file bytes");
      continue;
    }
    if (e.line < 1) finding(cat("a document at line ", e.line));
    const auto n = static_cast<int64_t>(e.text.size());
    if (format >= 2 &&
        (n > limits.max_line_bytes || e.text.empty() || e.text.find('\n') != std::string::npos))
      finding(cat("a JSONL record of ", n, " bytes at line ", e.line));
    if (format <= 1 && n > limits.max_doc_bytes)
      finding(cat("a document of ", n, " bytes over max_doc_bytes = ", limits.max_doc_bytes,
                  " at line ", e.line, ": '", shown(e.text), "'"));
  }
  if (!stopped) {
    if (unreadable ? bytes != 0 || !sha.empty()
                   : bytes != static_cast<int64_t>(stored.size()) || sha != sha256_hex(stored))
      finding(cat("bytes ", bytes, " and SHA-256 '", sha, "' of a file of ", stored.size(),
                  unreadable ? " bytes that could not be read" : " bytes"));
  }

  // Exactly what the content holds, where it is known: its text, without a UTF-8 byte order
  // mark at its start.
  if (known) {
    const std::string_view text = content.starts_with("\xef\xbb\xbf") ? content.substr(3) : content;
    const std::vector<Event> want =
        format == 0   ? expected_text(text, stored.size(), file.name, limits)
        : format == 1 ? expected_delimited(text, spec.delimiter, file.name, limits)
                      : expected_jsonl(text, limits);
    if (stopped ? got.size() > want.size() : got.size() != want.size()) {
      const size_t n = std::min(got.size(), want.size());
      size_t i = 0;
      while (i < n && got[i] == want[i]) ++i;
      finding(cat(got.size(), " events read where the content holds ", want.size(),
                  "; the first difference, at ", i, ": ", i < got.size() ? shown(got[i]) : "(none)",
                  " where the content holds ", i < want.size() ? shown(want[i]) : "(none)"));
    }
    for (size_t i = 0; i < got.size(); ++i)
      if (!(got[i] == want[i]))
        finding(cat("event ", i, " read is ", shown(got[i]), " where the content holds ",
                    shown(want[i])));
  }

  // Each record decoded.
  if (format >= 2) {
    for (const Event& e : got)
      if (e.kind == 'd') check_record(e.text, e.line, spec, file.name);
    // Records cut anywhere: the decoder must refuse or take them without reading past the end.
    if (!content.empty() && content.size() < 4096) check_record(content, 1, spec, file.name);
  }

  std::filesystem::remove(file.path);
  bool any_doc = false;
  for (const Event& e : got) any_doc |= e.kind == 'd';
  return any_doc;
}

}  // namespace pollen::fuzz
