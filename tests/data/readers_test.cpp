// The input readers on small files written here: what each reads and what it reports.
#include <gtest/gtest.h>

#include <unistd.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "data/readers.h"

using namespace pollen;
using namespace pollen::data;
namespace fs = std::filesystem;

namespace {

struct Read {
  std::vector<RawDoc> docs;
  std::vector<Problem> problems;
};

Read read_file_as(const std::string& name, const std::string& content, const SourceSpec& spec,
                  const ReadLimits& limits) {
  const fs::path dir = fs::temp_directory_path() / ("pollen_readers_" + std::to_string(getpid()));
  fs::create_directories(dir);
  const fs::path path = dir / name;
  std::ofstream(path, std::ios::binary) << content;
  Read r;
  int64_t bytes = 0;
  std::string sha;
  read_input(
      {0, path, "src/" + name, false}, spec, limits, [&](RawDoc& d) { r.docs.push_back(d); },
      [&](Problem&& p) { r.problems.push_back(std::move(p)); }, bytes, sha);
  fs::remove_all(dir);
  return r;
}

// `text` as one gzip member.
std::string gzip(const std::string& text) {
  z_stream z{};
  EXPECT_EQ(deflateInit2(&z, Z_DEFAULT_COMPRESSION, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY),
            Z_OK);
  std::string out(deflateBound(&z, text.size()), '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(text.data()));
  z.avail_in = static_cast<uInt>(text.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&z, Z_FINISH), Z_STREAM_END);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

}  // namespace

// Zero bytes after the last gzip member are padding, as gzip and Python's gzip read them: the
// file is read whole. Other bytes after it are a member, and a broken one makes it unreadable.
TEST(Readers, ZeroPaddingAfterTheLastGzipMemberIsTheEnd) {
  const SourceSpec jsonl{.name = "src", .format = "jsonl"};
  const std::string records = "{\"text\": \"one\"}\n{\"text\": \"two\"}\n";
  Read r = read_file_as("f.jsonl.gz", gzip(records) + std::string(2000000, '\0'), jsonl, {});
  EXPECT_TRUE(r.problems.empty()) << r.problems[0].reason << ": " << r.problems[0].detail;
  EXPECT_EQ(r.docs.size(), 2u);
  r = read_file_as("g.jsonl.gz",
                   gzip(records) + gzip("{\"text\": \"three\"}\n") + std::string(512, '\0'), jsonl,
                   {});
  EXPECT_TRUE(r.problems.empty()) << r.problems[0].reason << ": " << r.problems[0].detail;
  EXPECT_EQ(r.docs.size(), 3u);
  r = read_file_as("h.jsonl.gz", gzip(records) + std::string(512, '\0') + "garbage", jsonl, {});
  ASSERT_EQ(r.problems.size(), 1u);
  EXPECT_EQ(r.problems[0].reason, "unreadable_file");
}

// max_doc_bytes bounds a delimited document as it is handed on, its lines joined by '\n': two
// lines that fit only without the '\n' between them make a document over the limit.
TEST(Readers, ADelimitedDocumentOverTheLimitWithItsLineBreaksIsDropped) {
  SourceSpec spec{.name = "src", .format = "delimited"};
  ReadLimits limits;
  limits.max_doc_bytes = 4;
  const Read r = read_file_as("f.txt", "ab\ncd\n%\nab\nc\n%\nabcd\n", spec, limits);
  ASSERT_EQ(r.problems.size(), 1u);
  EXPECT_EQ(r.problems[0].reason, "document_too_large");
  EXPECT_EQ(r.problems[0].file, "src/f.txt");
  EXPECT_EQ(r.problems[0].line, 1);
  EXPECT_EQ(r.problems[0].detail,
            "the document (6 bytes with its line breaks) is over max_doc_bytes = 4");
  EXPECT_EQ(r.problems[0].bytes, 6);
  ASSERT_EQ(r.docs.size(), 2u);
  EXPECT_EQ(r.docs[0].text, "ab\nc");
  EXPECT_EQ(r.docs[0].line, 4);
  EXPECT_EQ(r.docs[0].id, "src/f.txt#2");
  EXPECT_EQ(r.docs[1].text, "abcd");
  for (const RawDoc& d : r.docs) EXPECT_LE(d.text.size(), 4u) << d.id;
}

// A document dropped for its size says which limit it passed and counts its bytes: a text
// file's, and a delimited document with a line over max_line_bytes.
TEST(Readers, ADocumentTooLargeSaysWhichLimitAndCountsItsBytes) {
  ReadLimits limits;
  limits.max_doc_bytes = 10;
  Read r = read_file_as("f.txt", std::string(25, 'a'), {.name = "src", .format = "text"}, limits);
  ASSERT_EQ(r.problems.size(), 1u);
  EXPECT_EQ(r.problems[0].detail, "the document's 25 bytes are over max_doc_bytes = 10");
  EXPECT_EQ(r.problems[0].bytes, 25);
  limits.max_line_bytes = 4;
  r = read_file_as("g.txt", "ab\nabcdefg\ncd\n%\nok\n", {.name = "src", .format = "delimited"},
                   limits);
  ASSERT_EQ(r.problems.size(), 1u);
  EXPECT_EQ(r.problems[0].detail, "its line 2 is over max_line_bytes = 4");
  EXPECT_EQ(r.problems[0].bytes, 3 + 8 + 3);
  ASSERT_EQ(r.docs.size(), 1u);
  EXPECT_EQ(r.docs[0].text, "ok");
}

// A UTF-8 byte order mark at the start of a file (as editors on Windows write) is not text: the
// first JSONL record parses, and a text file's document does not begin with it.
TEST(Readers, AByteOrderMarkAtTheStartOfAFileIsDropped) {
  const std::string bom = "\xEF\xBB\xBF";
  const SourceSpec jsonl{.name = "src", .format = "jsonl"};
  Read r = read_file_as("f.jsonl", bom + "{\"text\": \"one\"}\n{\"text\": \"two\"}\n", jsonl, {});
  EXPECT_TRUE(r.problems.empty()) << r.problems[0].reason << ": " << r.problems[0].detail;
  ASSERT_EQ(r.docs.size(), 2u);
  EXPECT_EQ(r.docs[0].text, "{\"text\": \"one\"}");  // the raw record, decoded later
  const SourceSpec text{.name = "src", .format = "text"};
  r = read_file_as("f.txt", bom + "Hello there.", text, {});
  ASSERT_EQ(r.docs.size(), 1u);
  EXPECT_EQ(r.docs[0].text, "Hello there.");
  // Only at the start: a mark inside the text stays, and a file of fewer bytes is read whole.
  r = read_file_as("g.txt", "Hi " + bom, text, {});
  ASSERT_EQ(r.docs.size(), 1u);
  EXPECT_EQ(r.docs[0].text, "Hi " + bom);
  r = read_file_as("h.txt", "\xEF\xBB", text, {});
  ASSERT_EQ(r.docs.size(), 1u);
  EXPECT_EQ(r.docs[0].text, "\xEF\xBB");
}
