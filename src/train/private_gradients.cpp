#include "train/private_gradients.h"

#include <algorithm>
#include <cmath>

#include "autograd/per_sample.h"
#include "autograd/tape.h"

namespace pollen::train {

namespace {
model::Batch rows_of(const model::Batch& rows, int64_t r0, int64_t r1) {  // (r1 - r0, seq)
  return {rows.tokens.slice(0, r0, r1), rows.targets.slice(0, r0, r1),
          rows.positions.slice(0, r0, r1), rows.doc_ids.slice(0, r0, r1)};
}

// Every row's gradient from one forward and one backward pass, clipped by its own norm.
ClippedRows add_clipped_chunk(const model::Llama& model, const model::Batch& rows,
                              optim::DpSgd& dp) {
  const int64_t samples = rows.tokens.size(0), seq = rows.tokens.size(1);
  std::vector<int64_t> scored(static_cast<size_t>(samples));
  ClippedRows sums;
  for (int64_t r = 0; r < samples; ++r) {
    scored[static_cast<size_t>(r)] = count_scored(rows_of(rows, r, r + 1));
    sums.scored += scored[static_cast<size_t>(r)];
  }
  if (sums.scored == 0) return sums;  // zero gradients: nothing to add
  ag::PerSampleGradients per_sample(samples, seq);
  ag::Tape tape;
  ag::Var loss;
  {
    ag::TapeScope scope(tape);
    loss = model.loss(rows, ag::Reduction::sum);
  }
  sums.loss_sum = loss.value().item();
  tape.backward(loss);  // each row's gradient of its summed token loss
  const std::vector<ag::Var> params = model.parameters();
  for (const ag::Var& p : params)
    POLLEN_CHECK(!p.grad().defined(), "privacy: an op wrote a gradient without per-sample ",
                 "clipping");
  // A row's mean-loss gradient is its summed-loss gradient over its scored tokens.
  std::vector<double> scale(static_cast<size_t>(samples), 0.0);
  for (size_t r = 0; r < scale.size(); ++r) {
    if (scored[r] == 0) continue;
    const double count = static_cast<double>(scored[r]);
    // A norm near 0 may round below it (a tied table's cross term); NaN stays NaN, left out.
    const double norm_sq = std::max(per_sample.norms_sq()[r], 0.0);
    scale[r] = dp.clip_factor(std::sqrt(norm_sq) / count) / count;
  }
  per_sample.write(scale);
  dp.add_gradients();
  for (auto p : params) p.zero_grad();
  return sums;
}

// One row per forward and backward, each row's gradient taken whole, then clipped.
ClippedRows add_clipped_one_by_one(const model::Llama& model, const model::Batch& rows,
                                   optim::DpSgd& dp) {
  const std::vector<ag::Var> params = model.parameters();
  ClippedRows sums;
  for (int64_t r = 0; r < rows.tokens.size(0); ++r) {
    const model::Batch row = rows_of(rows, r, r + 1);
    const int64_t scored = count_scored(row);
    if (scored == 0) continue;  // a zero gradient: nothing to add
    ag::Tape tape;
    ag::Var loss;
    {
      ag::TapeScope scope(tape);
      loss = model.loss(row, ag::Reduction::sum);
    }
    sums.loss_sum += loss.value().item();
    sums.scored += scored;
    tape.backward(loss, 1.0 / static_cast<double>(scored));  // the sequence's mean token loss
    dp.add_clipped();
    for (auto p : params) p.zero_grad();
  }
  return sums;
}
}  // namespace

bool batched_clipping_is_cheaper(const model::LlamaConfig& c, int64_t seq) {
  // Per row. Batched: each weight's norm, from the Gram matrices of its input and output
  // gradient (2 T^2 (m + k) FLOPs) or from the row's m x k gradient (2 T m k), the cheaper;
  // and the head's logits once more for its clipped gradient (2 T V C).
  const double t = static_cast<double>(seq);
  auto norm = [t](int64_t m, int64_t k) {
    const double md = static_cast<double>(m), kd = static_cast<double>(k);
    return std::min(2 * t * t * (md + kd), 2 * t * md * kd);
  };
  const int64_t d = c.hidden_size, f = c.intermediate_size, hd = c.resolved_head_dim();
  const int64_t q = c.num_attention_heads * hd, kv = c.num_key_value_heads * hd;
  const double layer = norm(q, d) + 2 * norm(kv, d) + norm(d, q) + 2 * norm(f, d) + norm(d, f);
  const double batched = static_cast<double>(c.num_hidden_layers) * layer + norm(c.vocab_size, d) +
                         2 * t * static_cast<double>(c.vocab_size) * static_cast<double>(d);
  // One by one: its passes over every gradient per row (the norm, the clipped sum, the zeroing
  // and the next row's accumulation into zeroed buffers), counted as 240 FLOPs per parameter, the
  // constant at which this estimate picks the faster way in every case measured on a 2-core CPU
  // (bench/README.md, "DP-SGD against Opacus"). The batched way's own sweeps (each sample's
  // gradient of a layer when its norm is taken directly, the scaled copies) are left out.
  const double one_by_one = 240.0 * static_cast<double>(c.parameter_count());
  return batched < one_by_one;
}

ClipMethod automatic_clip_method(const model::LlamaConfig& config, int64_t seq) {
  return batched_clipping_is_cheaper(config, seq) ? ClipMethod::batched : ClipMethod::one_by_one;
}

ClippedRows add_clipped_rows(const model::Llama& model, const model::Batch& rows, optim::DpSgd& dp,
                             int64_t chunk_rows, ClipMethod method) {
  if (method == ClipMethod::automatic)
    method = automatic_clip_method(model.config(), rows.tokens.size(1));
  if (method == ClipMethod::one_by_one) return add_clipped_one_by_one(model, rows, dp);
  POLLEN_CHECK(chunk_rows > 0, "privacy: rows per pass must be positive, got ", chunk_rows);
  ClippedRows sums;
  for (int64_t r0 = 0; r0 < rows.tokens.size(0); r0 += chunk_rows) {
    const ClippedRows c = add_clipped_chunk(
        model, rows_of(rows, r0, std::min(r0 + chunk_rows, rows.tokens.size(0))), dp);
    sums.loss_sum += c.loss_sum;
    sums.scored += c.scored;
  }
  return sums;
}

PrivateGradient private_gradients(const model::Llama& model, const data::Loader& loader,
                                  optim::DpSgd& dp, int64_t step, int64_t chunk_rows,
                                  dist::GradReducer* reducer,
                                  const std::function<void()>& before_reduction) {
  dist::Communicator* comm = reducer ? reducer->communicator() : nullptr;
  const int rank = comm ? comm->rank() : 0, world = comm ? comm->world() : 1;
  // Every rank draws rank 0's sample.
  int64_t key[1] = {static_cast<int64_t>(dp.sample_key(step))};
  if (world > 1) comm->broadcast(key, 0, "DP-SGD's sample key");
  const std::vector<int64_t> sample = dp.sample_from(static_cast<uint64_t>(key[0]));
  std::vector<int64_t> share;  // every world-th sequence of the sample
  for (size_t i = static_cast<size_t>(rank); i < sample.size(); i += static_cast<size_t>(world))
    share.push_back(sample[i]);
  dp.begin(model.parameters());
  double sums[3] = {0, 0, 0};  // loss, scored tokens, sequences clipped
  if (!share.empty()) {
    const ClippedRows c = add_clipped_rows(model, loader.windows(share), dp, chunk_rows);
    sums[0] = c.loss_sum;
    sums[1] = static_cast<double>(c.scored);
  }
  sums[2] = static_cast<double>(dp.clipped());
  // The noise once, in rank 0's share; each rank's share over B in its gradients, then the
  // shares summed as a plain step's gradients are.
  if (rank == 0) dp.add_noise(step);
  dp.finish();
  if (before_reduction) before_reduction();
  PrivateGradient g;
  if (world > 1) {
    g.reduce_wait_s = reducer->finish();
    comm->all_reduce_sum(sums, "DP-SGD's loss and counts");
  }
  g.rows = static_cast<int64_t>(sample.size());
  g.clipped = static_cast<int64_t>(sums[2]);
  g.loss.scored = static_cast<int64_t>(sums[1]);
  g.loss.loss = g.loss.scored > 0 ? sums[0] / sums[1] : NAN;
  return g;
}

}  // namespace pollen::train
