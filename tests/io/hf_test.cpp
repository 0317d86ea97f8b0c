// HF directories: config.json read key by key (one test per key that changes the computation),
// export and import bit-exact (sharded too), the model resolver, and logits against HF
// transformers both ways (a model transformers saved, loaded by pollen; a directory pollen wrote,
// loaded by transformers).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "base/files.h"
#include "base/rng.h"
#include "io/checkpoint.h"
#include "io/hf.h"
#include "io/model_source.h"
#include "support/errors.h"
#include "support/file_size_limit.h"
#include "support/tiny_lm.h"
#include "tokenizer/hf_format.h"
#include "tokenizer/open.h"

namespace fs = std::filesystem;
using namespace pollen;
using nlohmann::json;

namespace {

fs::path temp_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("pollen_hf_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

json base_config() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 61,
    "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": false,
    "hidden_act": "silu", "attention_bias": false, "mlp_bias": false, "rope_scaling": null,
    "torch_dtype": "float32", "transformers_version": "4.44.2", "bos_token_id": 1,
    "eos_token_id": 2, "use_cache": true, "initializer_range": 0.02, "pretraining_tp": 1,
    "attention_dropout": 0.0})");
}

std::string config_error(const json& j) {
  try {
    io::parse_hf_config(j, "config.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void expect_refused(json j, const std::string& key_in_message) {
  const std::string msg = config_error(j);
  EXPECT_NE(msg.find(key_in_message), std::string::npos) << "message: '" << msg << "'";
}

TEST(HfConfig, ReadsTheSizeKeys) {
  const auto c = io::parse_hf_config(base_config(), "config.json");
  EXPECT_EQ(c.vocab_size, 61);
  EXPECT_EQ(c.hidden_size, 32);
  EXPECT_EQ(c.intermediate_size, 48);
  EXPECT_EQ(c.num_hidden_layers, 2);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.max_position_embeddings, 64);
  json j = base_config();
  j.erase("vocab_size");
  expect_refused(j, "'vocab_size' is required");
  j = base_config();
  j["hidden_size"] = "32";
  expect_refused(j, "'hidden_size' must be an integer");
  j = base_config();
  j.erase("num_key_value_heads");  // HF's default: as many as the attention heads
  EXPECT_EQ(io::parse_hf_config(j, "c").num_key_value_heads, 4);
  // null means the same for every type (Mistral and Qwen2 default to 8 and 32 when it is absent).
  for (const char* type : {"llama", "mistral", "qwen2"}) {
    j = base_config();
    j["model_type"] = type;
    if (j["model_type"] != "llama")
      for (const char* k : {"attention_bias", "mlp_bias", "pretraining_tp"}) j.erase(k);
    j["num_key_value_heads"] = nullptr;
    EXPECT_EQ(io::parse_hf_config(j, "c").num_key_value_heads, 4) << type;
  }
}

TEST(HfConfig, RmsNormEps) {
  json j = base_config();
  j["rms_norm_eps"] = 1e-6;
  EXPECT_EQ(io::parse_hf_config(j, "c").rms_norm_eps, 1e-6);
  j["rms_norm_eps"] = -1;
  expect_refused(j, "rms_norm_eps must be positive");
}

// A value config.json's keys parse to but the model refuses is reported naming the file.
TEST(HfConfig, ValueErrorsNameTheFile) {
  const fs::path dir = temp_dir("value");
  json j = base_config();
  j["rms_norm_eps"] = -1;
  write_file_atomic(dir / "config.json", j.dump());
  const std::string e = pollen::testing::error_of([&] { io::read_hf_config(dir / "config.json"); });
  EXPECT_NE(e.find("'" + (dir / "config.json").string() + "': model '"), std::string::npos) << e;
  EXPECT_NE(e.find("rms_norm_eps must be positive"), std::string::npos) << e;
  fs::remove_all(dir);
}

// Keys transformers >= 4.56 writes: "dtype" (torch_dtype renamed) is ignored as torch_dtype is;
// "layer_types" is taken when every layer is full attention, the only kind pollen has.
TEST(HfConfig, DtypeAndLayerTypesOfNewerTransformers) {
  json j = base_config();
  j.erase("torch_dtype");
  j["dtype"] = "bfloat16";
  j["layer_types"] = {"full_attention", "full_attention"};
  EXPECT_EQ(config_error(j), "");
  j["layer_types"] = {"full_attention", "sliding_attention"};
  expect_refused(j, "key 'layer_types' holds \"sliding_attention\"");
  j["layer_types"] = "full_attention";
  expect_refused(j, "key 'layer_types' must be a list");
}

TEST(HfConfig, RopeTheta) {
  json j = base_config();
  j["rope_theta"] = 500000.0;
  EXPECT_EQ(io::parse_hf_config(j, "c").rope_theta, 500000.0);
}

TEST(HfConfig, HeadDim) {
  json j = base_config();
  j["head_dim"] = 16;
  EXPECT_EQ(io::parse_hf_config(j, "c").resolved_head_dim(), 16);
  j["head_dim"] = nullptr;
  EXPECT_EQ(io::parse_hf_config(j, "c").resolved_head_dim(), 8);
  j["head_dim"] = -16;  // not "unset"
  expect_refused(j, "head_dim must be 1 to 2^16");
}

TEST(HfConfig, TieWordEmbeddings) {
  json j = base_config();
  j["tie_word_embeddings"] = true;
  EXPECT_TRUE(io::parse_hf_config(j, "c").tie_word_embeddings);
  j.erase("tie_word_embeddings");
  EXPECT_FALSE(io::parse_hf_config(j, "c").tie_word_embeddings);
}

TEST(HfConfig, HiddenActMustBeSilu) {
  json j = base_config();
  j["hidden_act"] = "gelu";
  expect_refused(j, "'hidden_act' is 'gelu'");
}

// Keys of the official SmolLM2-135M (is_llama_config, rope_interleaved) and Qwen2.5 (use_mrope)
// configs load; set to the computations pollen does not do, they are refused.
TEST(HfConfig, SmolLm2AndQwen25KeysLoad) {
  json j = base_config();
  j["is_llama_config"] = true;
  j["rope_interleaved"] = false;
  j["use_mrope"] = false;
  EXPECT_EQ(io::parse_hf_config(j, "c").hidden_size, base_config()["hidden_size"].get<int64_t>());
  j["rope_interleaved"] = true;
  expect_refused(j, "'rope_interleaved' is true");
  j["rope_interleaved"] = false;
  j["use_mrope"] = true;
  expect_refused(j, "'use_mrope' is true");
}

TEST(HfConfig, MlpBiasRefused) {
  json j = base_config();
  j["mlp_bias"] = true;
  expect_refused(j, "'mlp_bias' is true");
}

TEST(HfConfig, AttentionBias) {
  json j = base_config();
  j["attention_bias"] = true;  // Llama's also biases o_proj
  expect_refused(j, "'attention_bias' is true");
  j = base_config();
  j["model_type"] = "qwen2";
  j.erase("attention_bias");
  j.erase("mlp_bias");
  j["use_sliding_window"] = false;
  j["sliding_window"] = 4096;
  j["max_window_layers"] = 28;
  EXPECT_TRUE(io::parse_hf_config(j, "c").attention_bias);
  EXPECT_EQ(io::parse_hf_config(j, "c").sliding_window, 0);
  j["use_sliding_window"] = true;
  expect_refused(j, "'use_sliding_window' is true");
}

TEST(HfConfig, SlidingWindow) {
  json j = base_config();
  j["model_type"] = "mistral";
  j.erase("attention_bias");
  j.erase("mlp_bias");
  j["sliding_window"] = 5;
  EXPECT_EQ(io::parse_hf_config(j, "c").sliding_window, 5);
  j["sliding_window"] = nullptr;
  EXPECT_EQ(io::parse_hf_config(j, "c").sliding_window, 0);
  j = base_config();
  j["sliding_window"] = 5;
  expect_refused(j, "'sliding_window' is not used by model_type llama");
}

TEST(HfConfig, RopeScaling) {
  json j = base_config();
  j["rope_scaling"] = {{"rope_type", "llama3"},
                       {"factor", 8.0},
                       {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 8192}};
  auto c = io::parse_hf_config(j, "c");
  EXPECT_EQ(c.rope_scaling.kind, ops::RopeScaling::Kind::llama3);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192);
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  c = io::parse_hf_config(j, "c");
  EXPECT_EQ(c.rope_scaling.kind, ops::RopeScaling::Kind::linear);
  EXPECT_EQ(c.rope_scaling.factor, 2.0);
  // linear scaling divides every inverse frequency by the factor
  EXPECT_DOUBLE_EQ(ops::rope_inv_freq(c.rope_params(), 8, 1), std::pow(10000.0, -0.25) / 2.0);
  j["rope_scaling"] = {{"rope_type", "longrope"}, {"factor", 2.0}};
  expect_refused(j, "rope_type 'longrope' is not implemented");
  j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2.0}, {"bogus", 1}};
  expect_refused(j, "'bogus'");
}

