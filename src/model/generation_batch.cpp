#include "model/generation_batch.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#include "base/error.h"

namespace pollen::model {

GenerationBatch::GenerationBatch(const Llama& model, Decoder decode, OnToken on_token,
                                 bool use_cache, int64_t prefill_chunk)
    : model_(model),
      decode_(std::move(decode)),
      on_token_(std::move(on_token)),
      use_cache_(use_cache),
      prefill_chunk_(model.config().rope_scaling.kind == ops::RopeScaling::Kind::dynamic
                         ? 0
                         : std::max<int64_t>(0, prefill_chunk)) {}

size_t GenerationBatch::add(GenerationRow row) {
  check_generation_row(row, static_cast<bool>(decode_));
  POLLEN_CHECK(row.options.use_cache == use_cache_, "generate: a row with use_cache ",
               row.options.use_cache, " in a batch with use_cache ", use_cache_);
  Live r{next_id_++, std::move(row), {}, 0, {}, -1, false};
  r.seq = r.row.prompt;
  live_.push_back(std::move(r));
  return live_.back().id;
}

GenerationBatch::Finished GenerationBatch::finish(Live& r) {
  if (decode_ && !r.cut) r.out.text = decode_(r.out.tokens);
  if (r.slot >= 0) {
    cache_->truncate(r.slot, 0);
    free_slots_.push_back(r.slot);
  }
  return {r.id, std::move(r.out), nullptr};
}

Tensor GenerationBatch::forward(std::vector<bool>& ready) {
  const int64_t V = model_.config().vocab_size, n = static_cast<int64_t>(live_.size());
  Tensor logits = Tensor::zeros({n, V}, DType::f32);
  ready.assign(live_.size(), true);
  if (!use_cache_) {
    for (int64_t i = 0; i < n; ++i) {
      const std::vector<uint32_t>& seq = live_[static_cast<size_t>(i)].seq;
      const int64_t t = static_cast<int64_t>(seq.size());
      Tensor ids = Tensor::empty({1, t}, DType::i32);
      for (int64_t j = 0; j < t; ++j) ids.data<int32_t>()[j] = static_cast<int32_t>(seq[j]);
      const Tensor all = model_.logits(Batch::contiguous_rows(ids, ids));
      std::memcpy(logits.data<float>() + i * V, all.data<float>() + (t - 1) * V,
                  sizeof(float) * static_cast<size_t>(V));
    }
    return logits;
  }
  // Rows that joined take a free row of the cache, or new ones. The cache holds what this step
  // runs and grows by doubling, never past the longest row's prompt and budget: memory follows
  // what rows generate, not the budgets they may never use.
  int64_t rows = cache_ ? cache_->rows() : 0, capacity = cache_ ? cache_->capacity() : 0;
  int64_t needed = 0, most = 0;
  for (Live& r : live_) {
    if (r.slot < 0 && free_slots_.empty()) {
      r.slot = rows++;
    } else if (r.slot < 0) {
      r.slot = free_slots_.back();
      free_slots_.pop_back();
    }
    const auto prompt = static_cast<int64_t>(r.row.prompt.size());
    needed = std::max(needed, static_cast<int64_t>(r.seq.size()));
    most = std::max(most, prompt + std::min(r.row.options.max_tokens,
                                            std::numeric_limits<int64_t>::max() - prompt));
  }
  if (needed > capacity) capacity = std::max(needed, std::min(2 * capacity, most));
  if (!cache_) cache_.emplace(model_.config(), rows, capacity);
  cache_->reserve(rows, capacity);
  // Each row's tokens not yet run: a generating row's last token, a joining row's prompt (within
  // what is left of the step's prompt budget, in the order rows joined).
  auto budget = prefill_chunk_ > 0 ? static_cast<size_t>(prefill_chunk_) : SIZE_MAX;
  std::vector<std::vector<uint32_t>> tokens(static_cast<size_t>(rows));
  for (size_t i = 0; i < live_.size(); ++i) {
    Live& r = live_[i];
    size_t take = r.seq.size() - r.cached;
    if (r.cached < r.row.prompt.size()) {  // still in its prompt
      take = std::min(take, budget);
      budget -= take;
    }
    tokens[static_cast<size_t>(r.slot)].assign(
        r.seq.begin() + static_cast<std::ptrdiff_t>(r.cached),
        r.seq.begin() + static_cast<std::ptrdiff_t>(r.cached + take));
    r.cached += take;
    ready[i] = r.cached == r.seq.size();
  }
  const Tensor by_slot = cache_->forward(model_, tokens);
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(logits.data<float>() + i * V,
                by_slot.data<float>() + live_[static_cast<size_t>(i)].slot * V,
                sizeof(float) * static_cast<size_t>(V));
  return logits;
}

bool GenerationBatch::sample(Live& r, std::span<const float> logits) {
  const SamplingOptions& o = r.row.options;
  const uint32_t next = sample_token(logits, r.seq, o, r.row.rng);
  if (std::find(o.stop_tokens.begin(), o.stop_tokens.end(), next) != o.stop_tokens.end()) {
    r.out.finish_reason = "stop";
    r.out.stop_token = next;
    return true;
  }
  r.seq.push_back(next);
  r.out.tokens.push_back(next);
  if (on_token_) on_token_(r.id, next, logits);
  if (!o.stop_strings.empty()) {
    const std::string text = decode_(r.out.tokens);
    const size_t first = first_stop(text, o.stop_strings);
    if (first != std::string::npos) {
      r.out.finish_reason = "stop";
      r.out.text = text.substr(0, first);
      r.cut = true;
      return true;
    }
  }
  if (static_cast<int64_t>(r.out.tokens.size()) == o.max_tokens) {
    r.out.finish_reason = "length";
    return true;
  }
  return false;
}

std::vector<GenerationBatch::Finished> GenerationBatch::step() {
  std::vector<Finished> finished;
  const auto leave = [&](const std::vector<bool>& gone) {
    size_t kept = 0;
    for (size_t i = 0; i < live_.size(); ++i) {
      if (gone[i]) continue;
      if (kept != i) live_[kept] = std::move(live_[i]);
      ++kept;
    }
    live_.resize(kept);
    if (live_.empty()) {  // the cache's memory goes back until rows come again
      cache_.reset();
      free_slots_.clear();
    }
  };
  std::vector<bool> gone(live_.size(), false);
  for (size_t i = 0; i < live_.size(); ++i) {
    Live& r = live_[i];
    if (r.row.cancelled && r.row.cancelled->load()) {
      r.out.finish_reason = "cancelled";
    } else if (static_cast<int64_t>(r.out.tokens.size()) >= r.row.options.max_tokens) {
      r.out.finish_reason = "length";  // a row with no budget
    } else {
      continue;
    }
    finished.push_back(finish(r));
    gone[i] = true;
  }
  leave(gone);
  if (live_.empty()) return finished;

  std::vector<bool> ready;
  const Tensor logits = forward(ready);
  const auto V = static_cast<size_t>(model_.config().vocab_size);
  gone.assign(live_.size(), false);
  for (size_t i = 0; i < live_.size(); ++i) {
    if (!ready[i]) continue;  // its prompt goes on next step
    const std::span<const float> row(logits.data<float>() + i * V, V);
    std::exception_ptr error;
    try {
      gone[i] = sample(live_[i], row);
    } catch (...) {  // this row's alone (NaN logits, a failing decoder)
      error = std::current_exception();
      live_[i].out.finish_reason = "error";
      gone[i] = true;
    }
    if (gone[i]) {
      finished.push_back(finish(live_[i]));
      finished.back().error = error;
    }
  }
  leave(gone);
  return finished;
}

}  // namespace pollen::model
