#include "fed/strategy.h"

#include <algorithm>
#include <cmath>

#include "base/config.h"
#include "fed/first_moments.h"

namespace pollen::fed {

Weights clone_weights(const Weights& w) {
  Weights out;
  out.reserve(w.size());
  for (const Tensor& t : w) out.push_back(t.clone());
  return out;
}

Weights weights_minus(const Weights& a, const Weights& b) {
  POLLEN_ASSERT(a.size() == b.size());
  Weights out;
  out.reserve(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    POLLEN_ASSERT(a[i].shape() == b[i].shape());
    Tensor d = Tensor::empty(a[i].shape(), DType::f32);
    const float* x = a[i].data<float>();
    const float* y = b[i].data<float>();
    float* o = d.data<float>();
    for (int64_t j = 0; j < d.numel(); ++j) o[j] = x[j] - y[j];
    out.push_back(std::move(d));
  }
  return out;
}

namespace {

Weights zeros_like(const Weights& w) {
  Weights out;
  out.reserve(w.size());
  for (const Tensor& t : w) out.push_back(Tensor::zeros(t.shape(), DType::f32));
  return out;
}

void check_same_layout(const Weights& a, const Weights& b, const std::string& what) {
  POLLEN_CHECK(a.size() == b.size(), what, ": ", b.size(), " tensors, the model has ", a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    POLLEN_CHECK(b[i].dtype() == DType::f32 && b[i].is_contiguous(), what, ": tensor ", i,
                 " is not contiguous float32");
    POLLEN_CHECK(a[i].shape() == b[i].shape(), what, ": tensor ", i, " has shape ",
                 shape_str(b[i].shape()), ", the model's is ", shape_str(a[i].shape()));
  }
}

// Runs f(x, m, v, d, s) over every element; x, m, v are float32 storage, d the aggregated delta,
// s the element's tensor's multiple of the learning rate.
template <typename F>
void for_each_element(Weights& x, Weights* m, Weights* v, const Weights& d,
                      const std::vector<double>& scale, F f) {
  for (size_t i = 0; i < x.size(); ++i) {
    float* xp = x[i].data<float>();
    float* mp = m ? (*m)[i].data<float>() : nullptr;
    float* vp = v ? (*v)[i].data<float>() : nullptr;
    const float* dp = d[i].data<float>();
    const int64_t n = x[i].numel();
    for (int64_t j = 0; j < n; ++j) {
      f(xp[j], mp ? mp[j] : *xp, vp ? vp[j] : *xp, dp[j], scale[i]);
    }
  }
}

double pick(double value, double fallback) {
  return value >= 0 ? value : fallback;
}

std::vector<std::pair<std::string, Tensor>> named(const char* prefix, const Weights& w) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (size_t i = 0; i < w.size(); ++i) out.emplace_back(cat(prefix, ".", i), w[i]);
  return out;
}

Weights unnamed(const char* prefix, const std::vector<std::pair<std::string, Tensor>>& state) {
  Weights out;
  for (const auto& [name, t] : state) {
    if (name.rfind(std::string(prefix) + ".", 0) == 0) {
      POLLEN_CHECK(name == cat(prefix, ".", out.size()), "strategy state: expected tensor '",
                   prefix, ".", out.size(), "', found '", name, "'");
      out.push_back(t.to(DType::f32));
    }
  }
  return out;
}

class FedAvg : public Strategy {
 public:
  explicit FedAvg(StrategyOptions o) : Strategy(std::move(o)) { lr_ = pick(options_.lr, 1.0); }
  std::string name() const override { return "fedavg"; }