TEST(HfConfig, RopeScalingDynamic) {
  json j = base_config();
  j["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", 2.0}};
  const auto c = io::parse_hf_config(j, "c");
  EXPECT_EQ(c.rope_scaling.kind, ops::RopeScaling::Kind::dynamic);
  EXPECT_EQ(c.rope_scaling.factor, 2.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 64);  // max_position_embeddings
  // Up to 64 positions the rotation is plain; at 128 theta grows by (2*128/64 - 1)^(8/6).
  EXPECT_EQ(ops::rope_params_for_length(c.rope_params(), 8, 64).theta, 10000.0);
  EXPECT_DOUBLE_EQ(ops::rope_params_for_length(c.rope_params(), 8, 128).theta,
                   10000.0 * std::pow(3.0, 8.0 / 6.0));
  j["rope_scaling"]["original_max_position_embeddings"] = 64;  // the same: accepted
  EXPECT_EQ(config_error(j), "");
  j["rope_scaling"]["original_max_position_embeddings"] = 32;
  expect_refused(j, "'original_max_position_embeddings' (32) differs");
  j["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", 0.5}};
  expect_refused(j, "'factor' must be >= 1");
  j["rope_scaling"] = {{"rope_type", "dynamic"}, {"factor", 2.0}, {"beta_fast", 3.0}};
  expect_refused(j, "'beta_fast' is not understood for rope_type 'dynamic'");
}

TEST(HfConfig, RopeScalingYarn) {
  json j = base_config();
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}};
  auto c = io::parse_hf_config(j, "c");
  EXPECT_EQ(c.rope_scaling.kind, ops::RopeScaling::Kind::yarn);
  EXPECT_DOUBLE_EQ(c.rope_scaling.attention_factor, 0.1 * std::log(4.0) + 1.0);  // HF's default
  EXPECT_EQ(c.rope_scaling.beta_fast, 32.0);
  EXPECT_EQ(c.rope_scaling.beta_slow, 1.0);
  EXPECT_DOUBLE_EQ(ops::rope_attention_factor(c.rope_params()), 0.1 * std::log(4.0) + 1.0);
  // D = 8, theta 1e4, 64 positions: the ramp runs over pairs 0..2, so pair 0 keeps its frequency,
  // pair 1 is halfway and pairs 2, 3 are divided by the factor.
  const auto inv = [&](int64_t i) { return ops::rope_inv_freq(c.rope_params(), 8, i); };
  const auto plain = [](int64_t i) { return std::pow(10000.0, -2.0 * i / 8.0); };
  EXPECT_DOUBLE_EQ(inv(0), plain(0));
  EXPECT_DOUBLE_EQ(inv(1), 0.5 * plain(1) / 4.0 + 0.5 * plain(1));
  EXPECT_DOUBLE_EQ(inv(3), plain(3) / 4.0);
  j["rope_scaling"] = {{"rope_type", "yarn"},
                       {"factor", 4.0},
                       {"attention_factor", 1.5},
                       {"beta_fast", 16.0},
                       {"beta_slow", 2.0}};
  c = io::parse_hf_config(j, "c");
  EXPECT_EQ(c.rope_scaling.attention_factor, 1.5);
  EXPECT_EQ(c.rope_scaling.beta_fast, 16.0);
  EXPECT_EQ(c.rope_scaling.beta_slow, 2.0);
  j["rope_scaling"]["beta_slow"] = 20.0;
  expect_refused(j, "beta_fast > beta_slow");
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"mscale", 0.7}};
  expect_refused(j, "'mscale' is not understood for rope_type 'yarn'");
}

