#pragma once
// A Llama-family decoder with the semantics of HF LlamaForCausalLM (pre-norm RMSNorm blocks,
// rotary embeddings in rotate_half form, grouped-query attention, SwiGLU MLP, optional tied
// embeddings and q/k/v biases). Parameters carry HF's names.
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "autograd/functions.h"
#include "model/config.h"
#include "model/lora.h"

namespace pollen::model {

// One batch of token windows. tokens (B,T) int32; targets (B,T) int32 (negative = not scored);
// positions (B,T) int32 and doc_ids (B,T) int32 for packed documents (each token attends to and
// is rotated within its own document). Empty positions/doc_ids mean one document per row.
struct Batch {
  Tensor tokens, targets, positions, doc_ids;
  static Batch contiguous_rows(const Tensor& tokens, const Tensor& targets);
};

// Mistral's sliding window folded into the attention's first-visible-key per token: token t sees
// keys from max(seg_start[t], t - window + 1). window <= 0 returns seg_start.
Tensor window_starts(const Tensor& seg_start, int64_t window);

struct LayerParams {
  ag::Var input_norm, q_proj, k_proj, v_proj, o_proj, q_bias, k_bias, v_bias;
  ag::Var post_attention_norm, gate_proj, up_proj, down_proj;
};

class Llama {
 public:
  // Parameters initialised as HF does: normal(0, initializer_range) for matrices, ones for norms,
  // zeros for biases; drawn from the seed, one counter-based stream per parameter.
  Llama(const LlamaConfig& config, uint64_t seed, DType dtype = DType::f32);
  // Parameters from a source (loading a model): called once per parameter with its HF name and
  // shape; it returns a contiguous tensor of that shape in `dtype` (or throws naming what is
  // wrong).
  using ParamSource = std::function<Tensor(const std::string& name, const Shape& shape)>;
  Llama(const LlamaConfig& config, const ParamSource& source, DType dtype = DType::f32);

  const LlamaConfig& config() const { return config_; }
  DType dtype() const { return dtype_; }
  // Where the parameters live. to() moves every parameter there (gradients are dropped); the
  // forward then moves each batch's host tensors (tokens, positions, targets, document starts)
  // to that device itself, so callers keep building batches on the host. LoRA adapters stay on
  // the CPU: a model with adapters cannot move.
  Device device() const { return device_; }
  void to(Device device);

  // Every parameter with its HF name, in a fixed order.
  std::vector<std::pair<std::string, ag::Var>> named_parameters() const;
  std::vector<ag::Var> parameters() const;

  // Final hidden states (B*T, C) after the last norm.
  ag::Var hidden_states(const Batch& batch) const;
  // Mean (or sum) cross-entropy over scored targets; *scored gets how many were scored.
  ag::Var loss(const Batch& batch, ag::Reduction reduction = ag::Reduction::mean,
               int64_t* scored = nullptr) const;
  // The summed cross-entropy over scored targets in double, without autograd (evaluation: a
  // total that does not depend on how rows are batched); *scored gets how many were scored.
  double loss_sum(const Batch& batch, int64_t* scored) const;
  // Logits (B*T, V) without autograd (evaluation, generation, parity tests).
  Tensor logits(const Batch& batch) const;

  // The head's parameter (the embedding when tied), as exported.
  const ag::Var& output_head() const { return tie_ ? embed_tokens_ : lm_head_; }
  // The head as the forward uses it: output_head(), plus scale * B A when a LoRA adapter on
  // lm_head is attached (differentiable in the adapter). Objectives that score with the head
  // (sequence log-probabilities) take this one.
  ag::Var head_weight() const;

  // Attaches LoRA adapters made for this model's shape and dtype (checked): every forward
  // (hidden_states, loss, logits, generation) applies them, and the base parameters stop wanting
  // gradients, so that training updates only lora->named_parameters(). Replaces any attached.
  void attach_lora(std::shared_ptr<const Lora> lora);
  // Removes the adapters; the base parameters want gradients again.
  void detach_lora();
  const std::shared_ptr<const Lora>& lora() const { return lora_; }
  // The same model without adapters, sharing the base weights (nothing is copied): the frozen
  // base as a reference (DPO, KL to the reference).
  Llama without_lora() const;

  void set_recompute(bool recompute) { recompute_ = recompute; }  // per-layer recomputation

  // The pieces, for inference paths that do not go through autograd (the KV cache).
  const ag::Var& embed_tokens() const { return embed_tokens_; }
  const ag::Var& final_norm() const { return norm_; }
  const std::vector<LayerParams>& layers() const { return layers_; }

 private:
  std::vector<std::pair<std::string, ag::Var>> named_parameters_in_construction_order() const;
  // Every defined parameter: the embedding, each layer's in `layer_order`, the final norm, the
  // head.
  std::vector<std::pair<std::string, ag::Var>> collect_parameters(
      std::span<ag::Var LayerParams::*const> layer_order) const;
  // `forward`: the step's forward pass this is (LoRA dropout draws a mask per pass).
  ag::Var block(int64_t layer, const ag::Var& x, const Batch& batch, const Tensor& seg_start,
                uint64_t forward) const;
  Tensor on_device(const Tensor& t) const;  // t itself when it is already on the model's device
  // x W^T (+ bias) for one of layer `layer`'s projections, with its LoRA adapter when attached.
  ag::Var project(int64_t layer, LoraTarget target, const ag::Var& x, const ag::Var& w,
                  uint64_t forward, const ag::Var* bias = nullptr) const;

  LlamaConfig config_;
  DType dtype_;
  Device device_ = Device::cpu;
  bool tie_;
  bool recompute_ = false;
  ag::Var embed_tokens_, norm_, lm_head_;
  std::vector<LayerParams> layers_;
  std::shared_ptr<const Lora> lora_;
};

// SHA-256 over every parameter's name and float32 values, in order (adapters not included): the
// identity of a base that LoRA adapters were trained on.
std::string weights_sha256(const Llama& model);

}  // namespace pollen::model
