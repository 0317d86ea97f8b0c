// The post-training loop with [lora]: only the adapters train (the base stays bitwise as loaded),
// the loss falls, checkpoints hold the adapters in PEFT's format with their optimizer state and
// resume bitwise, and the saved adapter, loaded as --adapter loads it, gives the logits of the
// adapted model the run ended with.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include "base/files.h"
#include "io/checkpoint.h"
#include "io/hf.h"
#include "io/model_source.h"
#include "io/peft.h"
#include "io/safetensors.h"
#include "support/errors.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/open.h"
#include "train/post_config.h"
#include "train/post_fixtures.h"
#include "train/post_run.h"
#include "train/sft.h"

using pollen::testing::error_of;

namespace fs = std::filesystem;
using namespace pollen;

namespace {

const test_support::PostFiles& fixture() {
  static const test_support::PostFiles f = test_support::make_post_files("lora-loop");
  return f;
}

const fs::path& sft_data() {
  static const fs::path data =
      test_support::write_sft_data(fixture().dir / "train.jsonl", "arithmetic", 60, 1);
  return data;
}

// The tiny run with adapters on every linear layer of the decoder; A trains unless `train_a`.
std::string lora_toml(const fs::path& run, int steps, const std::string& lora_extra = "",
                      const std::string& more_targets = "") {
  const auto& fx = fixture();
  return test_support::tiny_post_toml(run, fx.model_file, fx.tokenizer_path, steps,
                                      "[eval]\ninterval = 2\n\n[sft]\ndata = \"" +
                                          sft_data().string() +
                                          "\"\nseq = 64\nmicro_batch = 2\naccumulation = 2\n") +
         "\n[lora]\nrank = 4\nalpha = 8\ntarget_modules = [\"q_proj\", \"k_proj\", \"v_proj\", "
         "\"o_proj\", \"gate_proj\", \"up_proj\", \"down_proj\"" +
         more_targets + "]\nseed = 5\n" + lora_extra;
}

// The base as the run loads it (a model file is initialised from the run's seed, 3).
model::Llama load_base() {
  return io::load_model(io::resolve_model(fixture().model_file.string()), DType::f32, 3);
}

// Fixed tokens to compare logits on.
model::Batch probe_batch() {
  Tensor tokens = Tensor::empty({2, 9}, DType::i32);
  for (int64_t i = 0; i < tokens.numel(); ++i)
    tokens.data<int32_t>()[i] = static_cast<int32_t>((i * 37 + 11) % 320);
  return model::Batch::contiguous_rows(tokens, tokens);
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  const auto x = a.to_doubles(), y = b.to_doubles();
  EXPECT_EQ(x.size(), y.size());
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::fabs(x[i] - y[i]));
  return worst;
}

// SFT, watched: copies the base weights the model has at its first step, checks at every
// evaluation that they are bitwise the same, and keeps the adapted model's logits on the probe
// batch at the last evaluation.
class WatchedSft : public train::Objective {
 public:
  explicit WatchedSft(const train::ObjectiveContext& ctx) : sft_(train::make_sft_objective(ctx)) {}
  std::string name() const override { return sft_->name(); }
  train::ObjectiveStep train_step(const model::Llama& model, int64_t step) override {
    if (base_.empty())
      for (const auto& [n, v] : model.named_parameters()) base_.emplace_back(n, v.value().clone());
    return sft_->train_step(model, step);
  }
  train::ObjectiveStep evaluate(const model::Llama& model) override {
    const auto now = model.named_parameters();
    EXPECT_EQ(now.size(), base_.size());
    for (size_t i = 0; i < now.size() && i < base_.size(); ++i) {
      EXPECT_FALSE(now[i].second.requires_grad()) << now[i].first;
      EXPECT_TRUE(bitwise_equal(now[i].second.value(), base_[i].second)) << now[i].first;
    }
    EXPECT_NE(model.lora(), nullptr);
    last_logits = model.logits(probe_batch());
    return sft_->evaluate(model);
  }
  nlohmann::ordered_json state() const override { return sft_->state(); }
  void restore(const nlohmann::ordered_json& s) override { sft_->restore(s); }

  static inline Tensor last_logits;

 private:
  std::unique_ptr<train::Objective> sft_;
  std::vector<std::pair<std::string, Tensor>> base_;
};