 protected:
  void apply(int64_t, Weights& x, const Weights& d) override {
    const double lr = lr_;
    for_each_element(x, nullptr, nullptr, d, lr_scales(x),
                     [lr](float& xi, float&, float&, float di, double s) {
                       xi = static_cast<float>(static_cast<double>(xi) - lr * s * di);
                     });
  }
  double lr_;
};

// Momentum on the pseudo-gradient: heavy ball (FedAvgM) or Nesterov (DiLoCo's outer optimizer).
class Momentum : public Strategy {
 public:
  Momentum(StrategyOptions o, bool nesterov) : Strategy(std::move(o)), nesterov_(nesterov) {
    lr_ = pick(options_.lr, nesterov ? 0.7 : 1.0);
    mu_ = pick(options_.momentum, 0.9);
  }
  std::string name() const override { return nesterov_ ? "diloco" : "fedavgm"; }
  std::vector<std::pair<std::string, Tensor>> state() const override {
    return named("momentum", m_);
  }
  void load_state(const std::vector<std::pair<std::string, Tensor>>& s) override {
    m_ = unnamed("momentum", s);
  }

 protected:
  void apply(int64_t round, Weights& x, const Weights& d) override {
    if (m_.empty()) m_ = zeros_like(x);
    check_same_layout(x, m_, "strategy momentum state");
    const double lr = lr_, mu = momentum(round);
    const bool nesterov = nesterov_;
    for_each_element(x, &m_, nullptr, d, lr_scales(x),
                     [=](float& xi, float& mi, float&, float di, double s) {
                       const double m = mu * mi + di;
                       mi = static_cast<float>(m);
                       const double step = nesterov ? di + mu * m : m;
                       xi = static_cast<float>(static_cast<double>(xi) - lr * s * step);
                     });
  }
  // Round r's momentum: mu (r - 1) / w for the w warm-up rounds, then mu.
  double momentum(int64_t round) const {
    const int64_t w = options_.momentum_warmup_rounds;
    if (round > w) return mu_;
    return mu_ * static_cast<double>(round - 1) / static_cast<double>(w);
  }
  bool nesterov_;
  double lr_, mu_;
  Weights m_;
};

// Flower's FedOpt family: adaptive server optimizers on d = -Delta (the mean of local minus
// global weights).
class FedOpt : public Strategy {
 public:
  enum class Kind { adam, yogi, adagrad };
  FedOpt(StrategyOptions o, Kind kind) : Strategy(std::move(o)), kind_(kind) {
    switch (kind) {
      case Kind::adam:
        eta_ = pick(options_.lr, 0.1), b1_ = pick(options_.beta1, 0.9);
        b2_ = pick(options_.beta2, 0.99), tau_ = pick(options_.tau, 1e-9);
        break;
      case Kind::yogi:
        eta_ = pick(options_.lr, 0.01), b1_ = pick(options_.beta1, 0.9);
        b2_ = pick(options_.beta2, 0.99), tau_ = pick(options_.tau, 1e-3);
        break;
      case Kind::adagrad:
        eta_ = pick(options_.lr, 0.1), b1_ = pick(options_.beta1, 0.0);
        b2_ = pick(options_.beta2, 0.0), tau_ = pick(options_.tau, 1e-9);
        break;
    }
  }
  std::string name() const override {
    return kind_ == Kind::adam ? "fedadam" : kind_ == Kind::yogi ? "fedyogi" : "fedadagrad";
  }
  std::vector<std::pair<std::string, Tensor>> state() const override {
    auto s = named("m", m_);
    auto v = named("v", v_);
    s.insert(s.end(), v.begin(), v.end());
    return s;
  }
  void load_state(const std::vector<std::pair<std::string, Tensor>>& s) override {
    m_ = unnamed("m", s);
    v_ = unnamed("v", s);
  }

