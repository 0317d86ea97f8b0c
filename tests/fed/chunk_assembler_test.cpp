// A stream of chunks is put back together only as announced: in order, within the announced
// size, whole and with its SHA-256; and what a stream holds in memory follows what it has sent.
#include <gtest/gtest.h>

#include <string>

#include "base/error.h"
#include "base/hash.h"
#include "fed/wire.h"
#include "support/errors.h"

using namespace pollen;
using namespace pollen::fed;

namespace {

pb::TensorSetHeader header_for(const std::string& bytes) {
  pb::TensorSetHeader h;
  h.set_total_bytes(bytes.size());
  h.set_sha256(sha256_hex(bytes));
  return h;
}

pb::Chunk chunk(uint64_t offset, const std::string& data) {
  pb::Chunk c;
  c.set_offset(offset);
  c.set_data(data);
  return c;
}

// Every byte differs from its neighbours, so a chunk put at the wrong place changes the hash.
std::string counting_bytes(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(i * 131 + i / 256);
  return s;
}

}  // namespace

TEST(ChunkAssembler, AssemblesTheStreamChunkByChunk) {
  const std::string bytes = counting_bytes(3 * kMaxChunkBytes + 17);
  ChunkAssembler a(header_for(bytes), "push from c1");
  for_each_chunk(bytes, kMaxChunkBytes, [&](const pb::Chunk& c) { a.add(c); });
  EXPECT_EQ(a.finish(), bytes);
}

TEST(ChunkAssembler, AnAnnouncedSizeIsNotReservedBeforeTheStreamSends) {
  // A header claiming 4 GiB, and nothing sent: the stream holds at most the up-front bound.
  pb::TensorSetHeader huge;
  huge.set_total_bytes(uint64_t{4} << 30);
  huge.set_sha256(std::string(64, '0'));
  ChunkAssembler idle(huge, "push from c1");
  EXPECT_LE(idle.held_bytes(), ChunkAssembler::kReservedUpFront);

  // Once more than the bound has come, the rest is reserved at once (no doubling past it).
  const std::string bytes =
      counting_bytes(2 * ChunkAssembler::kReservedUpFront + 3 * kMaxChunkBytes);
  ChunkAssembler a(header_for(bytes), "push from c1");
  EXPECT_LE(a.held_bytes(), ChunkAssembler::kReservedUpFront);
  uint64_t off = 0;
  while (off <= ChunkAssembler::kReservedUpFront) {
    a.add(chunk(off, bytes.substr(off, kMaxChunkBytes)));
    off += kMaxChunkBytes;
  }
  EXPECT_EQ(a.held_bytes(), bytes.size());
}

TEST(ChunkAssembler, RefusesChunksOutOfOrderEmptyOversizedOrPastTheTotal) {
  const std::string bytes = counting_bytes(1000);
  auto refuses = [&](const pb::Chunk& c, const std::string& says) {
    ChunkAssembler a(header_for(bytes), "push from c1");
    a.add(chunk(0, bytes.substr(0, 10)));
    try {
      a.add(c);
      ADD_FAILURE() << "took a chunk that should be refused (" << says << ")";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("push from c1"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refuses(chunk(11, "x"), "expected 10");                                        // a gap
  refuses(chunk(5, "x"), "expected 10");                                         // an overlap
  refuses(chunk(10, ""), "chunks hold 1 to");                                    // empty
  refuses(chunk(10, std::string(kMaxChunkBytes + 1, 'x')), "chunks hold 1 to");  // oversized
  refuses(chunk(10, bytes.substr(10) + "x"), "run past the");                    // past the total
}

TEST(ChunkAssembler, AShortOrAlteredStreamIsRefusedAtTheEnd) {
  const std::string bytes = counting_bytes(1000);
  ChunkAssembler short_stream(header_for(bytes), "pull of round 3");
  short_stream.add(chunk(0, bytes.substr(0, 999)));
  const std::string short_error = pollen::testing::error_of([&] { short_stream.finish(); });
  EXPECT_NE(short_error.find("pull of round 3: stream ended after 999 of 1000 bytes"),
            std::string::npos)
      << short_error;

  std::string altered = bytes;
  altered[500] ^= 1;
  ChunkAssembler a(header_for(bytes), "pull of round 3");
  a.add(chunk(0, altered));
  const std::string altered_error = pollen::testing::error_of([&] { a.finish(); });
  EXPECT_NE(altered_error.find("pull of round 3: SHA-256 mismatch"), std::string::npos)
      << altered_error;
}
