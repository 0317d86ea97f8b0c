#include "fed/robust.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "fed/strategy.h"

namespace pollen::fed {

namespace {

// The updates as the rules see them: in client-id order, after norm bounding.
struct Inputs {
  std::vector<const ClientUpdate*> updates;
  std::vector<const Weights*> deltas;  // the update's own delta, or its clipped copy
  std::vector<Weights> clipped;        // storage for the clipped copies
};

}  // namespace

void check_client_update(const Weights& like, const ClientUpdate& u) {
  POLLEN_CHECK(u.tokens > 0, "aggregate: client '", u.client_id, "' reports ", u.tokens,
               " tokens trained; an update needs at least one");
  POLLEN_CHECK(u.delta.size() == like.size(), "aggregate: update of client '", u.client_id,
               "' has ", u.delta.size(), " tensors, the model has ", like.size());
  for (size_t i = 0; i < like.size(); ++i) {
    POLLEN_CHECK(u.delta[i].dtype() == DType::f32 && u.delta[i].is_contiguous() &&
                     u.delta[i].shape() == like[i].shape(),
                 "aggregate: update of client '", u.client_id, "': tensor ", i, " has shape ",
                 shape_str(u.delta[i].shape()), ", the model's is contiguous float32 ",
                 shape_str(like[i].shape()));
  }
}

Weights weighted_sum(const Weights& like, const std::vector<const Weights*>& deltas,
                     const std::vector<double>& weights) {
  Weights out;
  std::vector<double> acc;
  for (size_t i = 0; i < like.size(); ++i) {
    const int64_t n = like[i].numel();
    acc.assign(static_cast<size_t>(n), 0.0);
    for (size_t k = 0; k < deltas.size(); ++k) {
      const double w = weights[k];
      const float* d = (*deltas[k])[i].data<float>();
      for (int64_t j = 0; j < n; ++j) acc[static_cast<size_t>(j)] += w * d[j];
    }
    Tensor t = Tensor::empty(like[i].shape(), DType::f32);
    float* o = t.data<float>();
    for (int64_t j = 0; j < n; ++j) o[j] = static_cast<float>(acc[static_cast<size_t>(j)]);
    out.push_back(std::move(t));
  }
  return out;
}

namespace {

Inputs prepare(const RobustOptions& o, const Weights& like,
               const std::vector<ClientUpdate>& updates, AggregationReport* report) {
  POLLEN_CHECK(!updates.empty(), "aggregate: no client updates");
  Inputs in;
  for (const auto& u : updates) {
    check_client_update(like, u);
    in.updates.push_back(&u);
  }
  std::sort(in.updates.begin(), in.updates.end(), [](const ClientUpdate* a, const ClientUpdate* b) {
    return a->client_id < b->client_id;
  });
  in.clipped.reserve(in.updates.size());
  for (const ClientUpdate* u : in.updates) {
    const double norm = l2_norm(u->delta);
    UpdateReport r;
    r.norm = norm;
    if (o.norm_bound > 0 && norm > o.norm_bound) {
      in.clipped.push_back(clone_weights(u->delta));
      r.clipped = clip_to_norm(in.clipped.back(), norm, o.norm_bound);
      in.deltas.push_back(&in.clipped.back());
    } else {
      in.deltas.push_back(&u->delta);
    }
    if (report) report->clients[u->client_id] = r;
  }
  return in;
}

Weights zeros_like(const Weights& like) {
  Weights out;
  for (const Tensor& t : like) out.push_back(Tensor::zeros(t.shape(), DType::f32));
  return out;
}

// sum_k t_k d_k / sum_k t_k over the chosen updates (token-weighted).
Weights weighted_mean(const Weights& like, const Inputs& in, const std::vector<size_t>& chosen) {
  double total = 0;
  for (size_t k : chosen) total += static_cast<double>(in.updates[k]->tokens);
  std::vector<const Weights*> deltas;
  std::vector<double> weights;
  for (size_t k : chosen) {
    deltas.push_back(in.deltas[k]);
    weights.push_back(static_cast<double>(in.updates[k]->tokens) / total);
  }
  return weighted_sum(like, deltas, weights);
}

// Runs f(values, coordinate) -> aggregated value for every coordinate; values holds the n
// clients' values of that coordinate in client order, as (value, client index).
template <typename F>
Weights coordinate_wise(const Weights& like, const Inputs& in, F f) {
  Weights out = zeros_like(like);
  std::vector<std::pair<double, size_t>> values(in.deltas.size());
  for (size_t i = 0; i < like.size(); ++i) {
    float* o = out[i].data<float>();
    for (int64_t j = 0; j < like[i].numel(); ++j) {
      for (size_t k = 0; k < in.deltas.size(); ++k) {
        values[k] = {(*in.deltas[k])[i].data<float>()[j], k};
      }
      o[j] = static_cast<float>(f(values));
    }
  }
  return out;
}

Weights median(const Weights& like, const Inputs& in) {
  const size_t n = in.deltas.size();
  return coordinate_wise(like, in, [n](std::vector<std::pair<double, size_t>>& v) {
    auto mid = v.begin() + static_cast<std::ptrdiff_t>(n / 2);
    std::nth_element(v.begin(), mid, v.end());
    if (n % 2 == 1) return mid->first;
    const double below = std::max_element(v.begin(), mid)->first;
    return (below + mid->first) / 2;
  });
}

Weights trimmed_mean(const Weights& like, const Inputs& in, size_t k, AggregationReport* report) {
  const size_t n = in.deltas.size();
  std::vector<int64_t> trimmed(n, 0);
  int64_t coordinates = 0;
  Weights out = coordinate_wise(like, in, [&](std::vector<std::pair<double, size_t>>& v) {
    std::sort(v.begin(), v.end());
    double sum = 0;
    for (size_t r = k; r < n - k; ++r) sum += v[r].first;
    for (size_t r = 0; r < k; ++r) ++trimmed[v[r].second], ++trimmed[v[n - 1 - r].second];
    ++coordinates;
    return sum / static_cast<double>(n - 2 * k);
  });
  if (report) {
    for (size_t c = 0; c < n; ++c) {
      report->clients[in.updates[c]->client_id].trimmed =
          coordinates ? static_cast<double>(trimmed[c]) / static_cast<double>(coordinates) : 0;
    }
  }
  return out;
}

// Krum's scores: for each update, the summed squared L2 distance to its n - f - 2 nearest others.
std::vector<double> krum_scores(const Inputs& in, int64_t f) {
  const size_t n = in.deltas.size();
  std::vector<std::vector<double>> dist(n, std::vector<double>(n, 0.0));
  for (size_t a = 0; a < n; ++a) {
    for (size_t b = a + 1; b < n; ++b) {
      double s = 0;
      for (size_t i = 0; i < in.deltas[a]->size(); ++i) {
        const float* x = (*in.deltas[a])[i].data<float>();
        const float* y = (*in.deltas[b])[i].data<float>();
        for (int64_t j = 0; j < (*in.deltas[a])[i].numel(); ++j) {
          const double d = static_cast<double>(x[j]) - y[j];
          s += d * d;
        }
      }
      dist[a][b] = dist[b][a] = s;
    }
  }
  const auto closest = static_cast<size_t>(std::max<int64_t>(1, static_cast<int64_t>(n) - f - 2));
  std::vector<double> scores(n);
  for (size_t a = 0; a < n; ++a) {
    std::vector<double> others;
    for (size_t b = 0; b < n; ++b) {
      if (b != a) others.push_back(dist[a][b]);
    }
    std::sort(others.begin(), others.end());
    scores[a] = std::accumulate(
        others.begin(),
        others.begin() + static_cast<std::ptrdiff_t>(std::min(closest, others.size())), 0.0);
  }
  return scores;
}

}  // namespace

std::vector<std::string> aggregation_names() {
  return {"mean", "median", "trimmed_mean", "krum", "multi_krum"};
}

void validate(const RobustOptions& o, int64_t min_clients) {
  const auto names = aggregation_names();
  if (std::find(names.begin(), names.end(), o.aggregation) == names.end()) {
    std::string list;
    for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
    fail("strategy.aggregation: unknown rule '", o.aggregation, "'; expected one of ", list);
  }
  POLLEN_CHECK(std::isfinite(o.norm_bound) && o.norm_bound >= 0,
               "strategy.norm_bound must be 0 (no bound) or positive, got ", o.norm_bound);
  POLLEN_CHECK(o.trim_fraction >= 0 && o.trim_fraction < 0.5,
               "strategy.trim_fraction must be in [0, 0.5), got ", o.trim_fraction);
  POLLEN_CHECK(o.byzantine >= 0, "strategy.byzantine must be 0 or more, got ", o.byzantine);
  POLLEN_CHECK(o.multi_krum >= 0, "strategy.multi_krum must be 0 (n - f) or more, got ",
               o.multi_krum);
  if (o.aggregation == "krum" || o.aggregation == "multi_krum") {
    POLLEN_CHECK(min_clients > 2 * o.byzantine + 2, "strategy.aggregation = '", o.aggregation,
                 "' tolerates strategy.byzantine = ", o.byzantine,
                 " clients only with more than 2f + 2 = ", 2 * o.byzantine + 2,
                 " updates per round; strategy.min_clients is ", min_clients, " (raise it to ",
                 2 * o.byzantine + 3, " or lower byzantine)");
  }
  if (o.aggregation == "multi_krum") {
    POLLEN_CHECK(o.multi_krum <= min_clients - o.byzantine, "strategy.multi_krum = ", o.multi_krum,
                 " keeps more than n - f = ", min_clients - o.byzantine,
                 " updates of the smallest round (strategy.min_clients ", min_clients, ")");
  }
}

int64_t AggregationReport::clipped() const {
  return std::count_if(clients.begin(), clients.end(),
                       [](const auto& c) { return c.second.clipped; });
}

int64_t AggregationReport::rejected() const {
  return std::count_if(clients.begin(), clients.end(),
                       [](const auto& c) { return c.second.rejected; });
}

double l2_norm(const Weights& w) {
  double s = 0;
  for (const Tensor& t : w) {
    const float* p = t.data<float>();
    for (int64_t j = 0; j < t.numel(); ++j) s += static_cast<double>(p[j]) * p[j];
  }
  return std::sqrt(s);
}

bool clip_to_norm(Weights& w, double norm, double bound) {
  if (norm <= bound) return false;
  const double scale = bound / norm;
  for (Tensor& t : w) {
    float* p = t.data<float>();
    for (int64_t j = 0; j < t.numel(); ++j) p[j] = static_cast<float>(p[j] * scale);
  }
  return true;
}

Weights robust_aggregate(const RobustOptions& o, const Weights& like,
                         const std::vector<ClientUpdate>& updates, AggregationReport* report) {
  const Inputs in = prepare(o, like, updates, report);
  const auto n = static_cast<int64_t>(in.updates.size());
  std::vector<size_t> all(in.updates.size());
  std::iota(all.begin(), all.end(), size_t{0});
  if (o.aggregation == "mean") return weighted_mean(like, in, all);
  if (o.aggregation == "median") return median(like, in);
  if (o.aggregation == "trimmed_mean") {
    const auto k = static_cast<int64_t>(std::floor(o.trim_fraction * static_cast<double>(n)));
    POLLEN_CHECK(2 * k < n, "aggregate: trimmed_mean drops ", k, " updates at each side of ", n,
                 "; it needs 2 * trimmed < n");
    return trimmed_mean(like, in, static_cast<size_t>(k), report);
  }
  POLLEN_CHECK(o.aggregation == "krum" || o.aggregation == "multi_krum",
               "aggregate: unknown rule '", o.aggregation, "'");
  POLLEN_CHECK(n > 2 * o.byzantine + 2, "aggregate: ", o.aggregation, " with f = ", o.byzantine,
               " byzantine clients needs more than 2f + 2 = ", 2 * o.byzantine + 2,
               " updates, the round has ", n);
  const int64_t keep =
      o.aggregation == "krum" ? 1 : (o.multi_krum > 0 ? o.multi_krum : n - o.byzantine);
  POLLEN_CHECK(keep >= 1 && keep <= n - o.byzantine, "aggregate: multi_krum keeps ", keep,
               " updates, more than n - f = ", n - o.byzantine);
  const std::vector<double> scores = krum_scores(in, o.byzantine);
  std::vector<size_t> order = all;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return scores[a] < scores[b]; });
  std::vector<size_t> chosen(order.begin(), order.begin() + keep);
  std::sort(chosen.begin(), chosen.end());
  if (report) {
    for (size_t k = 0; k < all.size(); ++k) {
      report->clients[in.updates[k]->client_id].rejected =
          !std::binary_search(chosen.begin(), chosen.end(), k);
    }
  }
  if (o.aggregation == "krum") return clone_weights(*in.deltas[chosen[0]]);
  return weighted_mean(like, in, chosen);
}

}  // namespace pollen::fed
