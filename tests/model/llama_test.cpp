// The Llama decoder: parameter and FLOP counts, float64 logits against an independent PyTorch
// implementation of HF LlamaForCausalLM, whole-model gradients against finite differences,
// determinism and activation recomputation.
#include "model/llama.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "base/files.h"
#include "ops/cross_entropy.h"
#include "optim/adamw.h"
#include "support/errors.h"
#include "support/gradcheck.h"

namespace pollen {
namespace {
namespace fs = std::filesystem;

model::LlamaConfig micro_config() {
  model::LlamaConfig c;
  c.name = "micro";
  c.vocab_size = 37;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;  // grouped-query attention
  c.rope_theta = 500000.0;
  c.rms_norm_eps = 1e-6;
  return c;
}

// Every parameter set to random values (norm weights and biases too, so that each one matters).
void randomise(const model::Llama& m, uint64_t seed, double scale) {
  Rng rng(seed);
  for (auto& [name, v] : m.named_parameters()) {
    ag::Var var = v;
    double* p = var.value().data<double>();
    for (int64_t i = 0; i < var.value().numel(); ++i) p[i] = scale * rng.normal();
  }
}

model::Batch make_batch(int64_t b, int64_t t, int64_t vocab, const std::vector<int64_t>& doc_lens,
                        uint64_t seed) {
  Rng rng(seed);
  model::Batch batch;
  batch.tokens = Tensor::empty({b, t}, DType::i32);
  batch.targets = Tensor::empty({b, t}, DType::i32);
  batch.positions = Tensor::empty({b, t}, DType::i32);
  batch.doc_ids = Tensor::empty({b, t}, DType::i32);
  for (int64_t r = 0; r < b; ++r) {
    int64_t doc = 0, pos = 0, left = doc_lens.empty() ? t : doc_lens[0];
    for (int64_t j = 0; j < t; ++j) {
      if (left == 0) {
        ++doc;
        pos = 0;
        left = doc_lens[static_cast<size_t>(doc) % doc_lens.size()];
      }
      const int64_t i = r * t + j;
      batch.tokens.data<int32_t>()[i] = static_cast<int32_t>(rng.below(vocab));
      batch.targets.data<int32_t>()[i] = static_cast<int32_t>(rng.below(vocab));
      batch.positions.data<int32_t>()[i] = static_cast<int32_t>(pos++);
      batch.doc_ids.data<int32_t>()[i] = static_cast<int32_t>(doc);
      --left;
    }
  }
  return batch;
}

std::string peers_python() {
  if (fs::exists(POLLEN_PEERS_PYTHON)) return POLLEN_PEERS_PYTHON;
  return "/usr/bin/python3";
}

bool torch_available() {
  return std::system((peers_python() + " -c 'import torch' 2>/dev/null").c_str()) == 0;
}

TEST(LlamaConfig, ParameterAndFlopCounts) {
  // llama-tiny by hand: per layer 4*256*256 (attention) + 3*256*688 (MLP) + 2*256 (norms).
  const auto tiny = model::preset("llama-tiny");
  const int64_t per_layer = 4 * 256 * 256 + 3 * 256 * 688 + 2 * 256;
  EXPECT_EQ(tiny.parameter_count(), 4 * per_layer + 256 + 2 * 4096 * 256);
  EXPECT_DOUBLE_EQ(tiny.flops_per_token(128),
                   6.0 * (4 * per_layer + 256 + 4096 * 256) + 12.0 * 4 * 256 * 128);
  // llama-cpu has grouped-query attention: k and v are 2 heads of 64.
  const auto cpu = model::preset("llama-cpu");
  EXPECT_EQ(cpu.parameter_count(),
            6 * (2 * 384 * 384 + 2 * 384 * 128 + 3 * 384 * 1024 + 2 * 384) + 384 + 2 * 8192 * 384);
  // SmolLM2-135M: 134,515,008 parameters (tied embeddings), as HF reports.
  EXPECT_EQ(model::preset("smollm2-135m").parameter_count(), 134515008);
  // The model's own parameter list agrees with the count.
  model::Llama m(tiny, 0);
  int64_t n = 0;
  for (auto& p : m.parameters()) n += p.value().numel();
  EXPECT_EQ(n, tiny.parameter_count());
}

TEST(LlamaConfig, TomlFileErrorsNameFileAndKey) {
  auto dir = fs::temp_directory_path() / "pollen_model_cfg";
  fs::create_directories(dir);
  write_file_atomic(dir / "ok.toml", "[model]\npreset = 'llama-tiny'\nnum_hidden_layers = 2\n");
  EXPECT_EQ(model::resolve_config((dir / "ok.toml").string()).num_hidden_layers, 2);
  write_file_atomic(dir / "bad.toml", "[model]\nhidden_size = 2.5\n");
  try {
    model::resolve_config((dir / "bad.toml").string());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.hidden_size': expected an integer"),
              std::string::npos)
        << e.what();
  }
  write_file_atomic(dir / "typo.toml", "[model]\nnum_layers = 2\n");
  EXPECT_THROW(model::resolve_config((dir / "typo.toml").string()), Error);
  // Sizes that do not fit together name the file as well as the keys.
  write_file_atomic(dir / "heads.toml", "preset = 'llama-tiny'\nnum_attention_heads = 3\n");
  const std::string heads =
      pollen::testing::error_of([&] { model::resolve_config((dir / "heads.toml").string()); });
  EXPECT_NE(heads.find("config file '" + (dir / "heads.toml").string() + "'"), std::string::npos)
      << heads;
  EXPECT_NE(heads.find("num_attention_heads (3) must be a multiple of num_key_value_heads"),
            std::string::npos)
      << heads;
  EXPECT_THROW(model::resolve_config("llama-huge"), Error);
  fs::remove_all(dir);
}

// [model.rope_scaling] is checked as config.json's rope_scaling is: a key its kind does not use
// is warned of and left at its default (pollen's config.toml writes every key), yarn and dynamic
// need a factor of at least 1 and scale from max_position_embeddings, yarn's betas are ordered and
// its attention_factor defaults as transformers'.
TEST(LlamaConfig, RopeScalingInATomlFileIsCheckedAsInConfigJson) {
  const fs::path file = fs::temp_directory_path() / "pollen_rope_cfg.toml";
  const auto read = [&](const std::string& scaling) {
    write_file_atomic(file, "[model]\npreset = 'llama-tiny'\n[model.rope_scaling]\n" + scaling);
    return model::load_config(file).rope_scaling;
  };
  const auto error = [&](const std::string& scaling) {
    return pollen::testing::error_of([&] { read(scaling); });
  };
  ::testing::internal::CaptureStderr();
  const ops::RopeScaling linear = read("kind = 'linear'\nfactor = 4.0\nbeta_fast = 8.0\n");
  const std::string warned = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warned.find("rope_scaling.beta_fast': rope_scaling kind 'linear' does not use it"),
            std::string::npos)
      << warned;
  EXPECT_EQ(linear.beta_fast, ops::RopeScaling{}.beta_fast);  // left at its default
  EXPECT_EQ(linear.factor, 4.0);
  EXPECT_NE(error("kind = 'yarn'\nfactor = 0.5\n").find("must be >= 1 for kind 'yarn'"),
            std::string::npos);
  EXPECT_NE(error("kind = 'yarn'\nfactor = 4.0\nbeta_fast = 1.0\nbeta_slow = 5.0\n")
                .find("beta_fast > beta_slow > 0"),
            std::string::npos);
  EXPECT_NE(
      error("kind = 'yarn'\nfactor = 4.0\nattention_factor = -2.0\n").find("attention_factor > 0"),
      std::string::npos);
  const ops::RopeScaling yarn = read("kind = 'yarn'\nfactor = 4.0\n");
  EXPECT_DOUBLE_EQ(yarn.attention_factor, 0.1 * std::log(4.0) + 1.0);
  EXPECT_EQ(yarn.original_max_position_embeddings,
            model::preset("llama-tiny").max_position_embeddings);
  fs::remove(file);
}

