#pragma once
// The tape: ops run eagerly and, while a tape is active and an input wants a gradient, append a
// closure that maps the output's gradient to the inputs' gradients. backward() replays the
// closures in reverse, releasing each one (and the activations it holds) as soon as it has run.
//
//   ag::Tape tape;
//   { ag::TapeScope scope(tape); loss = model.loss(batch); }
//   tape.backward(loss);          // parameters' grads accumulate until zero_grad()
//
// Without an active tape (or inside ag::NoGrad) nothing is recorded: inference keeps no memory.
#include <functional>
#include <vector>

#include "autograd/var.h"

namespace pollen::ag {

class Tape {
 public:
  void record(std::function<void()> backward_fn) { steps_.push_back(std::move(backward_fn)); }
  // Seeds d(loss)/d(loss) = seed and runs the recorded steps in reverse; the tape is empty after.
  void backward(Var& loss, double seed = 1.0);
  // The same from any output: seeds its gradient with `grad` (same shape as out).
  void backward(Var& out, const Tensor& grad);
  size_t size() const { return steps_.size(); }
  void clear() { steps_.clear(); }

 private:
  std::vector<std::function<void()>> steps_;
};

Tape* active_tape();

class TapeScope {
 public:
  explicit TapeScope(Tape& tape);
  ~TapeScope();
  TapeScope(const TapeScope&) = delete;
  TapeScope& operator=(const TapeScope&) = delete;

 private:
  Tape* previous_;
};

class NoGrad {
 public:
  NoGrad();
  ~NoGrad();
  NoGrad(const NoGrad&) = delete;
  NoGrad& operator=(const NoGrad&) = delete;

 private:
  Tape* previous_;
};

// True when an op on these inputs must be recorded.
bool should_record(std::initializer_list<const Var*> inputs);

// The gradient buffer of v: allocated and zeroed on first use.
Tensor& grad_buffer(const std::shared_ptr<VarNode>& v);

// Adds g into v's gradient (taking g itself when v has none yet).
void accumulate(const std::shared_ptr<VarNode>& v, const Tensor& g);

// Watches a backward pass: which leaves (parameters) each step writes a gradient to, and when
// the step is over. Data-parallel training starts reducing a bucket of gradients as soon as the
// step that writes its last gradient is done, while backward goes on.
class BackwardObserver {
 public:
  virtual ~BackwardObserver() = default;
  virtual void leaf_written(const VarNode* leaf) = 0;  // a step is writing leaf's gradient
  virtual void step_done() = 0;                        // the writes of that step are complete
};

// Installs an observer on this thread for the scope's life (backward passes of nested tapes,
// as in activation recomputation, report to it too).
class ObserveBackward {
 public:
  explicit ObserveBackward(BackwardObserver& observer);
  ~ObserveBackward();
  ObserveBackward(const ObserveBackward&) = delete;
  ObserveBackward& operator=(const ObserveBackward&) = delete;

 private:
  BackwardObserver* previous_;
};

}  // namespace pollen::ag
