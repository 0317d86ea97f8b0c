// The post-training loop: bitwise resume after a preemption, checkpoints that are models
// (io::resolve_model opens them with their tokenizer and chat template), the resolved config,
// the run file's unknown keys refused (LoRA runs: post_lora_test.cpp).
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include "base/files.h"
#include "base/thread_pool.h"
#include "io/checkpoint.h"
#include "io/model_source.h"
#include "io/safetensors.h"
#include "train/post_config.h"
#include "train/post_fixtures.h"
#include "train/post_run.h"
#include "train/sft.h"

namespace fs = std::filesystem;
using namespace pollen;

namespace {

using test_support::error_of;

const test_support::PostFiles& fixture() {
  static const test_support::PostFiles f = test_support::make_post_files("loop");
  return f;
}

const fs::path& sft_data() {
  static const fs::path data =
      test_support::write_sft_data(fixture().dir / "train.jsonl", "arithmetic", 60, 1);
  return data;
}

std::string run_toml(const fs::path& run, int steps, const std::string& extra = "") {
  const auto& fx = fixture();
  return test_support::tiny_post_toml(
      run, fx.model_file, fx.tokenizer_path, steps,
      "[eval]\ninterval = 3\n\n[sft]\ndata = \"" + sft_data().string() +
          "\"\nseq = 64\nmicro_batch = 2\naccumulation = 2\n" + extra);
}

train::PostResult run(const std::string& text, bool resume, int64_t stop_after = -1) {
  return test_support::run_post(train::parse_post_config(text, "post.toml", "sft"),
                                train::make_sft_objective, resume, stop_after);
}

TEST(PostRun, ResumeAfterPreemptionEqualsAnUninterruptedRunBitwise) {
  const fs::path dir = test_support::post_temp_dir("resume");
  const auto whole = run(run_toml(dir / "whole", 7), false);
  ASSERT_EQ(whole.status, train::RunStatus::finished) << whole.message;

  const std::string text = run_toml(dir / "split", 7);
  const auto first = run(text, false, 3);
  ASSERT_EQ(first.status, train::RunStatus::preempted) << first.message;
  EXPECT_EQ(first.step, 3);
  EXPECT_NE(error_of([&] { run(text, false); }).find("--resume"), std::string::npos);
  const auto second = run(text, true);
  ASSERT_EQ(second.status, train::RunStatus::finished) << second.message;
  EXPECT_EQ(second.step, 7);
  EXPECT_EQ(second.last_loss, whole.last_loss);
  EXPECT_EQ(second.last_val_loss, whole.last_val_loss);

  // Every step's loss and metrics, bitwise (the JSON text of the doubles).
  const auto a = test_support::read_metrics(dir / "whole"),
             b = test_support::read_metrics(dir / "split");
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    for (const char* k :
         {"step", "loss", "grad_norm", "lr", "sft/scored", "sft/examples", "val_loss", "tokens"}) {
      if (a[i].contains(k)) EXPECT_EQ(a[i][k].dump(), b[i][k].dump()) << i << " " << k;
    }
  }
  // The weights and optimizer state, bitwise.
  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    const auto x = io::read_safetensors(whole.last_checkpoint / file);
    const auto y = io::read_safetensors(second.last_checkpoint / file);
    ASSERT_EQ(x.tensors.size(), y.tensors.size());
    for (size_t i = 0; i < x.tensors.size(); ++i) {
      ASSERT_EQ(x.tensors[i].first, y.tensors[i].first);
      ASSERT_EQ(x.tensors[i].second.nbytes(), y.tensors[i].second.nbytes());
      EXPECT_EQ(std::memcmp(x.tensors[i].second.raw(), y.tensors[i].second.raw(),
                            x.tensors[i].second.nbytes()),
                0)
          << file << " " << x.tensors[i].first;
    }
  }
  // A resumed run refuses a changed objective section (its data position would mean nothing).
  EXPECT_NE(
      error_of([&] { run(run_toml(dir / "split", 9, "pack = false\n"), true); }).find("sft.pack"),
      std::string::npos);
  // Fewer steps than the checkpoint took leave nothing to train: refused, not "finished".
  const std::string fewer = error_of([&] { run(run_toml(dir / "split", 5), true); });
  EXPECT_NE(fewer.find("train.steps (5) is below the step of checkpoint"), std::string::npos)
      << fewer;
  // A resume with nothing left to do leaves TensorBoard's folder as it was.
  const auto event_files = [&] {
    return std::distance(fs::directory_iterator(dir / "split" / "tensorboard"),
                         fs::directory_iterator());
  };
  const auto files = event_files();
  EXPECT_EQ(run(text, true).status, train::RunStatus::finished);
  EXPECT_EQ(event_files(), files) << "an empty event file was left behind";
  // The folder holds an sft run: another command's resume names both rather than an unknown key.
  const auto& fx = fixture();
  const std::string dpo = test_support::tiny_post_toml(dir / "split", fx.model_file,
                                                       fx.tokenizer_path, 9, "[dpo]\nbeta = 0.1\n");
  const std::string other = error_of([&] {
    test_support::run_post(train::parse_post_config(dpo, "dpo.toml", "dpo"),
                           train::make_sft_objective, true);
  });
  EXPECT_NE(other.find("holds a run of pollen sft"), std::string::npos) << other;
  EXPECT_NE(other.find("not of pollen dpo: choose another run.dir"), std::string::npos) << other;
}

