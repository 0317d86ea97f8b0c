#pragma once
// LoRA adapters in PEFT's format (https://huggingface.co/docs/peft), a folder holding
//   adapter_config.json        peft_type "LORA", r, lora_alpha, lora_dropout, target_modules,
//                              bias "none", use_rslora, task_type "CAUSAL_LM", ...
//   adapter_model.safetensors  base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight
//                              (r, in) and .lora_B.weight (out, r), and so on per module
// so that PeftModel.from_pretrained loads what pollen trains, and the reverse. Reading checks the
// config's keys, every tensor's name and shape, the rank and the targets against the base model
// and says which file, key or tensor differs.
#include <filesystem>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "model/lora.h"

namespace pollen::model {
class Llama;
}  // namespace pollen::model

namespace pollen::io {

// adapter_config.json for these adapters; `base_model` is recorded as base_model_name_or_path.
nlohmann::ordered_json peft_config_json(const model::LoraConfig& config,
                                        const std::string& base_model);

// Writes (atomically, each file) adapter_config.json and adapter_model.safetensors into `dir`
// (created when missing).
void save_peft_adapter(const model::Lora& lora, const std::filesystem::path& dir,
                       const std::string& base_model);

// adapter_config.json as a LoraConfig (rank, alpha, dropout, targets, rslora; seed 0). Features
// pollen does not implement (DoRA, biases, per-layer ranks, regex targets, modules_to_save, ...)
// are refused naming the key.
model::LoraConfig read_peft_config(const std::filesystem::path& config_json);

// Loads a PEFT adapter folder for a base model of shape `base`, in `dtype` (f32/bf16/f16 stored
// tensors are converted). `train_a` = false freezes A (the federated rule). PEFT saves a copy of
// the base's lm_head beside adapters that target it (`...lm_head.base_layer.weight`, its
// save_embedding_layers): taken when `base_weights` is given and the copy is its head bit for bit,
// refused otherwise (PEFT would load the copy over the base's head).
std::shared_ptr<model::Lora> load_peft_adapter(const std::filesystem::path& dir,
                                               const model::LlamaConfig& base,
                                               DType dtype = DType::f32, bool train_a = true,
                                               const model::Llama* base_weights = nullptr);

}  // namespace pollen::io