train::PostResult run(const std::string& text, bool resume, int64_t stop_after = -1) {
  return test_support::run_post(
      train::parse_post_config(text, "lora.toml", "sft", {"optimizer.lr=0.02"}),
      [](const train::ObjectiveContext& ctx) { return std::make_unique<WatchedSft>(ctx); }, resume,
      stop_after);
}

std::vector<nlohmann::json> val_records(const fs::path& run) {
  std::vector<nlohmann::json> out;
  for (const auto& j : test_support::read_metrics(run))
    if (j.contains("val_loss")) out.push_back(j);
  return out;
}

TEST(PostLora, TrainsOnlyTheAdaptersLowersTheLossAndSavesThemAsPeft) {
  const fs::path dir = test_support::post_temp_dir("lora-train");
  const auto r = run(lora_toml(dir / "run", 12, "", ", \"lm_head\""), false);
  ASSERT_EQ(r.status, train::RunStatus::finished) << r.message;

  const auto val = val_records(dir / "run");
  ASSERT_GE(val.size(), 2u);
  EXPECT_LT(val.back()["val_loss"].get<double>(), val.front()["val_loss"].get<double>() - 0.2);

  // The checkpoint: the adapters in PEFT's layout, no model weights; the optimizer's moments for
  // exactly the adapters' tensors.
  const fs::path ck = r.last_checkpoint;
  EXPECT_FALSE(fs::exists(ck / "model.safetensors"));
  const auto config = nlohmann::json::parse(std::ifstream(ck / "adapter_config.json"));
  EXPECT_EQ(config["peft_type"], "LORA");
  EXPECT_EQ(config["r"], 4);
  EXPECT_EQ(config["base_model_name_or_path"], fixture().model_file.string());
  const auto adapters = io::read_safetensors(ck / "adapter_model.safetensors");
  EXPECT_EQ(adapters.tensors.size(), 2u * (2u * 7u + 1u));  // A and B: 2 layers x 7, the head
  for (const auto& [n, t] : adapters.tensors)
    EXPECT_TRUE(n.starts_with("base_model.model.") &&
                (n.ends_with(".lora_A.weight") || n.ends_with(".lora_B.weight")))
        << n;
  const auto moments = io::read_safetensors(ck / "optimizer.safetensors");
  for (const auto& [n, t] : moments.tensors) EXPECT_NE(n.find(".lora_"), std::string::npos) << n;
  EXPECT_EQ(moments.tensors.size(), 2 * adapters.tensors.size());  // m and v of each

  // Loaded as --adapter loads it (on the base the run named): the adapted model's logits, bitwise
  // when attached, and to rounding when merged into the weights (what export and generate do).
  model::Llama base = load_base();
  const auto loaded = io::load_peft_adapter(ck, base.config());
  const Tensor merged = model::merge_lora(base, *loaded).logits(probe_batch());
  const Tensor unadapted = base.logits(probe_batch());
  base.attach_lora(loaded);
  EXPECT_TRUE(bitwise_equal(base.logits(probe_batch()), WatchedSft::last_logits));
  EXPECT_LT(max_abs_diff(merged, WatchedSft::last_logits), 1e-5);
  EXPECT_GT(max_abs_diff(unadapted, WatchedSft::last_logits), 1e-3);  // the adapters do matter

  // The checkpoint, and the run folder, as --model: the base the run named with the adapters
  // merged, the run's tokenizer and chat template.
  for (const fs::path& spec : {ck, dir / "run"}) {
    const io::ModelSource src = io::resolve_model(spec.string());
    ASSERT_NE(src.base, nullptr) << spec;
    EXPECT_EQ(src.chat_template.value_or(""), "chatml");
    EXPECT_TRUE(src.tokenizer.has_value());
    EXPECT_TRUE(bitwise_equal(io::load_model(src).logits(probe_batch()), merged)) << spec;
  }
  // Its adapter_config.json is checked against the manifest too: another alpha is another model.
  auto peft = nlohmann::json::parse(read_file(ck / "adapter_config.json"));
  peft["lora_alpha"] = peft["lora_alpha"].get<double>() * 10;
  write_file_atomic(ck / "adapter_config.json", peft.dump());
  const std::string e = pollen::testing::error_of([&] { io::resolve_model(ck.string()); });
  EXPECT_NE(e.find("does not verify: adapter_config.json"), std::string::npos) << e;
}

