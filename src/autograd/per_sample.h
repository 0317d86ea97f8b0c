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
// parts' norms. Tied embeddings (the table also the output head, the table embedded once) are
// handled: the head keeps, for each sample, its gradient of the table rows of the sample's input
// ids, and the embedding's backward adds the two uses' cross term, 2 <embedding part, head
// part>. Any other second use is refused. Float32 on the CPU.
#include <cstdint>
#include <functional>
#include <optional>
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

  // Tied embeddings. The embedding's forward notes its ids (N) int32 (once per table); a head on
  // the same table reads them and, in its backward, notes its gradient of the table row of each
  // input's id, summed over the input's sample (N,C; ops::CrossEntropyGrads::sample_tied_rows).
  // The embedding's backward takes that (once) and defers with defer_tied, the head having
  // deferred the table already.
  void note_embedding_ids(const VarNode* table, const Tensor& ids);
  const Tensor* embedding_ids(const VarNode* table) const;
  void note_tied_rows(const VarNode* table, Tensor rows);
  std::optional<Tensor> take_tied_rows(const VarNode* table);
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
  std::unordered_map<const VarNode*, Tensor> tied_rows_;
  PerSampleGradients* previous_;
};

// The PerSampleGradients active on this thread, or null.
PerSampleGradients* active_per_sample();

}  // namespace pollen::ag
