#pragma once
// Sub-allocation of large segments, as PyTorch's caching allocator does it: a request takes the
// smallest free block that fits (best fit), split when what is left is worth keeping, and a
// freed block merges with its free neighbours in the same segment. So memory freed by one
// shape serves another: the gradients freed at the end of a step hold the next forward's
// activations, instead of sitting idle in a cache of their own size.
//
// The pool keeps addresses only and never touches the memory; a Source gets and returns
// segments (malloc on the host, cudaMalloc on a GPU). Not thread-safe: its owner locks.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <set>
#include <unordered_map>

namespace pollen {

class BlockPool {
 public:
  struct Source {
    std::function<void*(size_t bytes)> allocate;  // nullptr when out of memory
    std::function<void(void* ptr, size_t bytes)> release;
  };

  static constexpr size_t kAlignment = 512;                   // every block's size and offset
  static constexpr size_t kSmallRequest = size_t{1} << 20;    // up to here: the small pool
  static constexpr size_t kSmallSegment = size_t{2} << 20;    // its segments
  static constexpr size_t kMediumRequest = size_t{10} << 20;  // up to here: 20 MiB segments
  static constexpr size_t kMediumSegment = size_t{20} << 20;
  static constexpr size_t kLargeRounding = size_t{2} << 20;  // larger: own segment, 2 MiB steps

  explicit BlockPool(Source source) : source_(std::move(source)) {}
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;
  ~BlockPool();  // returns the free segments; blocks still in use are the owner's error

  // A block of at least `bytes` (rounded up to kAlignment), or nullptr when the source has no
  // segment to give. *size is the block's size, what in_use_bytes counts.
  void* allocate(size_t bytes, size_t* size);
  // Back to the pool; returns the block's size. ptr must come from allocate.
  size_t release(void* ptr);
  // Returns every segment that is wholly free to the source; returns the bytes returned.
  size_t release_free_segments();

  size_t in_use_bytes() const { return in_use_bytes_; }
  size_t reserved_bytes() const { return reserved_bytes_; }  // in segments
  uint64_t segments_allocated() const { return segments_allocated_; }
  static size_t rounded(size_t bytes);  // the block size a request of `bytes` takes

 private:
  struct Block {
    char* ptr = nullptr;
    size_t size = 0;
    bool free = true;
    bool small = false;     // from the small pool's segments
    Block* prev = nullptr;  // neighbours within the segment
    Block* next = nullptr;
  };
  struct BySizeThenAddress {
    bool operator()(const Block* a, const Block* b) const {
      return a->size != b->size ? a->size < b->size : a->ptr < b->ptr;
    }
  };
  using FreeSet = std::set<Block*, BySizeThenAddress>;

  FreeSet& free_set(bool small) { return small ? free_small_ : free_large_; }
  Block* new_segment(size_t request, bool small);
  void split(Block* block, size_t size);
  Block* merge_with_free_neighbours(Block* block);

  Source source_;
  FreeSet free_small_, free_large_;
  std::unordered_map<void*, Block*> in_use_;
  size_t in_use_bytes_ = 0, reserved_bytes_ = 0;
  uint64_t segments_allocated_ = 0;
};

}  // namespace pollen