TEST(PostLora, FrozenAKeepsItsSeededValuesAndResumesBitwise) {
  const fs::path dir = test_support::post_temp_dir("lora-resume");
  const std::string frozen = "train_a = false\ndropout = 0.1\n";
  const auto whole = run(lora_toml(dir / "whole", 6, frozen), false);
  ASSERT_EQ(whole.status, train::RunStatus::finished) << whole.message;
  const std::string text = lora_toml(dir / "split", 6, frozen);
  const auto first = run(text, false, 3);
  ASSERT_EQ(first.status, train::RunStatus::preempted) << first.message;
  // Resumed without its adapters, the run is refused naming the keys, not a missing file.
  const std::string without = pollen::testing::error_of([&] {
    test_support::run_post(
        train::parse_post_config(text, "lora.toml", "sft",
                                 {"optimizer.lr=0.02", "lora.enabled=false"}),
        [](const train::ObjectiveContext& ctx) { return std::make_unique<WatchedSft>(ctx); }, true);
  });
  EXPECT_NE(without.find("lora.rank (4 -> none)"), std::string::npos) << without;
  const auto second = run(text, true);
  ASSERT_EQ(second.status, train::RunStatus::finished) << second.message;
  EXPECT_EQ(second.last_loss, whole.last_loss);
  EXPECT_EQ(second.last_val_loss, whole.last_val_loss);
  for (const char* file : {"adapter_model.safetensors", "optimizer.safetensors"}) {
    const auto x = io::read_safetensors(whole.last_checkpoint / file);
    const auto y = io::read_safetensors(second.last_checkpoint / file);
    ASSERT_EQ(x.tensors.size(), y.tensors.size()) << file;
    for (size_t i = 0; i < x.tensors.size(); ++i) {
      EXPECT_EQ(x.tensors[i].first, y.tensors[i].first);
      EXPECT_TRUE(bitwise_equal(x.tensors[i].second, y.tensors[i].second))
          << file << " " << x.tensors[i].first;
    }
  }
  // A is still the one drawn from lora.seed, and only B has optimizer state.
  const model::LoraConfig config =
      io::read_peft_config(whole.last_checkpoint / "adapter_config.json");
  model::LoraConfig seeded = config;
  seeded.seed = 5;
  const model::Lora fresh(load_base().config(), seeded);
  const auto saved = io::read_safetensors(whole.last_checkpoint / "adapter_model.safetensors");
  int checked = 0;
  for (const auto& [n, v] : fresh.named_tensors()) {
    if (!n.ends_with("lora_A.weight")) continue;
    const Tensor* t = saved.find(n);
    ASSERT_NE(t, nullptr) << n;
    EXPECT_TRUE(bitwise_equal(*t, v.value())) << n;
    ++checked;
  }
  EXPECT_EQ(checked, 14);
  for (const auto& [n, t] :
       io::read_safetensors(whole.last_checkpoint / "optimizer.safetensors").tensors)
    EXPECT_NE(n.find("lora_B"), std::string::npos) << n;
}