struct ParityCase {
  int64_t batch, seq;
  std::vector<int64_t> doc_lens;  // empty: one document per row
  bool tied, bias;
};

TEST(LlamaParity, Float64LogitsEqualIndependentPyTorchImplementation) {
  if (!torch_available()) GTEST_SKIP() << "PyTorch not importable by " << peers_python();
  const std::vector<ParityCase> cases = {{1, 1, {}, false, false},
                                         {2, 5, {}, false, false},
                                         {2, 19, {}, true, false},
                                         {3, 12, {5, 3, 4}, false, false},
                                         {1, 16, {1, 7, 8}, false, true}};
  for (const auto& pc : cases) {
    model::LlamaConfig cfg = micro_config();
    cfg.tie_word_embeddings = pc.tied;
    cfg.attention_bias = pc.bias;
    model::Llama m(cfg, 3, DType::f64);
    randomise(m, 4, 0.3);
    const model::Batch batch = make_batch(pc.batch, pc.seq, cfg.vocab_size, pc.doc_lens, 5);
    const Tensor logits = m.logits(batch);

    auto dir = fs::temp_directory_path() / "pollen_llama_parity";
    fs::remove_all(dir);
    fs::create_directories(dir);
    nlohmann::json meta;
    meta["config"] = {{"hidden_size", cfg.hidden_size},
                      {"num_hidden_layers", cfg.num_hidden_layers},
                      {"num_attention_heads", cfg.num_attention_heads},
                      {"num_key_value_heads", cfg.num_key_value_heads},
                      {"rope_theta", cfg.rope_theta},
                      {"rms_norm_eps", cfg.rms_norm_eps}};
    std::ofstream bin(dir / "weights.bin", std::ios::binary);
    for (auto& [name, v] : m.named_parameters()) {
      meta["names"].push_back(name);
      meta["shapes"].push_back(v.shape());
      bin.write(static_cast<const char*>(v.value().raw()),
                static_cast<std::streamsize>(v.value().nbytes()));
    }
    bin.close();
    auto rows = [](const Tensor& t) {
      std::vector<std::vector<int>> out(static_cast<size_t>(t.size(0)));
      for (int64_t i = 0; i < t.numel(); ++i)
        out[static_cast<size_t>(i / t.size(1))].push_back(t.data<int32_t>()[i]);
      return out;
    };
    meta["tokens"] = rows(batch.tokens);
    meta["positions"] = rows(batch.positions);
    meta["doc_ids"] = rows(batch.doc_ids);
    write_file_atomic(dir / "meta.json", meta.dump());
    const std::string cmd = peers_python() + " " + POLLEN_SOURCE_DIR +
                            "/tests/model/hf_llama_reference.py " + dir.string();
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    const std::string ref = read_file(dir / "logits.bin");
    ASSERT_EQ(ref.size(), logits.nbytes());
    const double* want = reinterpret_cast<const double*>(ref.data());
    const double* got = logits.data<double>();
    double worst = 0;
    for (int64_t i = 0; i < logits.numel(); ++i)
      worst = std::max(worst, std::fabs(got[i] - want[i]) / (1 + std::fabs(want[i])));
    EXPECT_LT(worst, 1e-12) << "batch " << pc.batch << " seq " << pc.seq;
    fs::remove_all(dir);
  }
}

