// LoRA: gradients of the adapted linear layer and of a whole adapted model against float64 finite
// differences, adapted logits against the merged model's, generation with adapters against the
// merged model's, the frozen base, dropout's determinism, and the federated aggregation rule.
#include "model/lora.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>

#include "autograd/lora.h"
#include "base/config.h"
#include "base/error.h"
#include "model/generate.h"
#include "model/llama.h"
#include "ops/elementwise.h"
#include "support/gradcheck.h"

namespace pollen {
namespace {
using model::LoraTarget;

model::LlamaConfig micro_config() {
  model::LlamaConfig c;
  c.name = "micro";
  c.vocab_size = 13;
  c.hidden_size = 8;
  c.intermediate_size = 12;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.attention_bias = true;
  return c;
}

const std::vector<LoraTarget> kAllTargets = {
    LoraTarget::q_proj,    LoraTarget::k_proj,  LoraTarget::v_proj,    LoraTarget::o_proj,
    LoraTarget::gate_proj, LoraTarget::up_proj, LoraTarget::down_proj, LoraTarget::lm_head};

model::LoraConfig lora_config(int64_t rank, std::vector<LoraTarget> targets, uint64_t seed = 5) {
  model::LoraConfig c;
  c.rank = rank;
  c.alpha = 3.0;
  c.targets = std::move(targets);
  c.seed = seed;
  return c;
}

// Every parameter random (norm weights and biases too, so that each one matters).
void randomise(const std::vector<std::pair<std::string, ag::Var>>& params, uint64_t seed,
               double scale) {
  Rng rng(seed);
  for (auto& [name, v] : params) {
    Tensor t = testing::random_tensor(v.shape(), rng, scale, v.dtype());
    ag::Var var = v;
    var.value().copy_(t);
  }
}

model::Batch random_batch(int64_t b, int64_t t, int64_t vocab, uint64_t seed) {
  Rng rng(seed);
  Tensor tokens = Tensor::empty({b, t}, DType::i32), targets = Tensor::empty({b, t}, DType::i32);
  for (int64_t i = 0; i < b * t; ++i) {
    tokens.data<int32_t>()[i] = static_cast<int32_t>(rng.below(static_cast<uint64_t>(vocab)));
    targets.data<int32_t>()[i] = static_cast<int32_t>(rng.below(static_cast<uint64_t>(vocab)));
  }
  return model::Batch::contiguous_rows(tokens, targets);
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  const auto x = a.to_doubles(), y = b.to_doubles();
  EXPECT_EQ(x.size(), y.size());
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::fabs(x[i] - y[i]));
  return worst;
}

// One adapted layer with bias and a dropout mask: x, W, bias, A and B against finite differences
// (the loss weights each output differently so that every element matters).
TEST(LoraGradients, AdaptedLinearAgainstFiniteDifferences) {
  Rng rng(1);
  const int64_t n = 5, k = 6, m = 4, r = 3;
  std::vector<ag::Var> leaves = {ag::Var(testing::random_tensor({n, k}, rng), true, "x"),
                                 ag::Var(testing::random_tensor({m, k}, rng), true, "W"),
                                 ag::Var(testing::random_tensor({m}, rng), true, "bias"),
                                 ag::Var(testing::random_tensor({r, k}, rng), true, "A"),
                                 ag::Var(testing::random_tensor({m, r}, rng), true, "B")};
  Tensor mask = Tensor::empty({n, k}, DType::f64);
  for (int64_t i = 0; i < n * k; ++i) mask.data<double>()[i] = i % 3 == 0 ? 0.0 : 1.5;
  const ag::Var probe(testing::random_tensor({n, m}, rng), false, "probe");
  for (const Tensor& drop : {mask, Tensor()}) {
    const double err = testing::max_gradcheck_error(
        [&](std::vector<ag::Var>& l) {
          ag::Var y = ag::lora_linear(l[0], l[1], &l[2], l[3], l[4], 0.7, drop);
          // sum(y * probe) as a cross-free scalar: a linear layer of y onto one output.
          return ag::linear(ag::reshape(y, {1, n * m}),
                            ag::Var(probe.value().reshape({1, n * m}), false));
        },
        leaves);
    EXPECT_LT(err, 1e-6);
  }
}

TEST(LoraGradients, AdaptedWeightAgainstFiniteDifferences) {
  Rng rng(2);
  std::vector<ag::Var> leaves = {ag::Var(testing::random_tensor({4, 6}, rng), true, "W"),
                                 ag::Var(testing::random_tensor({2, 6}, rng), true, "A"),
                                 ag::Var(testing::random_tensor({4, 2}, rng), true, "B")};
  const ag::Var probe(testing::random_tensor({1, 24}, rng), false, "probe");
  const double err = testing::max_gradcheck_error(
      [&](std::vector<ag::Var>& l) {
        return ag::linear(ag::reshape(ag::lora_weight(l[0], l[1], l[2], 1.3), {1, 24}), probe);
      },
      leaves);
  EXPECT_LT(err, 1e-6);
}

// A whole adapted model's loss against finite differences in every A and B: every target with
// lm_head, then every layer target with dropout (which lm_head does not take).
TEST(LoraGradients, WholeAdaptedModelAgainstFiniteDifferences) {
  const model::LlamaConfig cfg = micro_config();
  model::Llama m(cfg, 1, DType::f64);
  randomise(m.named_parameters(), 2, 0.5);
  const model::Batch batch = random_batch(2, 5, cfg.vocab_size, 3);
  std::vector<LoraTarget> layer_targets(kAllTargets.begin(), kAllTargets.end() - 1);
  model::LoraConfig with_dropout = lora_config(2, layer_targets);
  with_dropout.dropout = 0.3;
  for (const model::LoraConfig& lc : {lora_config(2, kAllTargets), with_dropout}) {
    auto lora = std::make_shared<model::Lora>(cfg, lc, DType::f64);
    randomise(lora->named_tensors(), 4, 0.5);
    m.attach_lora(lora);
    auto params = std::vector<ag::Var>{};
    for (auto& [name, v] : lora->named_parameters()) params.push_back(v);
    const bool head = lc.targets_module(LoraTarget::lm_head);
    EXPECT_EQ(params.size(), static_cast<size_t>(2 * (7 * cfg.num_hidden_layers + (head ? 1 : 0))));
    const double err = testing::max_gradcheck_error(
        [&](std::vector<ag::Var>&) {
          lora->set_dropout_step(7);  // every evaluation is the same step's first forward pass
          return m.loss(batch);
        },
        params);
    EXPECT_LT(err, 1e-5);
    for (auto& [name, v] : m.named_parameters())
      EXPECT_FALSE(v.grad().defined()) << "frozen base parameter " << name << " got a gradient";
  }
}

TEST(Lora, FreshAdaptersChangeNothingAndDrawAFromTheSeed) {
  const model::LlamaConfig cfg = micro_config();
  model::Llama m(cfg, 1);
  const model::Batch batch = random_batch(2, 6, cfg.vocab_size, 3);
  const Tensor base = m.logits(batch);
  auto lora = std::make_shared<model::Lora>(cfg, lora_config(4, kAllTargets, 11));
  m.attach_lora(lora);
  EXPECT_EQ(max_abs_diff(m.logits(batch), base), 0.0) << "B starts at zero";
  // PEFT's kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in)), not all equal; same seed, same
  // A.
  const model::Lora again(cfg, lora_config(4, kAllTargets, 11));
  const model::Lora other(cfg, lora_config(4, kAllTargets, 12));
  const auto a = lora->adapter(1, LoraTarget::down_proj).a.value().to_doubles();
  double largest = 0;
  for (double v : a) largest = std::max(largest, std::fabs(v));
  EXPECT_LE(largest, 1.0 / std::sqrt(12.0));
  EXPECT_GT(largest, 0.8 / std::sqrt(12.0));
  EXPECT_EQ(a, again.adapter(1, LoraTarget::down_proj).a.value().to_doubles());
  EXPECT_NE(a, other.adapter(1, LoraTarget::down_proj).a.value().to_doubles());
  EXPECT_EQ(lora->named_tensors().front().first,
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(lora->named_tensors().back().first, "base_model.model.lm_head.lora_B.weight");
  EXPECT_EQ(model::Lora::base_weight_name(lora->named_tensors().back().first), "lm_head.weight");
  EXPECT_DOUBLE_EQ(lora->scale(), 3.0 / 4);
  model::LoraConfig rs = lora_config(4, kAllTargets);
  rs.rslora = true;
  EXPECT_DOUBLE_EQ(rs.scale(), 3.0 / 2);
}

// With random non-zero B, the adapted model's logits equal the merged model's (float64), and
// the base is untouched: detached, or seen through without_lora().
TEST(Lora, AdaptedLogitsEqualMergedModel) {
  const model::LlamaConfig cfg = micro_config();
  model::Llama m(cfg, 1, DType::f64);
  randomise(m.named_parameters(), 2, 0.5);
  const model::Batch batch = random_batch(3, 7, cfg.vocab_size, 3);
  const Tensor base = m.logits(batch);
  auto lora = std::make_shared<model::Lora>(cfg, lora_config(3, kAllTargets), DType::f64);
  randomise(lora->named_tensors(), 4, 0.5);
  m.attach_lora(lora);
  const Tensor adapted = m.logits(batch);
  const model::Llama merged = model::merge_lora(m.without_lora(), *lora);
  EXPECT_FALSE(merged.lora());
  EXPECT_LT(max_abs_diff(adapted, merged.logits(batch)), 1e-12);
  EXPECT_GT(max_abs_diff(adapted, base), 0.1) << "the adapters must matter for this test";
  EXPECT_EQ(max_abs_diff(m.without_lora().logits(batch), base), 0.0);
  m.detach_lora();
  EXPECT_EQ(max_abs_diff(m.logits(batch), base), 0.0);
  for (auto& [name, v] : m.named_parameters()) EXPECT_TRUE(v.requires_grad()) << name;
}

// Generation applies the adapters: an adapted model generates what its merged model does.
TEST(Lora, GenerationWithAdaptersEqualsMergedModel) {
  model::LlamaConfig cfg = micro_config();
  cfg.vocab_size = 50;
  cfg.hidden_size = 32;
  cfg.intermediate_size = 48;
  cfg.num_attention_heads = 4;
  cfg.num_key_value_heads = 2;
  model::Llama m(cfg, 1);
  randomise(m.named_parameters(), 2, 0.3);
  auto lora = std::make_shared<model::Lora>(cfg, lora_config(4, kAllTargets));
  randomise(lora->named_tensors(), 4, 0.5);
  m.attach_lora(lora);
  const model::Llama merged = model::merge_lora(m.without_lora(), *lora);
  model::SamplingOptions greedy;
  greedy.temperature = 0;
  greedy.max_tokens = 12;
  model::SamplingOptions sampled = greedy;
  sampled.temperature = 1.0;
  sampled.seed = 3;
  const std::vector<std::vector<uint32_t>> prompts = {{1, 2, 3}, {7, 8}};
  for (const auto& options : {greedy, sampled}) {
    const auto a = model::generate(m, prompts, options);
    const auto b = model::generate(merged, prompts, options);
    const auto base = model::generate(m.without_lora(), prompts, options);
    ASSERT_EQ(a.size(), b.size());
    bool differs_from_base = false;
    for (size_t r = 0; r < a.size(); ++r) {
      EXPECT_EQ(a[r].tokens, b[r].tokens) << "row " << r;
      differs_from_base = differs_from_base || a[r].tokens != base[r].tokens;
    }
    EXPECT_TRUE(differs_from_base) << "the adapters must matter for this test";
  }
  // The KV cache's logits against the full forward of the adapted model.
  model::KvCache cache(cfg, 1, 16);
  const Tensor cached = cache.forward(m, {{4, 5, 6, 7}});
  Tensor tokens = Tensor::empty({1, 4}, DType::i32);
  for (int i = 0; i < 4; ++i) tokens.data<int32_t>()[i] = 4 + i;
  const Tensor full = m.logits(model::Batch::contiguous_rows(tokens, tokens));
  EXPECT_LT(max_abs_diff(cached, full.slice(0, 3, 4)), 1e-5);
}

// Each forward pass of a step draws its own masks, as PEFT's dropout does (the micro-batches of an
// accumulated step are not dropped alike); setting the step again draws the same sequence.
TEST(Lora, EachForwardPassOfAStepDrawsItsOwnMask) {
  const model::LlamaConfig cfg = micro_config();
  const model::Batch batch = random_batch(2, 6, cfg.vocab_size, 3);
  model::LoraConfig lc = lora_config(2, {LoraTarget::q_proj, LoraTarget::down_proj});
  lc.dropout = 0.5;
  model::Llama m(cfg, 1);
  auto lora = std::make_shared<model::Lora>(cfg, lc);
  randomise(lora->named_tensors(), 4, 0.5);
  m.attach_lora(lora);
  lora->set_dropout_step(3);
  const double first = m.loss(batch).value().item();
  const double second = m.loss(batch).value().item();
  lora->set_dropout_step(3);
  EXPECT_EQ(m.loss(batch).value().item(), first);
  EXPECT_NE(second, first);
}

// Recomputation through a frozen base still reaches the adapters, with the same gradients;
// dropout masks depend on (seed, step, forward pass) only.
TEST(Lora, RecomputationAndDropoutAreDeterministic) {
  const model::LlamaConfig cfg = micro_config();
  const model::Batch batch = random_batch(2, 6, cfg.vocab_size, 3);
  model::LoraConfig lc =
      lora_config(2, {LoraTarget::q_proj, LoraTarget::v_proj, LoraTarget::down_proj});
  lc.dropout = 0.25;
  auto grads = [&](bool recompute, uint64_t step, bool dropout) {
    model::Llama m(cfg, 1);
    m.set_recompute(recompute);
    auto lora = std::make_shared<model::Lora>(cfg, lc);
    randomise(lora->named_tensors(), 4, 0.5);
    if (dropout) lora->set_dropout_step(step);
    m.attach_lora(lora);
    ag::Tape tape;
    ag::Var loss;
    {
      ag::TapeScope scope(tape);
      loss = m.loss(batch);
    }
    tape.backward(loss);
    std::vector<std::vector<double>> out = {{loss.value().item()}};
    for (auto& [name, v] : lora->named_parameters()) {
      EXPECT_TRUE(v.grad().defined()) << name;
      if (v.grad().defined()) out.push_back(v.grad().to_doubles());
    }
    return out;
  };
  const auto plain = grads(false, 3, true);
  EXPECT_EQ(plain, grads(true, 3, true)) << "recomputation changed the adapters' gradients";
  EXPECT_EQ(plain, grads(false, 3, true)) << "the same step drew another mask";
  EXPECT_NE(plain, grads(false, 4, true)) << "another step drew the same mask";
  EXPECT_NE(plain, grads(false, 3, false)) << "dropout did nothing";
  EXPECT_EQ(grads(false, 3, false), grads(true, 4, false));
}

// A frozen (train_a = false): only B trains. The federated rule "A from a shared seed, B
// averaged" gives the model that averaging the clients' merged updates gives; averaging A and B
// separately does not when the A differ.
TEST(LoraFederated, SharedFrozenAWithAveragedBEqualsAveragedMergedUpdates) {
  const model::LlamaConfig cfg = micro_config();
  model::Llama base(cfg, 1, DType::f64);
  randomise(base.named_parameters(), 2, 0.5);
  model::LoraConfig lc = lora_config(3, kAllTargets, 21);
  lc.train_a = false;
  std::vector<std::unique_ptr<model::Lora>> clients;
  for (uint64_t i = 0; i < 3; ++i) {
    clients.push_back(std::make_unique<model::Lora>(cfg, lc, DType::f64));
    EXPECT_EQ(clients.back()->named_parameters().size(), clients.back()->named_tensors().size() / 2)
        << "only B trains";
    for (auto& [name, v] : clients.back()->named_parameters())
      randomise({{name, v}}, 100 + i * 17 + name.size(), 0.5);  // each client's trained B
  }
  const std::vector<const model::Lora*> ptrs = {clients[0].get(), clients[1].get(),
                                                clients[2].get()};
  const std::vector<double> weights = {1.0, 2.0, 5.0};

  auto apply_updates = [&](const std::vector<std::pair<std::string, Tensor>>& updates) {
    std::map<std::string, Tensor> w;
    for (auto& [name, v] : base.named_parameters()) w[name] = v.value().clone();
    for (const auto& [name, d] : updates) ops::axpy(1.0, d, w.at(name));
    return model::Llama(
        cfg, [&](const std::string& n, const Shape&) { return w.at(n); }, DType::f64);
  };
  const model::Llama reference = apply_updates(model::average_merged_updates(ptrs, weights));
  const model::Lora averaged = model::average_lora_shared_a(ptrs, weights);
  const model::Llama by_rule = model::merge_lora(base, averaged);
  const model::Batch batch = random_batch(2, 6, cfg.vocab_size, 3);
  EXPECT_LT(max_abs_diff(by_rule.logits(batch), reference.logits(batch)), 1e-12);
  const auto by_rule_params = by_rule.named_parameters();
  const auto reference_params = reference.named_parameters();
  ASSERT_EQ(by_rule_params.size(), reference_params.size());
  for (size_t i = 0; i < by_rule_params.size(); ++i)
    EXPECT_LT(max_abs_diff(by_rule_params[i].second.value(), reference_params[i].second.value()),
              1e-14)
        << by_rule_params[i].first;

  // A that differ (each client drew its own): the rule refuses them, and averaging A and B
  // separately is not the mean of the merged updates.
  std::vector<std::unique_ptr<model::Lora>> own;
  for (uint64_t i = 0; i < 3; ++i) {
    model::LoraConfig c = lc;
    c.seed = 30 + i;
    own.push_back(std::make_unique<model::Lora>(cfg, c, DType::f64));
    randomise(own.back()->named_parameters(), 200 + i, 0.5);
  }
  const std::vector<const model::Lora*> own_ptrs = {own[0].get(), own[1].get(), own[2].get()};
  try {
    (void)model::average_lora_shared_a(own_ptrs, weights);
    ADD_FAILURE() << "clients with different A were averaged";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("q_proj.lora_A.weight"), std::string::npos) << e.what();
  }
  std::map<std::string, Tensor> mean;
  for (size_t i = 0; i < own.size(); ++i)
    for (auto& [name, v] : own[i]->named_tensors()) {
      if (!mean.count(name)) mean[name] = Tensor::zeros(v.shape(), DType::f64);
      ops::axpy(weights[i] / 8.0, v.value(), mean[name]);
    }
  const model::Lora naive(
      cfg, lc, [&](const std::string& n, const Shape&) { return mean.at(n); }, DType::f64);
  const model::Llama naive_model = model::merge_lora(base, naive);
  const model::Llama exact = apply_updates(model::average_merged_updates(own_ptrs, weights));
  EXPECT_GT(max_abs_diff(naive_model.logits(batch), exact.logits(batch)), 1e-3);
}

TEST(Lora, BadConfigurationsAreRefused) {
  const model::LlamaConfig cfg = micro_config();
  auto message = [&](const model::LoraConfig& c, const model::LlamaConfig& m) {
    try {
      model::Lora lora(m, c);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  model::LoraConfig c = lora_config(0, kAllTargets);
  EXPECT_NE(message(c, cfg).find("rank"), std::string::npos);
  c = lora_config(2, kAllTargets);
  c.dropout = 0.1;
  EXPECT_NE(message(c, cfg).find("lm_head"), std::string::npos);
  model::LlamaConfig tied = cfg;
  tied.tie_word_embeddings = true;
  EXPECT_NE(message(lora_config(2, kAllTargets), tied).find("ties"), std::string::npos);
  EXPECT_THROW(model::parse_lora_target("c_attn", "x"), Error);
  model::Llama other(micro_config(), 1);
  model::LlamaConfig wider = cfg;
  wider.hidden_size = 16;
  EXPECT_THROW(
      other.attach_lora(std::make_shared<model::Lora>(wider, lora_config(2, {LoraTarget::q_proj}))),
      Error);
}

TEST(Lora, RunFileTable) {
  ConfigTable root = ConfigTable::parse(
      "[lora]\nrank = 4\nalpha = 8\ndropout = 0.05\ntarget_modules = ['q_proj', 'down_proj']\n"
      "rslora = true\ntrain_a = false\n",
      "run.toml");
  ConfigTable t = *root.table("lora");
  const model::LoraConfig c = model::read_lora_config(t, 99);
  t.finish();
  EXPECT_EQ(c.rank, 4);
  EXPECT_DOUBLE_EQ(c.alpha, 8);
  EXPECT_DOUBLE_EQ(c.dropout, 0.05);
  EXPECT_EQ(c.targets, (std::vector<LoraTarget>{LoraTarget::q_proj, LoraTarget::down_proj}));
  EXPECT_TRUE(c.rslora);
  EXPECT_FALSE(c.train_a);
  EXPECT_EQ(c.seed, 99u);
  auto error = [](const std::string& text) {
    try {
      ConfigTable r = ConfigTable::parse(text, "run.toml");
      ConfigTable l = *r.table("lora");
      model::read_lora_config(l, 0);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error("[lora]\nrank = 0\n").find("key 'lora.rank'"), std::string::npos)
      << error("[lora]\nrank = 0\n");
  // alpha 0 scales the adapters' update to nothing: B would never train.
  for (const char* alpha : {"0", "-1"})
    EXPECT_NE(error(std::string("[lora]\nalpha = ") + alpha + "\n")
                  .find("key 'lora.alpha': expected a positive number"),
              std::string::npos)
        << alpha;
  const std::string bad = error("[lora]\ntarget_modules = ['qkv']\n");
  EXPECT_NE(bad.find("target_modules"), std::string::npos) << bad;
  EXPECT_NE(bad.find("'qkv'"), std::string::npos) << bad;
}

}  // namespace
}  // namespace pollen
