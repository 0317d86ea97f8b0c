// Perplexity: every scored token counted once, whatever the packing, equal to scoring each
// document alone; weights load from a checkpoint by name.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>

#include "autograd/tape.h"
#include "base/error.h"
#include "base/files.h"
#include "data/shards.h"
#include "eval/perplexity.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "train/tiny_run.h"

namespace pollen::eval {
namespace {

namespace fs = std::filesystem;

model::LlamaConfig tiny_config() {
  model::LlamaConfig c = model::preset("llama-tiny");
  c.vocab_size = 64;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 0;
  c.max_position_embeddings = 64;
  return c;
}

class Perplexity : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("pollen_eval_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    manifest_ = test_support::make_tiny_dataset(dir_ / "data", 20);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_, manifest_;
};

// Each validation document alone, as one row: the reference sum and count.
std::pair<double, int64_t> score_documents_alone(const model::Llama& m, const fs::path& manifest) {
  ag::NoGrad no_grad;
  const data::Manifest man = data::Manifest::load(manifest);
  double sum = 0;
  int64_t scored = 0;
  for (const auto& info : man.split("validation")) {
    data::ShardReader shard(man.dir(), info, man.token_dtype);
    const auto& starts = shard.doc_starts();
    for (size_t d = 0; d + 1 < starts.size(); ++d) {
      const auto n = static_cast<int64_t>(starts[d + 1] - starts[d]);
      std::vector<int32_t> in, out;
      for (int64_t i = 0; i + 1 < n; ++i) {
        in.push_back(static_cast<int32_t>(shard.token(starts[d] + i)));
        out.push_back(static_cast<int32_t>(shard.token(starts[d] + i + 1)));
      }
      const model::Batch b = model::Batch::contiguous_rows(Tensor::from({1, n - 1}, in),
                                                           Tensor::from({1, n - 1}, out));
      int64_t k = 0;
      sum += m.loss(b, ag::Reduction::sum, &k).value().item();
      scored += k;
    }
  }
  return {sum, scored};
}

TEST_F(Perplexity, EqualsScoringEachDocumentAloneWhateverThePacking) {
  const model::Llama m(tiny_config(), 3);
  const auto [sum, scored] = score_documents_alone(m, manifest_);
  ASSERT_GT(scored, 0);
  const double expected = sum / static_cast<double>(scored);
  // Documents are 12-40 tokens: seq 48 holds each whole, packed 1 or 5 rows at a time, or all
  // in one batch (a batch of 2^40 rows takes only the rows the pieces fill).
  for (int64_t batch : {int64_t{1}, int64_t{5}, int64_t{1} << 40}) {
    const PerplexityResult r = perplexity(m, manifest_, {"validation", 48, batch});
    EXPECT_EQ(r.tokens, scored) << "batch " << batch;
    EXPECT_EQ(r.documents, 40);
    EXPECT_EQ(r.pieces, 40);
    EXPECT_NEAR(r.loss, expected, 1e-5 * expected) << "batch " << batch;
    EXPECT_NEAR(r.perplexity, std::exp(r.loss), 1e-9 * r.perplexity);
  }
  // Short rows cut long documents into pieces: still every target exactly once.
  const PerplexityResult cut = perplexity(m, manifest_, {"validation", 8, 3});
  EXPECT_EQ(cut.tokens, scored);
  EXPECT_GT(cut.pieces, 40);
  EXPECT_TRUE(std::isfinite(cut.loss));
}

TEST_F(Perplexity, LoadsWeightsByNameAndRefusesMismatches) {
  const model::Llama trained(tiny_config(), 11), fresh(tiny_config(), 12);
  io::NamedTensors named;
  for (const auto& [name, var] : trained.named_parameters()) named.emplace_back(name, var.value());
  fs::create_directories(dir_ / "ckpt");
  io::write_safetensors(dir_ / "ckpt" / "model.safetensors", named);
  load_weights(fresh, dir_ / "ckpt");
  const PerplexityOptions o{"validation", 64, 4};
  const auto a = perplexity(trained, manifest_, o), b = perplexity(fresh, manifest_, o);
  EXPECT_EQ(a.loss, b.loss);

  model::LlamaConfig wider = tiny_config();
  wider.hidden_size = 64;
  wider.intermediate_size = 128;
  const model::Llama other(wider, 1);
  try {
    load_weights(other, dir_ / "ckpt");
    FAIL() << "expected a shape error";
  } catch (const pollen::Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.safetensors"), std::string::npos) << e.what();
  }
  EXPECT_THROW(perplexity(trained, manifest_, {"nosuchsplit", 16, 2}), pollen::Error);
  // A bf16 export's weights are read as the model's floats, rounded as bf16 rounds them.
  io::NamedTensors halved;
  for (const auto& [name, var] : trained.named_parameters())
    halved.emplace_back(name, var.value().to(DType::bf16));
  io::write_safetensors(dir_ / "ckpt" / "model.safetensors", halved);
  load_weights(fresh, dir_ / "ckpt");
  const auto rounded = fresh.named_parameters();
  for (size_t i = 0; i < rounded.size(); ++i) {
    const Tensor expected = halved[i].second.to(DType::f32);
    ASSERT_EQ(std::memcmp(rounded[i].second.value().raw(), expected.raw(), expected.nbytes()), 0)
        << halved[i].first;
  }
}

TEST_F(Perplexity, RefusesACheckpointWhoseWeightsChangedAfterItWasWritten) {
  const model::Llama trained(tiny_config(), 11), fresh(tiny_config(), 12);
  io::NamedTensors named;
  for (const auto& [name, var] : trained.named_parameters()) named.emplace_back(name, var.value());
  io::CheckpointWriter writer(dir_ / "run", 7);
  writer.add_tensors("model.safetensors", named);
  const fs::path ckpt = writer.commit();
  load_weights(fresh, ckpt);
  load_weights(fresh, ckpt / "model.safetensors");

  // One weight changed in place, the size kept: only the checksum tells.
  const fs::path file = ckpt / "model.safetensors";
  std::string bytes = read_file(file);
  bytes[bytes.size() - 3] ^= 0x10;
  write_file_atomic(file, bytes);
  for (const fs::path& given : {ckpt, file}) {
    try {
      load_weights(fresh, given);
      FAIL() << "expected a checksum error for " << given;
    } catch (const pollen::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("does not verify"), std::string::npos) << what;
      EXPECT_NE(what.find("SHA-256"), std::string::npos) << what;
    }
  }
}

}  // namespace
}  // namespace pollen::eval