// A model small enough to check every weight by finite differences: one layer, grouped-query
// heads (2 over 1).
model::LlamaConfig gradcheck_config() {
  model::LlamaConfig cfg = micro_config();
  cfg.num_hidden_layers = 1;
  cfg.hidden_size = 8;
  cfg.intermediate_size = 12;
  cfg.vocab_size = 11;
  cfg.num_attention_heads = 2;
  cfg.num_key_value_heads = 1;
  return cfg;
}

TEST(LlamaGradients, WholeModelAgainstFiniteDifferences) {
  model::LlamaConfig cfg = gradcheck_config();
  cfg.attention_bias = true;
  model::Llama m(cfg, 1, DType::f64);
  randomise(m, 2, 0.5);
  const model::Batch batch = make_batch(2, 5, cfg.vocab_size, {2, 3}, 3);
  auto params = m.parameters();
  testing::max_gradcheck_error([&](std::vector<ag::Var>&) { return m.loss(batch); }, params);
}

// The tied head: the embedding's gradient is the sum of its two uses (lookup and classifier),
// and ignored targets (-100) add nothing to either; the mean is over the scored targets only.
TEST(LlamaGradients, TiedHeadAndIgnoredTargetsAgainstFiniteDifferences) {
  model::LlamaConfig cfg = gradcheck_config();
  cfg.tie_word_embeddings = true;
  model::Llama m(cfg, 1, DType::f64);
  randomise(m, 2, 0.5);
  model::Batch batch = make_batch(2, 9, cfg.vocab_size, {4, 5}, 3);
  for (int64_t i : {0, 4, 5, 11, 17}) batch.targets.data<int32_t>()[i] = ops::kIgnoreIndex;
  auto params = m.parameters();
  testing::max_gradcheck_error([&](std::vector<ag::Var>&) { return m.loss(batch); }, params);
}

