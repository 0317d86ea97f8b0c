#pragma once
// Host memory for tensors, from a BlockPool over segments of malloc'd memory: freed blocks are
// handed out again, split and merged, so a training loop that asks for the same sizes every step
// stops calling malloc after step one.
#include <cstddef>
#include <cstdint>

namespace pollen {

struct AllocatorStats {
  size_t in_use_bytes = 0;  // handed out now
  size_t peak_in_use_bytes = 0;
  size_t cached_bytes = 0;         // held from the system and not handed out
  size_t peak_reserved_bytes = 0;  // peak of in use + cached: what was held from the system
  uint64_t system_allocs = 0;      // segments taken from the system
  uint64_t reuses = 0;             // requests served without a new segment

  // A block of `size` bytes handed out, or given back; `reserved` is what the allocator's pools
  // hold from the system after it.
  void handed_out(size_t size, size_t reserved, bool new_segment);
  void given_back(size_t size, size_t reserved);
};

class CpuAllocator {
 public:
  static CpuAllocator& instance();
  void* allocate(size_t bytes);  // 512-byte aligned; bytes rounded up to a multiple of 512
  void release(void* ptr);       // a pointer allocate returned
  void empty_cache();            // returns every wholly free segment to the system
  AllocatorStats stats() const;
  void reset_peak();
  static size_t size_class(size_t bytes);  // the size of the block `bytes` takes
};

}  // namespace pollen
