#include "eval/perplexity.h"

#include <chrono>
#include <cmath>
#include <cstring>

#include "autograd/tape.h"
#include "base/error.h"
#include "data/shards.h"
#include "io/checkpoint.h"
#include "io/model_source.h"
#include "io/safetensors.h"

namespace pollen::eval {

namespace fs = std::filesystem;

namespace {

// Rows of packed pieces, run through the model when `batch` rows are full.
class Packer {
 public:
  Packer(const model::Llama& model, const PerplexityOptions& o)
      : model_(model), seq_(o.seq), batch_(o.batch) {
    reset();
  }

  // inputs[0..L) predict targets inputs[1..L]: `piece` holds L + 1 tokens.
  void add(const std::vector<int32_t>& piece) {
    const int64_t len = static_cast<int64_t>(piece.size()) - 1;
    if (used_ + len > seq_) next_row();
    const int64_t base = row_ * seq_ + used_;
    for (int64_t i = 0; i < len; ++i) {
      tokens_[base + i] = piece[i];
      targets_[base + i] = piece[i + 1];
      positions_[base + i] = static_cast<int32_t>(i);
      doc_ids_[base + i] = doc_;
    }
    used_ += len;
    ++doc_;
  }

  void finish() {
    if (row_ > 0 || used_ > 0) run();
  }

  double sum = 0;
  int64_t scored = 0;

 private:
  void next_row() {
    pad_row();
    if (++row_ == batch_) run();
  }
  void pad_row() {
    for (int64_t i = used_; i < seq_; ++i) {
      const int64_t k = row_ * seq_ + i;
      tokens_[k] = 0;
      targets_[k] = -100;
      positions_[k] = 0;
      doc_ids_[k] = doc_;  // padding is a document of its own
    }
    ++doc_;
    used_ = 0;
  }
  void run() {
    if (used_ > 0) {
      pad_row();
      ++row_;
    }
    for (int64_t r = row_; r < batch_; ++r) {  // unused rows: padding only
      row_ = r;
      pad_row();
    }
    model::Batch b;
    const Shape shape{batch_, seq_};
    b.tokens = Tensor::from(shape, tokens_);
    b.targets = Tensor::from(shape, targets_);
    b.positions = Tensor::from(shape, positions_);
    b.doc_ids = Tensor::from(shape, doc_ids_);
    int64_t n = 0;
    const double loss = model_.loss_sum(b, &n);
    if (n > 0) sum += loss;
    scored += n;
    reset();
  }
  void reset() {
    const size_t size = static_cast<size_t>(batch_ * seq_);
    tokens_.assign(size, 0);
    targets_.assign(size, -100);
    positions_.assign(size, 0);
    doc_ids_.assign(size, 0);
    row_ = 0;
    used_ = 0;
    doc_ = 0;
  }

  const model::Llama& model_;
  int64_t seq_, batch_;
  std::vector<int32_t> tokens_, targets_, positions_, doc_ids_;
  int64_t row_ = 0, used_ = 0;
  int32_t doc_ = 0;
};

}  // namespace

PerplexityResult perplexity(const model::Llama& model, const fs::path& manifest_path,
                            const PerplexityOptions& o) {
  POLLEN_CHECK(o.seq >= 1 && o.batch >= 1, "perplexity: seq and batch must be >= 1");
  POLLEN_CHECK(o.seq <= model.config().max_position_embeddings, "perplexity: seq ", o.seq,
               " exceeds the model's max_position_embeddings ",
               model.config().max_position_embeddings);
  const auto t0 = std::chrono::steady_clock::now();
  const data::Manifest m = data::Manifest::load(manifest_path);
  POLLEN_CHECK(m.vocab_size <= model.config().vocab_size, "'", manifest_path.string(),
               "': vocabulary of ", m.vocab_size, " ids, the model has ",
               model.config().vocab_size);
  const auto shards = m.split(o.split);
  POLLEN_CHECK(!shards.empty(), "'", manifest_path.string(), "' has no shards of split '", o.split,
               "'");
  // Each piece starts at most one row: more rows than pieces would only be padding (a --batch of
  // 2^30 allocated its rows up front).
  int64_t most_rows = 0;
  for (const data::ShardInfo& info : shards) most_rows += info.num_tokens / o.seq + info.num_docs;
  PerplexityOptions packing = o;
  packing.batch = std::max<int64_t>(1, std::min(o.batch, most_rows));
  ag::NoGrad no_grad;
  PerplexityResult r;
  Packer packer(model, packing);
  std::vector<int32_t> piece;
  for (const data::ShardInfo& info : shards) {
    data::ShardReader shard(m.dir(), info, m.token_dtype);
    const auto& starts = shard.doc_starts();
    for (size_t d = 0; d + 1 < starts.size(); ++d) {
      const auto begin = static_cast<int64_t>(starts[d]), end = static_cast<int64_t>(starts[d + 1]);
      ++r.documents;
      for (int64_t s = begin; s + 1 < end; s += o.seq) {
        const int64_t stop = std::min(end, s + o.seq + 1);
        piece.clear();
        for (int64_t i = s; i < stop; ++i) piece.push_back(static_cast<int32_t>(shard.token(i)));
        packer.add(piece);
        ++r.pieces;
      }
    }
  }
  packer.finish();
  r.tokens = packer.scored;
  r.loss = r.tokens > 0 ? packer.sum / static_cast<double>(r.tokens) : NAN;
  r.perplexity = std::exp(r.loss);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

void load_weights(const model::Llama& model, const fs::path& checkpoint) {
  const fs::path file =
      fs::is_directory(checkpoint) ? checkpoint / "model.safetensors" : checkpoint;
  POLLEN_CHECK(fs::is_regular_file(file), "no weights at '", file.string(), "'");
  // A checkpoint's file (its folder has a manifest) must be the one the checkpoint wrote.
  const fs::path folder = file.parent_path().empty() ? fs::path(".") : file.parent_path();
  if (fs::is_regular_file(folder / "manifest.json")) {
    if (auto why = io::verify_checkpoint(folder, {file.filename().string()}))
      fail("checkpoint '", folder.string(), "' does not verify: ", *why);
  }
  io::refuse_adapter_only_checkpoint(folder, cat("--checkpoint '", checkpoint.string(), "'"));
  const auto weights = io::read_safetensors(file);
  for (const auto& [name, var] : model.named_parameters()) {
    const Tensor& into = var.value();
    const Tensor* t = weights.find(name);
    POLLEN_CHECK(t != nullptr, "'", file.string(), "' has no tensor '", name, "'");
    // A bf16 or f16 export is read as the model's floats, as --model reads it.
    const bool floats = dtype_is_float(t->dtype()) && dtype_is_float(into.dtype());
    POLLEN_CHECK(t->shape() == into.shape() && (t->dtype() == into.dtype() || floats), "'",
                 file.string(), "': tensor '", name, "' is ", shape_str(t->shape()), " ",
                 dtype_name(t->dtype()), ", the model wants ", shape_str(into.shape()), " ",
                 dtype_name(into.dtype()));
    const Tensor same = t->dtype() == into.dtype() ? *t : t->to(into.dtype());
    std::memcpy(into.raw(), same.raw(), into.nbytes());
  }
}

}  // namespace pollen::eval
