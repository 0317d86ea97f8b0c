#pragma once
// The training loader: (batch, seq + 1) token windows in one seeded global permutation.
//
// Each dataset's split is one token stream (its shards concatenated in manifest order), cut into
// non-overlapping windows of seq + 1 tokens (the tail that does not fill a window is unused).
// An epoch is a list of windows drawn from every dataset (all of each one's windows when no
// weights are given; otherwise each dataset's share of the epoch follows its weight, repeating
// or subsampling its windows), shuffled by one permutation seeded by (seed, epoch). Global
// batch g of an epoch is permutation entries [g * batch, (g + 1) * batch). An optimizer step
// reads `step_batch` rows (several global batches with gradient accumulation), and an epoch ends
// only between steps, when fewer than `step_batch` entries are left (those are skipped): so no
// step mixes two epochs, and where epochs end is the same whatever the number of ranks (which
// changes `batch` but not `step_batch`). The state is (seed, epoch, cursor), cursor counting
// windows of the epoch already read, so a resumed run reads exactly what the uninterrupted one
// would, whatever the number of ranks. Rank r reads rows [r * batch / world,
// (r + 1) * batch / world) of each global batch.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/llama.h"

namespace pollen::data {

struct Manifest;

// Manifests mixed into one stream (or trained on one and evaluated on another) must speak the
// same ids: one vocabulary, one tokenizer, one end-of-document token. Throws naming both (or the
// one that holds no tokens at all).
void check_same_tokens(const Manifest& a, const Manifest& b);
// A manifest scored by a model whose tokenizer (file `tokenizer`) has `fingerprint`: data that
// another tokenizer wrote would be read as this model's ids. Throws naming both; a manifest that
// records no tokenizer passes.
void check_tokenized_by(const Manifest& m, const std::string& fingerprint,
                        const std::string& tokenizer);

struct LoaderOptions {
  std::vector<std::filesystem::path> manifests;  // one or several datasets
  std::vector<double> weights;                   // mixing weights (empty: proportional to tokens)
  std::string split = "train";                   // or "validation"
  int64_t batch = 8, seq = 128;                  // global batch rows, tokens per row
  int64_t step_batch = 0;  // global rows per optimizer step, a multiple of batch (0: batch)
  uint64_t seed = 0;
  int rank = 0, world = 1;  // this rank gets rows [rank*batch/world, (rank+1)*batch/world)
  // Every manifest (but one of weight 0) must hold windows of the split (training: one without
  // would silently be left out of the mixture); else those without add none (evaluation).
  bool every_manifest = false;
};

struct LoaderState {
  uint64_t seed = 0, epoch = 0, cursor = 0;
  nlohmann::json to_json() const;
  static LoaderState from_json(const nlohmann::json& j);
  bool operator==(const LoaderState&) const = default;
};

class Loader {
 public:
  // Reads the manifests and maps their shards, verifying each against the manifest's SHA-256
  // (an error names the file that does not match).
  explicit Loader(const LoaderOptions& options);
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  // The next (batch / world, seq) rows for this rank, all int32: tokens = window[0, seq),
  // targets = window[1, seq + 1) with -100 where the target is the first token of a document,
  // positions restarting at 0 at the window start and at each document start, doc_ids counting
  // the documents of each row from 0.
  model::Batch next();

  LoaderState state() const;
  // Continues from a state (its seed replaces the options' seed).
  void restore(const LoaderState& state);

  // Input tokens per epoch: windows_per_epoch() * seq.
  int64_t tokens_per_epoch() const;
  // Windows in one epoch's permutation (every epoch has the same number).
  int64_t windows_per_epoch() const;
  // The same count for `options` from their manifests alone (no shard is read or verified): what
  // a caller sizes the batch of the loader it then makes by.
  static int64_t count_windows(const LoaderOptions& options);

  // Every window of every dataset once, whatever the weights: the records DP-SGD samples from
  // (optim/dp_sgd.h), numbered dataset by dataset in stream order.
  int64_t windows_total() const;
  // One row per window id of `windows` (ids in [0, windows_total())), each filled as next()
  // fills its rows; the loader's state does not move.
  model::Batch windows(const std::vector<int64_t>& windows) const;

 private:
  int64_t step_rows() const;  // step_batch, or batch when 0
  struct Dataset;
  struct Entry {
    uint32_t dataset;
    uint64_t window;
  };
  void build_epoch();
  void fill_row(const Entry& e, int64_t row, model::Batch& b) const;
  model::Batch empty_batch(int64_t rows) const;

  LoaderOptions options_;
  std::vector<std::unique_ptr<Dataset>> datasets_;
  std::vector<int64_t> per_epoch_;  // windows of each dataset per epoch
  LoaderState state_;
  uint64_t built_epoch_ = ~0ull, built_seed_ = 0;
  std::vector<Entry> order_;
};

}  // namespace pollen::data
