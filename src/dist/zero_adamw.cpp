#include "dist/zero_adamw.h"

#include <algorithm>
#include <cmath>

namespace pollen::dist {
namespace {

// Elements [at, at + n) of a flat (or flattened contiguous) tensor, as a view.
Tensor span_of(const Tensor& t, int64_t at, int64_t n) {
  return t.view({-1}).slice(0, at, at + n);
}

}  // namespace

ZeroAdamW::ZeroAdamW(GradReducer& reducer, const optim::AdamWOptions& options,
                     const std::vector<bool>& decay)
    : reducer_(reducer), comm_(*reducer.communicator()), options_(options) {
  const auto& params = reducer_.params();
  POLLEN_CHECK(decay.size() == params.size(), "ZeRO AdamW: ", decay.size(), " decay flags for ",
               params.size(), " parameters");
  if (!params.empty()) device_ = params[0].value().device();
  for (const auto& p : params)
    POLLEN_CHECK(p.dtype() == DType::f32, "ZeRO AdamW: parameter '", p.name(), "' is ",
                 dtype_name(p.dtype()), "; the sharded optimizer updates f32 weights in place");
  const auto& buckets = reducer_.buckets();
  for (size_t b = 0; b < buckets.size(); ++b) {
    const int64_t s = reducer_.shard_size(b);
    const int64_t lo = comm_.rank() * s, hi = lo + s;
    exp_avg_.push_back(Tensor::zeros({s}, DType::f32, device_));
    exp_avg_sq_.push_back(Tensor::zeros({s}, DType::f32, device_));
    for (const auto& e : buckets[b].entries) {
      const int64_t first = std::max(lo, e.offset), last = std::min(hi, e.offset + e.numel);
      if (first >= last) continue;
      const Piece p{b, e.param, first - e.offset, first - lo, last - first};
      pieces_.push_back(p);
      ops::AdamWSlot slot;
      slot.param = span_of(params[e.param].value(), p.in_param, p.numel);
      slot.grad = span_of(reducer_.shard_grad(b), p.in_shard, p.numel);
      slot.exp_avg = span_of(exp_avg_[b], p.in_shard, p.numel);
      slot.exp_avg_sq = span_of(exp_avg_sq_[b], p.in_shard, p.numel);
      slot.weight_decay = decay[e.param] ? options_.weight_decay : 0.0;
      slots_.push_back(std::move(slot));
    }
  }
}

int64_t ZeroAdamW::state_bytes() const {
  int64_t bytes = 0;
  for (size_t b = 0; b < exp_avg_.size(); ++b)
    bytes += static_cast<int64_t>(exp_avg_[b].nbytes() + exp_avg_sq_[b].nbytes());
  for (const Tensor& m : masters_) bytes += static_cast<int64_t>(m.nbytes());
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
    send.push_back(Tensor::zeros({reducer_.shard_size(b)}, DType::f32, device_));
  for (size_t k = 0; k < pieces_.size(); ++k)
    span_of(send[pieces_[k].bucket], pieces_[k].in_shard, pieces_[k].numel).copy_(slots_[k].param);
  for (size_t b = 0; b < buckets.size(); ++b)
    requests.push_back(comm_.start_all_gather(send[b].data<float>(), reducer_.flat(b).data<float>(),
                                              reducer_.shard_size(b),
                                              cat("the parameter all-gather of bucket ", b)));
  const auto& params = reducer_.params();
  for (size_t b = 0; b < buckets.size(); ++b) {
    last_wait_s_ += comm_.wait(requests[b]);
    for (const auto& e : buckets[b].entries)
      span_of(params[e.param].value(), 0, e.numel)
          .copy_(span_of(reducer_.flat(b), e.offset, e.numel));
  }
  return norm;
}

void ZeroAdamW::gather_bucket(size_t b, const Tensor& shard, std::vector<Tensor>& whole,
                              const std::vector<bool>& wanted, bool keep) {
  const auto& entries = reducer_.buckets()[b].entries;
  const auto is_wanted = [&](size_t param) { return wanted.empty() || wanted[param]; };
  if (std::none_of(entries.begin(), entries.end(),
                   [&](const auto& e) { return is_wanted(e.param); }))
    return;  // every rank skips the same buckets: their layouts are the same
  Tensor all = Tensor::empty({reducer_.buckets()[b].padded}, DType::f32, device_);
  comm_.wait(comm_.start_all_gather(shard.data<float>(), all.data<float>(), reducer_.shard_size(b),
                                    cat("the optimizer state gather of bucket ", b)));
  if (!keep) return;
  // To host memory bucket by bucket: whole moments on the GPU would take back what ZeRO saves.
  const Tensor host = all.cpu();
  const auto& params = reducer_.params();
  for (const auto& e : entries) {
    if (!is_wanted(e.param)) continue;
    whole[e.param] = Tensor::empty(params[e.param].shape(), DType::f32);
    span_of(whole[e.param], 0, e.numel).copy_(span_of(host, e.offset, e.numel));
  }
}

void ZeroAdamW::gather_state(std::vector<Tensor>& exp_avg, std::vector<Tensor>& exp_avg_sq,
                             bool keep) {
  exp_avg.assign(reducer_.params().size(), Tensor());
  exp_avg_sq.assign(reducer_.params().size(), Tensor());
  for (size_t b = 0; b < reducer_.buckets().size(); ++b) {
    gather_bucket(b, exp_avg_[b], exp_avg, {}, keep);
    gather_bucket(b, exp_avg_sq_[b], exp_avg_sq, {}, keep);
  }
}

std::vector<Tensor> ZeroAdamW::gather_first_moments(const std::vector<bool>& wanted, bool keep) {
  POLLEN_ASSERT(wanted.size() == reducer_.params().size());
  std::vector<Tensor> exp_avg(reducer_.params().size());
  for (size_t b = 0; b < reducer_.buckets().size(); ++b)
    gather_bucket(b, exp_avg_[b], exp_avg, wanted, keep);
  return exp_avg;
}

void ZeroAdamW::load_state(const std::vector<Tensor>& exp_avg,
                           const std::vector<Tensor>& exp_avg_sq) {
  POLLEN_ASSERT(exp_avg.size() == reducer_.params().size() &&
                exp_avg_sq.size() == reducer_.params().size());
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const Piece& p = pieces_[k];
    slots_[k].exp_avg.copy_(span_of(exp_avg[p.param].contiguous(), p.in_param, p.numel));
    slots_[k].exp_avg_sq.copy_(span_of(exp_avg_sq[p.param].contiguous(), p.in_param, p.numel));
  }
}