// A config nested 200000 levels deep is refused naming the file, not a stack overflow while its
// values are copied or printed.
TEST(HfConfig, DeepNestingIsRefusedNamingTheFile) {
  const fs::path dir = temp_dir("deep");
  write_file_atomic(dir / "config.json",
                    "{\"model_type\": \"llama\", \"vocab_size\": " + std::string(200000, '[') +
                        std::string(200000, ']') + "}");
  const std::string error =
      pollen::testing::error_of([&] { io::read_hf_config(dir / "config.json"); });
  EXPECT_NE(error.find("config.json': JSON nested more than 512"), std::string::npos) << error;
  fs::remove_all(dir);
}

TEST(HfConfig, UnknownKeysRefusedIgnoredKeysSkipped) {
  json j = base_config();
  j["some_new_switch"] = true;
  expect_refused(j, "key 'some_new_switch' is not understood");
  j = base_config();
  for (const auto& k : io::hf_ignored_config_keys()) j[k] = "anything";
  j["architectures"] = {"LlamaForCausalLM"};
  EXPECT_EQ(config_error(j), "");
  j["model_type"] = "gpt2";
  expect_refused(j, "model_type 'gpt2' is not supported");
}

void randomise(const model::Llama& m, uint64_t seed) {
  Rng rng(seed);
  for (auto& [name, v] : m.named_parameters()) {
    float* p = v.value().data<float>();
    for (int64_t i = 0; i < v.value().numel(); ++i)
      p[i] = static_cast<float>((name.ends_with("norm.weight") ? 1.0 : 0.0) + 0.1 * rng.normal());
  }
}

model::LlamaConfig small(bool tied, bool bias) {
  model::LlamaConfig c = io::parse_hf_config(base_config(), "c");
  c.tie_word_embeddings = tied;
  c.attention_bias = bias;
  return c;
}

TEST(HfExport, RoundTripIsBitExactAndShards) {
  for (bool tied : {false, true}) {
    model::LlamaConfig c = small(tied, !tied);
    c.rope_scaling = {ops::RopeScaling::Kind::llama3, 8.0, 1.0, 4.0, 16};
    model::Llama m(c, 7);
    randomise(m, 3);
    const fs::path dir = temp_dir(tied ? "tied" : "untied");
    io::HfExportOptions o;
    o.max_shard_bytes = 20000;  // several shards
    io::export_hf(m, dir, o);
    EXPECT_TRUE(fs::exists(dir / "model.safetensors.index.json"));
    int shards = 0;
    for (const auto& e : fs::directory_iterator(dir))
      shards += e.path().filename().string().starts_with("model-0000");
    EXPECT_GE(shards, 2);
    const model::Llama back = io::load_hf_model(dir);
    EXPECT_EQ(back.config().rope_scaling, c.rope_scaling);
    EXPECT_EQ(back.config().attention_bias, c.attention_bias);
    const auto a = m.named_parameters(), b = back.named_parameters();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].first, b[i].first);
      ASSERT_EQ(a[i].second.value().nbytes(), b[i].second.value().nbytes());
      EXPECT_EQ(std::memcmp(a[i].second.value().raw(), b[i].second.value().raw(),
                            a[i].second.value().nbytes()),
                0)
          << a[i].first;
    }
    // A single file below the limit.
    io::export_hf(m, dir, {});
    EXPECT_TRUE(fs::exists(dir / "model.safetensors"));
    EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
    fs::remove_all(dir);
  }
}

TEST(HfExport, Bf16WeightsConvertOnLoad) {
  model::Llama m(small(true, false), 7);
  randomise(m, 5);
  const fs::path dir = temp_dir("bf16");
  io::HfExportOptions o;
  o.dtype = DType::bf16;
  io::export_hf(m, dir, o);
  const model::Llama back = io::load_hf_model(dir);
  const auto a = m.named_parameters(), b = back.named_parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    const Tensor expect = a[i].second.value().to(DType::bf16).to(DType::f32);
    EXPECT_EQ(std::memcmp(expect.raw(), b[i].second.value().raw(), expect.nbytes()), 0);
  }
  fs::remove_all(dir);
}

// An export that fails while writing the weights (a full disk) leaves the folder as it was: the
// old weights and config.json untouched, and no temporary file behind.
TEST(HfExport, AFailedWriteLeavesTheOldExportAndNoTemporaryFile) {
  const fs::path dir = temp_dir("full");
  io::export_hf(model::Llama(small(false, false), 7), dir, {});
  const std::string old_weights = read_file(dir / "model.safetensors");
  const std::string old_config = read_file(dir / "config.json");
  const std::vector<std::string> old_names = pollen::testing::file_names(dir);
  model::LlamaConfig bigger = small(false, false);
  bigger.intermediate_size *= 8;
  {
    pollen::testing::FileSizeLimit full_disk(old_weights.size() / 2);
    EXPECT_NE(pollen::testing::error_of([&] {
                io::export_hf(model::Llama(bigger, 7), dir, {});
              }).find("cannot write"),
              std::string::npos);
  }
  EXPECT_EQ(pollen::testing::file_names(dir), old_names);
  EXPECT_EQ(read_file(dir / "model.safetensors"), old_weights);
  EXPECT_EQ(read_file(dir / "config.json"), old_config);
  fs::remove_all(dir);
}