std::vector<std::vector<double>> train_steps(bool recompute, int steps) {
  model::Llama m(model::preset("llama-tiny"), 9);
  m.set_recompute(recompute);
  optim::AdamW opt(m.parameters(), {});
  const model::Batch batch = make_batch(2, 32, 4096, {20, 12}, 10);
  std::vector<std::vector<double>> out;
  for (int s = 0; s < steps; ++s) {
    ag::Tape tape;
    ag::Var loss;
    {
      ag::TapeScope scope(tape);
      loss = m.loss(batch);
    }
    tape.backward(loss);
    const double norm = opt.step(1e-3);
    opt.zero_grad();
    out.push_back({loss.value().item(), norm});
  }
  auto params = m.parameters();
  out.push_back(params.front().value().to_doubles());
  out.push_back(params.back().value().to_doubles());
  return out;
}

TEST(LlamaTraining, DeterministicAndRecomputationChangesNothing) {
  const auto a = train_steps(false, 3);
  const auto b = train_steps(false, 3);
  const auto c = train_steps(true, 3);
  EXPECT_EQ(a, b) << "two identical runs differ";
  EXPECT_EQ(a, c) << "activation recomputation changed the result";
  EXPECT_LT(a[2][0], a[0][0]) << "loss did not fall on a repeated batch";
}

// Same initial weights in float32 and float64: the float32 training path (its vectorised
// kernels) must follow the float64 reference step by step.
TEST(LlamaTraining, Float32FollowsFloat64OverSteps) {
  model::LlamaConfig cfg = model::preset("llama-tiny");
  cfg.num_hidden_layers = 2;
  model::Llama m64(cfg, 21, DType::f64), m32(cfg, 21, DType::f32);
  const model::Batch batch = make_batch(2, 80, cfg.vocab_size, {50, 30}, 22);
  optim::AdamW o64(m64.parameters(), {}), o32(m32.parameters(), {});
  for (int step = 0; step < 4; ++step) {
    double losses[2];
    int i = 0;
    for (auto pair : {std::pair{&m64, &o64}, std::pair{&m32, &o32}}) {
      ag::Tape tape;
      ag::Var l;
      {
        ag::TapeScope scope(tape);
        l = pair.first->loss(batch);
      }
      tape.backward(l);
      pair.second->step(3e-3);
      pair.second->zero_grad();
      losses[i++] = l.value().item();
    }
    EXPECT_NEAR(losses[1], losses[0], 2e-4 * losses[0]) << "step " << step;
  }
}

TEST(LlamaTraining, GradientAccumulationSumsOverBackwardPasses) {
  model::Llama m(micro_config(), 1, DType::f64);
  const model::Batch b1 = make_batch(1, 6, 37, {}, 1), b2 = make_batch(1, 6, 37, {}, 2);
  auto grads_after = [&](const std::vector<const model::Batch*>& batches) {
    for (auto& p : m.parameters()) p.zero_grad();
    for (const auto* b : batches) {
      ag::Tape tape;
      ag::Var l;
      {
        ag::TapeScope scope(tape);
        l = m.loss(*b, ag::Reduction::sum);
      }
      tape.backward(l);
    }
    std::vector<std::vector<double>> grads;  // every parameter: embedding, layers, head
    for (auto& p : m.parameters()) grads.push_back(p.grad().to_doubles());
    return grads;
  };
  const auto g1 = grads_after({&b1}), g2 = grads_after({&b2}), g12 = grads_after({&b1, &b2});
  ASSERT_EQ(g12.size(), g1.size());
  for (size_t p = 0; p < g12.size(); ++p)
    for (size_t i = 0; i < g12[p].size(); ++i)
      EXPECT_NEAR(g12[p][i], g1[p][i] + g2[p][i], 1e-12) << "parameter " << p << " element " << i;
}

TEST(LlamaInference, NoGradRecordsNothing) {
  model::Llama m(micro_config(), 1);
  ag::Tape tape;
  {
    ag::TapeScope scope(tape);
    ag::NoGrad no_grad;
    m.loss(make_batch(1, 4, 37, {}, 1));
  }
  EXPECT_EQ(tape.size(), 0u);
}

}  // namespace
}  // namespace pollen
