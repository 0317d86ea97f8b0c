#include "fed/secagg/graph.h"

#include <algorithm>

#include "base/error.h"
#include "base/rng.h"

namespace pollen::fed::secagg {

size_t graph_degree(size_t n, int64_t k) {
  if (n <= 1) return 0;
  if (k <= 0 || static_cast<size_t>(k) >= n - 1) return n - 1;
  size_t d = static_cast<size_t>(k);
  if (d % 2 == 1 && n % 2 == 1) ++d;  // H(k, n) with k and n odd is not regular: take k + 1
  return std::min(d, n - 1);
}

namespace {

// The clients in their seeded Fisher-Yates order on the ring.
std::vector<size_t> ring_order(size_t n, uint64_t seed) {
  std::vector<size_t> ring(n);
  for (size_t i = 0; i < n; ++i) ring[i] = i;
  Rng rng(seed);
  for (size_t i = n; i-- > 1;) std::swap(ring[i], ring[rng.below(i + 1)]);
  return ring;
}

}  // namespace

std::vector<size_t> neighbours_of(size_t n, int64_t k, uint64_t seed, size_t me) {
  POLLEN_CHECK(me < n, "secure aggregation: client index ", me, " outside a roster of ", n);
  std::vector<size_t> out;
  const size_t d = graph_degree(n, k);
  if (d == n - 1) {
    for (size_t j = 0; j < n; ++j)
      if (j != me) out.push_back(j);
    return out;
  }
  const std::vector<size_t> ring = ring_order(n, seed);
  const size_t pos = static_cast<size_t>(std::find(ring.begin(), ring.end(), me) - ring.begin());
  for (size_t step = 1; step <= d / 2; ++step) {
    out.push_back(ring[(pos + step) % n]);
    out.push_back(ring[(pos + n - step) % n]);
  }
  if (d % 2 == 1) out.push_back(ring[(pos + n / 2) % n]);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::vector<size_t>> neighbour_graph(size_t n, int64_t k, uint64_t seed) {
  std::vector<std::vector<size_t>> adj(n);
  const size_t d = graph_degree(n, k);
  if (d == n - 1) {
    for (size_t i = 0; i < n; ++i) {
      for (size_t j = 0; j < n; ++j) {
        if (j != i) adj[i].push_back(j);
      }
    }
    return adj;
  }
  const std::vector<size_t> ring = ring_order(n, seed);
  auto link = [&](size_t a, size_t b) {
    adj[ring[a]].push_back(ring[b]);
    adj[ring[b]].push_back(ring[a]);
  };
  for (size_t pos = 0; pos < n; ++pos) {
    for (size_t step = 1; step <= d / 2; ++step) link(pos, (pos + step) % n);
  }
  if (d % 2 == 1) {
    POLLEN_ASSERT(n % 2 == 0);
    for (size_t pos = 0; pos < n / 2; ++pos) link(pos, pos + n / 2);
  }
  for (auto& a : adj) std::sort(a.begin(), a.end());
  return adj;
}

}  // namespace pollen::fed::secagg
