#include "train/private_gradients.h"

#include <cmath>

#include "autograd/tape.h"

namespace pollen::train {

PrivateGradient private_gradients(const model::Llama& model, const data::Loader& loader,
                                  optim::DpSgd& dp, int64_t step, dist::Communicator* comm) {
  const int rank = comm ? comm->rank() : 0, world = comm ? comm->world() : 1;
  // Every rank draws rank 0's sample.
  int64_t key[1] = {static_cast<int64_t>(dp.sample_key(step))};
  if (world > 1) comm->broadcast(key, 0, "DP-SGD's sample key");
  const std::vector<int64_t> sample = dp.sample_from(static_cast<uint64_t>(key[0]));
  const std::vector<ag::Var> params = model.parameters();
  dp.begin(params);
  double sums[3] = {0, 0, 0};  // loss, scored tokens, sequences clipped
  for (size_t i = 0; i < sample.size(); ++i) {
    if (static_cast<int>(i % static_cast<size_t>(world)) != rank) continue;
    const model::Batch row = loader.windows({sample[i]});  // (1, seq)
    const int64_t scored = count_scored(row);
    if (scored == 0) continue;  // a zero gradient: nothing to add
    ag::Tape tape;
    ag::Var loss;
    {
      ag::TapeScope scope(tape);
      loss = model.loss(row, ag::Reduction::sum);
    }
    sums[0] += loss.value().item();
    sums[1] += static_cast<double>(scored);
    tape.backward(loss, 1.0 / static_cast<double>(scored));  // the sequence's mean token loss
    dp.add_clipped();
    for (auto p : params) p.zero_grad();
  }
  sums[2] = static_cast<double>(dp.clipped());
  // The noise once, in rank 0's share, then the shares summed: every rank holds the release.
  if (rank == 0) dp.add_noise(step);
  PrivateGradient g;
  if (world > 1) {
    for (Tensor& s : dp.clipped_sum())
      g.reduce_wait_s +=
          comm->wait(comm->start_all_reduce(s.data<float>(), s.numel(), "DP-SGD's clipped sums"));
    comm->all_reduce_sum(sums, "DP-SGD's loss and counts");
  }
  dp.finish();
  g.rows = static_cast<int64_t>(sample.size());
  g.clipped = static_cast<int64_t>(sums[2]);
  g.loss.scored = static_cast<int64_t>(sums[1]);
  g.loss.loss = g.loss.scored > 0 ? sums[0] / sums[1] : NAN;
  return g;
}

}  // namespace pollen::train
