// LoRA adapters in PEFT's format: written and read back, malformed folders refused naming the
// file, key or tensor, and both directions against PEFT itself (PyPI) on the transformers model
// built from the same base.
#include "io/peft.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "base/error.h"
#include "base/files.h"
#include "base/rng.h"
#include "io/hf.h"
#include "io/safetensors.h"
#include "model/llama.h"
#include "support/errors.h"
#include "support/file_size_limit.h"

using pollen::testing::error_of;

namespace fs = std::filesystem;
using namespace pollen;
using model::LoraTarget;

namespace {

fs::path temp_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("pollen_peft_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

model::LlamaConfig base_config() {
  model::LlamaConfig c;
  c.name = "peft-base";
  c.vocab_size = 61;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  return c;
}

void randomise(const std::vector<std::pair<std::string, ag::Var>>& tensors, uint64_t seed,
               double scale) {
  Rng rng(seed);
  for (auto& [name, v] : tensors) {
    ag::Var var = v;
    float* p = var.value().data<float>();
    for (int64_t i = 0; i < var.value().numel(); ++i)
      p[i] = static_cast<float>(scale * rng.normal());
  }
}

std::shared_ptr<model::Lora> random_adapters(const model::LlamaConfig& base,
                                             const model::LoraConfig& config) {
  auto lora = std::make_shared<model::Lora>(base, config);
  randomise(lora->named_parameters(), 4, 0.5);
  return lora;
}

model::LoraConfig all_targets(int64_t rank) {
  model::LoraConfig c;
  c.rank = rank;
  c.alpha = 7;
  c.rslora = true;
  c.targets = {LoraTarget::q_proj,    LoraTarget::k_proj,    LoraTarget::v_proj,
               LoraTarget::o_proj,    LoraTarget::gate_proj, LoraTarget::up_proj,
               LoraTarget::down_proj, LoraTarget::lm_head};
  return c;
}

TEST(Peft, WrittenAdaptersReadBackTheSame) {
  const fs::path dir = temp_dir("roundtrip");
  const model::LlamaConfig base = base_config();
  auto lora = random_adapters(base, all_targets(3));
  io::save_peft_adapter(*lora, dir, "my-base");
  const auto config = nlohmann::json::parse(read_file(dir / "adapter_config.json"));
  EXPECT_EQ(config["peft_type"], "LORA");
  EXPECT_EQ(config["r"], 3);
  EXPECT_EQ(config["lora_alpha"], 7.0);
  EXPECT_EQ(config["use_rslora"], true);
  EXPECT_EQ(config["bias"], "none");
  EXPECT_EQ(config["task_type"], "CAUSAL_LM");
  EXPECT_EQ(config["base_model_name_or_path"], "my-base");
  EXPECT_EQ(config["target_modules"].size(), 8u);
  const auto f = io::read_safetensors(dir / "adapter_model.safetensors");
  const Tensor* a = f.find("base_model.model.model.layers.1.mlp.down_proj.lora_A.weight");
  const Tensor* b = f.find("base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight");
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->shape(), (Shape{3, 48}));
  EXPECT_EQ(b->shape(), (Shape{16, 3}));

  const auto back = io::load_peft_adapter(dir, base);
  EXPECT_EQ(back->config().rank, 3);
  EXPECT_EQ(back->config().targets, lora->config().targets);
  EXPECT_DOUBLE_EQ(back->scale(), lora->scale());
  const auto want = lora->named_tensors(), got = back->named_tensors();
  ASSERT_EQ(want.size(), got.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(want[i].first, got[i].first);
    EXPECT_EQ(want[i].second.value().to_doubles(), got[i].second.value().to_doubles());
  }
  fs::remove_all(dir);
}

// PEFT saves a copy of the base's head beside adapters that target lm_head (its default
// save_embedding_layers): taken when it is the base's head bit for bit, refused when it differs
// (PEFT would load it over the base's head) or when no base is at hand to compare.
TEST(Peft, PeftsCopyOfTheBasesHeadMustBeTheBasesHead) {
  const fs::path dir = temp_dir("saved_head");
  const model::Llama base(base_config(), 3);
  io::save_peft_adapter(*random_adapters(base.config(), all_targets(2)), dir, "my-base");
  Tensor head;
  for (const auto& [name, v] : base.named_parameters())
    if (name == "lm_head.weight") head = v.value().clone();
  ASSERT_TRUE(head.numel() > 0);
  const std::string copy_name = "base_model.model.lm_head.base_layer.weight";
  const auto with_copy = [&](const Tensor& copy) {
    io::NamedTensors t;
    for (auto& [n, v] : io::read_safetensors(dir / "adapter_model.safetensors").tensors)
      if (n != copy_name) t.emplace_back(n, v);
    t.emplace_back(copy_name, copy);
    fs::remove(dir / "adapter_model.safetensors");
    io::write_safetensors(dir / "adapter_model.safetensors", t);
  };
  with_copy(head.to(DType::bf16).to(DType::f32));  // another base's head, say
  EXPECT_NE(pollen::testing::error_of([&] {
              io::load_peft_adapter(dir, base.config(), DType::f32, true, &base);
            }).find("(PEFT's copy of the base's head) differs from the base's lm_head.weight"),
            std::string::npos);
  with_copy(head);
  EXPECT_NO_THROW(io::load_peft_adapter(dir, base.config(), DType::f32, true, &base));
  EXPECT_NE(pollen::testing::error_of([&] {
              io::load_peft_adapter(dir, base.config());
            }).find("cannot compare with its base"),
            std::string::npos);
  fs::remove_all(dir);
}

// Saving adapters onto a full disk leaves the saved ones untouched and no temporary file behind.
TEST(Peft, AFailedSaveLeavesTheOldAdaptersAndNoTemporaryFile) {
  const fs::path dir = temp_dir("full");
  const model::LlamaConfig base = base_config();
  io::save_peft_adapter(*random_adapters(base, all_targets(1)), dir, "my-base");
  const std::string old_weights = read_file(dir / "adapter_model.safetensors");
  const std::string old_config = read_file(dir / "adapter_config.json");
  const std::vector<std::string> old_names = pollen::testing::file_names(dir);
  {
    pollen::testing::FileSizeLimit full_disk(old_weights.size());
    EXPECT_NE(pollen::testing::error_of([&] {
                io::save_peft_adapter(*random_adapters(base, all_targets(8)), dir, "my-base");
              }).find("cannot write"),
              std::string::npos);
  }
  EXPECT_EQ(pollen::testing::file_names(dir), old_names);
  EXPECT_EQ(read_file(dir / "adapter_model.safetensors"), old_weights);
  EXPECT_EQ(read_file(dir / "adapter_config.json"), old_config);
  fs::remove_all(dir);
}

// Each malformed folder is refused with the file and the tensor or key in the message.
TEST(Peft, MalformedAdaptersAreRefusedNamingTheTensorOrKey) {
  const fs::path root = temp_dir("malformed");
  const model::LlamaConfig base = base_config();
  model::LoraConfig two;
  two.rank = 2;
  two.targets = {LoraTarget::q_proj, LoraTarget::v_proj};
  auto lora = random_adapters(base, two);
  io::save_peft_adapter(*lora, root / "good", "b");
  const std::string q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
  auto variant = [&](const std::string& name, const std::function<void(io::NamedTensors&)>& edit) {
    const fs::path d = root / name;
    fs::create_directories(d);
    fs::copy_file(root / "good" / "adapter_config.json", d / "adapter_config.json");
    io::NamedTensors t = io::read_safetensors(root / "good" / "adapter_model.safetensors").tensors;
    edit(t);
    io::write_safetensors(d / "adapter_model.safetensors", t);
    return error_of([&] { io::load_peft_adapter(d, base); });
  };
  std::string e = variant("missing", [&](io::NamedTensors& t) { t.erase(t.begin()); });
  EXPECT_NE(e.find("has no tensor '" + q_a + "'"), std::string::npos) << e;
  e = variant("shape", [&](io::NamedTensors& t) {
    t[0].second = Tensor::zeros({2, 31}, DType::f32);
  });
  EXPECT_NE(e.find(q_a), std::string::npos) << e;
  EXPECT_NE(e.find("(2, 31)"), std::string::npos) << e;
  e = variant("dtype", [&](io::NamedTensors& t) {
    t[0].second = Tensor::zeros(t[0].second.shape(), DType::i32);
  });
  EXPECT_NE(e.find("has dtype i32; adapters are floating point"), std::string::npos) << e;
  e = variant("rank", [&](io::NamedTensors& t) {
    t[0].second = Tensor::zeros({4, 32}, DType::f32);
  });
  EXPECT_NE(e.find("has rank 4 but adapter_config.json says r = 2"), std::string::npos) << e;
  const std::string stray = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight";
  e = variant("unknown", [&](io::NamedTensors& t) {
    t.emplace_back(stray, Tensor::zeros({2, 32}, DType::f32));
  });
  EXPECT_NE(e.find(stray), std::string::npos) << e;
  EXPECT_NE(e.find("not an adapter of target_modules [q_proj, v_proj]"), std::string::npos) << e;
  e = variant("layer", [&](io::NamedTensors& t) {
    t.emplace_back("base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight",
                   Tensor::zeros({2, 32}, DType::f32));
  });
  EXPECT_NE(e.find("layers.2.self_attn.q_proj"), std::string::npos) << e;

  auto with_config = [&](const std::string& name,
                         const std::function<void(nlohmann::json&)>& edit) {
    const fs::path d = root / name;
    fs::create_directories(d);
    fs::copy_file(root / "good" / "adapter_model.safetensors", d / "adapter_model.safetensors");
    auto j = nlohmann::json::parse(read_file(root / "good" / "adapter_config.json"));
    edit(j);
    write_file_atomic(d / "adapter_config.json", j.dump());
    return error_of([&] { io::load_peft_adapter(d, base); });
  };
  e = with_config("module", [](nlohmann::json& j) { j["target_modules"].push_back("c_attn"); });
  EXPECT_NE(e.find("unknown LoRA target module 'c_attn'"), std::string::npos) << e;
  e = with_config("type", [](nlohmann::json& j) { j["peft_type"] = "IA3"; });
  EXPECT_NE(e.find("peft_type"), std::string::npos) << e;
  e = with_config("dora", [](nlohmann::json& j) { j["use_dora"] = true; });
  EXPECT_NE(e.find("'use_dora'"), std::string::npos) << e;
  // Later PEFT keys that change what the adapter computes (null or empty: as without them).
  e = with_config("alora", [](nlohmann::json& j) { j["alora_invocation_tokens"] = {5, 6, 7}; });
  EXPECT_NE(e.find("'alora_invocation_tokens'"), std::string::npos) << e;
  e = with_config("tokens", [](nlohmann::json& j) {
    j["trainable_token_indices"] = {{"embed_tokens", {3}}};
  });
  EXPECT_NE(e.find("'trainable_token_indices'"), std::string::npos) << e;
  e = with_config("nulls", [](nlohmann::json& j) {
    j["alora_invocation_tokens"] = nullptr;
    j["arrow_config"] = nullptr;
    j["use_qalora"] = false;
    j["exclude_modules"] = nullptr;
  });
  EXPECT_EQ(e, "") << e;
  e = with_config("regex", [](nlohmann::json& j) { j["target_modules"] = ".*proj"; });
  EXPECT_NE(e.find("target_modules"), std::string::npos) << e;
  e = with_config("no_r", [](nlohmann::json& j) { j.erase("r"); });
  EXPECT_NE(e.find("no key 'r'"), std::string::npos) << e;
  EXPECT_NE(e.find("adapter_config.json"), std::string::npos) << e;
  // Adapters for another model shape.
  model::LlamaConfig wider = base;
  wider.hidden_size = 64;
  e = error_of([&] { io::load_peft_adapter(root / "good", wider); });
  EXPECT_NE(e.find(q_a), std::string::npos) << e;
  fs::remove_all(root);
}

// ---- against PEFT (PyPI) on HF transformers ----------------------------------------------------

std::string hf_python() {
  return POLLEN_HF_PEERS_PYTHON;
}

bool peft_available() {
  static const bool ok =
      fs::exists(hf_python()) &&
      std::system((hf_python() + " -c 'import torch, transformers, peft' 2>/dev/null").c_str()) ==
          0;
  return ok;
}

std::vector<double> read_logits(const fs::path& file) {
  const std::string bytes = read_file(file);
  std::vector<double> out(bytes.size() / 8);
  std::memcpy(out.data(), bytes.data(), out.size() * 8);
  return out;
}

double max_diff(const Tensor& logits, const std::vector<double>& ref) {
  EXPECT_EQ(static_cast<size_t>(logits.numel()), ref.size());
  double worst = 0;
  for (size_t i = 0; i < ref.size() && i < static_cast<size_t>(logits.numel()); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(logits.data<float>()[i]) - ref[i]));
  return worst;
}

