#include "tensor/allocator.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>

#include "base/error.h"
#include "tensor/block_pool.h"

namespace pollen {
namespace {
struct State {
  std::mutex mutex;
  BlockPool pool{{[](size_t bytes) { return std::aligned_alloc(BlockPool::kAlignment, bytes); },
                  [](void* ptr, size_t) { std::free(ptr); }}};
  AllocatorStats stats;
};
State& state() {
  static State* s = new State();  // never destroyed: tensors may outlive static destructors
  return *s;
}
}  // namespace

void AllocatorStats::handed_out(size_t size, size_t reserved, bool new_segment) {
  in_use_bytes += size;
  cached_bytes = reserved - in_use_bytes;
  peak_in_use_bytes = std::max(peak_in_use_bytes, in_use_bytes);
  peak_reserved_bytes = std::max(peak_reserved_bytes, reserved);
  ++(new_segment ? system_allocs : reuses);
}

void AllocatorStats::given_back(size_t size, size_t reserved) {
  in_use_bytes -= size;
  cached_bytes = reserved - in_use_bytes;
}

CpuAllocator& CpuAllocator::instance() {
  static CpuAllocator a;
  return a;
}

size_t CpuAllocator::size_class(size_t bytes) {
  return BlockPool::rounded(bytes);
}

void* CpuAllocator::allocate(size_t bytes) {
  State& s = state();
  std::lock_guard lock(s.mutex);
  const uint64_t segments = s.pool.segments_allocated();
  size_t size = 0;
  void* p = s.pool.allocate(bytes, &size);
  if (!p) {
    s.pool.release_free_segments();
    p = s.pool.allocate(bytes, &size);
  }
  POLLEN_CHECK(p, "out of host memory allocating ", size_class(bytes), " bytes (",
               s.stats.in_use_bytes, " in tensors)");
  s.stats.handed_out(size, s.pool.reserved_bytes(), s.pool.segments_allocated() != segments);
  return p;
}

void CpuAllocator::release(void* ptr) {
  if (!ptr) return;
  State& s = state();
  std::lock_guard lock(s.mutex);
  const size_t size = s.pool.release(ptr);
  s.stats.given_back(size, s.pool.reserved_bytes());
}

void CpuAllocator::empty_cache() {
  State& s = state();
  std::lock_guard lock(s.mutex);
  s.pool.release_free_segments();
  s.stats.cached_bytes = s.pool.reserved_bytes() - s.stats.in_use_bytes;
}

AllocatorStats CpuAllocator::stats() const {
  std::lock_guard lock(state().mutex);
  return state().stats;
}

void CpuAllocator::reset_peak() {
  std::lock_guard lock(state().mutex);
  AllocatorStats& st = state().stats;
  st.peak_in_use_bytes = st.in_use_bytes;
  st.peak_reserved_bytes = st.in_use_bytes + st.cached_bytes;
}

}  // namespace pollen