// A base named by its run folder is pinned to the checkpoint the run started from: resumed after
// that run trained on (a newer checkpoint), the run goes on from the same base, as one that named
// that checkpoint does.
TEST(PostLora, ARunFolderBaseIsPinnedToTheCheckpointItStartedFrom) {
  const fs::path dir = test_support::post_temp_dir("lora-pinned");
  const auto& fx = fixture();
  const std::string base_text = test_support::tiny_post_toml(
      dir / "base", fx.model_file, fx.tokenizer_path, 4,
      "[sft]\ndata = \"" + sft_data().string() + "\"\nseq = 64\nmicro_batch = 2\n");
  const auto base_run = test_support::run_post(
      train::parse_post_config(base_text, "base.toml", "sft"), train::make_sft_objective, false);
  ASSERT_EQ(base_run.status, train::RunStatus::finished) << base_run.message;
  const fs::path started = dir / "base" / "checkpoints" / io::checkpoint_name(2);
  const fs::path later = dir / "base" / "checkpoints" / io::checkpoint_name(4);
  const auto with_base = [&](const fs::path& run, const fs::path& base) {
    std::string text = lora_toml(run, 4);
    const std::string named = "base = \"" + fx.model_file.string() + "\"";
    text.replace(text.find(named), named.size(), "base = \"" + base.string() + "\"");
    return text;
  };
  fs::rename(later, dir / "aside");  // the base run's newest is step 2 when this run starts
  const std::string text = with_base(dir / "split", dir / "base");
  ASSERT_EQ(run(text, false, 2).status, train::RunStatus::preempted);
  fs::rename(dir / "aside", later);  // ... and step 4 when it resumes
  const auto resumed = run(text, true);
  ASSERT_EQ(resumed.status, train::RunStatus::finished) << resumed.message;
  const auto whole = run(with_base(dir / "whole", started), false);
  ASSERT_EQ(whole.status, train::RunStatus::finished) << whole.message;
  const auto x = io::read_safetensors(whole.last_checkpoint / "adapter_model.safetensors");
  const auto y = io::read_safetensors(resumed.last_checkpoint / "adapter_model.safetensors");
  ASSERT_EQ(x.tensors.size(), y.tensors.size());
  for (size_t i = 0; i < x.tensors.size(); ++i)
    EXPECT_TRUE(bitwise_equal(x.tensors[i].second, y.tensors[i].second)) << x.tensors[i].first;
  // A LoRA run needs its base to resume, and names the pinned checkpoint when it is gone.
  fs::rename(started, dir / "started-aside");
  const std::string gone = error_of([&] { run(text, true); });
  EXPECT_NE(gone.find("the run's adapters were trained on '" + started.string() +
                      "', the checkpoint of model.base '" + (dir / "base").string()),
            std::string::npos)
      << gone;
  EXPECT_NE(gone.find("checkpoint.keep"), std::string::npos) << gone;
  // Another checkpoint copied there is not that step's.
  fs::copy(later, started, fs::copy_options::recursive);
  const std::string misnamed = error_of([&] { run(text, true); });
  EXPECT_NE(misnamed.find("is named 'step-00000002' but manifest.json says step 4"),
            std::string::npos)
      << misnamed;
  // One of other weights at the base's path (that copy, its manifest saying step 2): the adapters
  // were trained on other weights, and the resume is refused saying so.
  auto manifest = nlohmann::json::parse(read_file(started / "manifest.json"));
  manifest["step"] = 2;
  write_file_atomic(started / "manifest.json", manifest.dump());
  const std::string changed = error_of([&] { run(text, true); });
  EXPECT_NE(changed.find("cannot resume: the base '" + started.string() + "' holds other weights"),
            std::string::npos)
      << changed;
  fs::remove_all(started);
  fs::rename(dir / "started-aside", started);
  // The checkpoints name the pinned checkpoint as their base.
  const train::PostConfig saved =
      train::load_post_config(resumed.last_checkpoint / "config.toml", "sft");
  EXPECT_EQ(fs::path(saved.base), started);
  // ... and so does the adapters' PEFT config (PEFT loads the adapters onto that base).
  for (const fs::path& ckpt :
       {resumed.last_checkpoint, dir / "split" / "checkpoints" / io::checkpoint_name(2)}) {
    const auto peft = nlohmann::json::parse(read_file(ckpt / "adapter_config.json"));
    EXPECT_EQ(fs::path(peft.value("base_model_name_or_path", "")), started) << ckpt;
  }
}

