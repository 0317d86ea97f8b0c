#include "autograd/per_sample.h"

#include "base/error.h"

namespace pollen::ag {
namespace {
thread_local PerSampleGradients* t_per_sample = nullptr;
}

PerSampleGradients::PerSampleGradients(int64_t samples, int64_t rows)
    : rows_(rows), norms_sq_(static_cast<size_t>(samples), 0.0), previous_(t_per_sample) {
  POLLEN_CHECK(samples > 0 && rows > 0, "per-sample clipping: expected samples and rows > 0, got ",
               samples, " and ", rows);
  t_per_sample = this;
}

PerSampleGradients::~PerSampleGradients() {
  t_per_sample = previous_;
}

void PerSampleGradients::defer(const VarNode* param, const std::vector<double>& norms_sq,
                               Writer write) {
  POLLEN_CHECK(params_.insert(param).second, "per-sample clipping: a parameter is used twice ",
               "in one pass (tied weights other than an embedding table that is also the output ",
               "head), so its per-sample norm is not the sum of its uses");
  defer_tied(param, norms_sq, std::move(write));
}

void PerSampleGradients::defer_tied(const VarNode* param, const std::vector<double>& norms_sq,
                                    Writer write) {
  POLLEN_CHECK(params_.count(param) == 1, "per-sample clipping: a tied weight's second use ",
               "deferred before its first");
  POLLEN_CHECK(param->is_leaf, "per-sample clipping: a weight reached an op through another op ",
               "(a LoRA-merged or cast weight), whose gradient would not reach the parameter");
  POLLEN_CHECK(norms_sq.size() == norms_sq_.size(), "per-sample clipping: ", norms_sq.size(),
               " norms for ", norms_sq_.size(), " samples");
  for (size_t s = 0; s < norms_sq.size(); ++s) norms_sq_[s] += norms_sq[s];
  writers_.push_back(std::move(write));
}

void PerSampleGradients::write(const std::vector<double>& scale) {
  POLLEN_CHECK(scale.size() == norms_sq_.size(), "per-sample clipping: ", scale.size(),
               " scales for ", norms_sq_.size(), " samples");
  for (Writer& w : writers_) w(scale);
  writers_.clear();
}

void PerSampleGradients::note_embedding_ids(const VarNode* table, const Tensor& ids) {
  POLLEN_CHECK(
      embedding_ids_.emplace(table, ids).second, "per-sample clipping: an embedding ",
      "table is used twice in one pass, so its per-sample norm is not the sum of its uses");
}

const Tensor* PerSampleGradients::embedding_ids(const VarNode* table) const {
  const auto it = embedding_ids_.find(table);
  return it == embedding_ids_.end() ? nullptr : &it->second;
}

void PerSampleGradients::note_tied_rows(const VarNode* table, Tensor rows) {
  tied_rows_[table] = std::move(rows);
}

std::optional<Tensor> PerSampleGradients::take_tied_rows(const VarNode* table) {
  auto node = tied_rows_.extract(table);
  if (node.empty()) return std::nullopt;
  return std::move(node.mapped());
}

PerSampleGradients* active_per_sample() {
  return t_per_sample;
}

}  // namespace pollen::ag
