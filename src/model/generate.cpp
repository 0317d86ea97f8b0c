#include "model/generate.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>

#include "base/error.h"
#include "base/rng.h"
#include "base/thread_pool.h"
#include "model/generation_batch.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/gemm.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"

namespace pollen::model {
namespace {

// y (N, out) = x (N, in) W^T (+ b).
Tensor linear(const Tensor& x, const ag::Var& w, const ag::Var& b) {
  Tensor y = Tensor::empty({x.size(0), w.size(0)}, DType::f32);
  ops::gemm(x, false, w.value(), true, y);
  if (b.defined()) {
    const float* bias = b.value().data<float>();
    float* p = y.data<float>();
    const int64_t n = y.size(0), m = y.size(1);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < m; ++j) p[i * m + j] += bias[j];
  }
  return y;
}

// linear() plus a LoRA adapter's scale * (x A^T) B^T when `adapter` is defined (no dropout).
Tensor linear(const Tensor& x, const ag::Var& w, const ag::Var& b, const LoraAdapter& adapter,
              double scale) {
  Tensor y = linear(x, w, b);
  if (adapter.defined()) {
    Tensor u = Tensor::empty({x.size(0), adapter.a.size(0)}, DType::f32);  // (N,r)
    ops::gemm(x, false, adapter.a.value(), true, u);
    ops::gemm(u, false, adapter.b.value(), true, y, scale, 1.0);
  }
  return y;
}

Tensor rmsnorm(const Tensor& x, const ag::Var& w, double eps) {
  Tensor y = Tensor::empty(x.shape(), DType::f32), rstd = Tensor::empty({x.size(0)}, DType::f32);
  ops::rmsnorm_forward(x, w.value(), eps, y, rstd);
  return y;
}

}  // namespace

KvCache::KvCache(const LlamaConfig& config, int64_t rows, int64_t capacity, DType dtype)
    : capacity_(capacity),
      kv_dim_(config.num_key_value_heads * config.resolved_head_dim()),
      lengths_(static_cast<size_t>(rows), 0) {
  POLLEN_CHECK(dtype == DType::f32, "KvCache: only f32 models are supported for now");
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    k_.push_back(Tensor::zeros({rows, capacity, kv_dim_}, DType::f32));
    v_.push_back(Tensor::zeros({rows, capacity, kv_dim_}, DType::f32));
  }
}

namespace {

// Rotary embedding of the new tokens' q (N,1,H,D) and k (N,1,KVH,D) at positions (N,1), in
// place. Dynamic scaling takes its theta from the longest position of a call, so each row's
// tokens (contiguous in the N) are rotated by a call of their own: a row's result must not
// depend on the rows beside it.
void rotate_rows(Tensor q, Tensor k, const Tensor& positions, const ops::RopeParams& rope,
                 const std::vector<int64_t>& row_of) {
  const int64_t n = static_cast<int64_t>(row_of.size());
  const bool per_row = rope.scaling.kind == ops::RopeScaling::Kind::dynamic;
  for (int64_t begin = 0, end = 0; begin < n; begin = end) {
    end = per_row ? begin : n;
    while (end < n && row_of[static_cast<size_t>(end)] == row_of[static_cast<size_t>(begin)]) ++end;
    Tensor qr = q.slice(0, begin, end), kr = k.slice(0, begin, end);
    const Tensor pr = positions.slice(0, begin, end);
    ops::rope_forward(qr, pr, rope, qr);
    ops::rope_forward(kr, pr, rope, kr);
  }
}

}  // namespace

