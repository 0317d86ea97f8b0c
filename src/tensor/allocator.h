#pragma once
// Host memory for tensors. Freed blocks are kept in per-size free lists and handed out again, so
// a training loop that asks for the same sizes every step stops calling malloc after step one.
#include <cstddef>
#include <cstdint>

namespace pollen {

struct AllocatorStats {
  size_t in_use_bytes = 0;  // handed out now
  size_t peak_in_use_bytes = 0;
  size_t cached_bytes = 0;         // freed, kept for reuse
  size_t peak_reserved_bytes = 0;  // peak of in use + cached: what was held from the system
  uint64_t system_allocs = 0;      // calls that reached the system allocator
  uint64_t reuses = 0;             // requests served from the cache
};

class CpuAllocator {
 public:
  static CpuAllocator& instance();
  void* allocate(size_t bytes);  // 64-byte aligned; bytes rounded up to a size class
  void release(void* ptr, size_t bytes);
  void empty_cache();  // returns every cached block to the system
  AllocatorStats stats() const;
  void reset_peak();
  static size_t size_class(size_t bytes);
};

}  // namespace pollen
