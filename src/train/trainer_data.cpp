#include "train/trainer_data.h"

#include <algorithm>
#include <cmath>

#include "autograd/tape.h"
#include "base/error.h"
#include "base/log.h"
#include "data/shards.h"

namespace pollen::train {
namespace {

// Each micro-step reads micro_batch rows on every rank: one global micro-batch of
// micro_batch x ranks rows, split by rank; a step is the same global batch at any world size.
int64_t micro_steps_per_step(const TrainConfig& cfg, const dist::Communicator& comm) {
  const int64_t global_rows = cfg.micro_batch * comm.world();
  if (cfg.batch_tokens % (global_rows * cfg.seq) != 0) {
    // What would fit: the micro-batches that divide a step's rows among these ranks.
    const int64_t step_rows = cfg.batch_tokens / cfg.seq;
    std::string fits;
    for (int64_t m = 1; m <= step_rows / comm.world(); ++m)
      if (step_rows % (m * comm.world()) == 0) fits += cat(fits.empty() ? "" : ", ", m);
    throw Error(cat(
        "train.batch_tokens (", cfg.batch_tokens,
        ") is not a multiple of micro_batch * seq * ranks (", cfg.micro_batch, " * ", cfg.seq,
        " * ", comm.world(), "): each rank reads micro_batch rows per micro-step; ",
        fits.empty()
            ? cat("no micro_batch splits its ", step_rows, " rows among ", comm.world(), " ranks")
            : cat("with ", comm.world(), " ranks train.micro_batch may be ", fits,
                  " (--set train.micro_batch=N --set train.batch_tokens=", cfg.batch_tokens,
                  ": batch_tokens defaults to micro_batch * seq, and a step keeps its batch; ",
                  "micro_batch may change on resume)")));
  }
  return cfg.batch_tokens / (global_rows * cfg.seq);
}

data::LoaderOptions train_loader_options(const TrainConfig& cfg, const dist::Communicator& comm,
                                         int64_t accum) {
  const int64_t global_rows = cfg.micro_batch * comm.world();
  data::LoaderOptions lo;
  for (const auto& m : cfg.manifests) lo.manifests.emplace_back(m);
  lo.weights = cfg.weights;
  lo.split = cfg.train_split;
  lo.every_manifest = true;
  lo.batch = global_rows;
  lo.step_batch = global_rows * accum;  // batch_tokens / seq, the same at any world size
  lo.seq = cfg.seq;
  lo.seed = cfg.seed;
  lo.rank = comm.rank();
  lo.world = comm.world();
  return lo;
}

// The training data, its errors naming the keys that chose it.
data::Loader train_loader(const TrainConfig& cfg, const data::LoaderOptions& lo) {
  try {
    return data::Loader(lo);
  } catch (const Error& e) {
    fail("data.manifests, data.train_split '", cfg.train_split, "': ", e.what());
  }
}

// The validation split of the train loader's data (`train`), or none: not asked for, empty,
// unreadable (a warning says why) or unreadable on another rank. A split of fewer windows than
// one micro-batch is read as one batch of them all.
Validation open_validation(const TrainConfig& cfg, const data::LoaderOptions& train,
                           dist::Communicator& comm) {
  Validation v;
  if (cfg.validation_split.empty() || cfg.eval_batches <= 0) return v;
  data::LoaderOptions vo = train;
  vo.every_manifest = false;
  vo.batch = cfg.micro_batch;  // every rank reads every batch and scores its share of them
  vo.step_batch = 0;
  vo.rank = 0;
  vo.world = 1;
  vo.manifests.clear();
  for (const auto& m : cfg.validation_manifests) vo.manifests.emplace_back(m);
  vo.split = cfg.validation_split;
  // The training mixture, over the manifests that hold the split (one without it is no reason
  // to evaluate on none).
  if (cfg.validation_manifests == cfg.manifests && !cfg.weights.empty()) {
    vo.weights = cfg.weights;
    for (size_t i = 0; i < vo.manifests.size(); ++i)
      if (data::Manifest::load(vo.manifests[i]).split(vo.split).empty()) vo.weights[i] = 0;
    if (std::all_of(vo.weights.begin(), vo.weights.end(), [](double w) { return w == 0; }))
      vo.weights.clear();  // none holds it: the loader says so below
  }
  // The default split missing from data prepared without one is no evaluation, warned; a split
  // or manifests the config names are a mistake to stop on.
  const bool named =
      cfg.validation_split != "validation" || cfg.validation_manifests != cfg.manifests;
  std::string why_not;  // this rank's, when it cannot evaluate
  try {
    // A split of fewer windows than a micro-batch is scored whole, as one batch (none: the
    // loader says why).
    const int64_t windows = data::Loader::count_windows(vo);
    if (windows > 0 && windows < cfg.micro_batch) {
      log::info("validation split '", cfg.validation_split, "' has ", windows, " windows of ",
                cfg.seq + 1,
                " tokens, fewer than one micro-batch: each evaluation scores them all");
      vo.batch = windows;
    }
    v.loader = std::make_unique<data::Loader>(vo);
    v.start = v.loader->state();
    const int64_t held = v.loader->windows_per_epoch();
    v.batches = std::min(cfg.eval_batches, held / vo.batch);
    if (v.batches < cfg.eval_batches && held >= cfg.micro_batch)
      log::warn_job("eval.batches = ", cfg.eval_batches, " asks for more than validation split '",
                    cfg.validation_split, "' holds (", held, " windows of ", cfg.seq + 1,
                    " tokens): each evaluation scores its ", v.batches,
                    " whole micro-batches once");
  } catch (const Error& e) {
    if (named)
      throw Error(cat("data.validation_split '", cfg.validation_split,
                      "' of data.validation_manifests cannot be evaluated: ", e.what(),
                      " (data.validation_split = \"\" turns evaluation off)"));
    why_not = e.what();
    v.loader.reset();
  }
  // Evaluation is a collective: it runs only if every rank has the validation data (one rank
  // that cannot read it would leave the others' reductions paired with the wrong ones).
  double ranks_with_data[1] = {v.loader ? 1.0 : 0.0};
  if (comm.world() > 1)
    comm.all_reduce_sum(ranks_with_data, "whether every rank has validation data");
  if (ranks_with_data[0] == 0) {
    log::warn_job("no evaluation: ", why_not);  // the same data, the same reason on every rank
  } else if (ranks_with_data[0] < comm.world()) {
    if (!v.loader) log::warn("rank ", comm.rank(), ": ", why_not);  // its own reason
    log::warn_job("no evaluation: ", comm.world() - static_cast<int>(ranks_with_data[0]),
                  " rank(s) could not read validation split '", cfg.validation_split, "'");
    v.loader.reset();
  }
  return v;
}

}  // namespace

TrainData open_train_data(const TrainConfig& cfg, dist::Communicator& comm) {
  const int64_t accum = micro_steps_per_step(cfg, comm);
  const data::LoaderOptions lo = train_loader_options(cfg, comm, accum);
  return TrainData{accum, train_loader(cfg, lo), open_validation(cfg, lo, comm)};
}

double validation_loss(const model::Llama& model, Validation& validation, int64_t batches,
                       dist::Communicator* comm, int64_t* scored) {
  batches = std::min(batches, validation.batches);
  ag::NoGrad no_grad;
  validation.loader->restore(validation.start);  // the same validation batches at every evaluation
  const int64_t rank = comm ? comm->rank() : 0, world = comm ? comm->world() : 1;
  double sums[2] = {0, 0};  // loss, scored tokens
  for (int64_t i = 0; i < batches; ++i) {
    const model::Batch b = validation.loader->next();
    if (i % world != rank) continue;
    int64_t n = 0;
    sums[0] += model.loss_sum(b, &n);
    sums[1] += static_cast<double>(n);
  }
  if (comm) comm->all_reduce_sum(sums, "the validation loss");
  if (scored) *scored = static_cast<int64_t>(sums[1]);
  return sums[1] > 0 ? sums[0] / sums[1] : NAN;
}

}  // namespace pollen::train
