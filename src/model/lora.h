#pragma once
// LoRA adapters (Hu et al. 2021) for the Llama's linear layers, with PEFT's semantics:
//   y = x W^T + scale * dropout(x) A^T B^T,   A (r, in), B (out, r), scale = alpha / r
// (alpha / sqrt(r) with rslora). A starts kaiming-uniform (a = sqrt(5), i.e. U(+-1/sqrt(in)))
// and B at zero, so a fresh adapter leaves the model unchanged. Parameters carry PEFT's names
// (base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight), which adapter files use.
//
// The adapters are attached to a Llama (Llama::attach_lora), which then trains only them; they
// merge into a plain Llama (merge_lora: W' = W + scale * B A) for export.
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "autograd/tape.h"
#include "model/config.h"

namespace pollen {
class ConfigTable;
}

namespace pollen::model {

class Llama;

// The linear layers an adapter can target, by HF module name.
enum class LoraTarget { q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head };
constexpr int kLayerTargets = 7;  // q_proj .. down_proj: the ones inside each decoder layer
const char* lora_target_name(LoraTarget target);
// "q_proj" -> LoraTarget::q_proj; throws listing the names when unknown (`where` names the key).
LoraTarget parse_lora_target(const std::string& name, const std::string& where);

struct LoraConfig {
  int64_t rank = 8;
  double alpha = 16;
  double dropout = 0;  // on the adapter's input while training (set_dropout_step)
  std::vector<LoraTarget> targets = {LoraTarget::q_proj, LoraTarget::v_proj};  // PEFT's default
  bool rslora = false;  // scale alpha / sqrt(rank) instead of alpha / rank
  bool train_a = true;  // false: A stays as drawn from the seed, only B trains (federated rule)
  uint64_t seed = 0;    // A's initial values and the dropout masks

  double scale() const;
  bool targets_module(LoraTarget target) const;
  void validate() const;  // throws naming the wrong field
};

// The [lora] table of a run file: rank, alpha, dropout, target_modules, rslora, train_a, seed
// (seed defaults to `default_seed`, the run's). Unknown keys are left for the caller's finish().
LoraConfig read_lora_config(ConfigTable& table, uint64_t default_seed);

// One adapted linear layer: A (r, in), B (out, r).
struct LoraAdapter {
  ag::Var a, b;
  bool defined() const { return a.defined(); }
};

class Lora {
 public:
  // Fresh adapters for a model of this shape: A kaiming-uniform from config.seed (one stream per
  // adapter, in named order), B zeros.
  Lora(const LlamaConfig& model, const LoraConfig& config, DType dtype = DType::f32);
  // Adapters from a source (loading): called with each tensor's PEFT name and shape; returns a
  // contiguous tensor of that shape in `dtype` or throws naming what is wrong.
  using TensorSource = std::function<Tensor(const std::string& name, const Shape& shape)>;
  Lora(const LlamaConfig& model, const LoraConfig& config, const TensorSource& source,
       DType dtype = DType::f32);

  const LoraConfig& config() const { return config_; }
  const LlamaConfig& model_config() const { return model_; }
  DType dtype() const { return dtype_; }
  double scale() const { return config_.scale(); }

  // The adapter of layer `layer` on `target` (a layer target); undefined when not targeted.
  const LoraAdapter& adapter(int64_t layer, LoraTarget target) const;
  const LoraAdapter& head() const { return head_; }  // on lm_head; undefined when not targeted

  // The trained tensors with their PEFT names (A and B, or only B when A is frozen): what the
  // optimizer updates and federated clients exchange.
  std::vector<std::pair<std::string, ag::Var>> named_parameters() const;
  // Every adapter tensor (A and B) with its PEFT name, in a fixed order: what adapter files hold.
  std::vector<std::pair<std::string, ag::Var>> named_tensors() const;
  // The HF name of the base weight an adapter tensor adapts:
  // "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" ->
  // "model.layers.0.self_attn.q_proj.weight".
  static std::string base_weight_name(const std::string& adapter_name);

  // Dropout draws its masks from (seed, step, forward pass, layer, target) once a training step
  // is set: each forward pass of the step (its micro-batches, DPO's chunks) draws its own, a
  // recomputation draws its forward's again, and a resumed run draws what the uninterrupted one
  // did. Until set (and after disable_dropout) no dropout.
  void set_dropout_step(uint64_t step);
  void disable_dropout() { dropout_key_.reset(); }
  // The number of the step's forward pass that starts now (0, 1, ...); the model takes one at
  // the start of each forward pass. 0 when dropout is off.
  uint64_t next_dropout_forward() const;
  // Counts n forward passes of the step as begun without running them (a rank of a
  // data-parallel step starts after the passes the ranks before it run).
  void skip_dropout_forwards(uint64_t n) const;
  // The mask (rows, cols) of 0 and 1/(1-p) for one adapter in one forward pass; undefined when
  // dropout is off.
  Tensor dropout_mask(int64_t layer, LoraTarget target, int64_t rows, int64_t cols,
                      uint64_t forward) const;

 private:
  struct DropoutKey {
    uint64_t step;
    uint64_t forwards = 0;  // forward passes begun in this step
  };
  LlamaConfig model_;
  LoraConfig config_;
  DType dtype_;
  std::vector<std::array<LoraAdapter, kLayerTargets>> layers_;
  LoraAdapter head_;
  // Mutable: a forward pass of a const model counts itself here (training is one thread).
  mutable std::optional<DropoutKey> dropout_key_;
};

// W' = W + scale * B A for every adapted weight: a plain Llama with its own weights (the base is
// not changed).
Llama merge_lora(const Llama& base, const Lora& lora);

// Federated aggregation of clients' adapters (weights: e.g. each client's tokens, positive).
// With A frozen from one shared seed, the mean of the merged updates is exact in B alone:
// mean_i(scale B_i A) = scale mean_i(B_i) A. average_lora_shared_a returns the adapters with that
// A and the weighted mean of the B_i; it refuses clients whose A differ (naming the tensor).
Lora average_lora_shared_a(std::span<const Lora* const> clients, std::span<const double> weights);
// The weighted mean of the clients' merged updates scale * B_i A_i, by base weight name (HF
// names, (out, in)): the reference the rule above must equal, and the general rule when A differ.
std::vector<std::pair<std::string, Tensor>> average_merged_updates(
    std::span<const Lora* const> clients, std::span<const double> weights);

}  // namespace pollen::model