TEST(HfLoad, RefusesMissingAndStrayTensors) {
  model::Llama m(small(false, false), 7);
  const fs::path dir = temp_dir("stray");
  io::export_hf(m, dir, {});
  io::NamedTensors t;
  for (const auto& [n, v] : m.named_parameters())
    if (n != "model.norm.weight") t.emplace_back(n, v.value());
  fs::remove(dir / "model.safetensors");
  io::write_safetensors(dir / "model.safetensors", t);
  try {
    io::load_hf_model(dir);
    ADD_FAILURE() << "loaded without model.norm.weight";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no tensor 'model.norm.weight'"), std::string::npos)
        << e.what();
  }
  for (const auto& [n, v] : m.named_parameters())
    if (n == "model.norm.weight") t.emplace_back(n, v.value());
  t.emplace_back("model.extra.weight", Tensor::zeros({2}, DType::f32));
  fs::remove(dir / "model.safetensors");
  io::write_safetensors(dir / "model.safetensors", t);
  try {
    io::load_hf_model(dir);
    ADD_FAILURE() << "loaded with a stray tensor";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'model.extra.weight' is not a parameter"),
              std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
}

// A tied model's saved lm_head.weight (transformers writes one) loads when it is the embedding,
// in bf16 as well; one that differs, or of another shape, is refused: transformers would compute
// with it.
TEST(HfLoad, ATiedModelsSavedHeadMustBeItsEmbedding) {
  model::Llama m(small(true, false), 7);
  randomise(m, 4);
  const fs::path dir = temp_dir("tied_head");
  const auto with_head = [&](const Tensor& head) {
    io::NamedTensors t;
    for (const auto& [n, v] : m.named_parameters()) t.emplace_back(n, v.value().to(DType::bf16));
    t.emplace_back("lm_head.weight", head);
    fs::remove(dir / "model.safetensors");
    io::write_safetensors(dir / "model.safetensors", t);
  };
  io::export_hf(m, dir, {});
  const Tensor embedding = m.named_parameters().front().second.value();
  ASSERT_EQ(m.named_parameters().front().first, "model.embed_tokens.weight");
  with_head(embedding.to(DType::bf16));
  EXPECT_NO_THROW(io::load_hf_model(dir));
  Tensor other = embedding.clone();
  other.data<float>()[37] += 1;
  with_head(other.to(DType::bf16));
  EXPECT_EQ(pollen::testing::error_of([&] { io::load_hf_model(dir); }),
            "'" + (dir / "model.safetensors").string() +
                "': tensor 'lm_head.weight' differs from model.embed_tokens.weight (first at "
                "element 37) although config.json ties them (tie_word_embeddings); set "
                "tie_word_embeddings to false to load both, or save the model again");
  with_head(Tensor::zeros({7, 3}, DType::bf16));
  EXPECT_NE(pollen::testing::error_of([&] {
              io::load_hf_model(dir);
            }).find("'lm_head.weight' has shape (7, 3)"),
            std::string::npos);
  fs::remove_all(dir);
}

// Every weight_map entry must name a file of the folder: ".", ".." and paths are refused, and
// a tensor of a dtype that is not a float is refused naming the ones that are.
TEST(HfLoad, RefusesWeightMapEntriesOutsideTheFolderAndIntegerWeights) {
  const model::Llama m(small(false, false), 7);
  const fs::path dir = temp_dir("weight_map");
  io::HfExportOptions o;
  o.max_shard_bytes = 20000;
  io::export_hf(m, dir, o);
  const json index = json::parse(read_file(dir / "model.safetensors.index.json"));
  for (const std::string entry : {".", "..", "../model-00001-of-00004.safetensors"}) {
    json edited = index;
    edited["weight_map"]["model.norm.weight"] = entry;
    write_file_atomic(dir / "model.safetensors.index.json", edited.dump());
    const std::string e = pollen::testing::error_of([&] { io::load_hf_model(dir); });
    EXPECT_NE(e.find("weight_map['model.norm.weight'] = '" + entry +
                     "' must be a file in the same folder"),
              std::string::npos)
        << e;
  }
  fs::remove_all(dir);
  io::export_hf(m, dir, {});
  io::NamedTensors t;
  for (const auto& [n, v] : m.named_parameters())
    t.emplace_back(
        n, n == "model.norm.weight" ? Tensor::zeros(v.value().shape(), DType::i32) : v.value());
  io::write_safetensors(dir / "model.safetensors", t);
  const std::string e = pollen::testing::error_of([&] { io::load_hf_model(dir); });
  EXPECT_NE(e.find("has dtype i32; expected F64, F32, BF16 or F16"), std::string::npos) << e;
  fs::remove_all(dir);
}

Tensor token_rows() {
  return Tensor::from<int32_t>({2, 10}, {1, 5, 7, 9, 11, 2, 3, 40, 50, 60,  //
                                         4, 4, 4, 8, 8,  8, 1, 2,  3,  4});
}

TEST(ModelSource, CheckpointAndHfDirGiveTheSameLogits) {
  model::Llama m(small(false, true), 7);
  randomise(m, 9);
  const fs::path root = temp_dir("resolve");
  // A checkpoint folder as `pollen train` writes it: model.safetensors + config.toml.
  io::CheckpointWriter w(root / "run" / "checkpoints", 5);
  io::NamedTensors weights;
  for (const auto& [n, v] : m.named_parameters()) weights.emplace_back(n, v.value());
  w.add_tensors("model.safetensors", weights);
  const auto& c = m.config();
  w.add_text("config.toml",
             "[model]\nvocab_size = 61\nhidden_size = 32\nintermediate_size = 48\n"
             "num_hidden_layers = 2\nnum_attention_heads = 4\nnum_key_value_heads = 2\n"
             "max_position_embeddings = 64\nrms_norm_eps = 1e-05\nattention_bias = true\n"
             "rope_theta = " +
                 std::to_string(c.rope_theta) + "\n");
  w.commit();
  io::export_hf(m, root / "hf", {});
  const io::ModelSource ck = io::resolve_model((root / "run").string());  // a run folder
  EXPECT_EQ(ck.kind, io::ModelSource::Kind::checkpoint);
  const io::ModelSource hf = io::resolve_model((root / "hf").string());
  EXPECT_EQ(hf.kind, io::ModelSource::Kind::hf_dir);
  EXPECT_EQ(io::resolve_model("llama-tiny").kind, io::ModelSource::Kind::preset);
  const auto batch = model::Batch::contiguous_rows(token_rows(), token_rows());
  const Tensor a = io::load_model(ck).logits(batch), b = io::load_model(hf).logits(batch);
  EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0);
  const Tensor e = m.logits(batch);
  EXPECT_EQ(std::memcmp(a.raw(), e.raw(), a.nbytes()), 0);
  // A weight stored as integers is refused, not converted, as in an HF folder.
  weights.back().second = Tensor::zeros(weights.back().second.shape(), DType::i32);
  io::write_safetensors(ck.path / "model.safetensors", weights);
  try {
    io::load_model(ck);
    ADD_FAILURE() << "an integer weight was loaded";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("has dtype i32; weights are floating point"),
              std::string::npos)
        << err.what();
  }
  try {
    io::resolve_model(root.string());
    ADD_FAILURE();
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("neither an HF directory"), std::string::npos);
  }
  // A path that names nothing is a wrong path, not an unknown preset; a word may be either.
  for (const std::string spec :
       {(root / "nope").string(), std::string("out/nope"), std::string("nope.safetensors")}) {
    try {
      io::resolve_model(spec);
      ADD_FAILURE() << spec;
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find("model '" + spec + "': no such file or folder"),
                std::string::npos)
          << err.what();
    }
  }
  try {
    io::resolve_model("llama-huge");
    ADD_FAILURE();
  } catch (const Error& err) {
    const std::string what = err.what();
    EXPECT_NE(what.find("unknown model preset 'llama-huge': expected one of llama-tiny"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("nor is there a file or folder 'llama-huge'"), std::string::npos) << what;
  }
  fs::remove_all(root);
}

