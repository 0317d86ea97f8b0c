// Resolving a pollen checkpoint or run folder as a model: every checkpoint passed over is named
// in a warning, and a training checkpoint without its manifest is refused.
#include <gtest/gtest.h>

#include <filesystem>

#include "base/files.h"
#include "io/checkpoint.h"
#include "io/hf.h"
#include "io/model_source.h"
#include "model/llama.h"
#include "support/errors.h"

namespace fs = std::filesystem;
using namespace pollen;

namespace {

fs::path temp_dir(const std::string& name) {
  fs::path d =
      fs::temp_directory_path() / ("pollen_model_source_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

const char* kConfigToml =
    "[model]\nvocab_size = 61\nhidden_size = 32\nintermediate_size = 48\n"
    "num_hidden_layers = 2\nnum_attention_heads = 4\nnum_key_value_heads = 2\n"
    "max_position_embeddings = 64\n";

// A training checkpoint of a small model at `step`, as the trainer writes it.
fs::path write_checkpoint(const fs::path& root, int64_t step) {
  const model::Llama m(io::parse_hf_config({{"model_type", "llama"},
                                            {"vocab_size", 61},
                                            {"hidden_size", 32},
                                            {"intermediate_size", 48},
                                            {"num_hidden_layers", 2},
                                            {"num_attention_heads", 4},
                                            {"num_key_value_heads", 2},
                                            {"max_position_embeddings", 64}},
                                           "config"),
                       7);
  io::NamedTensors weights;
  for (const auto& [n, v] : m.named_parameters()) weights.emplace_back(n, v.value());
  io::CheckpointWriter w(root, step);
  w.add_tensors("model.safetensors", weights);
  w.add_tensors("optimizer.safetensors", weights);
  w.add_text("state.json", "{}\n");
  w.add_text("config.toml", kConfigToml);
  return w.commit();
}

void flip_a_byte(const fs::path& file) {
  std::string bytes = read_file(file);
  bytes[bytes.size() - 3] ^= 0x10;
  write_file_atomic(file, bytes);
}

TEST(ModelSource, ARunFolderWarnsOfEachCheckpointItPassesOver) {
  const fs::path run = temp_dir("skipped");
  const fs::path oldest = write_checkpoint(run / "checkpoints", 1);
  const fs::path middle = write_checkpoint(run / "checkpoints", 2);
  const fs::path newest = write_checkpoint(run / "checkpoints", 3);
  flip_a_byte(middle / "model.safetensors");
  fs::remove(newest / "config.toml");
  ::testing::internal::CaptureStderr();
  const io::ModelSource source = io::resolve_model(run.string());
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(source.path, oldest);
  EXPECT_NE(log.find("model '" + run.string() + "': skipping checkpoint '" + newest.string() +
                     "': config.toml is missing"),
            std::string::npos)
      << log;
  EXPECT_NE(
      log.find("skipping checkpoint '" + middle.string() + "': model.safetensors has SHA-256"),
      std::string::npos)
      << log;
  fs::remove_all(run);
}

// A run's retention may remove the checkpoint chosen before it is read: the error says so.
TEST(ModelSource, ACheckpointRemovedAfterItWasChosenIsNamedAsSuch) {
  const fs::path run = temp_dir("retention");
  write_checkpoint(run / "checkpoints", 1);
  const io::ModelSource source = io::resolve_model(run.string());
  fs::remove_all(source.path);  // as checkpoint.keep does while the run goes on
  const std::string e = pollen::testing::error_of([&] { io::load_model(source, DType::f32, 0); });
  EXPECT_NE(e.find("model '" + run.string() + "': checkpoint '" + source.path.string() +
                   "' was removed after it was chosen"),
            std::string::npos)
      << e;
  fs::remove_all(run);
}

// Every checkpoint is written with a manifest.json; a training checkpoint (state.json,
// optimizer.safetensors) without one cannot be checked, so it is refused rather than loaded.
TEST(ModelSource, ATrainingCheckpointWithoutItsManifestIsRefused) {
  const fs::path root = temp_dir("no_manifest");
  const fs::path ckpt = write_checkpoint(root / "checkpoints", 4);
  EXPECT_EQ(io::resolve_model(ckpt.string()).path, ckpt);
  fs::remove(ckpt / "manifest.json");
  const std::string e = pollen::testing::error_of([&] { io::resolve_model(ckpt.string()); });
  EXPECT_NE(e.find("'" + ckpt.string() + "' is a pollen training checkpoint"), std::string::npos)
      << e;
  EXPECT_NE(e.find("without manifest.json"), std::string::npos) << e;
  fs::remove(ckpt / "state.json");
  EXPECT_NE(pollen::testing::error_of([&] {
              io::resolve_model(ckpt.string());
            }).find("without manifest.json"),
            std::string::npos);
  // Weights and config.toml alone (no training state) are a model folder made by hand.
  fs::remove(ckpt / "optimizer.safetensors");
  EXPECT_EQ(io::resolve_model(ckpt.string()).path, ckpt);
  fs::remove_all(root);
}

// A federated post-training server's folder holds the global adapters' B matrices in its
// checkpoints, no model: refused saying what to pass (the server's adapter/ folder with the base)
// rather than as a folder of no known kind, whether the server folder or a checkpoint is named.
TEST(ModelSource, AFederatedAdapterCheckpointSaysToPassTheBaseAndItsAdapters) {
  const fs::path server = temp_dir("fed_post");
  io::CheckpointWriter w(server / "checkpoints", 6);
  w.add_tensors("model.safetensors", {});
  w.add_text("state.json", "{\"round\": 6, \"post_objective\": \"sft\"}\n");
  const fs::path ckpt = w.commit();
  for (const std::string& named : {server.string(), ckpt.string(), ckpt.string() + "/"}) {
    const std::string e = pollen::testing::error_of([&] { io::resolve_model(named); });
    EXPECT_NE(e.find("model '" + named + "': '"), std::string::npos) << e;
    EXPECT_NE(e.find("' is a checkpoint of a federated post-training server"), std::string::npos)
        << e;
    EXPECT_NE(e.find("--adapter '" + (server / "adapter").string() + "'"), std::string::npos) << e;
  }
  fs::remove_all(server);
}

}  // namespace