// Every new token of every row goes through the layers as one (N, C) matrix, so projections
// and the MLP are single GEMMs; attention reads each token's own row of the cache.
Tensor KvCache::forward(const Llama& model, const std::vector<std::vector<uint32_t>>& tokens) {
  const LlamaConfig& c = model.config();
  POLLEN_CHECK(model.dtype() == DType::f32, "generation: only f32 models are supported for now");
  POLLEN_CHECK(static_cast<int64_t>(tokens.size()) == rows(), "KvCache::forward: ", tokens.size(),
               " rows of tokens for a cache of ", rows());
  std::vector<int64_t> row_of, pos_of;
  std::vector<int64_t> last_index(tokens.size(), -1);
  for (size_t r = 0; r < tokens.size(); ++r) {
    POLLEN_CHECK(lengths_[r] + static_cast<int64_t>(tokens[r].size()) <= capacity_, "KvCache: row ",
                 r, " would hold ", lengths_[r] + tokens[r].size(),
                 " tokens, over its capacity of ", capacity_);
    for (size_t i = 0; i < tokens[r].size(); ++i) {
      POLLEN_CHECK(tokens[r][i] < static_cast<uint64_t>(c.vocab_size), "generation: token id ",
                   tokens[r][i], " is outside the model's vocabulary of ", c.vocab_size);
      row_of.push_back(static_cast<int64_t>(r));
      pos_of.push_back(lengths_[r] + static_cast<int64_t>(i));
      last_index[r] = static_cast<int64_t>(row_of.size()) - 1;
    }
  }
  const int64_t n = static_cast<int64_t>(row_of.size());
  const int64_t V = c.vocab_size;
  Tensor out = Tensor::zeros({rows(), V}, DType::f32);
  if (n == 0) return out;
  const int64_t H = c.num_attention_heads, KVH = c.num_key_value_heads;
  const int64_t D = c.resolved_head_dim(), C = c.hidden_size, group = H / KVH;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const ops::RopeParams rope = c.rope_params();

  Tensor ids = Tensor::empty({n}, DType::i32), positions = Tensor::empty({n, 1}, DType::i32);
  for (int64_t i = 0; i < n; ++i) {
    ids.data<int32_t>()[i] = static_cast<int32_t>(tokens[static_cast<size_t>(
        row_of[i])][static_cast<size_t>(pos_of[i] - lengths_[static_cast<size_t>(row_of[i])])]);
    positions.data<int32_t>()[i] = static_cast<int32_t>(pos_of[i]);
  }
  Tensor x = Tensor::empty({n, C}, DType::f32);
  ops::embedding_forward(model.embed_tokens().value(), ids, x);

  const Lora* lora = model.lora().get();
  const double lora_scale = lora ? lora->scale() : 0.0;
  const LoraAdapter none;
  for (size_t l = 0; l < model.layers().size(); ++l) {
    const LayerParams& p = model.layers()[l];
    auto adapter = [&](LoraTarget target) -> const LoraAdapter& {
      return lora ? lora->adapter(static_cast<int64_t>(l), target) : none;
    };
    auto project = [&](const Tensor& in, const ag::Var& w, const ag::Var& b, LoraTarget target) {
      return linear(in, w, b, adapter(target), lora_scale);
    };
    Tensor h = rmsnorm(x, p.input_norm, c.rms_norm_eps);
    Tensor q = project(h, p.q_proj, p.q_bias, LoraTarget::q_proj),
           k = project(h, p.k_proj, p.k_bias, LoraTarget::k_proj),
           v = project(h, p.v_proj, p.v_bias, LoraTarget::v_proj);
    rotate_rows(q.reshape({n, 1, H, D}), k.reshape({n, 1, KVH, D}), positions, rope, row_of);
    float* kc = k_[l].data<float>();
    float* vc = v_[l].data<float>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t at = (row_of[i] * capacity_ + pos_of[i]) * kv_dim_;
      std::memcpy(kc + at, k.data<float>() + i * kv_dim_, sizeof(float) * kv_dim_);
      std::memcpy(vc + at, v.data<float>() + i * kv_dim_, sizeof(float) * kv_dim_);
    }
    Tensor a = Tensor::empty({n, H * D}, DType::f32);
    const float* qp = q.data<float>();
    float* ap = a.data<float>();
    parallel_for(n * H, 1, [&](int64_t begin, int64_t end) {
      std::vector<double> scores;
      std::vector<double> acc(static_cast<size_t>(D));
      for (int64_t task = begin; task < end; ++task) {
        const int64_t i = task / H, head = task % H, kvh = head / group;
        const int64_t pos = pos_of[i];
        const int64_t first =
            c.sliding_window > 0 ? std::max<int64_t>(0, pos - c.sliding_window + 1) : 0;
        const float* qi = qp + (i * H + head) * D;
        scores.assign(static_cast<size_t>(pos - first + 1), 0.0);
        double best = -std::numeric_limits<double>::infinity();
        for (int64_t j = first; j <= pos; ++j) {
          const float* kj = kc + (row_of[i] * capacity_ + j) * kv_dim_ + kvh * D;
          double s = 0;
          for (int64_t d = 0; d < D; ++d) s += static_cast<double>(qi[d]) * kj[d];
          s *= scale;
          scores[static_cast<size_t>(j - first)] = s;
          best = std::max(best, s);
        }
        double total = 0;
        for (double& s : scores) total += (s = std::exp(s - best));
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = first; j <= pos; ++j) {
          const float* vj = vc + (row_of[i] * capacity_ + j) * kv_dim_ + kvh * D;
          const double w = scores[static_cast<size_t>(j - first)] / total;
          for (int64_t d = 0; d < D; ++d) acc[static_cast<size_t>(d)] += w * vj[d];
        }
        float* o = ap + (i * H + head) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<float>(acc[static_cast<size_t>(d)]);
      }
    });
    Tensor x1 = Tensor::empty({n, C}, DType::f32);
    ops::add(x, project(a, p.o_proj, {}, LoraTarget::o_proj), x1);
    Tensor h2 = rmsnorm(x1, p.post_attention_norm, c.rms_norm_eps);
    Tensor gate = project(h2, p.gate_proj, {}, LoraTarget::gate_proj),
           up = project(h2, p.up_proj, {}, LoraTarget::up_proj);
    Tensor m = Tensor::empty(gate.shape(), DType::f32);
    ops::swiglu_forward(gate, up, m);
    x = Tensor::empty({n, C}, DType::f32);
    ops::add(x1, project(m, p.down_proj, {}, LoraTarget::down_proj), x);
  }
  for (size_t r = 0; r < tokens.size(); ++r) lengths_[r] += static_cast<int64_t>(tokens[r].size());

  // Only each row's last token needs logits.
  std::vector<int64_t> with_tokens;
  for (size_t r = 0; r < tokens.size(); ++r)
    if (last_index[r] >= 0) with_tokens.push_back(static_cast<int64_t>(r));
  Tensor last = Tensor::empty({static_cast<int64_t>(with_tokens.size()), C}, DType::f32);
  for (size_t i = 0; i < with_tokens.size(); ++i)
    std::memcpy(last.data<float>() + static_cast<int64_t>(i) * C,
                x.data<float>() + last_index[static_cast<size_t>(with_tokens[i])] * C,
                sizeof(float) * C);
  Tensor hn = rmsnorm(last, model.final_norm(), c.rms_norm_eps);
  Tensor logits = linear(hn, model.output_head(), {}, lora ? lora->head() : none, lora_scale);
  for (size_t i = 0; i < with_tokens.size(); ++i)
    std::memcpy(out.data<float>() + with_tokens[i] * V,
                logits.data<float>() + static_cast<int64_t>(i) * V, sizeof(float) * V);
  return out;
}