TEST(PostLora, RunFileKeysAreCheckedAndResolved) {
  const fs::path dir = test_support::post_temp_dir("lora-keys");
  const auto cfg = train::parse_post_config(lora_toml(dir / "run", 2), "lora.toml", "sft");
  EXPECT_TRUE(cfg.lora.enabled);
  EXPECT_EQ(cfg.lora.config.rank, 4);
  EXPECT_EQ(cfg.lora.config.seed, 5u);
  EXPECT_EQ(cfg.lora.config.targets.size(), 7u);
  const std::string toml = cfg.to_toml(load_base().config());
  EXPECT_NE(toml.find("target_modules"), std::string::npos) << toml;
  // The objective's section is identified (a federated silo's data version) as earlier pollen
  // printed it, strings as literals, so that states saved before still match.
  EXPECT_NE(cfg.objective_identity.find("data = '" + sft_data().string() + "'"), std::string::npos)
      << cfg.objective_identity;
  EXPECT_NE(toml.find("down_proj"), std::string::npos) << toml;
  EXPECT_FALSE(train::parse_post_config(lora_toml(dir / "run", 2), "lora.toml", "sft",
                                        {"lora.enabled=false"})
                   .lora.enabled);
  // The seed defaults to the run's (3).
  std::string unseeded = lora_toml(dir / "run", 2);
  unseeded.erase(unseeded.find("seed = 5\n"), 9);
  EXPECT_EQ(train::parse_post_config(unseeded, "lora.toml", "sft").lora.config.seed, 3u);
  EXPECT_NE(error_of([&] {
              train::parse_post_config(lora_toml(dir / "run", 2), "lora.toml", "sft",
                                       {"lora.rank=0"});
            }).find("lora.rank"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              train::parse_post_config(lora_toml(dir / "run", 2), "lora.toml", "sft",
                                       {"lora.target_modules=[\"qproj\"]"});
            }).find("lora.target_modules"),
            std::string::npos);
}

}  // namespace

// A LoRA fine-tune with its own chat template on an HF base whose configs name another end of
// text: the export carries the run's template and end of turn, not the base's configs.
TEST(PostLora, AnExportOfARunOnAnHfBaseCarriesTheRunsTemplateAndEndOfTurn) {
  const fs::path dir = test_support::post_temp_dir("lora-hf-base");
  const auto& fx = fixture();
  const tokenizer::Tokenizer tok = tokenizer::open_tokenizer(fx.tokenizer_path, "");
  const auto id_of = [&](const std::string& content) {
    for (const auto& t : tok.added_tokens())
      if (t.content == content) return t.id;
    ADD_FAILURE() << content;
    return uint32_t{0};
  };
  io::HfExportOptions o;
  o.tokenizer_json = read_file(fx.tokenizer_path);
  o.eos_token_id = id_of("<|endoftext|>");
  o.tokenizer_config = {{"eos_token", "<|endoftext|>"}};  // no chat template
  io::export_hf(load_base(), dir / "hf", o);
  std::string text = lora_toml(dir / "run", 2);
  const std::string base = "base = \"" + fx.model_file.string() + "\"";
  ASSERT_NE(text.find(base), std::string::npos);
  text.replace(text.find(base), base.size(), "base = \"" + (dir / "hf").string() + "\"");
  ASSERT_EQ(run(text, false).status, train::RunStatus::finished);

  const auto exports = [&] {  // `pollen export hf` of the run into dir/export
    return std::system(cat(POLLEN_BINARY, " export hf --model ", (dir / "run").string(),
                           " --output ", (dir / "export").string(), " > ",
                           (dir / "export.log").string(), " 2>&1")
                           .c_str()) == 0;
  };
  ASSERT_TRUE(exports()) << read_file(dir / "export.log");
  const auto config = nlohmann::json::parse(read_file(dir / "export" / "tokenizer_config.json"));
  EXPECT_EQ(config.value("chat_template", ""),
            tokenizer::chat_template_jinja(tokenizer::ChatTemplate::chatml));
  EXPECT_EQ(config.value("eos_token", ""), "<|im_end|>");
  const auto generation =
      nlohmann::json::parse(read_file(dir / "export" / "generation_config.json"));
  ASSERT_TRUE(generation["eos_token_id"].is_array()) << generation.dump();
  EXPECT_EQ(generation["eos_token_id"][0], id_of("<|im_end|>"));

  // A base that carries the run's template keeps its own configs (their other keys too).
  o.tokenizer_config = {
      {"chat_template", tokenizer::chat_template_jinja(tokenizer::ChatTemplate::chatml)},
      {"eos_token", "<|im_end|>"},
      {"model_max_length", 64}};
  io::export_hf(load_base(), dir / "hf", o);
  fs::remove_all(dir / "run");
  ASSERT_EQ(run(text, false).status, train::RunStatus::finished);
  ASSERT_TRUE(exports()) << read_file(dir / "export.log");
  EXPECT_EQ(nlohmann::json::parse(read_file(dir / "export" / "tokenizer_config.json")),
            nlohmann::json::parse(read_file(dir / "hf" / "tokenizer_config.json")));
  fs::remove_all(dir);
}
