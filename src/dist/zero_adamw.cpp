#include "dist/zero_adamw.h"

#include <cmath>
#include <cstring>

namespace pollen::dist {
namespace {

void copy_floats(float* to, const float* from, int64_t n) {
  std::memcpy(to, from, static_cast<size_t>(n) * sizeof(float));
}

}  // namespace

ZeroAdamW::ZeroAdamW(GradReducer& reducer, const optim::AdamWOptions& options,
                     const std::vector<bool>& decay)
    : reducer_(reducer), comm_(*reducer.communicator()), options_(options) {
  const auto& params = reducer_.params();
  POLLEN_CHECK(decay.size() == params.size(), "ZeRO AdamW: ", decay.size(), " decay flags for ",
               params.size(), " parameters");
  const auto& buckets = reducer_.buckets();
  for (size_t b = 0; b < buckets.size(); ++b) {
    const int64_t s = reducer_.shard_size(b);
    const int64_t lo = comm_.rank() * s, hi = lo + s;
    exp_avg_.push_back(Tensor::zeros({s}, DType::f32));
    exp_avg_sq_.push_back(Tensor::zeros({s}, DType::f32));
    for (const auto& e : buckets[b].entries) {
      const int64_t first = std::max(lo, e.offset), last = std::min(hi, e.offset + e.numel);
      if (first >= last) continue;
      const Piece p{b, e.param, first - e.offset, first - lo, last - first};
      pieces_.push_back(p);
      ops::AdamWSlot slot;
      slot.param = params[e.param].value().view({-1}).slice(0, p.in_param, p.in_param + p.numel);
      slot.grad = reducer_.shard_grad(b).slice(0, p.in_shard, p.in_shard + p.numel);
      slot.exp_avg = exp_avg_[b].slice(0, p.in_shard, p.in_shard + p.numel);
      slot.exp_avg_sq = exp_avg_sq_[b].slice(0, p.in_shard, p.in_shard + p.numel);
      slot.weight_decay = decay[e.param] ? options_.weight_decay : 0.0;
      slots_.push_back(std::move(slot));
    }
  }
}

int64_t ZeroAdamW::state_bytes() const {
  int64_t bytes = 0;
  for (size_t b = 0; b < exp_avg_.size(); ++b)
    bytes += static_cast<int64_t>(exp_avg_[b].nbytes() + exp_avg_sq_[b].nbytes());
  return bytes;
}

double ZeroAdamW::step(double lr) {
  std::vector<Tensor> shards;
  for (size_t b = 0; b < reducer_.buckets().size(); ++b) shards.push_back(reducer_.shard_grad(b));
  double sum_sq = ops::sum_of_squares(shards);
  comm_.all_reduce_sum(std::span<double>(&sum_sq, 1), "the gradient norm");
  const double norm = std::sqrt(sum_sq);
  last_wait_s_ = 0;
  if (!std::isfinite(norm)) return norm;
  ++step_;
  ops::AdamWHyper h;
  h.lr = lr;
  h.beta1 = options_.beta1;
  h.beta2 = options_.beta2;
  h.eps = options_.eps;
  h.step = step_;
  if (options_.max_grad_norm > 0 && norm > options_.max_grad_norm)
    h.grad_scale = options_.max_grad_norm / (norm + 1e-6);
  ops::adamw_step(slots_, h);

  // Every rank's updated block into every rank's parameters.
  const auto& buckets = reducer_.buckets();
  std::vector<Tensor> send;
  std::vector<Request> requests;
  for (size_t b = 0; b < buckets.size(); ++b)
    send.push_back(Tensor::zeros({reducer_.shard_size(b)}, DType::f32));
  for (size_t k = 0; k < pieces_.size(); ++k)
    copy_floats(send[pieces_[k].bucket].data<float>() + pieces_[k].in_shard,
                slots_[k].param.data<float>(), pieces_[k].numel);
  for (size_t b = 0; b < buckets.size(); ++b)
    requests.push_back(comm_.start_all_gather(send[b].data<float>(), reducer_.flat(b).data<float>(),
                                              reducer_.shard_size(b),
                                              cat("the parameter all-gather of bucket ", b)));
  const auto& params = reducer_.params();
  for (size_t b = 0; b < buckets.size(); ++b) {
    last_wait_s_ += comm_.wait(requests[b]);
    const float* flat = reducer_.flat(b).data<float>();
    for (const auto& e : buckets[b].entries)
      copy_floats(params[e.param].value().data<float>(), flat + e.offset, e.numel);
  }
  return norm;
}

void ZeroAdamW::gather_bucket_moments(size_t b, const Tensor& shard_moment,
                                      std::vector<Tensor>& whole) {
  Tensor all = Tensor::empty({reducer_.buckets()[b].padded}, DType::f32);
  comm_.wait(comm_.start_all_gather(shard_moment.data<float>(), all.data<float>(),
                                    reducer_.shard_size(b),
                                    cat("the optimizer state gather of bucket ", b)));
  const auto& params = reducer_.params();
  for (const auto& e : reducer_.buckets()[b].entries) {
    whole[e.param] = Tensor::empty(params[e.param].shape(), DType::f32);
    copy_floats(whole[e.param].data<float>(), all.data<float>() + e.offset, e.numel);
  }
}

void ZeroAdamW::gather_state(std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq) {
  exp_avg.assign(reducer_.params().size(), Tensor());
  exp_avg_sq.assign(reducer_.params().size(), Tensor());
  for (size_t b = 0; b < reducer_.buckets().size(); ++b) {
    gather_bucket_moments(b, exp_avg_[b], exp_avg);
    gather_bucket_moments(b, exp_avg_sq_[b], exp_avg_sq);
  }
}

void ZeroAdamW::load_state(const std::vector<Tensor>& exp_avg,
                           const std::vector<Tensor>& exp_avg_sq) {
  POLLEN_ASSERT(exp_avg.size() == reducer_.params().size());
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const Piece& p = pieces_[k];
    copy_floats(slots_[k].exp_avg.data<float>(),
                exp_avg[p.param].contiguous().data<float>() + p.in_param, p.numel);
  }
  load_second_moments(exp_avg_sq);
}

void ZeroAdamW::load_second_moments(const std::vector<Tensor>& exp_avg_sq) {
  POLLEN_ASSERT(exp_avg_sq.size() == reducer_.params().size());
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const Piece& p = pieces_[k];
    copy_floats(slots_[k].exp_avg_sq.data<float>(),
                exp_avg_sq[p.param].contiguous().data<float>() + p.in_param, p.numel);
  }
}

}  // namespace pollen::dist