void KvCache::reserve(int64_t rows, int64_t capacity) {
  const int64_t new_rows = std::max(rows, this->rows()),
                new_capacity = std::max(capacity, capacity_);
  if (new_rows == this->rows() && new_capacity == capacity_) return;
  for (size_t l = 0; l < k_.size(); ++l) {
    for (std::vector<Tensor>* cache : {&k_, &v_}) {
      Tensor grown = Tensor::zeros({new_rows, new_capacity, kv_dim_}, DType::f32);
      const float* from = (*cache)[l].data<float>();
      float* to = grown.data<float>();
      for (int64_t r = 0; r < this->rows(); ++r)
        std::memcpy(to + r * new_capacity * kv_dim_, from + r * capacity_ * kv_dim_,
                    sizeof(float) * static_cast<size_t>(length(r) * kv_dim_));
      (*cache)[l] = std::move(grown);
    }
  }
  lengths_.resize(static_cast<size_t>(new_rows), 0);
  capacity_ = new_capacity;
}

void KvCache::truncate(int64_t row, int64_t length) {
  POLLEN_CHECK(row >= 0 && row < rows(), "KvCache::truncate: no row ", row);
  int64_t& have = lengths_[static_cast<size_t>(row)];
  POLLEN_CHECK(length >= 0 && length <= have, "KvCache::truncate: row ", row, " holds ", have,
               " tokens, cannot keep ", length);
  have = length;
}

std::span<const float> candidate_logits(std::span<const float> logits, const SamplingOptions& o) {
  POLLEN_CHECK(o.vocab_size >= 0, "generate: vocab_size must be >= 0, got ", o.vocab_size);
  if (o.vocab_size == 0) return logits;
  return logits.first(std::min(logits.size(), static_cast<size_t>(o.vocab_size)));
}

size_t first_stop(std::string_view text, const std::vector<std::string>& stops) {
  size_t first = std::string_view::npos;
  for (const auto& s : stops)
    if (!s.empty()) first = std::min(first, text.find(s));
  return first;
}

