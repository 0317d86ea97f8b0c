#pragma once
// Strategies: how the server turns the clients' updates of one round into the next global model.
// Each is a small class behind one interface (configure the round, aggregate, evaluate), as in
// Flower.
//
// Conventions. A client's update is its pseudo-gradient, global minus local weights
// (delta_i = x - x_i), with the number of tokens it trained on. Aggregation averages the deltas
// weighted by tokens (Delta = sum_i t_i delta_i / sum_i t_i, summed in the order of the client
// ids, so the result never depends on arrival order) and hands Delta to an outer optimizer that
// treats it as a gradient:
//
//   fedavg     x -= lr * Delta                          (lr 1: the token-weighted mean of x_i)
//   fedavgm    m = mu * m + Delta;  x -= lr * m          (Flower's FedAvgM, Hsu et al. 2019)
//   fedadam    d = -Delta;  m = b1 m + (1-b1) d;  v = b2 v + (1-b2) d^2;
//              x += eta * sqrt(1-b2^(t+1)) / (1-b1^(t+1)) * m / (sqrt(v) + tau)
//   fedyogi    as fedadam but v = v - (1-b2) d^2 sign(v - d^2), no bias correction
//   fedadagrad m = b1 m + (1-b1) d (b1 0 by default: m = d);  v = v + d^2;
//              x += eta * m / (sqrt(v) + tau)
//   diloco     Nesterov momentum (PyTorch SGD, nesterov=True): m = mu m + Delta;
//              x -= lr * (Delta + mu * m)               (DiLoCo: lr 0.7, mu 0.9)
//
// The FedOpt family (Reddi et al. 2021) follows Flower's implementations exactly, round number
// t counted from 1; arithmetic is in double per element, state and weights stored as float32.
// With embedding_lr_scale k an untied token embedding takes lr * k (eta * k) in each formula,
// its state kept as without k.
//
// The token-weighted mean is the default aggregation; [strategy] aggregation picks a robust rule
// instead (fed/robust.h), and central differential privacy (fed/privacy.h) replaces it with a
// clipped, noised mean that the coordinator hands to aggregate_mean().
//
// Row weighting (strategy.row_weighting, docs/federated.md): the rows of the token embedding
// (and of the untied output layer) are averaged over the clients weighted by how often each
// client saw that row's token this round, not by its tokens in all:
//   Delta[r] = sum_i c_ir delta_i[r] / sum_i c_ir        (rows with sum_i c_ir = 0: as above)
// so a row that one silo alone moved keeps that silo's move instead of a 1/n share of it.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "base/rng.h"
#include "fed/robust.h"
#include "tensor/tensor.h"

namespace pollen {
class ConfigTable;
}

namespace pollen::fed {

// The global model's parameters: float32 tensors in the model's fixed parameter order.
using Weights = std::vector<Tensor>;

Weights clone_weights(const Weights& w);
// a - b, tensor by tensor (float32, the same shapes).
Weights weights_minus(const Weights& a, const Weights& b);

// How often each token id occurred in a client's round: sparse, ids strictly ascending, every
// count at least 1.
struct TokenCounts {
  std::vector<int64_t> ids, counts;
};

struct ClientUpdate {
  std::string client_id;
  int64_t tokens = 0;  // tokens trained on this round: the aggregation weight
  Weights delta;       // global minus local weights, float32, same shapes as the global model
  std::map<std::string, double> metrics;
  // With row weighting: the token ids of the round's scored positions (inputs) and the tokens
  // they predict (targets); each sums to `tokens`.
  TokenCounts input_counts, target_counts;
};

// Which of the model's tensors hold one row per token id ([vocab, hidden]); -1: none.
struct TokenRowTensors {
  int64_t embedding = -1;  // weighted by input counts
  int64_t output = -1;     // an untied output layer, weighted by target counts
};

struct ClientEval {
  std::string client_id;
  int64_t tokens = 0;  // tokens scored
  double loss = 0;     // mean loss per scored token
};

struct StrategyOptions {
  std::string name = "fedavg";  // fedavg fedavgm fedadam fedyogi fedadagrad diloco
  double lr = -1;               // server learning rate (eta); -1: the strategy's default
  double momentum = -1;         // fedavgm, diloco; -1: default
  // fedavgm, diloco: the momentum grows linearly from 0 in round 1 to `momentum` in round
  // momentum_warmup_rounds + 1 (0: `momentum` from round 1)
  int64_t momentum_warmup_rounds = 0;
  double beta1 = -1, beta2 = -1;  // fedadam, fedyogi 0.9, 0.99; fedadagrad beta1 0
  double tau = -1;                // fedadam 1e-9, fedyogi 1e-3, fedadagrad 1e-9
  // Client selection per round: a fraction of the available clients (at least min_clients),
  // drawn by the server's seeded generator (under central DP by its secret one); 1 takes every
  // available client. Under central DP's
  // Poisson sampling fraction_fit is each client's rate and min_clients only the clients a
  // round needs alive to start.
  double fraction_fit = 1.0;
  int64_t min_clients = 1;
  RobustOptions robust;  // aggregation, norm_bound, trim_fraction, byzantine, multi_krum
  // none; input_counts: embedding rows by the clients' input counts; target_counts: the output
  // layer's rows by their target counts (a tied embedding: by targets); token_counts: both (a
  // tied embedding: by inputs plus targets).
  std::string row_weighting = "none";
  bool weights_rows() const { return row_weighting != "none"; }
  // none; factored: the clients share their inner AdamW's second moments (fed/second_moments.h)
  std::string second_moments = "none";
  bool shares_second_moments() const { return second_moments != "none"; }
  // none; output: the clients share their inner AdamW's first moments of the output layer;
  // token_rows: of the embedding too (fed/first_moments.h)
  std::string first_moments = "none";
  bool shares_first_moments() const { return first_moments != "none"; }
  // The outer step of an untied token embedding as a multiple of every other tensor's: x -=
  // lr * embedding_lr_scale * step on its rows (docs/federated.md, "The embedding's outer step").
  double embedding_lr_scale = 1.0;
};

// Reads the [strategy] table (every key documented in docs/federated.md).
StrategyOptions read_strategy_options(ConfigTable& table);

// Poisson sampling (central DP's privacy.sampling = "poisson"): each of `available` is selected
// on its own, with probability `rate`, by one draw of `rng` per client in id order; the sample
// (sorted) may be of any size, empty included.
std::vector<std::string> poisson_sample(const std::vector<std::string>& available, double rate,
                                        Rng& rng);

class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual std::string name() const = 0;