// A checkpoint folder named directly is checked against its manifest before it is loaded: the
// files it is loaded from, not the others (its optimizer state may have been removed).
TEST(ModelSource, ACheckpointNamedDirectlyIsVerified) {
  const model::Llama m(small(false, false), 7);
  const fs::path root = temp_dir("verify_direct");
  io::CheckpointWriter w(root / "checkpoints", 3);
  io::NamedTensors weights;
  for (const auto& [n, v] : m.named_parameters()) weights.emplace_back(n, v.value());
  w.add_tensors("model.safetensors", weights);
  w.add_tensors("optimizer.safetensors", weights);
  w.add_tensors("objective.safetensors", {{"score.weight", Tensor::zeros({1, 32}, DType::f32)}});
  w.add_text("config.toml",
             "[model]\nvocab_size = 61\nhidden_size = 32\nintermediate_size = 48\n"
             "num_hidden_layers = 2\nnum_attention_heads = 4\nnum_key_value_heads = 2\n"
             "max_position_embeddings = 64\n");
  const fs::path ckpt = w.commit();
  EXPECT_EQ(io::resolve_model(ckpt.string()).kind, io::ModelSource::Kind::checkpoint);
  fs::remove(ckpt / "optimizer.safetensors");
  EXPECT_EQ(io::resolve_model(ckpt.string()).kind, io::ModelSource::Kind::checkpoint);
  // One byte of a weight changed, the size kept.
  const std::string original = read_file(ckpt / "model.safetensors");
  std::string bytes = original;
  bytes[bytes.size() - 3] ^= 0x10;
  write_file_atomic(ckpt / "model.safetensors", bytes);
  try {
    io::resolve_model(ckpt.string());
    ADD_FAILURE() << "a checkpoint whose weights changed was taken";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("does not verify: model.safetensors has SHA-256"),
              std::string::npos)
        << err.what();
  }
  // The reward head read beside the weights (rm export) is checked as well.
  write_file_atomic(ckpt / "model.safetensors", original);
  EXPECT_EQ(io::resolve_model(ckpt.string()).kind, io::ModelSource::Kind::checkpoint);
  write_file_atomic(ckpt / "objective.safetensors",
                    read_file(ckpt / "objective.safetensors") + " ");
  try {
    io::resolve_model(ckpt.string());
    ADD_FAILURE() << "a checkpoint whose objective changed was taken";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("does not verify: objective.safetensors holds"),
              std::string::npos)
        << err.what();
  }
  // A tokenizer.json put beside the weights by hand is taken (the manifest lists weights).
  std::string objective = read_file(ckpt / "objective.safetensors");
  objective.pop_back();
  write_file_atomic(ckpt / "objective.safetensors", objective);
  write_file_atomic(ckpt / "tokenizer.json", "{}");
  EXPECT_EQ(io::resolve_model(ckpt.string()).kind, io::ModelSource::Kind::checkpoint);
  // A manifest edited to list no files no longer lets the weights through unchecked.
  fs::remove(ckpt / "objective.safetensors");
  nlohmann::json manifest = nlohmann::json::parse(read_file(ckpt / "manifest.json"));
  manifest["files"] = nlohmann::json::object();
  write_file_atomic(ckpt / "manifest.json", manifest.dump());
  try {
    io::resolve_model(ckpt.string());
    ADD_FAILURE() << "a checkpoint whose manifest lists nothing was taken";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("model.safetensors is not in manifest.json"),
              std::string::npos)
        << err.what();
  }
  fs::remove_all(root);
}

// A run folder gives its newest checkpoint whose model files verify: one whose optimizer state
// was removed is taken (a resumed run, which needs that state, still passes over it), one whose
// weights changed is not.
TEST(ModelSource, ARunFolderTakesTheNewestCheckpointWhoseModelVerifies) {
  const model::Llama m(small(false, false), 7);
  const fs::path root = temp_dir("verify_run");
  io::NamedTensors weights;
  for (const auto& [n, v] : m.named_parameters()) weights.emplace_back(n, v.value());
  const auto write_checkpoint = [&](int64_t step) {
    io::CheckpointWriter w(root / "checkpoints", step);
    w.add_tensors("model.safetensors", weights);
    w.add_tensors("optimizer.safetensors", weights);
    w.add_text("config.toml",
               "[model]\nvocab_size = 61\nhidden_size = 32\nintermediate_size = 48\n"
               "num_hidden_layers = 2\nnum_attention_heads = 4\nnum_key_value_heads = 2\n"
               "max_position_embeddings = 64\n");
    return w.commit();
  };
  const fs::path older = write_checkpoint(3), newer = write_checkpoint(5);
  fs::remove(newer / "optimizer.safetensors");
  EXPECT_EQ(io::resolve_model(root.string()).path, newer);
  EXPECT_EQ(io::choose_resume_checkpoint(root / "checkpoints").dir.value_or(""), older);
  std::string bytes = read_file(newer / "model.safetensors");
  bytes[bytes.size() - 3] ^= 0x10;
  write_file_atomic(newer / "model.safetensors", bytes);
  EXPECT_EQ(io::resolve_model(root.string()).path, older);
  // None verifies: the error says what failed in the newest.
  fs::remove(older / "model.safetensors");
  const std::string e = pollen::testing::error_of([&] { io::resolve_model(root.string()); });
  EXPECT_NE(e.find("a run folder without a checkpoint that verifies (the newest, '" +
                   newer.string() + "': "),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("model.safetensors"), std::string::npos) << e;
  fs::remove_all(root);
}

// ---- against HF transformers ----------------------------------------------------------------

std::string hf_python() {
  return POLLEN_HF_PEERS_PYTHON;
}

bool transformers_available() {
  static const bool ok =
      fs::exists(hf_python()) &&
      std::system((hf_python() + " -c 'import torch, transformers' 2>/dev/null").c_str()) == 0;
  return ok;
}

std::string script() {
  return std::string(POLLEN_SOURCE_DIR) + "/tests/io/hf_transformers_reference.py";
}

