#include "tensor/allocator.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <vector>

#include "base/error.h"

namespace pollen {
namespace {
struct State {
  std::mutex mutex;
  std::map<size_t, std::vector<void*>> free_lists;  // size class -> blocks
  AllocatorStats stats;
};
State& state() {
  static State* s = new State();  // never destroyed: tensors may outlive static destructors
  return *s;
}

void count_handed_out(State& s, size_t cls) {
  s.stats.in_use_bytes += cls;
  s.stats.peak_in_use_bytes = std::max(s.stats.peak_in_use_bytes, s.stats.in_use_bytes);
  s.stats.peak_reserved_bytes =
      std::max(s.stats.peak_reserved_bytes, s.stats.in_use_bytes + s.stats.cached_bytes);
}
}  // namespace

CpuAllocator& CpuAllocator::instance() {
  static CpuAllocator a;
  return a;
}

size_t CpuAllocator::size_class(size_t bytes) {
  if (bytes <= 4096) return (bytes + 63) / 64 * 64;
  // Above a page: round to 1/8 steps of the enclosing power of two (at most 12.5% waste).
  size_t p = 1;
  while (p * 2 <= bytes) p *= 2;
  size_t step = p / 8;
  return (bytes + step - 1) / step * step;
}

void* CpuAllocator::allocate(size_t bytes) {
  size_t cls = size_class(bytes == 0 ? 1 : bytes);
  State& s = state();
  {
    std::lock_guard lock(s.mutex);
    auto it = s.free_lists.find(cls);
    if (it != s.free_lists.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      s.stats.cached_bytes -= cls;
      count_handed_out(s, cls);
      ++s.stats.reuses;
      return p;
    }
  }
  void* p = std::aligned_alloc(64, cls);
  if (!p) {
    empty_cache();
    p = std::aligned_alloc(64, cls);
  }
  POLLEN_CHECK(p, "out of host memory allocating ", cls, " bytes");
  std::lock_guard lock(s.mutex);
  count_handed_out(s, cls);
  ++s.stats.system_allocs;
  return p;
}

void CpuAllocator::release(void* ptr, size_t bytes) {
  if (!ptr) return;
  size_t cls = size_class(bytes == 0 ? 1 : bytes);
  State& s = state();
  std::lock_guard lock(s.mutex);
  s.free_lists[cls].push_back(ptr);
  s.stats.in_use_bytes -= cls;
  s.stats.cached_bytes += cls;
}

void CpuAllocator::empty_cache() {
  State& s = state();
  std::lock_guard lock(s.mutex);
  for (auto& [cls, blocks] : s.free_lists) {
    for (void* p : blocks) std::free(p);
    s.stats.cached_bytes -= cls * blocks.size();
    blocks.clear();
  }
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