// run.threads = 0 ("all") is recorded as the count that ran, as pollen train records it.
TEST(PostRun, CheckpointsRecordTheThreadCountThatRan) {
  const fs::path dir = test_support::post_temp_dir("threads_all");
  std::string text = run_toml(dir / "run", 2);
  const std::string threads = "threads = 2";
  ASSERT_NE(text.find(threads), std::string::npos);
  text.replace(text.find(threads), threads.size(), "threads = 0");
  ASSERT_EQ(run(text, false).status, train::RunStatus::finished);
  const std::string saved =
      read_file(io::list_checkpoints(dir / "run" / "checkpoints").back() / "config.toml");
  EXPECT_NE(saved.find(cat("threads = ", available_cpus(), "\n")), std::string::npos) << saved;
  fs::remove_all(dir);
}

// A full fine-tune resumes from its checkpoint alone: the base checkpoint it was pinned to may be
// gone since (retention of the base run), and the run goes on as if it were there.
TEST(PostRun, AFullFineTuneResumesWhenItsPinnedBaseIsGone) {
  const fs::path dir = test_support::post_temp_dir("resume_base_gone");
  const auto& fx = fixture();
  const auto base_run = run(run_toml(dir / "base", 2), false);
  ASSERT_EQ(base_run.status, train::RunStatus::finished) << base_run.message;
  const auto with_base = [&](const fs::path& run, const fs::path& base) {
    std::string text = run_toml(run, 5);
    const std::string named = "base = \"" + fx.model_file.string() + "\"";
    text.replace(text.find(named), named.size(), "base = \"" + base.string() + "\"");
    return text;
  };
  const auto whole = run(with_base(dir / "whole", base_run.last_checkpoint), false);
  ASSERT_EQ(whole.status, train::RunStatus::finished) << whole.message;
  const std::string text = with_base(dir / "split", dir / "base");
  ASSERT_EQ(run(text, false, 2).status, train::RunStatus::preempted);
  fs::rename(dir / "base", dir / "base-removed");
  const auto resumed = run(text, true);
  ASSERT_EQ(resumed.status, train::RunStatus::finished) << resumed.message;
  EXPECT_EQ(resumed.last_loss, whole.last_loss);
  const auto x = io::read_safetensors(whole.last_checkpoint / "model.safetensors");
  const auto y = io::read_safetensors(resumed.last_checkpoint / "model.safetensors");
  ASSERT_EQ(x.tensors.size(), y.tensors.size());
  for (size_t i = 0; i < x.tensors.size(); ++i)
    EXPECT_EQ(std::memcmp(x.tensors[i].second.raw(), y.tensors[i].second.raw(),
                          x.tensors[i].second.nbytes()),
              0)
        << x.tensors[i].first;
  // The checkpoints still name the base the run began from.
  EXPECT_EQ(fs::path(train::load_post_config(resumed.last_checkpoint / "config.toml", "sft").base),
            base_run.last_checkpoint);
  // A base named directly (not pinned) may be gone too.
  fs::copy_file(fx.model_file, dir / "model.toml");
  const std::string direct = with_base(dir / "direct", dir / "model.toml");
  ASSERT_EQ(run(direct, false, 2).status, train::RunStatus::preempted);
  fs::remove(dir / "model.toml");
  const auto finished = run(direct, true);
  EXPECT_EQ(finished.status, train::RunStatus::finished) << finished.message;
}

