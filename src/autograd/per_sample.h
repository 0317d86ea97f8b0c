#pragma once
// Per-sample gradient clipping in one forward and one backward pass (DP-SGD, optim/dp_sgd.h): the
// batch is `samples` samples of `rows` consecutive rows (tokens) each, whose losses do not mix.
// While a PerSampleGradients is active on this thread, the ops that write a parameter's gradient
// (linear, rmsnorm, embedding, the cross-entropy's head) write none: each adds every sample's
// squared norm of its contribution to norms_sq() and keeps what it needs to write it later.
// After backward, write(scale) writes each parameter's gradient as the sum over samples of
// scale[s] times sample s's gradient: with scale[s] = min(1, C / norm_s), the sum of the
// clipped per-sample gradients, the cost of one batched step plus the norms ("book-keeping"
// clipping, Bu et al. 2023; the norms of a sample's linear layers from Gram matrices where that
// is cheaper, as ghost clipping does).
//
//   ag::PerSampleGradients ps(samples, rows);
//   { ag::TapeScope scope(tape); loss = model.loss(batch, ag::Reduction::sum); }
//   tape.backward(loss);
//   ps.write(scales_from(ps.norms_sq()));
//
// A parameter used by two ops in one pass has a per-sample norm that is not the sum of its
// parts' norms. Tied embeddings (the table also the output head) are handled: the head keeps,
// for each sample, its logits' gradient at the sample's input ids and its inputs, and the
// embedding's backward adds the two uses' cross term, 2 <embedding part, head part>. Any other
// second use is refused. Float32 on the CPU.
#include <cstdint>
#include <functional>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "autograd/var.h"
#include "tensor/tensor.h"

namespace pollen::ag {

class PerSampleGradients {
 public:
  PerSampleGradients(int64_t samples, int64_t rows);  // installs itself on this thread
  ~PerSampleGradients();
  PerSampleGradients(const PerSampleGradients&) = delete;
  PerSampleGradients& operator=(const PerSampleGradients&) = delete;

  int64_t samples() const { return static_cast<int64_t>(norms_sq_.size()); }
  int64_t rows() const { return rows_; }
  // For the ops: `param`'s contribution, each sample's squared norm and how to write the
  // gradient given each sample's scale.
  using Writer = std::function<void(const std::vector<double>& scale)>;
  void defer(const VarNode* param, const std::vector<double>& norms_sq, Writer write);

  // Tied embeddings. The embedding's forward notes its ids (N) int32; a head on the same table
  // takes them, and notes, for every row r (token) and every input position t of r's sample,
  // the gradient of the loss by r's logit of input t's id (gather (N, rows)), with its inputs
  // h (N,C). The embedding's backward then finds them (tied_head) and defers with `tied`.
  void note_embedding_ids(const VarNode* table, const Tensor& ids);
  const Tensor* embedding_ids(const VarNode* table) const;
  struct TiedHead {
    Tensor h;                   // (N,C)
    std::vector<float> gather;  // (N, rows)
  };
  void note_tied_head(const VarNode* table, TiedHead head);
  const TiedHead* tied_head(const VarNode* table) const;
  void defer_tied(const VarNode* param, const std::vector<double>& norms_sq, Writer write);

  // Each sample's squared norm of its gradient of every parameter.
  const std::vector<double>& norms_sq() const { return norms_sq_; }
  // Writes (accumulates into) the parameters' gradients; once.
  void write(const std::vector<double>& scale);

 private:
  int64_t rows_;
  std::vector<double> norms_sq_;
  std::vector<Writer> writers_;
  std::unordered_set<const VarNode*> params_;
  std::unordered_map<const VarNode*, Tensor> embedding_ids_;
  std::unordered_map<const VarNode*, TiedHead> tied_heads_;
  PerSampleGradients* previous_;
};

// The PerSampleGradients active on this thread, or null.
PerSampleGradients* active_per_sample();

}  // namespace pollen::ag
