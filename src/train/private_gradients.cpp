#include "train/private_gradients.h"

#include <cmath>

#include "autograd/tape.h"

namespace pollen::train {

PrivateGradient private_gradients(const model::Llama& model, const data::Loader& loader,
                                  optim::DpSgd& dp, int64_t step) {
  const std::vector<int64_t> sample = dp.sample(step);
  const std::vector<ag::Var> params = model.parameters();
  dp.begin(params);
  PrivateGradient g;
  g.rows = static_cast<int64_t>(sample.size());
  double sum = 0;
  for (const int64_t window : sample) {
    const model::Batch row = loader.windows({window});  // (1, seq)
    const int64_t scored = count_scored(row);
    if (scored == 0) continue;  // a zero gradient: nothing to add
    ag::Tape tape;
    ag::Var loss;
    {
      ag::TapeScope scope(tape);
      loss = model.loss(row, ag::Reduction::sum);
    }
    sum += loss.value().item();
    g.loss.scored += scored;
    tape.backward(loss, 1.0 / static_cast<double>(scored));  // the sequence's mean token loss
    dp.add_clipped();
    for (auto p : params) p.zero_grad();
  }
  g.clipped = dp.clipped();
  dp.release(step);
  g.loss.loss = g.loss.scored > 0 ? sum / static_cast<double>(g.loss.scored) : NAN;
  return g;
}

}  // namespace pollen::train
