#include "dist/grad_reducer.h"

namespace pollen::dist {

std::vector<Bucket> plan_buckets(const std::vector<ag::Var>& params, int64_t bucket_bytes,
                                 int world) {
  POLLEN_CHECK(bucket_bytes > 0, "gradient buckets: expected a positive size, got ", bucket_bytes,
               " bytes");
  const int64_t cap = std::max<int64_t>(1, bucket_bytes / static_cast<int64_t>(sizeof(float)));
  std::vector<Bucket> buckets;
  int64_t filled = 0;
  for (size_t k = params.size(); k-- > 0;) {
    const ag::Var& p = params[k];
    // bf16 gradients (a GPU model computing in bf16) are reduced in f32 buckets too.
    POLLEN_CHECK(
        p.dtype() == DType::f32 || (p.dtype() == DType::bf16 && p.value().device() == Device::cuda),
        "data parallel: parameter '", p.name(), "' is ", dtype_name(p.dtype()), " on ",
        device_name(p.value().device()), "; gradients are reduced in f32");
    const int64_t n = p.value().numel();
    if (buckets.empty() || (filled > 0 && filled + n > cap)) {
      buckets.emplace_back();
      filled = 0;
    }
    buckets.back().entries.push_back({k, filled, n});
    filled += n;
    buckets.back().padded = (filled + world - 1) / world * world;
  }
  return buckets;
}

GradReducer::GradReducer(Communicator& comm, std::vector<ag::Var> params, int64_t bucket_bytes,
                         ReduceMode mode)
    : comm_(comm), params_(std::move(params)), mode_(mode) {
  buckets_ = plan_buckets(params_, bucket_bytes, comm_.world());
  if (!params_.empty()) device_ = params_[0].value().device();
  for (const auto& p : params_)
    POLLEN_CHECK(p.value().device() == device_, "data parallel: parameter '", p.name(), "' is on ",
                 device_name(p.value().device()), ", the others on ", device_name(device_));
  bucket_of_.assign(params_.size(), 0);
  for (size_t b = 0; b < buckets_.size(); ++b) {
    for (const auto& e : buckets_[b].entries) bucket_of_[e.param] = b;
    flats_.push_back(Tensor::zeros({buckets_[b].padded}, DType::f32, device_));
    if (mode_ == ReduceMode::reduce_scatter)
      shards_.push_back(Tensor::zeros({shard_size(b)}, DType::f32, device_));
  }
  for (size_t i = 0; i < params_.size(); ++i) index_[params_[i].node().get()] = i;
  expected_writes_.assign(params_.size(), -1);
  writes_.assign(params_.size(), 0);
  waiting_on_.assign(buckets_.size(), 0);
  requests_.assign(buckets_.size(), 0);
  started_.assign(buckets_.size(), false);
}

void GradReducer::leaf_written(const ag::VarNode* leaf) {
  const auto it = index_.find(leaf);
  if (it == index_.end()) return;  // a leaf of a recomputation, not a parameter
  const size_t i = it->second;
  POLLEN_CHECK(!started_[bucket_of_[i]], "data parallel: parameter '", params_[i].name(),
               "' received a gradient after its bucket's reduction started; its number of ",
               "gradient writes per backward changed from the first step's ", expected_writes_[i]);
  ++writes_[i];
  written_this_step_.push_back(i);
}

void GradReducer::step_done() {
  if (learned_) {
    for (size_t i : written_this_step_) {
      if (writes_[i] == expected_writes_[i]) {
        --waiting_on_[bucket_of_[i]];
        writes_[i] = -writes_[i];  // final: counted once even if written twice in this step
      }
    }
    while (next_to_start_ < buckets_.size() && waiting_on_[next_to_start_] == 0)
      start(next_to_start_++);
  }
  written_this_step_.clear();
  comm_.progress();
}

void GradReducer::start(size_t b) {
  Bucket& bucket = buckets_[b];
  float* flat = flats_[b].data<float>();
  // On the GPU the copies are enqueued before the collective on the same stream.
  for (const auto& e : bucket.entries) {
    Tensor part = flats_[b].slice(0, e.offset, e.offset + e.numel);
    const Tensor& g = params_[e.param].grad();
    if (g.defined()) {
      part.copy_(g.contiguous().view({e.numel}));  // bf16 gradients widen to f32 here
    } else {
      part.zero_();
    }
  }
  const std::string what = cat("the gradient reduction of bucket ", b);
  requests_[b] =
      mode_ == ReduceMode::all_reduce
          ? comm_.start_all_reduce(flat, bucket.padded, what)
          : comm_.start_reduce_scatter(flat, shards_[b].data<float>(), shard_size(b), what);
  started_[b] = true;
  if (bucket_started_) bucket_started_(b);
}

void GradReducer::copy_out(size_t b) {
  for (const auto& e : buckets_[b].entries) {
    ag::Var& p = params_[e.param];
    // f32 whatever the parameter's dtype: AdamW takes f32 gradients for bf16 weights.
    Tensor g = Tensor::empty(p.shape(), DType::f32, device_);
    g.view({e.numel}).copy_(flats_[b].slice(0, e.offset, e.offset + e.numel));
    p.grad() = std::move(g);
  }
}

double GradReducer::finish() {
  if (!learned_) {
    expected_writes_ = writes_;
    learned_ = true;
  } else {
    for (size_t i = 0; i < params_.size(); ++i) {
      const int64_t got = writes_[i] < 0 ? -writes_[i] : writes_[i];
      POLLEN_CHECK(got == expected_writes_[i], "data parallel: parameter '", params_[i].name(),
                   "' received ", got, " gradient writes in this backward, ", expected_writes_[i],
                   " in the first step's");
    }
  }
  for (; next_to_start_ < buckets_.size(); ++next_to_start_) start(next_to_start_);
  double waited = 0;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    waited += comm_.wait(requests_[b]);
    if (mode_ == ReduceMode::all_reduce) copy_out(b);
  }
  // Ready for the next step.
  std::fill(writes_.begin(), writes_.end(), 0);
  std::fill(started_.begin(), started_.end(), false);
  std::fill(waiting_on_.begin(), waiting_on_.end(), 0);
  for (size_t i = 0; i < params_.size(); ++i)
    if (expected_writes_[i] > 0) ++waiting_on_[bucket_of_[i]];
  next_to_start_ = 0;
  return waited;
}

}  // namespace pollen::dist