 protected:
  void apply(int64_t round, Weights& x, const Weights& delta) override {
    if (m_.empty()) m_ = zeros_like(x), v_ = zeros_like(x);
    check_same_layout(x, m_, "strategy state m");
    check_same_layout(x, v_, "strategy state v");
    const double b1 = b1_, b2 = b2_, tau = tau_;
    double eta = eta_;
    if (kind_ == Kind::adam) {
      const double t = static_cast<double>(round) + 1.0;
      eta = eta_ * std::sqrt(1 - std::pow(b2, t)) / (1 - std::pow(b1, t));
    }
    const Kind kind = kind_;
    for_each_element(
        x, &m_, &v_, delta, lr_scales(x), [=](float& xi, float& mi, float& vi, float di, double s) {
          const double d = -static_cast<double>(di);
          const double m = b1 * mi + (1 - b1) * d;
          const double d2 = d * d;
          double v = vi;
          switch (kind) {
            case Kind::adam:
              v = b2 * v + (1 - b2) * d2;
              break;
            case Kind::yogi: {
              const double gap = v - d2;
              v = v - (1 - b2) * d2 * static_cast<double>((gap > 0) - (gap < 0));
              break;
            }
            case Kind::adagrad:
              v = v + d2;
              break;
          }
          mi = static_cast<float>(m);
          vi = static_cast<float>(v);
          xi = static_cast<float>(static_cast<double>(xi) + eta * s * m / (std::sqrt(v) + tau));
        });
  }
  Kind kind_;
  double eta_, b1_, b2_, tau_;
  Weights m_, v_;
};

}  // namespace

std::vector<std::string> row_weighting_names() {
  return {"none", "input_counts", "target_counts", "token_counts"};
}

