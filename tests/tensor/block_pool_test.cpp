// BlockPool's bookkeeping on made-up addresses (the pool never touches its memory): best fit,
// splits, merges, the small and large pools, segments going back, and a random workload whose
// blocks must never overlap.
#include "tensor/block_pool.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <iterator>
#include <map>
#include <random>
#include <vector>

namespace pollen {
namespace {

constexpr size_t kKiB = 1024, kMiB = 1024 * 1024;

// Segments at made-up addresses, 1 GiB apart, so that no two can touch.
struct FakeSegments {
  uintptr_t next = uintptr_t{1} << 40;
  size_t limit = SIZE_MAX;  // bytes it may hand out in all
  size_t out = 0;
  std::map<uintptr_t, size_t> live;  // address -> size
  std::vector<size_t> allocated, released;

  BlockPool::Source source() {
    return {[this](size_t bytes) -> void* {
              if (out + bytes > limit) return nullptr;
              const uintptr_t p = next;
              next += size_t{1} << 30;
              live[p] = bytes;
              out += bytes;
              allocated.push_back(bytes);
              return reinterpret_cast<void*>(p);
            },
            [this](void* ptr, size_t bytes) {
              const auto it = live.find(reinterpret_cast<uintptr_t>(ptr));
              ASSERT_NE(it, live.end());
              EXPECT_EQ(it->second, bytes);
              live.erase(it);
              out -= bytes;
              released.push_back(bytes);
            }};
  }
};

uintptr_t address(void* p) {
  return reinterpret_cast<uintptr_t>(p);
}

TEST(BlockPool, SmallRequestsShareATwoMebibyteSegmentBackToBack) {
  FakeSegments segments;
  BlockPool pool(segments.source());
  size_t a_size = 0, b_size = 0;
  void* a = pool.allocate(1, &a_size);
  void* b = pool.allocate(700, &b_size);
  EXPECT_EQ(a_size, 512u);
  EXPECT_EQ(b_size, 1024u);
  EXPECT_EQ(address(b), address(a) + 512);
  EXPECT_EQ(segments.allocated, (std::vector<size_t>{2 * kMiB}));
  EXPECT_EQ(pool.in_use_bytes(), 1536u);
  EXPECT_EQ(pool.reserved_bytes(), 2 * kMiB);
}

TEST(BlockPool, TakesTheSmallestFreeBlockThatFits) {
  FakeSegments segments;
  BlockPool pool(segments.source());
  size_t size = 0;
  // Free blocks of 4 KiB and 16 KiB, each held apart by a block in use.
  void* big = pool.allocate(16 * kKiB, &size);
  void* keep1 = pool.allocate(512, &size);
  void* small = pool.allocate(4 * kKiB, &size);
  void* keep2 = pool.allocate(512, &size);
  pool.release(big);
  pool.release(small);
  void* p = pool.allocate(3 * kKiB, &size);
  EXPECT_EQ(p, small);  // not the 16 KiB block, which comes first in the segment
  EXPECT_EQ(size, 3 * kKiB);
  void* q = pool.allocate(10 * kKiB, &size);
  EXPECT_EQ(q, big);
  EXPECT_EQ(segments.allocated.size(), 1u);
  for (void* r : {p, q, keep1, keep2}) pool.release(r);
}

TEST(BlockPool, FreedNeighboursMergeAndAWholeSegmentGoesBack) {
  FakeSegments segments;
  BlockPool pool(segments.source());
  size_t size = 0;
  void* a = pool.allocate(64 * kKiB, &size);
  void* b = pool.allocate(64 * kKiB, &size);
  void* c = pool.allocate(64 * kKiB, &size);
  pool.release(a);
  pool.release(c);
  EXPECT_EQ(pool.release_free_segments(), 0u);  // b still holds the segment
  pool.release(b);                              // a, b, c and the rest: one free block
  // The merged block serves the largest small request from the segment's start (unmerged, the
  // best fit would be the block after b).
  void* whole = pool.allocate(kMiB, &size);
  EXPECT_EQ(whole, a);
  EXPECT_EQ(segments.allocated.size(), 1u);
  pool.release(whole);
  EXPECT_EQ(pool.release_free_segments(), 2 * kMiB);
  EXPECT_EQ(segments.released, (std::vector<size_t>{2 * kMiB}));
  EXPECT_EQ(pool.reserved_bytes(), 0u);
  EXPECT_TRUE(segments.live.empty());
}

TEST(BlockPool, AFreedLargeBlockIsSplitForSmallerLargeRequests) {
  FakeSegments segments;
  BlockPool pool(segments.source());
  size_t size = 0;
  void* grads = pool.allocate(64 * kMiB, &size);  // above 10 MiB: a segment of its own size
  EXPECT_EQ(segments.allocated, (std::vector<size_t>{64 * kMiB}));
  pool.release(grads);
  void* x = pool.allocate(24 * kMiB, &size);
  void* y = pool.allocate(30 * kMiB, &size);
  EXPECT_EQ(x, grads);
  EXPECT_EQ(address(y), address(x) + 24 * kMiB);
  EXPECT_EQ(segments.allocated.size(), 1u);  // no new segment
  // 10 MiB left: more than a small request, so it was split off and serves the next one.
  void* z = pool.allocate(9 * kMiB + 512 * kKiB, &size);
  EXPECT_EQ(address(z), address(y) + 30 * kMiB);
  // What is left of that split, 512 KiB, is not worth a block of its own: z holds it.
  EXPECT_EQ(size, 10 * kMiB);
  EXPECT_EQ(pool.in_use_bytes(), 64 * kMiB);
  for (void* p : {x, y, z}) pool.release(p);
}

TEST(BlockPool, SegmentSizesFollowTheRequest) {
  FakeSegments segments;
  BlockPool pool(segments.source());
  size_t size = 0;
  void* c = pool.allocate(11 * kMiB + 1, &size);  // above 10 MiB: its size in 2 MiB steps
  EXPECT_EQ(size, 12 * kMiB);  // the 1 MiB - 512 bytes left over are not worth a block: c's
  void* b = pool.allocate(kMiB + 1, &size);  // up to 10 MiB: 20 MiB
  void* a = pool.allocate(kMiB, &size);      // small: 2 MiB
  EXPECT_EQ(segments.allocated, (std::vector<size_t>{12 * kMiB, 20 * kMiB, 2 * kMiB}));
  for (void* p : {a, b, c}) pool.release(p);
}

TEST(BlockPool, SmallAndLargeRequestsDoNotShareSegments) {
  FakeSegments segments;
  BlockPool pool(segments.source());
  size_t size = 0;
  void* large = pool.allocate(4 * kMiB, &size);  // a 20 MiB segment, 16 MiB of it free
  void* small = pool.allocate(4 * kKiB, &size);  // not from there: a small segment
  EXPECT_EQ(segments.allocated, (std::vector<size_t>{20 * kMiB, 2 * kMiB}));
  EXPECT_NE(address(small) >> 30, address(large) >> 30);
  pool.release(large);
  pool.release(small);
}

TEST(BlockPool, ReturnsNullWhenTheSourceHasNoMore) {
  FakeSegments segments;
  segments.limit = 20 * kMiB;
  BlockPool pool(segments.source());
  size_t size = 0;
  void* a = pool.allocate(8 * kMiB, &size);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(pool.allocate(21 * kMiB, &size), nullptr);
  EXPECT_EQ(pool.in_use_bytes(), 8 * kMiB);
  void* b = pool.allocate(12 * kMiB, &size);  // the segment's rest still serves
  EXPECT_EQ(address(b), address(a) + 8 * kMiB);
  pool.release(a);
  pool.release(b);
}

TEST(BlockPool, ARandomWorkloadNeverOverlapsAndGivesEverythingBack) {
  FakeSegments segments;
  BlockPool pool(segments.source());
  std::mt19937_64 rng(7);
  std::map<uintptr_t, size_t> held;  // address -> block size
  size_t held_bytes = 0;
  const size_t sizes[] = {1, 512, 3000, 64 * kKiB, kMiB, kMiB + 1, 5 * kMiB, 24 * kMiB};
  for (int step = 0; step < 20000; ++step) {
    if (held.empty() || rng() % 100 < 55) {
      const size_t want = sizes[rng() % 8] + rng() % 4096;
      size_t size = 0;
      void* p = pool.allocate(want, &size);
      ASSERT_NE(p, nullptr);
      ASSERT_GE(size, want);
      ASSERT_EQ(address(p) % BlockPool::kAlignment, 0u);
      // Neither neighbour in address order overlaps the new block.
      const auto next = held.lower_bound(address(p));
      if (next != held.end()) ASSERT_GE(next->first, address(p) + size);
      if (next != held.begin()) {
        const auto prev = std::prev(next);
        ASSERT_LE(prev->first + prev->second, address(p));
      }
      held[address(p)] = size;
      held_bytes += size;
    } else {
      auto it = held.begin();
      std::advance(it, static_cast<long>(rng() % held.size()));
      EXPECT_EQ(pool.release(reinterpret_cast<void*>(it->first)), it->second);
      held_bytes -= it->second;
      held.erase(it);
    }
    ASSERT_EQ(pool.in_use_bytes(), held_bytes);
    ASSERT_LE(held_bytes, pool.reserved_bytes());
  }
  for (const auto& [p, size] : held) pool.release(reinterpret_cast<void*>(p));
  EXPECT_EQ(pool.in_use_bytes(), 0u);
  // Every segment merged back whole.
  const size_t reserved = pool.reserved_bytes();
  EXPECT_EQ(reserved, segments.out);
  EXPECT_EQ(pool.release_free_segments(), reserved);
  EXPECT_EQ(pool.reserved_bytes(), 0u);
  EXPECT_TRUE(segments.live.empty());
}

}  // namespace
}  // namespace pollen
