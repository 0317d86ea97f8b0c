#include "data/readers.h"

#include <fnmatch.h>
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <set>

#include "base/error.h"
#include "base/hash.h"
#include "base/log.h"
#include "data/json_record.h"

namespace pollen::data {
namespace fs = std::filesystem;

namespace {

// The files under `folder` whose names the source's patterns take, with their paths relative to
// `root`, in a fixed order (entries sorted by name at every level); each real folder once. Linked
// folders are not entered but added to `links`. A folder that cannot be read is an error, but for
// one this user may not read, which is warned of and left out.
void list_folder(const fs::path& folder, const fs::path& root, const SourceSpec& src,
                 std::set<fs::path>& walked, std::deque<fs::path>& links,
                 std::vector<std::pair<std::string, fs::path>>& files) {
  std::error_code ec;
  std::vector<fs::path> entries;
  for (fs::directory_iterator it(folder, ec), end; !ec && it != end; it.increment(ec))
    entries.push_back(it->path());
  if (ec == std::errc::permission_denied) {
    log::warn("data: source.", src.name, ".paths: cannot read the folder '", folder.string(), "' (",
              ec.message(), "); its files are left out");
    return;
  }
  POLLEN_CHECK(!ec, "source.", src.name, ".paths: cannot list the folder '", folder.string(),
               "': ", ec.message());
  std::sort(entries.begin(), entries.end());
  for (const fs::path& entry : entries) {
    if (fs::is_directory(entry, ec)) {
      if (fs::is_symlink(entry, ec)) {
        links.push_back(entry);
      } else {
        const fs::path real = fs::canonical(entry, ec);
        if (walked.insert(ec ? fs::absolute(entry) : real).second)
          list_folder(entry, root, src, walked, links, files);
      }
      continue;
    }
    if (!fs::is_regular_file(entry, ec)) continue;
    const std::string name = entry.filename().string();
    bool inc = false, exc = false;
    for (const auto& g : src.include) inc |= fnmatch(g.c_str(), name.c_str(), 0) == 0;
    for (const auto& g : src.exclude) exc |= fnmatch(g.c_str(), name.c_str(), 0) == 0;
    if (inc && !exc) files.push_back({entry.lexically_relative(root).generic_string(), entry});
  }
}

// The files under the listed folder `root`. Folders linked from inside it are followed after the
// real ones, each real folder once under its first name: a link back up (a loop), or to a folder
// already listed, adds nothing, so no file is read twice.
std::vector<std::pair<std::string, fs::path>> list_tree(const fs::path& root,
                                                        const SourceSpec& src) {
  std::vector<std::pair<std::string, fs::path>> files;
  std::error_code ec;
  std::set<fs::path> walked{fs::canonical(root, ec)};
  std::deque<fs::path> links;
  list_folder(root, root, src, walked, links, files);
  while (!links.empty()) {
    const fs::path link = links.front();
    links.pop_front();
    const fs::path real = fs::canonical(link, ec);
    if (!ec && walked.insert(real).second) list_folder(link, root, src, walked, links, files);
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

std::vector<InputFile> list_inputs(const std::vector<SourceSpec>& sources, const fs::path& base) {
  std::vector<InputFile> out;
  for (size_t si = 0; si < sources.size(); ++si) {
    const auto& src = sources[si];
    for (const auto& p : src.paths) {
      fs::path path = fs::path(p).is_absolute() ? fs::path(p) : base / p;
      std::error_code ec;
      if (fs::is_directory(path, ec)) {
        for (auto& [rel, full] : list_tree(path, src))
          out.push_back({static_cast<int>(si), full, src.name + "/" + rel, false, p});
      } else {
        InputFile f{static_cast<int>(si), path, src.name + "/" + path.filename().string(), false,
                    p};
        f.missing = !fs::exists(path, ec);
        out.push_back(std::move(f));
      }
    }
  }
  return out;
}

std::string lower_extension(const fs::path& path) {
  std::string ext = path.extension().string();
  for (char& ch : ext) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return ext;
}

namespace {

// A file listed as missing, or removed since it was listed (another process cleaning up).
bool gone(const InputFile& file) {
  std::error_code ec;
  return file.missing || !fs::exists(file.path, ec);
}

// The bytes of a file, decompressed when its name ends in .gz or .zst, without a UTF-8 byte
// order mark at their start (editors on Windows write one; it is not text); hashes the raw bytes.
class ByteStream {
 public:
  ByteStream(const fs::path& path, const std::string& name) : name_(name) {
    file_ = std::fopen(path.c_str(), "rb");
    POLLEN_CHECK(file_, "cannot open: ", std::strerror(errno));
    const std::string ext = lower_extension(path);
    if (ext == ".gz") {
      kind_ = 1;
      std::memset(&z_, 0, sizeof z_);
      POLLEN_CHECK(inflateInit2(&z_, 15 + 32) == Z_OK, "zlib init failed");
    } else if (ext == ".zst") {
      kind_ = 2;
      zs_ = ZSTD_createDStream();
      ZSTD_initDStream(zs_);
    }
    raw_.resize(1 << 20);
  }
  ~ByteStream() {
    if (file_) std::fclose(file_);
    if (kind_ == 1) inflateEnd(&z_);
    if (zs_) ZSTD_freeDStream(zs_);
  }
  int64_t raw_bytes() const { return raw_bytes_; }
  std::string sha256() { return sha_.hex_digest(); }

  // Fills up to n bytes; returns 0 at the end.
  size_t read(char* out, size_t n) {
    if (!head_read_) {
      head_read_ = true;
      while (head_len_ < 3) {
        const size_t got = read_decoded(head_ + head_len_, 3 - head_len_);
        if (got == 0) break;
        head_len_ += got;
      }
      if (head_len_ == 3 && std::memcmp(head_, "\xEF\xBB\xBF", 3) == 0) head_len_ = 0;
    }
    if (head_pos_ < head_len_) {
      const size_t k = std::min(n, head_len_ - head_pos_);
      std::memcpy(out, head_ + head_pos_, k);
      head_pos_ += k;
      return k;
    }
    return read_decoded(out, n);
  }

 private:
  // The file's bytes as they come, decompressed.
  size_t read_decoded(char* out, size_t n) {
    if (kind_ == 0) return fill_raw_direct(out, n);
    while (true) {
      if (raw_pos_ == raw_len_ && !eof_) refill();
      if (kind_ == 1) {
        if (raw_pos_ == raw_len_ && eof_) {
          POLLEN_CHECK(stream_done_ || raw_bytes_ == 0, "truncated gzip stream");
          return 0;
        }
        if (stream_done_) {
          // Zero bytes after a member are padding (a tape's or a block device's), which gzip
          // and Python's gzip take as the end; anything else begins another member.
          while (raw_pos_ < raw_len_ && raw_[raw_pos_] == 0) ++raw_pos_;
          if (raw_pos_ == raw_len_) continue;
          POLLEN_CHECK(inflateReset(&z_) == Z_OK, "zlib reset failed");
          stream_done_ = false;
        }
        z_.next_in = reinterpret_cast<Bytef*>(raw_.data() + raw_pos_);
        z_.avail_in = static_cast<uInt>(raw_len_ - raw_pos_);
        z_.next_out = reinterpret_cast<Bytef*>(out);
        z_.avail_out = static_cast<uInt>(n);
        int rc = inflate(&z_, Z_NO_FLUSH);
        POLLEN_CHECK(rc == Z_OK || rc == Z_STREAM_END || rc == Z_BUF_ERROR,
                     "corrupt gzip data (zlib: ", z_.msg ? z_.msg : "error", ")");
        raw_pos_ = raw_len_ - z_.avail_in;
        if (rc == Z_STREAM_END) stream_done_ = true;
        size_t got = n - z_.avail_out;
        if (got) return got;
        if (rc == Z_BUF_ERROR && raw_pos_ == raw_len_ && eof_) fail("truncated gzip stream");
      } else {
        if (raw_pos_ == raw_len_ && eof_) {
          POLLEN_CHECK(zstd_frame_done_, "truncated zstd stream");
          return 0;
        }
        ZSTD_inBuffer in{raw_.data() + raw_pos_, raw_len_ - raw_pos_, 0};
        ZSTD_outBuffer o{out, n, 0};
        size_t rc = ZSTD_decompressStream(zs_, &o, &in);
        POLLEN_CHECK(!ZSTD_isError(rc), "corrupt zstd data (", ZSTD_getErrorName(rc), ")");
        zstd_frame_done_ = rc == 0;
        raw_pos_ += in.pos;
        if (o.pos) return o.pos;
      }
    }
  }

  void refill() {
    raw_len_ = std::fread(raw_.data(), 1, raw_.size(), file_);
    POLLEN_CHECK(!std::ferror(file_), "read error: ", std::strerror(errno));
    raw_pos_ = 0;
    if (raw_len_ == 0) eof_ = true;
    sha_.update(raw_.data(), raw_len_);
    raw_bytes_ += static_cast<int64_t>(raw_len_);
  }
  size_t fill_raw_direct(char* out, size_t n) {
    size_t got = std::fread(out, 1, n, file_);
    POLLEN_CHECK(!std::ferror(file_), "read error: ", std::strerror(errno));
    sha_.update(out, got);
    raw_bytes_ += static_cast<int64_t>(got);
    return got;
  }

  std::string name_;
  std::FILE* file_ = nullptr;
  int kind_ = 0;
  z_stream z_{};
  ZSTD_DStream* zs_ = nullptr;
  std::vector<char> raw_;
  size_t raw_pos_ = 0, raw_len_ = 0;
  bool eof_ = false, stream_done_ = false, zstd_frame_done_ = true;
  Sha256 sha_;
  int64_t raw_bytes_ = 0;
  char head_[3] = {};  // the first bytes, held back until they are known not to be a mark
  size_t head_len_ = 0, head_pos_ = 0;
  bool head_read_ = false;
};

// Lines of a ByteStream; a line longer than `cap` is reported as too long and skipped.
class LineReader {
 public:
  LineReader(ByteStream& in, int64_t cap) : in_(in), cap_(static_cast<size_t>(cap)) {
    buf_.resize(1 << 20);
  }
  // Returns false at the end. `too_long` is set for an over-long line (whose text is dropped).
  bool next(std::string& line, bool& too_long) {
    line.clear();
    too_long = false;
    length_ = 0;
    while (true) {
      if (pos_ == len_) {
        len_ = in_.read(buf_.data(), buf_.size());
        pos_ = 0;
        if (len_ == 0) {
          if (length_ == 0) return false;
          ++number_;  // a last line without '\n'
          return true;
        }
      }
      const char* b = buf_.data() + pos_;
      const char* nl = static_cast<const char*>(std::memchr(b, '\n', len_ - pos_));
      size_t take = nl ? static_cast<size_t>(nl - b) : len_ - pos_;
      length_ += static_cast<int64_t>(take) + (nl ? 1 : 0);
      if (!too_long) {
        if (line.size() + take > cap_) {
          too_long = true;
          line.clear();
          line.shrink_to_fit();
        } else {
          line.append(b, take);
        }
      }
      pos_ += take;
      if (nl) {
        ++pos_;
        ++number_;
        return true;
      }
    }
  }
  int64_t number() const { return number_; }  // of the line last returned (1-based)
  int64_t length() const { return length_; }  // its bytes, with its '\n'

 private:
  ByteStream& in_;
  size_t cap_;
  std::vector<char> buf_;
  size_t pos_ = 0, len_ = 0;
  int64_t number_ = 0, length_ = 0;
};

// Reads a .gz or .zst file to its end without keeping what it holds. gzip's CRC and length and
// zstd's checksum and frame end are only checked at the end of the stream, after the damaged
// bytes before them were decompressed: a file must pass this before any of its text is handed
// on, so that a file reported unreadable contributes no documents. Costs one more
// decompression, no memory.
void verify_compressed(const InputFile& file) {
  const std::string ext = lower_extension(file.path);
  if (ext != ".gz" && ext != ".zst") return;
  ByteStream in(file.path, file.name);
  std::vector<char> buf(1 << 20);
  while (in.read(buf.data(), buf.size()) > 0) {
  }
}

// The JSONL blocks of an open stream; `line_no` follows the last line handed on or reported.
void jsonl_blocks(ByteStream& in, const InputFile& file, const ReadLimits& limits,
                  size_t block_bytes,
                  const std::function<void(std::string_view, int64_t)>& on_block,
                  const std::function<void(Problem&&)>& on_problem, int64_t& line_no) {
  const auto cap = static_cast<size_t>(limits.max_line_bytes);
  std::vector<char> chunk(std::max<size_t>(block_bytes, 1));
  std::string pending;    // the start of a line whose end is not read yet
  int64_t skipping = -1;  // >= 0: bytes so far of an over-long line being skipped
  bool any = false;
  for (size_t n; (n = in.read(chunk.data(), chunk.size())) > 0;) {
    any = true;
    std::string_view c(chunk.data(), n);
    if (skipping >= 0) {
      const size_t nl = c.find('\n');
      if (nl == std::string_view::npos) {
        skipping += static_cast<int64_t>(n);
        continue;
      }
      on_problem(line_too_long(file.name, ++line_no, skipping + static_cast<int64_t>(nl + 1),
                               limits.max_line_bytes));
      skipping = -1;
      c.remove_prefix(nl + 1);
    }
    const size_t last = c.rfind('\n');
    if (last != std::string_view::npos) {
      std::string_view block = c.substr(0, last + 1);
      if (!pending.empty()) block = pending.append(block);
      on_block(block, line_no + 1);
      line_no += std::count(block.begin(), block.end(), '\n');
      pending.assign(c.substr(last + 1));
    } else {
      pending.append(c);
    }
    if (pending.size() > cap) {
      skipping = static_cast<int64_t>(pending.size());
      std::string().swap(pending);
    }
  }
  if (skipping >= 0)
    on_problem(line_too_long(file.name, ++line_no, skipping, limits.max_line_bytes));
  else if (!pending.empty())
    on_block(pending, line_no + 1);
  if (!any) on_problem({file.name, 0, "empty_file", "the file is empty"});
}

}  // namespace

void read_jsonl_blocks(const InputFile& file, const ReadLimits& limits, size_t block_bytes,
                       const std::function<void(std::string_view, int64_t)>& on_block,
                       const std::function<void(Problem&&)>& on_problem, int64_t& bytes,
                       std::string& sha256) {
  bytes = 0;
  sha256.clear();
  if (gone(file)) {
    on_problem({file.name, 0, "missing_file", "no such file"});
    return;
  }
  int64_t line_no = 0;
  // Errors thrown by the callbacks are the caller's: they propagate instead of being reported
  // as an unreadable file.
  bool in_callback = false;
  try {
    verify_compressed(file);
    ByteStream in(file.path, file.name);
    jsonl_blocks(
        in, file, limits, block_bytes,
        [&](std::string_view block, int64_t first) {
          in_callback = true;
          on_block(block, first);
          in_callback = false;
        },
        [&](Problem&& p) {
          in_callback = true;
          on_problem(std::move(p));
          in_callback = false;
        },
        line_no);
    bytes = in.raw_bytes();
    sha256 = in.sha256();
  } catch (const Error& e) {
    if (in_callback) throw;
    on_problem({file.name, line_no, "unreadable_file", e.what()});
  }
}

int64_t split_jsonl_lines(std::string_view block, int64_t first_line, int64_t max_line_bytes,
                          std::vector<JsonlLine>& out) {
  int64_t line = first_line;
  for (size_t b = 0; b < block.size(); ++line) {
    size_t e = block.find('\n', b);
    const bool has_newline = e != std::string_view::npos;
    if (!has_newline) e = block.size();
    const size_t length = e - b;
    if (static_cast<int64_t>(length) > max_line_bytes) {
      out.push_back({b, 0, line, static_cast<int64_t>(length + has_newline)});
    } else {
      size_t n = length;
      while (n > 0 && (block[b + n - 1] == '\r' || block[b + n - 1] == ' ')) --n;
      if (n > 0) out.push_back({b, n, line, 0});
    }
    b = e + 1;
  }
  return line - first_line;
}

Problem line_too_long(const std::string& file_name, int64_t line, int64_t bytes,
                      int64_t max_line_bytes) {
  return {file_name, line, "line_too_long",
          cat("a line of ", bytes, " bytes is over max_line_bytes = ", max_line_bytes), bytes};
}

void read_input(const InputFile& file, const SourceSpec& spec, const ReadLimits& limits,
                const std::function<void(RawDoc&)>& on_doc,
                const std::function<void(Problem&&)>& on_problem, int64_t& bytes,
                std::string& sha256) {
  bytes = 0;
  sha256.clear();
  if (gone(file)) {
    on_problem({file.name, 0, "missing_file", "no such file"});
    return;
  }
  int64_t line_no = 0;
  // Errors thrown by the callbacks are the caller's: they propagate instead of being reported
  // as an unreadable file.
  bool in_callback = false;
  auto doc_out = [&](RawDoc& d) {
    in_callback = true;
    on_doc(d);
    in_callback = false;
  };
  auto problem_out = [&](Problem&& p) {
    in_callback = true;
    on_problem(std::move(p));
    in_callback = false;
  };
  try {
    verify_compressed(file);
    ByteStream in(file.path, file.name);
    RawDoc d;
    if (spec.format == "text") {
      std::string& text = d.text;
      std::vector<char> buf(1 << 20);
      bool too_big = false;
      int64_t total = 0;
      for (size_t n; (n = in.read(buf.data(), buf.size())) > 0;) {
        total += static_cast<int64_t>(n);
        if (!too_big && static_cast<int64_t>(text.size() + n) > limits.max_doc_bytes) {
          too_big = true;
          text.clear();
          text.shrink_to_fit();
        }
        if (!too_big) text.append(buf.data(), n);
      }
      if (too_big)
        problem_out({file.name, 0, "document_too_large",
                     cat("the document's ", total,
                         " bytes are over max_doc_bytes = ", limits.max_doc_bytes),
                     total});
      else if (in.raw_bytes() == 0)
        problem_out({file.name, 0, "empty_file", "the file is empty"});
      else {
        d.id = file.name;
        doc_out(d);
      }
    } else if (spec.format == "delimited") {
      LineReader lines(in, limits.max_line_bytes);
      std::string line;
      std::string& doc = d.text;
      bool too_long = false, doc_bad = false, any = false, started = false;
      int64_t n = 0, doc_line = 1;
      int64_t doc_bytes = 0,
              long_line = 0;  // the document's lines with their '\n'; an over-long one
      auto flush = [&]() {
        ++n;
        if (doc_bad)
          problem_out({file.name, doc_line, "document_too_large",
                       long_line > 0 ? cat("its line ", long_line,
                                           " is over max_line_bytes = ", limits.max_line_bytes)
                                     : cat("the document (", doc_bytes,
                                           " bytes with its line breaks) is over max_doc_bytes = ",
                                           limits.max_doc_bytes),
                       doc_bytes});
        else {
          d.id.assign(file.name).append("#").append(std::to_string(n));
          d.line = doc_line;
          doc_out(d);
        }
        doc.clear();
        doc_bad = false;
        started = false;
        doc_bytes = long_line = 0;
      };
      while (lines.next(line, too_long)) {
        any = true;
        line_no = lines.number();
        std::string_view l(line);
        if (!l.empty() && l.back() == '\r') l.remove_suffix(1);
        if (!too_long && l == spec.delimiter) {
          flush();
          doc_line = line_no + 1;
          continue;
        }
        doc_bytes += lines.length();
        if (too_long && long_line == 0) long_line = line_no;
        // The document as it would be: its lines so far, a '\n', then this line.
        const size_t joined = doc.size() + (started ? 1 : 0) + l.size();
        if (too_long || static_cast<int64_t>(joined) > limits.max_doc_bytes) {
          doc_bad = true;
          doc.clear();
          started = true;
          continue;
        }
        if (!doc_bad) {
          if (started) doc += '\n';
          doc.append(l);
          started = true;
        }
      }
      // A last document without a closing delimiter.
      if (started || doc_bad) flush();
      if (!any) problem_out({file.name, 0, "empty_file", "the file is empty"});
    } else if (spec.format == "jsonl") {
      std::vector<JsonlLine> lines;
      d.json = true;
      jsonl_blocks(
          in, file, limits, 1 << 20,
          [&](std::string_view block, int64_t first) {
            lines.clear();
            split_jsonl_lines(block, first, limits.max_line_bytes, lines);
            for (const JsonlLine& l : lines) {
              if (l.too_long_bytes) {
                problem_out(
                    line_too_long(file.name, l.line, l.too_long_bytes, limits.max_line_bytes));
                continue;
              }
              d.text.assign(block.substr(l.begin, l.size));
              d.line = l.line;
              doc_out(d);
            }
          },
          problem_out, line_no);
    } else {
      fail("unknown format '", spec.format, "'");
    }
    bytes = in.raw_bytes();
    sha256 = in.sha256();
  } catch (const Error& e) {
    if (in_callback) throw;
    on_problem({file.name, line_no, "unreadable_file", e.what()});
  }
}

bool decode_record(std::string_view record, int64_t line, const SourceSpec& spec,
                   const std::string& file_name, std::string& id, std::string& text,
                   Problem& problem) {
  thread_local RecordFields fields;
  const auto bytes = static_cast<int64_t>(record.size());
  std::string error = parse_record(record, spec.text_field, spec.id_field, fields);
  if (!error.empty()) {
    problem = {file_name, line, "invalid_json", std::move(error), bytes};
    return false;
  }
  if (!fields.has_text) {
    problem = {file_name, line, "missing_field", cat("no string field '", spec.text_field, "'"),
               bytes};
    return false;
  }
  if (fields.has_id)
    id.swap(fields.id);
  else
    id = cat(file_name, ":", line);
  text.swap(fields.text);
  return true;
}

}  // namespace pollen::data
