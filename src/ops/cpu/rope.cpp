// Rotary position embedding on the CPU, from cos/sin tables cached per (theta, D, dtype).
#include "ops/cpu/rope.h"

#include <cmath>
#include <memory>
#include <mutex>
#include <vector>

#include "base/thread_pool.h"

namespace pollen::ops::cpu {
namespace {

// cos and sin of position * inv_freq[i] (times yarn's attention factor), computed in double, for
// positions [0, positions) and i in [0, D/2), stored (positions, D/2).
template <typename T>
struct RopeTable {
  RopeTable(const RopeParams& params, int64_t head_dim, int64_t position_count)
      : positions(position_count) {
    const int64_t half = head_dim / 2;
    cos.resize(static_cast<size_t>(positions * half));
    sin.resize(cos.size());
    const double scale = rope_attention_factor(params);
    for (int64_t i = 0; i < half; ++i) {
      const double inv_freq = rope_inv_freq(params, head_dim, i);
      for (int64_t p = 0; p < positions; ++p) {
        const double angle = static_cast<double>(p) * inv_freq;
        cos[p * half + i] = static_cast<T>(scale * std::cos(angle));
        sin[p * half + i] = static_cast<T>(scale * std::sin(angle));
      }
    }
  }
  int64_t positions;
  std::vector<T> cos, sin;
};

// A table covering at least `positions` positions. Tables grow in steps of kTableStep and each
// entry depends only on (theta, D, position), so a grown table agrees with the smaller one.
template <typename T>
std::shared_ptr<const RopeTable<T>> rope_table(const RopeParams& params, int64_t head_dim,
                                               int64_t positions) {
  constexpr int64_t kTableStep = 1024;
  struct Entry {
    RopeParams params;
    int64_t head_dim;
    std::shared_ptr<const RopeTable<T>> table;
  };
  static std::mutex mutex;
  static std::vector<Entry> cache;
  std::lock_guard lock(mutex);
  Entry* entry = nullptr;
  for (Entry& e : cache)
    if (e.params == params && e.head_dim == head_dim) entry = &e;
  if (entry && entry->table->positions >= positions) return entry->table;
  auto table = std::make_shared<const RopeTable<T>>(
      params, head_dim, (positions + kTableStep - 1) / kTableStep * kTableStep);
  if (entry) {
    entry->table = table;
  } else {
    // Dynamic scaling makes new parameters as sequences grow; keep the most recent few.
    constexpr size_t kMaxTables = 16;
    if (cache.size() == kMaxTables) cache.erase(cache.begin());
    cache.push_back({params, head_dim, table});
  }
  return table;
}

}  // namespace

template <typename T>
void rope_rotate(const T* x, const int32_t* positions, int64_t rows, int64_t heads,
                 int64_t head_dim, const RopeParams& params, bool inverse, T* out) {
  int32_t max_position = 0;
  for (int64_t r = 0; r < rows; ++r) max_position = std::max(max_position, positions[r]);
  const auto table = rope_table<T>(params, head_dim, int64_t{max_position} + 1);
  const int64_t half = head_dim / 2;
  // Negating sin is exact, so the inverse is exactly the transpose of the forward rotation.
  const T sin_sign = inverse ? T(-1) : T(1);
  parallel_for(rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* cos_row = table->cos.data() + positions[r] * half;
      const T* sin_row = table->sin.data() + positions[r] * half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* src = x + (r * heads + h) * head_dim;
        T* dst = out + (r * heads + h) * head_dim;
        // out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[i + D/2], x[i]).
        for (int64_t i = 0; i < half; ++i) {
          const T first = src[i], second = src[i + half];
          const T c = cos_row[i], s = sin_sign * sin_row[i];
          dst[i] = first * c - second * s;
          dst[i + half] = second * c + first * s;
        }
      }
    }
  });
}

template void rope_rotate(const float*, const int32_t*, int64_t, int64_t, int64_t,
                          const RopeParams&, bool, float*);
template void rope_rotate(const double*, const int32_t*, int64_t, int64_t, int64_t,
                          const RopeParams&, bool, double*);

}  // namespace pollen::ops::cpu
