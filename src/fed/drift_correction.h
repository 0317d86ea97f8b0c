#pragma once
// Drift correction of a client's local training (`train.drift_correction` = beta), a
// weight-space form of SCAFFOLD's control variates that costs no communication.
//
// Clients whose data differ drift apart over a round's H local steps, each towards its own
// data's optimum, and the average of such moves loses much of what each client learnt. The
// client knows two things that describe the drift without asking the server for more: how the
// global model moved last round, G = x[t-1] - x[t] (it pulled both), and how its own steps moved
// it then, d (its pseudo-gradient). After every local step of round t it therefore also moves
// its weights by -beta (G - d) / H, so that over the round it follows the federation's last move
// instead of its own: it ends near x[t] - own - beta (G - d), with own about d.
//
// What it sends is its own steps' move alone, `own` = x[t] - local - H * step_drift, never the
// correction: the server averages the same kind of update as without correction, whatever its
// outer optimizer (no feedback loop through momentum), and only where each client's gradients
// were taken changes. The state kept across rounds is one model-sized anchor, a = x[t-1] - d,
// since G - d = a - x[t]; it is used only when the client also trained the round just before.
#include <cstdint>

#include "fed/strategy.h"

namespace pollen::fed {

class DriftCorrection {
 public:
  explicit DriftCorrection(double beta = 0) : beta_(beta) {}
  bool enabled() const { return beta_ > 0; }

  // What to add to the weights after each of round `round`'s `steps` local steps, from the
  // global model `global` it trains from: -beta (anchor - global) / steps, tensor by tensor
  // (returned as the value to subtract). Empty when correction is off or the client did not
  // train round - 1 (a first round, a missed round, or a restart without the anchor).
  Weights step_drift(int64_t round, const Weights& global, int64_t steps) const;

  // The client's own move over the round, global - local - steps * drift (global - local when
  // drift is empty), and the anchor for round + 1 (global - own) when correction is on.
  Weights own_move(int64_t round, const Weights& global, const Weights& local, const Weights& drift,
                   int64_t steps);

  // The client state's part (fed/client_state.h): the anchor and the round it was taken in.
  const Weights& anchor() const { return anchor_; }
  int64_t anchor_round() const { return anchor_round_; }
  void restore(Weights anchor, int64_t round);

 private:
  double beta_;
  Weights anchor_;
  int64_t anchor_round_ = 0;
};

}  // namespace pollen::fed