void ZeroAdamW::load_first_moments(const std::vector<Tensor>& exp_avg) {
  POLLEN_ASSERT(exp_avg.size() == reducer_.params().size());
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const Piece& p = pieces_[k];
    if (!exp_avg[p.param].defined()) continue;
    slots_[k].exp_avg.copy_(span_of(exp_avg[p.param].contiguous(), p.in_param, p.numel));
  }
}

std::vector<ZeroAdamW::Block> ZeroAdamW::blocks() {
  std::vector<Block> out;
  for (size_t k = 0; k < pieces_.size(); ++k)
    out.push_back({pieces_[k].param, pieces_[k].in_param, slots_[k].exp_avg, slots_[k].exp_avg_sq});
  return out;
}

void ZeroAdamW::compute_in_bf16() {
  if (computes_in_bf16()) return;
  POLLEN_CHECK(device_ == Device::cuda, "ZeRO AdamW: bf16 compute needs the parameters on the ",
               "GPU, they are on ", device_name(device_));
  for (size_t b = 0; b < reducer_.buckets().size(); ++b)
    masters_.push_back(Tensor::zeros({reducer_.shard_size(b)}, DType::f32, device_));
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const Piece& p = pieces_[k];
    Tensor master = span_of(masters_[p.bucket], p.in_shard, p.numel);
    master.copy_(slots_[k].param);
    slots_[k].param = master;
  }
  for (const auto& v : reducer_.params()) {
    v.node()->value = v.value().to(DType::bf16);
    v.node()->grad = Tensor();
  }
}

std::vector<Tensor> ZeroAdamW::gather_weights(bool keep) {
  std::vector<Tensor> whole(reducer_.params().size());
  if (!computes_in_bf16()) {
    for (size_t i = 0; i < whole.size(); ++i) whole[i] = reducer_.params()[i].value();
    return whole;
  }
  for (size_t b = 0; b < reducer_.buckets().size(); ++b)
    gather_bucket(b, masters_[b], whole, {}, keep);
  return whole;
}

void ZeroAdamW::load_weights(const std::vector<Tensor>& weights) {
  const auto& params = reducer_.params();
  POLLEN_ASSERT(weights.size() == params.size());
  for (size_t i = 0; i < params.size(); ++i)
    POLLEN_CHECK(weights[i].dtype() == DType::f32 && weights[i].shape() == params[i].shape(),
                 "ZeRO AdamW: weights of '", params[i].name(), "' must be f32 ",
                 shape_str(params[i].shape()), ", got ", dtype_name(weights[i].dtype()), " ",
                 shape_str(weights[i].shape()));
  for (size_t i = 0; i < params.size(); ++i) {
    // On the parameters' device first, so that bf16 rounding runs there.
    const Tensor w = weights[i].device() == device_ ? weights[i] : weights[i].to(device_);
    if (computes_in_bf16()) {
      for (size_t k = 0; k < pieces_.size(); ++k)
        if (pieces_[k].param == i)
          slots_[k].param.copy_(span_of(w.contiguous(), pieces_[k].in_param, pieces_[k].numel));
    }
    Tensor value = params[i].value();  // copied into: the optimizer's views stay valid
    value.copy_(w);
  }
}

}  // namespace pollen::dist
