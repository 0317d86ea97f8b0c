#include "train/trainer_checkpoint.h"

#include <cmath>

#include "base/log.h"
#include "io/checkpoint.h"
#include "train/run_control.h"

namespace fs = std::filesystem;

namespace pollen::train {

CheckpointWritten write_checkpoint(const fs::path& root, int64_t step,
                                   const std::vector<CheckpointTensors>& weights,
                                   const std::vector<std::string>& trained,
                                   const OptimizerMoments& moments,
                                   const nlohmann::ordered_json& state,
                                   const std::string& config_toml,
                                   const std::vector<std::pair<std::string, std::string>>& texts) {
  const auto t0 = Clock::now();
  POLLEN_ASSERT(moments.exp_avg.size() == trained.size() &&
                moments.exp_avg_sq.size() == trained.size());
  // Files are written from host memory: a GPU run's tensors are copied over first.
  io::NamedTensors tensors;
  for (size_t i = 0; i < trained.size(); ++i) {
    tensors.emplace_back(trained[i] + ".exp_avg", moments.exp_avg[i].cpu());
    tensors.emplace_back(trained[i] + ".exp_avg_sq", moments.exp_avg_sq[i].cpu());
  }
  io::CheckpointWriter w(root, step);
  for (const auto& f : weights) {
    io::NamedTensors on_host;
    for (const auto& [name, t] : f.tensors) on_host.emplace_back(name, t.cpu());
    w.add_tensors(f.file, on_host, {{"format", "pt"}});
  }
  w.add_tensors("optimizer.safetensors", tensors,
                {{"step", std::to_string(moments.steps)}, {"optimizer", "adamw"}});
  w.add_text("state.json", state.dump(2) + "\n");
  w.add_text("config.toml", config_toml);
  for (const auto& [file, text] : texts) w.add_text(file, text);
  CheckpointWritten out;
  out.dir = w.commit();
  out.stats = w.stats();
  out.seconds = seconds_since(t0);
  return out;
}

CheckpointWritten write_checkpoint(const fs::path& root, int64_t step, const model::Llama& model,
                                   const OptimizerMoments& moments,
                                   const nlohmann::ordered_json& state,
                                   const std::string& config_toml) {
  CheckpointTensors weights{"model.safetensors", {}};
  std::vector<std::string> trained;
  for (const auto& [name, p] : model.named_parameters()) {
    weights.tensors.emplace_back(name, p.value());
    trained.push_back(name);
  }
  return write_checkpoint(root, step, {weights}, trained, moments, state, config_toml, {});
}

namespace {
// The weights a checkpoint holds for `model` trained by `opt`: its parameters' values, or in
// mixed precision the optimizer's f32 master weights in their place.
std::vector<std::pair<std::string, Tensor>> checkpoint_weights(const model::Llama& model,
                                                               const optim::AdamW& opt) {
  const auto named = model.named_parameters();
  POLLEN_ASSERT(opt.slots().size() == named.size());
  std::vector<std::pair<std::string, Tensor>> weights;
  for (size_t i = 0; i < named.size(); ++i) {
    weights.emplace_back(named[i].first,
                         opt.computes_in_bf16() ? opt.slots()[i].param : named[i].second.value());
  }
  return weights;
}
}  // namespace

CheckpointWritten write_checkpoint(const fs::path& root, int64_t step, const model::Llama& model,
                                   const optim::AdamW& opt, const nlohmann::ordered_json& state,
                                   const std::string& config_toml) {
  if (!opt.computes_in_bf16())
    return write_checkpoint(root, step, model, moments_of(opt), state, config_toml);
  CheckpointTensors weights{"model.safetensors", {}};
  std::vector<std::string> trained;
  for (auto& [name, t] : checkpoint_weights(model, opt)) {
    weights.tensors.emplace_back(name, t);
    trained.push_back(name);
  }
  return write_checkpoint(root, step, {weights}, trained, moments_of(opt), state, config_toml, {});
}

void log_checkpoint_and_retain(const fs::path& root, int64_t step, const CheckpointWritten& w,
                               int keep) {
  const double mb = static_cast<double>(w.stats.bytes) / 1048576.0;
  log::info("checkpoint step ", step, " saved to '", w.dir.string(), "' (", std::round(mb),
            " MB in ", std::round(w.seconds * 100) / 100, " s: serialise ",
            std::round(w.stats.serialise_s * 100) / 100, " s, hash ",
            std::round(w.stats.hash_s * 100) / 100, " s, sync ",
            std::round(w.stats.sync_s * 100) / 100, " s)");
  for (const auto& p : io::apply_retention(root, keep))
    log::debug("removed old checkpoint '", p.string(), "'");
}

OptimizerMoments moments_of(const optim::AdamW& opt) {
  OptimizerMoments m;  // the optimizer's own tensors, shared
  for (const auto& slot : opt.slots()) {
    m.exp_avg.push_back(slot.exp_avg);
    m.exp_avg_sq.push_back(slot.exp_avg_sq);
  }
  m.steps = opt.steps_taken();
  return m;
}

void load_checkpoint_tensors(const fs::path& file,
                             const std::vector<std::pair<std::string, Tensor>>& into) {
  const auto f = io::read_safetensors(file);
  for (const auto& [name, dst] : into) {
    const Tensor* t = f.find(name);
    POLLEN_CHECK(t != nullptr, "checkpoint '", file.string(), "' has no tensor '", name, "'");
    POLLEN_CHECK(t->shape() == dst.shape() && t->dtype() == dst.dtype(), "checkpoint '",
                 file.string(), "': tensor '", name, "' is ", shape_str(t->shape()), " ",
                 dtype_name(t->dtype()), ", the model wants ", shape_str(dst.shape()), " ",
                 dtype_name(dst.dtype()));
    Tensor(dst).copy_(*t);  // into host or GPU memory
  }
}

void load_optimizer_moments(const fs::path& dir,
                            const std::vector<std::pair<std::string, ag::Var>>& trained,
                            OptimizerMoments& moments) {
  if (moments.exp_avg.empty()) {
    for (const auto& [name, p] : trained) {
      moments.exp_avg.push_back(Tensor::empty(p.shape(), p.dtype()));
      moments.exp_avg_sq.push_back(Tensor::empty(p.shape(), p.dtype()));
    }
  }
  POLLEN_ASSERT(moments.exp_avg.size() == trained.size() &&
                moments.exp_avg_sq.size() == trained.size());
  std::vector<std::pair<std::string, Tensor>> into;
  for (size_t i = 0; i < trained.size(); ++i) {
    into.emplace_back(trained[i].first + ".exp_avg", moments.exp_avg[i]);
    into.emplace_back(trained[i].first + ".exp_avg_sq", moments.exp_avg_sq[i]);
  }
  const fs::path file = dir / "optimizer.safetensors";
  load_checkpoint_tensors(file, into);
  const auto meta = io::read_safetensors(file).metadata;
  const auto it = meta.find("step");
  POLLEN_CHECK(it != meta.end(), "checkpoint '", file.string(), "': metadata lacks 'step'");
  moments.steps = std::stoll(it->second);
}

void load_checkpoint(const fs::path& dir, const model::Llama& model, OptimizerMoments& moments) {
  const auto params = model.named_parameters();
  std::vector<std::pair<std::string, Tensor>> weights;
  for (const auto& [name, p] : params) weights.emplace_back(name, p.value());
  load_checkpoint_tensors(dir / "model.safetensors", weights);
  load_optimizer_moments(dir, params, moments);
}

void load_checkpoint(const fs::path& dir, const model::Llama& model, optim::AdamW& opt) {
  OptimizerMoments m = moments_of(opt);  // loaded in place
  if (opt.computes_in_bf16()) {
    load_checkpoint_tensors(dir / "model.safetensors", checkpoint_weights(model, opt));
    load_optimizer_moments(dir, model.named_parameters(), m);
    opt.refresh_model_copies();
  } else {
    load_checkpoint(dir, model, m);
  }
  opt.set_steps_taken(m.steps);
}

}  // namespace pollen::train