void check_sampling_options(const SamplingOptions& o) {
  POLLEN_CHECK(std::isfinite(o.temperature) && o.temperature >= 0,
               "sampling: temperature must be >= 0, got ", o.temperature);
  POLLEN_CHECK(o.top_k >= 0, "sampling: top_k must be >= 0 (0: off), got ", o.top_k);
  POLLEN_CHECK(o.top_p > 0 && o.top_p <= 1, "sampling: top_p must be in (0, 1], got ", o.top_p);
  POLLEN_CHECK(o.min_p >= 0 && o.min_p <= 1, "sampling: min_p must be in [0, 1], got ", o.min_p);
  POLLEN_CHECK(std::isfinite(o.repetition_penalty) && o.repetition_penalty > 0,
               "sampling: repetition_penalty must be above 0 (1: off), got ", o.repetition_penalty);
}

uint32_t sample_token(std::span<const float> all_logits, std::span<const uint32_t> seen,
                      const SamplingOptions& o, Rng& rng) {
  check_sampling_options(o);
  const std::span<const float> logits = candidate_logits(all_logits, o);
  const size_t V = logits.size();
  POLLEN_CHECK(V > 0, "sampling: no logits to sample from");
  std::vector<double> z(logits.begin(), logits.end());
  // A NaN would break the ordering below (and every probability): the model's output is broken.
  POLLEN_CHECK(std::none_of(z.begin(), z.end(), [](double x) { return std::isnan(x); }),
               "sampling: the model's logits hold NaN");
  if (o.repetition_penalty != 1.0) {
    std::vector<bool> done(V, false);
    for (uint32_t t : seen) {
      if (t >= V || done[t]) continue;
      done[t] = true;
      z[t] = z[t] > 0 ? z[t] / o.repetition_penalty : z[t] * o.repetition_penalty;
    }
  }
  if (o.temperature <= 0) {  // greedy: the first of equal maxima
    return static_cast<uint32_t>(std::max_element(z.begin(), z.end()) - z.begin());
  }
  std::vector<uint32_t> order(V);
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return z[a] > z[b]; });
  size_t keep = V;
  if (o.top_k > 0) {  // as HF: every token tied with the k-th stays
    keep = std::min(keep, static_cast<size_t>(o.top_k));
    while (keep < V && z[order[keep]] == z[order[keep - 1]]) ++keep;
  }
  std::vector<double> prob(keep);
  double total = 0;
  // exp((z - z_max) / T): the difference first, so that a tiny temperature drives the others to 0
  // rather than z / T to infinity and the weights to NaN.
  for (size_t i = 0; i < keep; ++i)
    total += (prob[i] = std::exp((z[order[i]] - z[order[0]]) / o.temperature));
  for (double& p : prob) p /= total;
  if (o.top_p < 1.0) {  // the smallest prefix whose mass reaches top_p
    double mass = 0;
    size_t n = 0;
    while (n < keep) {
      mass += prob[n++];
      if (mass >= o.top_p) break;
    }
    keep = std::max<size_t>(n, 1);
  }
  if (o.min_p > 0) {
    size_t n = 1;
    while (n < keep && prob[n] >= o.min_p * prob[0]) ++n;
    keep = n;
  }
  total = 0;
  for (size_t i = 0; i < keep; ++i) total += prob[i];
  double u = rng.uniform() * total;
  for (size_t i = 0; i < keep; ++i) {
    u -= prob[i];
    if (u < 0) return order[i];
  }
  return order[keep - 1];
}

std::vector<Generation> generate(const Llama& model,
                                 const std::vector<std::vector<uint32_t>>& prompts,
                                 const SamplingOptions& o, const Decoder& decode) {
  std::vector<GenerationRow> rows;
  for (size_t r = 0; r < prompts.size(); ++r)
    rows.push_back({prompts[r], o, Rng(o.seed).fork(r), nullptr});
  return generate_rows(model, std::move(rows), decode);
}

void check_generation_row(const GenerationRow& row, bool have_decoder) {
  const SamplingOptions& o = row.options;
  POLLEN_CHECK(o.stop_strings.empty() || have_decoder, "generate: stop strings need a decoder");
  POLLEN_CHECK(o.max_tokens >= 0, "generate: max_tokens must be >= 0");
  POLLEN_CHECK(!row.prompt.empty(), "generate: every prompt needs at least one token");
}

std::vector<Generation> generate_rows(const Llama& model, std::vector<GenerationRow> rows,
                                      const Decoder& decode, const OnToken& on_token) {
  std::vector<Generation> out(rows.size());
  if (rows.empty()) return out;
  GenerationBatch batch(model, decode, on_token, rows[0].options.use_cache);
  for (GenerationRow& row : rows) batch.add(std::move(row));
  while (batch.live() > 0) {
    for (GenerationBatch::Finished& f : batch.step()) {
      if (f.error) std::rethrow_exception(f.error);
      out[f.id] = std::move(f.generation);
    }
  }
  return out;
}

}  // namespace pollen::model