// A diverging run stops naming its last good checkpoint and the key that starts a new run from it
// (post-training has no model.init_from: model.base).
TEST(PostRun, TooManyNonFiniteStepsNameTheKeyToStartAgainFrom) {
  const fs::path dir = test_support::post_temp_dir("diverging");
  const auto r = test_support::run_post(
      train::parse_post_config(
          run_toml(dir / "run", 20), "post.toml", "sft",
          {"optimizer.lr=30000", "schedule.kind=constant", "schedule.warmup_steps=0",
           "train.grad_clip=0", "train.max_bad_steps=3", "checkpoint.interval=1"}),
      train::make_sft_objective, false);
  ASSERT_EQ(r.status, train::RunStatus::failed) << r.message;
  EXPECT_NE(r.message.find("3 non-finite steps in a row"), std::string::npos) << r.message;
  ASSERT_GE(r.step - 4, 1) << r.message;  // the last finite step's own checkpoint is not good
  EXPECT_NE(r.message.find(io::checkpoint_name(r.step - 4) + "'; to go on from it"),
            std::string::npos)
      << r.message;
  EXPECT_NE(r.message.find("model.base set to it"), std::string::npos) << r.message;
}

// A base or tokenizer that cannot be opened names its key and the run file.
TEST(PostRun, AMissingBaseOrTokenizerNamesItsKey) {
  const fs::path dir = test_support::post_temp_dir("bad_base");
  const std::string text = run_toml(dir / "run", 2);
  const auto with = [&](const std::string& set) {
    return error_of([&] {
      test_support::run_post(train::parse_post_config(text, "post.toml", "sft", {set}),
                             train::make_sft_objective, false);
    });
  };
  const std::string base = with("model.base=nope");
  EXPECT_NE(base.find("model.base set': model.base: unknown model preset 'nope'"),
            std::string::npos)
      << base;
  // A relative path is the run file's folder's, also when nothing is there (a resumed full
  // fine-tune goes on from its checkpoint when its base has moved away), whatever the current
  // folder; a name that could be a preset stays as it is.
  const fs::path runs = dir / "runs";
  EXPECT_EQ(train::parse_post_config(text, "post.toml", "sft", {"model.base=../gone"}, runs).base,
            (dir / "gone").string());
  EXPECT_EQ(
      train::parse_post_config(text, "post.toml", "sft", {"model.base=llama-tiny"}, runs).base,
      "llama-tiny");
  const std::string tok = with("model.tokenizer=" + (dir / "nope.json").string());
  EXPECT_NE(tok.find("model.tokenizer set': model.tokenizer: cannot open"), std::string::npos)
      << tok;
  // An SFT run file given to pollen dpo: named as such, not as an unknown [sft].
  const std::string other = error_of([&] { train::parse_post_config(text, "post.toml", "dpo"); });
  EXPECT_NE(other.find("has [sft] and no [dpo]: it is a run file of pollen sft, not of pollen dpo"),
            std::string::npos)
      << other;
}

// The data position of a checkpoint counts examples of the run's data: resuming on changed data
// (which would silently train on other examples) is refused, naming the file's key.
TEST(PostRun, ResumeOnChangedDataIsRefused) {
  const fs::path dir = test_support::post_temp_dir("resume_data");
  const fs::path data = test_support::write_sft_data(dir / "data.jsonl", "arithmetic", 60, 1);
  const std::string text = test_support::tiny_post_toml(
      dir / "run", fixture().model_file, fixture().tokenizer_path, 6,
      "[sft]\ndata = \"" + data.string() + "\"\nvalidation_fraction = 0.1\nseq = 64\n");
  ASSERT_EQ(run(text, false, 2).status, train::RunStatus::preempted);
  test_support::write_sft_data(data, "arithmetic", 60, 2);  // same size, other examples
  const std::string e = error_of([&] { run(text, true); });
  EXPECT_NE(e.find("cannot resume"), std::string::npos) << e;
  EXPECT_NE(e.find("sft.data '" + data.string() + "'"), std::string::npos) << e;
  test_support::write_sft_data(data, "arithmetic", 60, 1);  // the run's own data again
  EXPECT_EQ(run(text, true).status, train::RunStatus::finished);
}