// pollen's adapters (every target, lm_head included, rslora) load in PEFT with the same logits;
// PEFT's (seven targets, dropout in the config) load in pollen with the same logits. pollen
// computes in float32 and PEFT in float64: logits agree to 1e-4.
TEST(Peft, AdaptersMatchPeftBothWays) {
  ASSERT_TRUE(peft_available()) << "torch, transformers and peft not importable by " << hf_python()
                                << " (scripts/test-peers makes it)";
  const fs::path dir = temp_dir("peer");
  const model::LlamaConfig cfg = base_config();
  model::Llama m(cfg, 1);
  randomise(m.named_parameters(), 2, 0.2);
  io::export_hf(m, dir / "base");
  auto lora = random_adapters(cfg, all_targets(3));
  io::save_peft_adapter(*lora, dir / "pollen", (dir / "base").string());
  Tensor tokens = Tensor::empty({2, 9}, DType::i32);
  nlohmann::json rows = nlohmann::json::array();
  for (int64_t r = 0; r < 2; ++r) {
    std::vector<int32_t> row;
    for (int64_t i = 0; i < 9; ++i) row.push_back(static_cast<int32_t>((3 + 7 * i + 11 * r) % 61));
    std::memcpy(tokens.data<int32_t>() + r * 9, row.data(), 9 * sizeof(int32_t));
    rows.push_back(row);
  }
  std::ofstream(dir / "tokens.json") << rows.dump();
  const std::string script = std::string(POLLEN_SOURCE_DIR) + "/tests/io/peft_reference.py";
  ASSERT_EQ(std::system((hf_python() + " " + script + " " + dir.string() + " 2>" +
                         (dir / "stderr.txt").string())
                            .c_str()),
            0)
      << read_file(dir / "stderr.txt");
  const auto batch = model::Batch::contiguous_rows(tokens, tokens);
  const Tensor base_logits = m.logits(batch);

  m.attach_lora(lora);
  const Tensor ours = m.logits(batch);
  const auto peft_of_ours = read_logits(dir / "pollen_logits.bin");
  EXPECT_LT(max_diff(ours, peft_of_ours), 1e-4);
  std::printf("pollen's adapter: pollen vs PEFT logits, max |diff| %.3g\n",
              max_diff(ours, peft_of_ours));
  EXPECT_GT(max_diff(base_logits, peft_of_ours), 0.1) << "the adapters must matter for this test";

  const auto theirs = io::load_peft_adapter(dir / "peft", cfg);
  EXPECT_EQ(theirs->config().rank, 3);
  EXPECT_DOUBLE_EQ(theirs->config().dropout, 0.1);
  m.attach_lora(theirs);
  const auto peft_logits = read_logits(dir / "peft_logits.bin");
  EXPECT_LT(max_diff(m.logits(batch), peft_logits), 1e-4);
  std::printf("PEFT's adapter: pollen vs PEFT logits, max |diff| %.3g\n",
              max_diff(m.logits(batch), peft_logits));
  EXPECT_GT(max_diff(base_logits, peft_logits), 0.1) << "the adapters must matter for this test";

  // `pollen export hf --adapter` writes the merged model, which gives PEFT's logits on its own.
  ASSERT_EQ(
      std::system((std::string(POLLEN_BINARY) + " export hf --model " + (dir / "base").string() +
                   " --adapter " + (dir / "peft").string() + " --output " +
                   (dir / "merged").string() + " >" + (dir / "stderr.txt").string() + " 2>&1")
                      .c_str()),
      0)
      << read_file(dir / "stderr.txt");
  const model::Llama merged = io::load_hf_model(dir / "merged");
  EXPECT_FALSE(merged.lora());
  EXPECT_LT(max_diff(merged.logits(batch), peft_logits), 1e-4);
  std::printf("export hf --adapter: merged model vs PEFT logits, max |diff| %.3g\n",
              max_diff(merged.logits(batch), peft_logits));
  fs::remove_all(dir);
}

}  // namespace