std::vector<std::string> strategy_names() {
  return {"fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "diloco"};
}

std::unique_ptr<Strategy> make_strategy(const StrategyOptions& o) {
  POLLEN_CHECK(o.fraction_fit > 0 && o.fraction_fit <= 1,
               "strategy.fraction_fit must be in (0, 1], got ", o.fraction_fit);
  POLLEN_CHECK(o.min_clients >= 1, "strategy.min_clients must be at least 1, got ", o.min_clients);
  validate(o.robust, o.min_clients);
  const auto rw = row_weighting_names();
  POLLEN_CHECK(
      std::find(rw.begin(), rw.end(), o.row_weighting) != rw.end(),
      "strategy.row_weighting must be none, input_counts, target_counts or token_counts, got '",
      o.row_weighting, "'");
  POLLEN_CHECK(!o.weights_rows() || (o.robust.aggregation == "mean" && o.robust.norm_bound == 0),
               "strategy.row_weighting = '", o.row_weighting,
               "' weights the token-weighted mean's rows; it needs strategy.aggregation = 'mean' "
               "and no strategy.norm_bound (got '",
               o.robust.aggregation, "', ", o.robust.norm_bound, ")");
  POLLEN_CHECK(o.second_moments == "none" || o.second_moments == "factored",
               "strategy.second_moments must be none or factored, got '", o.second_moments, "'");
  const auto& fm = first_moments_names();
  POLLEN_CHECK(std::find(fm.begin(), fm.end(), o.first_moments) != fm.end(),
               "strategy.first_moments must be none, output or token_rows, got '", o.first_moments,
               "'");
  POLLEN_CHECK(std::isfinite(o.embedding_lr_scale) && o.embedding_lr_scale > 0,
               "strategy.embedding_lr_scale must be a positive number, got ", o.embedding_lr_scale);
  POLLEN_CHECK(o.momentum_warmup_rounds >= 0,
               "strategy.momentum_warmup_rounds must be at least 0, got ",
               o.momentum_warmup_rounds);
  POLLEN_CHECK(o.momentum_warmup_rounds == 0 || o.name == "fedavgm" || o.name == "diloco",
               "strategy.momentum_warmup_rounds ramps the momentum of fedavgm and diloco; "
               "strategy '",
               o.name, "' has none");
  // The outer optimizer's settings: -1 (absent) takes the strategy's default; another value must
  // be in range (a beta2 above 1 made the global model NaN) and one the strategy uses.
  const bool momentum_strategy = o.name == "fedavgm" || o.name == "diloco";
  const bool adaptive = o.name == "fedadam" || o.name == "fedyogi" || o.name == "fedadagrad";
  const auto check = [&](double value, const char* key, bool in_range, const char* expected,
                         bool used) {
    if (value == -1) return;
    POLLEN_CHECK(std::isfinite(value) && in_range, "strategy.", key, " must be ", expected,
                 " (or -1, the strategy's default), got ", value);
    POLLEN_CHECK(used, "strategy.", key, " is not a setting of strategy '", o.name, "'");
  };
  check(o.lr, "lr", o.lr > 0, "positive", true);
  check(o.momentum, "momentum", o.momentum >= 0 && o.momentum < 1, "in [0, 1)", momentum_strategy);
  check(o.beta1, "beta1", o.beta1 >= 0 && o.beta1 < 1, "in [0, 1)", adaptive);
  check(o.beta2, "beta2", o.beta2 >= 0 && o.beta2 < 1, "in [0, 1)",
        adaptive && o.name != "fedadagrad");
  check(o.tau, "tau", o.tau > 0, "positive", adaptive);
  if (o.name == "fedavg") return std::make_unique<FedAvg>(o);
  if (o.name == "fedavgm") return std::make_unique<Momentum>(o, false);
  if (o.name == "diloco") return std::make_unique<Momentum>(o, true);
  if (o.name == "fedadam") return std::make_unique<FedOpt>(o, FedOpt::Kind::adam);
  if (o.name == "fedyogi") return std::make_unique<FedOpt>(o, FedOpt::Kind::yogi);
  if (o.name == "fedadagrad") return std::make_unique<FedOpt>(o, FedOpt::Kind::adagrad);
  std::string names;
  for (const auto& n : strategy_names()) names += (names.empty() ? "" : ", ") + n;
  fail("unknown strategy '", o.name, "'; expected one of ", names);
}

StrategyOptions read_strategy_options(ConfigTable& t) {
  StrategyOptions o;
  o.name = t.get_string("name", o.name);
  o.lr = t.get_double("lr", o.lr);
  o.momentum = t.get_double("momentum", o.momentum);
  o.momentum_warmup_rounds = t.get_int("momentum_warmup_rounds", o.momentum_warmup_rounds);
  o.beta1 = t.get_double("beta1", o.beta1);
  o.beta2 = t.get_double("beta2", o.beta2);
  o.tau = t.get_double("tau", o.tau);
  o.fraction_fit = t.get_double("fraction_fit", o.fraction_fit);
  o.min_clients = t.get_int("min_clients", o.min_clients);
  o.robust.aggregation = t.get_string("aggregation", o.robust.aggregation);
  o.robust.norm_bound = t.get_double("norm_bound", o.robust.norm_bound);
  o.robust.trim_fraction = t.get_double("trim_fraction", o.robust.trim_fraction);
  o.robust.byzantine = t.get_int("byzantine", o.robust.byzantine);
  o.robust.multi_krum = t.get_int("multi_krum", o.robust.multi_krum);
  o.row_weighting = t.get_string("row_weighting", o.row_weighting);
  o.second_moments = t.get_string("second_moments", o.second_moments);
  o.first_moments = t.get_string("first_moments", o.first_moments);
  o.embedding_lr_scale = t.get_double("embedding_lr_scale", o.embedding_lr_scale);
  // Keys of aggregation rules other than the chosen one would be ignored without a word.
  const auto only_for = [&](const char* key, std::initializer_list<const char*> rules) {
    if (!t.has(key)) return;
    for (const char* rule : rules)
      if (o.robust.aggregation == rule) return;
    fail(t.where(key), " applies to strategy.aggregation ", *rules.begin(),
         rules.size() > 1 ? cat(" or ", *(rules.begin() + 1)) : std::string(), ", not '",
         o.robust.aggregation, "'");
  };
  only_for("trim_fraction", {"trimmed_mean"});
  only_for("byzantine", {"krum", "multi_krum"});
  only_for("multi_krum", {"multi_krum"});
  // The name first: a misspelt one would otherwise be reported as its keys' fault.
  const auto names = strategy_names();
  if (std::find(names.begin(), names.end(), o.name) == names.end()) {
    std::string list;
    for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
    fail(t.where("name"), ": unknown strategy '", o.name, "'; expected one of ", list);
  }
  try {
    make_strategy(o);  // validates the ranges now, naming the keys
  } catch (const Error& e) {
    fail("config file '", t.source(), "': ", e.what());
  }
  return o;
}

void Strategy::set_token_rows(TokenRowTensors rows) {
  POLLEN_CHECK(
      options_.embedding_lr_scale == 1 || (rows.embedding >= 0 && rows.output >= 0),
      "strategy.embedding_lr_scale = ", options_.embedding_lr_scale,
      " scales the outer step of an untied token embedding, and this model ",
      rows.embedding < 0 ? "has no token embedding" : "ties its embedding to the output layer",
      "; leave it at 1");
  token_rows_ = rows;
}

std::vector<double> Strategy::lr_scales(const Weights& global) const {
  std::vector<double> scales(global.size(), 1.0);
  if (token_rows_.embedding >= 0 && token_rows_.output >= 0) {
    scales.at(static_cast<size_t>(token_rows_.embedding)) = options_.embedding_lr_scale;
  }
  return scales;
}

std::vector<std::string> Strategy::configure_round(int64_t round,
                                                   const std::vector<std::string>& available,
                                                   Rng& rng) const {
  std::vector<std::string> ids = available;
  std::sort(ids.begin(), ids.end());
  const auto n = static_cast<int64_t>(ids.size());
  int64_t want = static_cast<int64_t>(std::ceil(options_.fraction_fit * static_cast<double>(n)));
  want = std::min(n, std::max(want, options_.min_clients));
  if (want >= n) return ids;
  // Partial Fisher-Yates with the server's generator: the same seed picks the same clients.
  for (int64_t i = 0; i < want; ++i) {
    const auto j = i + static_cast<int64_t>(rng.below(static_cast<uint64_t>(n - i)));
    std::swap(ids[static_cast<size_t>(i)], ids[static_cast<size_t>(j)]);
  }
  ids.resize(static_cast<size_t>(want));
  std::sort(ids.begin(), ids.end());
  return ids;
}

std::vector<std::string> poisson_sample(const std::vector<std::string>& available, double rate,
                                        Rng& rng) {
  std::vector<std::string> ids = available;
  std::sort(ids.begin(), ids.end());
  std::vector<std::string> chosen;
  // One draw per client whatever the others drew, so that each client's presence is
  // independent of every other's, as the accountant's analysis assumes.
  for (auto& id : ids)
    if (rng.uniform() < rate) chosen.push_back(std::move(id));
  return chosen;
}

Weights Strategy::weighted_delta(const Weights& like, const std::vector<ClientUpdate>& updates) {
  return robust_aggregate(RobustOptions{}, like, updates, nullptr);
}

void Strategy::weight_rows(Weights& mean, int64_t tensor, RowCounts which,
                           const std::vector<ClientUpdate>& updates) {
  POLLEN_CHECK(tensor >= 0 && static_cast<size_t>(tensor) < mean.size() &&
                   mean[static_cast<size_t>(tensor)].dim() == 2,
               "row weighting: tensor ", tensor, " is not a [vocab, hidden] matrix of the model");
  Tensor& m = mean[static_cast<size_t>(tensor)];
  const int64_t vocab = m.shape()[0], hidden = m.shape()[1];
  std::vector<const ClientUpdate*> order;
  for (const auto& u : updates) order.push_back(&u);
  std::sort(order.begin(), order.end(), [](const ClientUpdate* a, const ClientUpdate* b) {
    return a->client_id < b->client_id;
  });
  // Per row: sum_i c_ir delta_i[r] and sum_i c_ir, in double, clients in id order.
  std::vector<double> sum(static_cast<size_t>(vocab * hidden), 0.0);
  std::vector<double> weight(static_cast<size_t>(vocab), 0.0);
  auto add = [&](const ClientUpdate& u, const TokenCounts& c) {
    POLLEN_CHECK(c.ids.size() == c.counts.size(), "row weighting: update from '", u.client_id,
                 "' has ", c.ids.size(), " token ids but ", c.counts.size(), " counts");
    const float* d = u.delta[static_cast<size_t>(tensor)].data<float>();
    for (size_t k = 0; k < c.ids.size(); ++k) {
      const int64_t r = c.ids[k];
      POLLEN_CHECK(r >= 0 && r < vocab && c.counts[k] >= 0, "row weighting: update from '",
                   u.client_id, "' counts token ", r, " ", c.counts[k], " times; ids run below ",
                   vocab, ", counts are not negative");
      const auto w = static_cast<double>(c.counts[k]);
      weight[static_cast<size_t>(r)] += w;
      for (int64_t j = 0; j < hidden; ++j)
        sum[static_cast<size_t>(r * hidden + j)] += w * static_cast<double>(d[r * hidden + j]);
    }
  };
  for (const ClientUpdate* u : order) {
    if (which != RowCounts::targets) add(*u, u->input_counts);
    if (which != RowCounts::inputs) add(*u, u->target_counts);
  }
  float* out = m.data<float>();
  for (int64_t r = 0; r < vocab; ++r) {
    const double w = weight[static_cast<size_t>(r)];
    if (w <= 0) continue;  // nobody saw this token: the token-weighted mean stays
    for (int64_t j = 0; j < hidden; ++j)
      out[r * hidden + j] = static_cast<float>(sum[static_cast<size_t>(r * hidden + j)] / w);
  }
}

void Strategy::aggregate(int64_t round, Weights& global, const std::vector<ClientUpdate>& updates,
                         AggregationReport* report) {
  Weights mean = robust_aggregate(options_.robust, global, updates, report);
  if (options_.weights_rows()) {
    POLLEN_CHECK(token_rows_.embedding >= 0,
                 "row weighting: the strategy was not told which tensor is the embedding");
    for (const auto& u : updates) {
      POLLEN_CHECK(!u.input_counts.ids.empty() && !u.target_counts.ids.empty(),
                   "row weighting: the update from '", u.client_id, "' carries no token counts");
    }
    // The embedding's rows by input counts, the output layer's by target counts (a tied
    // embedding is both).
    const bool inputs = options_.row_weighting != "target_counts";
    const bool outputs = options_.row_weighting != "input_counts";
    if (token_rows_.output < 0) {
      weight_rows(mean, token_rows_.embedding,
                  inputs && outputs ? RowCounts::both
                  : inputs          ? RowCounts::inputs
                                    : RowCounts::targets,
                  updates);
    } else {
      if (inputs) weight_rows(mean, token_rows_.embedding, RowCounts::inputs, updates);
      if (outputs) weight_rows(mean, token_rows_.output, RowCounts::targets, updates);
    }
  }
  aggregate_mean(round, global, mean);
}

void Strategy::aggregate_mean(int64_t round, Weights& global, const Weights& mean_delta) {
  POLLEN_CHECK(round >= 1, "aggregate: rounds count from 1, got ", round);
  for (const Tensor& t : global) {
    POLLEN_CHECK(t.dtype() == DType::f32 && t.is_contiguous(),
                 "aggregate: the global model must be contiguous float32");
  }
  check_same_layout(global, mean_delta, "the aggregated pseudo-gradient");
  apply(round, global, mean_delta);
}

ClientEval Strategy::aggregate_evaluate(const std::vector<ClientEval>& evals) {
  ClientEval out;
  out.client_id = "all";
  double sum = 0;
  for (const auto& e : evals) {
    if (e.tokens <= 0) continue;
    sum += e.loss * static_cast<double>(e.tokens);
    out.tokens += e.tokens;
  }
  out.loss = out.tokens > 0 ? sum / static_cast<double>(out.tokens) : 0.0;
  return out;
}

}  // namespace pollen::fed
