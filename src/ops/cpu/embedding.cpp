// Embedding lookup (N tokens of a (V,C) table) and its scatter-add backward.
#include <cstring>

#include "base/thread_pool.h"
#include "ops/cpu/kernels.h"

namespace pollen::ops::cpu {

// out (N,C) = table[ids] ; ids are checked by the dispatch point.
template <typename T>
void embedding_forward(const T* table, const int32_t* ids, T* out, int64_t n, int64_t c) {
  parallel_for(n, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      std::memcpy(out + i * c, table + static_cast<int64_t>(ids[i]) * c, sizeof(T) * c);
    }
  });
}

// dtable[ids[i]] += dout[i]. Threads split the channels, not the tokens, so every row is summed
// by one thread in token order: no races, and the same result for any thread count.
template <typename T>
void embedding_backward(const T* dout, const int32_t* ids, T* dtable, int64_t n, int64_t c) {
  parallel_for(c, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = 0; i < n; ++i) {
      T* row = dtable + static_cast<int64_t>(ids[i]) * c;
      const T* g = dout + i * c;
      for (int64_t j = lo; j < hi; ++j) row[j] += g[j];
    }
  });
}

template void embedding_forward<float>(const float*, const int32_t*, float*, int64_t, int64_t);
template void embedding_forward<double>(const double*, const int32_t*, double*, int64_t, int64_t);
template void embedding_backward<float>(const float*, const int32_t*, float*, int64_t, int64_t);
template void embedding_backward<double>(const double*, const int32_t*, double*, int64_t, int64_t);

}  // namespace pollen::ops::cpu