void write_tokens(const fs::path& dir, const Tensor& rows = token_rows()) {
  json j = json::array();
  for (int64_t r = 0; r < rows.size(0); ++r) {
    const int32_t* p = rows.data<int32_t>() + r * rows.size(1);
    j.push_back(std::vector<int32_t>(p, p + rows.size(1)));
  }
  std::ofstream(dir / "tokens.json") << j.dump();
}

// Two rows of `length` tokens of a vocabulary of 61.
Tensor long_token_rows(int64_t length) {
  Tensor t = Tensor::empty({2, length}, DType::i32);
  for (int64_t i = 0; i < length; ++i) {
    t.data<int32_t>()[i] = static_cast<int32_t>((1 + 7 * i) % 61);
    t.data<int32_t>()[length + i] = static_cast<int32_t>((4 + 3 * i * i) % 61);
  }
  return t;
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

// `pollen export hf` of a pollen checkpoint: AutoTokenizer loads its tokenizer.json as it is
// (not as LlamaTokenizerFast, which would add <s>, </s> and <unk>), encodes as pollen does, and
// the tokenizer and config.json agree on the EOS, which generation_config.json lists first.
// A pollen checkpoint (step 5 of a run under `root`) of a small model over `tok`'s vocabulary;
// `model_keys` are added to its config.toml's [model]. Returns its step folder.
fs::path small_checkpoint(const fs::path& root, const tokenizer::Tokenizer& tok,
                          const std::string& model_keys = "") {
  model::LlamaConfig c = small(false, false);
  c.vocab_size = tok.vocab_size();
  const model::Llama m(c, 7);
  io::CheckpointWriter w(root / "run" / "checkpoints", 5);
  io::NamedTensors weights;
  for (const auto& [n, v] : m.named_parameters()) weights.emplace_back(n, v.value());
  w.add_tensors("model.safetensors", weights);
  w.add_text("config.toml",
             cat("[model]\nvocab_size = ", c.vocab_size,
                 "\nhidden_size = 32\nintermediate_size = 48\nnum_hidden_layers = 2\n"
                 "num_attention_heads = 4\nnum_key_value_heads = 2\n"
                 "max_position_embeddings = 64\n",
                 model_keys));
  return w.commit();
}

// `pollen export hf --model MODEL --output OUT EXTRA`, its output in root/export.log; true when
// it succeeded.
::testing::AssertionResult exports_hf(const fs::path& model, const fs::path& out,
                                      const fs::path& root, const std::string& extra = "") {
  const fs::path log = root / "export.log";
  if (std::system(cat(POLLEN_BINARY, " export hf --model ", model.string(), " --output ",
                      out.string(), " ", extra, " > ", log.string(), " 2>&1")
                      .c_str()) == 0)
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << read_file(log);
}

TEST(HfExport, APollenCheckpointsTokenizerLoadsInTransformers) {
  if (!transformers_available())
    GTEST_SKIP() << "HF transformers not importable by " << hf_python()
                 << " (scripts/test-peers makes it)";
  const fs::path root = temp_dir("export_tokenizer");
  const tokenizer::Tokenizer tok = pollen::testing::tiny_tokenizer();
  const fs::path ckpt = small_checkpoint(root, tok);
  tokenizer::save_tokenizer(tok, ckpt / "tokenizer.json");
  const fs::path out = root / "hf";
  ASSERT_TRUE(exports_hf(root / "run", out, root));
  const std::string text = "The cat sat.<|endoftext|> Bees make honey.";
  write_file_atomic(out / "text.txt", text);
  ASSERT_EQ(std::system((hf_python() + " " + script() + " tokenizer " + out.string() + " 2>" +
                         (root / "stderr.txt").string())
                            .c_str()),
            0)
      << read_file(root / "stderr.txt");
  const json got = json::parse(read_file(out / "tokenizer.out.json"));
  EXPECT_EQ(got["class"], "PreTrainedTokenizerFast");
  EXPECT_EQ(got["input_names"], json({"attention_mask", "input_ids"}));
  tokenizer::EncodeOptions eo;
  eo.special = tokenizer::SpecialPolicy::allow_all();
  eo.add_bos_eos = true;
  EXPECT_EQ(got["ids"].get<std::vector<uint32_t>>(), tok.encode(text, eo));
  uint32_t eot = 0;
  for (const auto& t : tok.added_tokens())
    if (t.content == "<|endoftext|>") eot = t.id;
  EXPECT_EQ(got["eos"], eot);
  EXPECT_EQ(got["config_eos"], eot);
  // generate stops where pollen generate does: at the tokenizer's other end token too.
  uint32_t im_end = 0;
  for (const auto& t : tok.added_tokens())
    if (t.content == "<|im_end|>") im_end = t.id;
  EXPECT_EQ(got["generation_eos"], json({eot, im_end}));
  fs::remove_all(root);
}

// A checkpoint trained with a chat template exports the template's end of turn as its EOS, and
// both end tokens in generation_config.json: transformers' generate stops at the end of a turn.
TEST(HfExport, AChatTrainedCheckpointsEosIsItsEndOfTurn) {
  if (!transformers_available())
    GTEST_SKIP() << "HF transformers not importable by " << hf_python()
                 << " (scripts/test-peers makes it)";
  const fs::path root = temp_dir("export_chat_eos");
  const tokenizer::Tokenizer tok = pollen::testing::tiny_tokenizer();
  const fs::path ckpt = small_checkpoint(root, tok, "chat_template = 'chatml'\n");
  tokenizer::save_tokenizer(tok, ckpt / "tokenizer.json");
  const fs::path out = root / "hf";
  ASSERT_TRUE(exports_hf(root / "run", out, root));
  write_file_atomic(out / "text.txt", "The cat sat.");
  ASSERT_EQ(std::system((hf_python() + " " + script() + " tokenizer " + out.string() + " 2>" +
                         (root / "stderr.txt").string())
                            .c_str()),
            0)
      << read_file(root / "stderr.txt");
  const json got = json::parse(read_file(out / "tokenizer.out.json"));
  uint32_t eot = 0, im_end = 0;
  for (const auto& t : tok.added_tokens()) {
    if (t.content == "<|endoftext|>") eot = t.id;
    if (t.content == "<|im_end|>") im_end = t.id;
  }
  ASSERT_NE(eot, im_end);
  EXPECT_EQ(got["eos"], im_end);
  EXPECT_EQ(got["config_eos"], im_end);
  EXPECT_EQ(got["generation_eos"], json({im_end, eot}));
  fs::remove_all(root);
}

// A checkpoint whose run names its tokenizer by another file name (a post-training run's [model]
// tokenizer) exports it as tokenizer.json, the name transformers looks for.
TEST(HfExport, TheTokenizerIsWrittenAsTokenizerJsonWhateverItsName) {
  const fs::path root = temp_dir("export_tokenizer_name");
  const tokenizer::Tokenizer tok = pollen::testing::tiny_tokenizer();
  tokenizer::save_tokenizer(tok, root / "fortunes-tokenizer.json");
  const fs::path ckpt = small_checkpoint(
      root, tok, cat("tokenizer = '", (root / "fortunes-tokenizer.json").string(), "'\n"));
  const fs::path out = root / "hf";
  ASSERT_TRUE(exports_hf(ckpt, out, root));
  EXPECT_EQ(read_file(out / "tokenizer.json"), read_file(root / "fortunes-tokenizer.json"));
  EXPECT_FALSE(fs::exists(out / "fortunes-tokenizer.json"));
  // And an export over that one is an export over an export.
  ASSERT_TRUE(exports_hf(ckpt, out, root));
  fs::remove_all(root);
}

// A model that knows no tokenizer (a federated server's global model) is exported with the one
// --tokenizer names, its BOS and EOS written as for a model's own.
TEST(HfExport, ATokenizerCanBeGivenForAModelWithoutOne) {
  const fs::path root = temp_dir("export_tokenizer_given");
  const tokenizer::Tokenizer tok = pollen::testing::tiny_tokenizer();
  tokenizer::save_tokenizer(tok, root / "given.json");
  const fs::path ckpt = small_checkpoint(root, tok);
  const fs::path out = root / "hf";
  ASSERT_TRUE(exports_hf(ckpt, out, root));
  EXPECT_NE(read_file(root / "export.log").find("--tokenizer adds one"), std::string::npos);
  EXPECT_FALSE(fs::exists(out / "tokenizer.json"));
  ASSERT_TRUE(exports_hf(ckpt, out, root, "--tokenizer " + (root / "given.json").string()));
  EXPECT_EQ(read_file(out / "tokenizer.json"), read_file(root / "given.json"));
  uint32_t eot = 0;
  for (const auto& t : tok.added_tokens())
    if (t.content == "<|endoftext|>") eot = t.id;
  EXPECT_EQ(json::parse(read_file(out / "config.json"))["eos_token_id"], eot);
  EXPECT_EQ(json::parse(read_file(out / "tokenizer_config.json"))["eos_token"], "<|endoftext|>");
  // A tokenizer with ids past the model's vocabulary is another model's; a rank file holds
  // neither its pattern nor its special tokens: both refused, saying so.
  json bigger = json::parse(read_file(root / "given.json"));
  bigger["added_tokens"].push_back({{"id", tok.vocab_size()},
                                    {"content", "<|extra|>"},
                                    {"single_word", false},
                                    {"lstrip", false},
                                    {"rstrip", false},
                                    {"normalized", false},
                                    {"special", true}});
  write_file_atomic(root / "bigger.json", bigger.dump());
  EXPECT_FALSE(exports_hf(ckpt, out, root, "--tokenizer " + (root / "bigger.json").string()));
  EXPECT_NE(read_file(root / "export.log")
                .find(cat(tok.vocab_size() + 1, " ids, more than the model's vocabulary of ",
                          tok.vocab_size())),
            std::string::npos)
      << read_file(root / "export.log");
  // GGUF's export names it too, before the weights load.
  const fs::path gguf_log = root / "gguf.log";
  EXPECT_NE(std::system(cat(POLLEN_BINARY, " export gguf --model ", ckpt.string(), " --tokenizer ",
                            (root / "bigger.json").string(), " --output ",
                            (root / "m.gguf").string(), " > ", gguf_log.string(), " 2>&1")
                            .c_str()),
            0);
  EXPECT_NE(read_file(gguf_log).find(cat("tokenizer '", (root / "bigger.json").string(), "' has ",
                                         tok.vocab_size() + 1, " ids")),
            std::string::npos)
      << read_file(gguf_log);
  tokenizer::save_tokenizer(tok, root / "given.tiktoken");
  EXPECT_FALSE(exports_hf(ckpt, out, root, "--tokenizer " + (root / "given.tiktoken").string()));
  EXPECT_NE(read_file(root / "export.log").find("expected a tokenizer.json"), std::string::npos)
      << read_file(root / "export.log");
  EXPECT_EQ(read_file(out / "tokenizer.json"), read_file(root / "given.json"));  // kept
  // A model with a tokenizer of its own keeps it.
  tokenizer::save_tokenizer(tok, ckpt / "tokenizer.json");
  EXPECT_FALSE(exports_hf(ckpt, out, root, "--tokenizer " + (root / "given.json").string()));
  EXPECT_NE(read_file(root / "export.log").find("has its own tokenizer"), std::string::npos);
  fs::remove_all(root);
}

// An HF directory without tokenizer_config.json or generation_config.json: its export keeps the
// BOS and EOS its config.json names (transformers would take LlamaConfig's 1 and 2 without them).
TEST(HfExport, AnHfDirectorysOwnBosAndEosAreKept) {
  const fs::path root = temp_dir("export_config_ids");
  const tokenizer::Tokenizer tok = pollen::testing::tiny_tokenizer();
  uint32_t im_start = 0, im_end = 0;
  for (const auto& t : tok.added_tokens()) {
    if (t.content == "<|im_start|>") im_start = t.id;
    if (t.content == "<|im_end|>") im_end = t.id;
  }
  model::LlamaConfig c = small(false, false);
  c.vocab_size = tok.vocab_size();
  io::HfExportOptions o;
  o.tokenizer_json = tokenizer::hf_json_text(tok);
  o.bos_token_id = im_start;
  o.eos_token_id = im_end;
  io::export_hf(model::Llama(c, 7), root / "src", o);
  fs::remove(root / "src" / "generation_config.json");
  ASSERT_FALSE(fs::exists(root / "src" / "tokenizer_config.json"));
  ASSERT_TRUE(exports_hf(root / "src", root / "out", root));
  const json config = json::parse(read_file(root / "out" / "config.json"));
  EXPECT_EQ(config["bos_token_id"], im_start);
  EXPECT_EQ(config["eos_token_id"], im_end);
  fs::remove_all(root);
}

// A checkpoint without a tokenizer of its own takes the one beside its data manifest only while
// it is the one the manifest records: a file replaced since would decode unlike the data.
TEST(ModelSource, ATokenizerBesideTheDataMustBeTheManifests) {
  const fs::path root = temp_dir("manifest_tokenizer");
  const tokenizer::Tokenizer tok = pollen::testing::tiny_tokenizer();
  fs::create_directories(root / "data");
  tokenizer::save_tokenizer(tok, root / "data" / "tokenizer.json");
  const fs::path ckpt = small_checkpoint(
      root, tok,
      cat("\n[data]\nmanifests = ['", (root / "data" / "manifest.json").string(), "']\n"));
  for (const bool same : {true, false}) {
    const json manifest{
        {"tokenizer", {{"fingerprint", same ? tok.fingerprint() : std::string(64, 'a')}}}};
    write_file_atomic(root / "data" / "manifest.json", manifest.dump());
    const io::ModelSource src = io::resolve_model(ckpt.string());
    EXPECT_EQ(src.tokenizer.has_value(), same);
  }
  // One that cannot be read is passed over too, not the end of resolving the model.
  write_file_atomic(root / "data" / "tokenizer.json", "{");
  EXPECT_FALSE(io::resolve_model(ckpt.string()).tokenizer.has_value());
  fs::remove_all(root);
}

class Transformers : public ::testing::TestWithParam<std::string> {};

TEST_P(Transformers, SavedModelLoadsWithTheSameLogitsAndExportLoadsBack) {
  if (!transformers_available())
    GTEST_SKIP() << "HF transformers not importable by " << hf_python()
                 << " (scripts/test-peers makes it)";
  const std::string kind = GetParam();
  const fs::path dir = temp_dir("tf_" + kind);
  // Dynamic and yarn scaling are measured past max_position_embeddings (64).
  const Tensor tokens = kind.starts_with("llama-") ? long_token_rows(80) : token_rows();
  write_tokens(dir, tokens);
  ASSERT_EQ(std::system((hf_python() + " " + script() + " make " + kind + " " + dir.string() +
                         " 2>" + (dir / "stderr.txt").string())
                            .c_str()),
            0)
      << read_file(dir / "stderr.txt");
  const io::ModelSource src = io::resolve_model(dir.string());
  ASSERT_EQ(src.kind, io::ModelSource::Kind::hf_dir);
  const model::Llama m = io::load_model(src);
  const auto batch = model::Batch::contiguous_rows(tokens, tokens);
  const Tensor logits = m.logits(batch);
  EXPECT_LT(max_diff(logits, read_logits(dir / "logits.bin")), 1e-4) << kind;

  // pollen's export, read by transformers.
  const fs::path out = dir / "exported";
  io::HfExportOptions o;
  o.max_shard_bytes = 30000;
  io::export_hf(m, out, o);
  write_tokens(out, tokens);
  ASSERT_EQ(std::system((hf_python() + " " + script() + " logits " + out.string() + " 2>" +
                         (dir / "stderr.txt").string())
                            .c_str()),
            0)
      << read_file(dir / "stderr.txt");
  EXPECT_LT(max_diff(logits, read_logits(out / "logits.bin")), 1e-4) << kind;
  fs::remove_all(dir);
}

// Keys a config.json leaves out take the defaults of the type's transformers config class, which
// differ by type: a Mistral config without num_key_value_heads has 8, a Qwen2 one 32, and a
// Mistral config without sliding_window a window of 4096 (null: none).
TEST(HfConfig, KeysLeftOutMeanWhatTransformersMakesOfThem) {
  if (!transformers_available())
    GTEST_SKIP() << "HF transformers not importable by " << hf_python()
                 << " (scripts/test-peers makes it)";
  const fs::path root = temp_dir("hf_defaults");
  for (const char* type : {"llama", "mistral", "qwen2", "mistral-null-window"}) {
    json j = {{"model_type", std::string(type).substr(0, std::string(type).find('-'))},
              {"vocab_size", 61},
              {"hidden_size", 64},
              {"intermediate_size", 48},
              {"num_hidden_layers", 1},
              {"num_attention_heads", 32}};
    if (std::string(type) == "mistral-null-window") j["sliding_window"] = nullptr;
    const fs::path dir = root / type;
    fs::create_directories(dir);
    write_file_atomic(dir / "config.json", j.dump());
    ASSERT_EQ(std::system((hf_python() + " " + script() + " config " + dir.string() + " 2>" +
                           (dir / "stderr.txt").string())
                              .c_str()),
              0)
        << read_file(dir / "stderr.txt");
    const json hf = json::parse(read_file(dir / "config.out.json"));
    const model::LlamaConfig c = io::read_hf_config(dir / "config.json");
    EXPECT_EQ(c.num_key_value_heads, hf["num_key_value_heads"].get<int64_t>()) << type;
    EXPECT_EQ(c.max_position_embeddings, hf["max_position_embeddings"].get<int64_t>()) << type;
    EXPECT_EQ(c.rope_theta, hf["rope_theta"].get<double>()) << type;
    EXPECT_EQ(c.rms_norm_eps, hf["rms_norm_eps"].get<double>()) << type;
    EXPECT_EQ(c.tie_word_embeddings, hf["tie_word_embeddings"].get<bool>()) << type;
    // Qwen2's sliding_window applies only with use_sliding_window, which pollen refuses.
    const bool windowed =
        std::string(type) == "mistral" || std::string(type) == "mistral-null-window";
    EXPECT_EQ(c.sliding_window,
              windowed && !hf["sliding_window"].is_null() ? hf["sliding_window"].get<int64_t>() : 0)
        << type;
  }
  EXPECT_EQ(io::read_hf_config(root / "mistral" / "config.json").sliding_window, 4096);
  EXPECT_EQ(io::read_hf_config(root / "qwen2" / "config.json").num_key_value_heads, 32);
  fs::remove_all(root);
}

INSTANTIATE_TEST_SUITE_P(Kinds, Transformers,
                         ::testing::Values("llama3", "qwen2", "smollm2", "smollm2-bf16", "mistral",
                                           "llama-dynamic", "llama-yarn"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& ch : n)
                             if (ch == '-') ch = '_';
                           return n;
                         });

}  // namespace