  // The clients that train in `round` (1-based), chosen from `available` (sorted ids): a fixed
  // number, max(ceil(fraction_fit n), min_clients), drawn without replacement.
  std::vector<std::string> configure_round(int64_t round, const std::vector<std::string>& available,
                                           Rng& rng) const;

  // The tensors that row weighting and embedding_lr_scale apply to (the coordinator names them
  // from the model). Refuses an embedding_lr_scale other than 1 without an untied embedding.
  void set_token_rows(TokenRowTensors rows);

  // Applies one round's updates to `global` in place, combined by options().robust, then with
  // row weighting the token rows replaced by their count-weighted means. Updates with zero
  // tokens are refused, and so are missing counts when rows are weighted. Fills *report (per
  // client norm, clipped, rejected) when given.
  void aggregate(int64_t round, Weights& global, const std::vector<ClientUpdate>& updates,
                 AggregationReport* report = nullptr);
  // Applies a mean pseudo-gradient computed elsewhere (secure aggregation, which never holds the
  // single updates; central DP's noised mean).
  void aggregate_mean(int64_t round, Weights& global, const Weights& mean_delta);

  // The token-weighted mean pseudo-gradient, summed in client-id order.
  static Weights weighted_delta(const Weights& like, const std::vector<ClientUpdate>& updates);
  // Replaces the rows of mean[tensor] (shape [vocab, hidden]) whose token some client counted by
  // the count-weighted mean of the clients' rows, summed in client-id order.
  enum class RowCounts { inputs, targets, both };
  static void weight_rows(Weights& mean, int64_t tensor, RowCounts counts,
                          const std::vector<ClientUpdate>& updates);

  // The token-weighted mean loss of the clients' evaluations (federated evaluation).
  static ClientEval aggregate_evaluate(const std::vector<ClientEval>& evals);

  // Outer optimizer state (momentum, second moments), for server checkpoints.
  virtual std::vector<std::pair<std::string, Tensor>> state() const { return {}; }
  virtual void load_state(const std::vector<std::pair<std::string, Tensor>>& state) {}

  const StrategyOptions& options() const { return options_; }

 protected:
  explicit Strategy(StrategyOptions options) : options_(std::move(options)) {}
  virtual void apply(int64_t round, Weights& global, const Weights& delta) = 0;
  // Each tensor's multiple of the outer learning rate: embedding_lr_scale for the untied
  // embedding, 1 for every other.
  std::vector<double> lr_scales(const Weights& global) const;

  StrategyOptions options_;
  TokenRowTensors token_rows_;
};

// Builds the strategy named in options.name; throws listing the names when unknown.
std::unique_ptr<Strategy> make_strategy(const StrategyOptions& options);
std::vector<std::string> strategy_names();
std::vector<std::string> row_weighting_names();

}  // namespace pollen::fed