TEST(PostRun, CheckpointIsAModelWithItsTokenizerAndChatTemplate) {
  const fs::path dir = test_support::post_temp_dir("ckpt");
  const auto r = run(run_toml(dir / "run", 2), false);
  ASSERT_EQ(r.status, train::RunStatus::finished) << r.message;
  EXPECT_FALSE(io::verify_checkpoint(r.last_checkpoint).has_value());
  for (const auto& spec : {r.last_checkpoint, dir / "run"}) {
    const io::ModelSource src = io::resolve_model(spec.string());
    EXPECT_EQ(src.kind, io::ModelSource::Kind::checkpoint);
    ASSERT_TRUE(src.tokenizer.has_value());
    EXPECT_EQ(src.tokenizer->filename(), "tokenizer.json");
    EXPECT_EQ(src.chat_template.value_or(""), "chatml");
    const model::Llama m = io::load_model(src);
    const auto saved = io::read_safetensors(r.last_checkpoint / "model.safetensors");
    const auto params = m.named_parameters();
    ASSERT_EQ(params.size(), saved.tensors.size());
    for (const auto& [name, p] : params) {
      const Tensor* t = saved.find(name);
      ASSERT_NE(t, nullptr) << name;
      EXPECT_EQ(std::memcmp(t->raw(), p.value().raw(), t->nbytes()), 0) << name;
    }
  }
  // The resolved config reads back as the same run.
  const std::string text = read_file(r.last_checkpoint / "config.toml");
  const auto saved = train::parse_post_config(text, "config.toml", "sft");
  const auto now = train::parse_post_config(run_toml(dir / "run", 2), "post.toml", "sft");
  ASSERT_TRUE(saved.architecture.has_value());
  EXPECT_EQ(saved.flat(*saved.architecture), now.flat(*saved.architecture));
  const auto st = nlohmann::json::parse(read_file(r.last_checkpoint / "state.json"));
  EXPECT_TRUE(st.at("objective").contains("next"));
}

// A tokenizer trained without the template's special tokens would encode its markup as bytes:
// the run is refused before it trains, naming the keys that choose the two.
TEST(PostRun, ATokenizerWithoutTheChatTemplatesSpecialTokensIsRefused) {
  const fs::path dir = test_support::post_temp_dir("no_specials");
  const std::string pattern = tokenizer::pattern_regex("cl100k_base");
  tokenizer::PieceCounts counts(pattern);
  const std::vector<std::string_view> text{"user\nassistant\n1 + 2 = 3"};
  counts.add_documents(text);
  const fs::path plain = dir / "plain.json";
  tokenizer::save_tokenizer(tokenizer::train_bpe(counts, {300, {"<|endoftext|>"}, pattern}), plain);
  const std::string toml =
      test_support::tiny_post_toml(dir / "run", fixture().model_file, plain, 2,
                                   "[sft]\ndata = \"" + sft_data().string() + "\"\nseq = 64\n");
  const std::string e = error_of([&] { run(toml, false); });
  for (const char* part :
       {"model.tokenizer", "model.chat_template", "<|im_start|>", "<|im_end|>", "plain.json"})
    EXPECT_NE(e.find(part), std::string::npos) << part << " in: " << e;
  EXPECT_FALSE(fs::exists(dir / "run" / "checkpoints"));
}

TEST(PostRun, UnknownKeysAndSectionsAreRefused) {
  const fs::path dir = test_support::post_temp_dir("keys");
  auto refused = [&](const std::string& extra, const std::string& key) {
    const std::string e = error_of(
        [&] { train::parse_post_config(run_toml(dir / "run", 2) + extra, "k.toml", "sft"); });
    EXPECT_NE(e.find(key), std::string::npos) << e;
    EXPECT_NE(e.find("k.toml"), std::string::npos) << e;
  };
  refused("\n[dpo]\nbeta = 0.1\n", "dpo");
  refused("\n[samples]\nprompts = []\n", "samples");
  EXPECT_NE(error_of([&] {
              train::parse_post_config(run_toml(dir / "run", 2), "k.toml", "sft",
                                       {"train.stpes=3"});
            }).find("train.stpes"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              train::parse_post_config(run_toml(dir / "run", 2), "k.toml", "sft",
                                       {"model.chat_template=\"jinja\""});
            }).find("model.chat_template"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              train::parse_post_config(run_toml(dir / "run", 2), "k.toml", "sft", {"lora.rnak=4"});
            }).find("lora.rnak"),
            std::string::npos);
  // [parallel]: ZeRO-1 and the gradient reduction's keys.
  refused("\n[parallel]\nzero = 2\n", "parallel.zero");
  refused("\n[parallel]\ntimeout_s = 0\n", "parallel.timeout_s");
  const train::PostConfig parallel = train::parse_post_config(
      run_toml(dir / "run", 2) + "\n[parallel]\nzero = 1\nbucket_mb = 4\ntimeout_s = 30\n",
      "k.toml", "sft");
  EXPECT_EQ(parallel.zero, 1);
  EXPECT_DOUBLE_EQ(parallel.bucket_mb, 4);
  EXPECT_DOUBLE_EQ(parallel.timeout_s, 30);
}

}  // namespace
