#pragma once
// SecAgg+'s sparse masking graph (Bell et al. 2020): instead of every pair of clients, each
// client masks with, and secret-shares to, only its k neighbours. The graph is a Harary graph
// H(k, n) over a seeded random order of the clients: place them on a ring in that order and
// join each to the k/2 nearest on either side (k even); k odd (n even) adds the opposite
// client. With k and n both odd no k-regular graph exists, and k + 1 is taken instead. It is
// k-regular and k-connected (for that k), so it stays connected after fewer than k dropouts.
// Server and clients compute it from the same roster and seed, so neither has to trust the
// other's list. k = 0 or k >= n - 1 gives the complete graph: the original SecAgg.
#include <cstddef>
#include <cstdint>
#include <vector>

namespace pollen::fed::secagg {

// Neighbours of each of n clients (indices 0 ... n-1 of the sorted roster), each list sorted.
std::vector<std::vector<size_t>> neighbour_graph(size_t n, int64_t k, uint64_t seed);

// Client `me`'s row of neighbour_graph, in O(n) time and memory: what a client needs, whatever
// the size of the roster it is sent (the whole graph of the complete case is O(n^2)).
std::vector<size_t> neighbours_of(size_t n, int64_t k, uint64_t seed, size_t me);

// The degree neighbour_graph gives for n clients: min(k, n - 1) rounded up to even unless n is
// even (k = 0: n - 1).
size_t graph_degree(size_t n, int64_t k);

}  // namespace pollen::fed::secagg
