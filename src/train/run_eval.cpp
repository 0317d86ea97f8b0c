#include "train/run_eval.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <tuple>

#include "base/config.h"
#include "base/error.h"
#include "base/files.h"
#include "base/folder_lock.h"
#include "base/json_depth.h"
#include "base/log.h"
#include "base/path_labels.h"
#include "data/loader.h"
#include "data/shards.h"
#include "eval/perplexity.h"
#include "io/checkpoint.h"
#include "io/model_source.h"
#include "obs/metrics.h"
#include "train/config.h"
#include "train/run_control.h"

namespace fs = std::filesystem;

namespace pollen::train {
namespace {

// What makes two evaluations the same: checkpoint step, dataset, split, row length.
using EvalKey = std::tuple<int64_t, std::string, std::string, int64_t>;

// One curve: dataset, split, row length (an EvalKey without its step).
using Series = std::tuple<std::string, std::string, int64_t>;

Series series_of(const EvalKey& key) {
  return {std::get<1>(key), std::get<2>(key), std::get<3>(key)};
}

// A manifest as stored and compared: absolute, so that the same data given by a relative and an
// absolute path (or from another folder) is one dataset. Records written with a relative path
// resolve the same way, against the current folder.
std::string manifest_key(const std::string& manifest) {
  return fs::absolute(manifest).lexically_normal().string();
}

EvalKey key_of(const nlohmann::ordered_json& j) {
  return {j.at("step").get<int64_t>(), manifest_key(j.at("data").get<std::string>()),
          j.at("split").get<std::string>(), j.at("seq").get<int64_t>()};
}

// Each dataset's name in TensorBoard tags: the folder holding its manifest, with the folders above
// it that tell it apart from the other datasets `known` (a/fort and b/fort), so that no two share
// a tag. `known` (absolute and distinct: manifest_key's) is every dataset the run's evaluations
// name, so that a dataset keeps its tag from one eval --run to the next.
std::map<std::string, std::string> dataset_labels(const std::set<std::string>& known) {
  std::vector<fs::path> folders;
  for (const auto& m : known) folders.push_back(fs::path(m).parent_path());
  const std::vector<std::string> names = distinct_folder_labels(folders);
  std::map<std::string, std::string> labels;
  size_t i = 0;
  for (const auto& m : known) {  // a manifest at the root is named by its file
    labels[m] = names[i] == "/" ? fs::path(m).stem().string() : names[i];
    ++i;
  }
  return labels;
}

// A result whose TensorBoard points are not known to be written holds where they go: the event
// file (a name in the run's tensorboard/) and its size before them.
bool valid_tensorboard_mark(const nlohmann::ordered_json& m) {
  if (!m.is_object() || !m.contains("file") || !m["file"].is_string() || !m.contains("bytes") ||
      !m["bytes"].is_number_unsigned())
    return false;
  const std::string file = m["file"].get<std::string>();
  return !file.empty() && file[0] != '.' && file.find('/') == std::string::npos;
}

bool shown_in_tensorboard(const nlohmann::ordered_json& j) {
  return !j.contains("tensorboard");
}

}  // namespace

std::vector<nlohmann::ordered_json> read_run_evals(const fs::path& run_dir) {
  std::vector<nlohmann::ordered_json> out;
  const fs::path path = run_dir / "eval.jsonl";
  std::ifstream in(path);
  if (!in) return out;
  std::string line;
  int64_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.empty()) continue;
    check_json_depth(line, cat("'", path.string(), "' line ", n));
    auto j = nlohmann::ordered_json::parse(line, nullptr, false);
    POLLEN_CHECK(!j.is_discarded() && j.is_object() && j.contains("step") &&
                     j["step"].is_number_integer() && j.contains("data") && j["data"].is_string() &&
                     j.contains("split") && j["split"].is_string() && j.contains("seq") &&
                     j["seq"].is_number_integer() &&
                     (!j.contains("tag") || (j["tag"].is_string() && !j["tag"].empty())) &&
                     (!j.contains("tensorboard") || valid_tensorboard_mark(j["tensorboard"])),
                 "'", path.string(), "' line ", n,
                 ": expected a JSON object with step, data, split and seq (integers and strings), "
                 "tag, when present, a non-empty string, and tensorboard, when present, {file, "
                 "bytes} of an event file in tensorboard/");
    out.push_back(std::move(j));
  }
  return out;
}

RunEvalResult evaluate_run(const fs::path& run_dir, const RunEvalOptions& o) {
  const fs::path config_path = run_dir / "config.toml";
  POLLEN_CHECK(fs::is_regular_file(config_path), "'", run_dir.string(),
               "' is not a run folder of pollen train (no config.toml)");
  const std::string config_text = read_file(config_path);
  {
    // A post-training run's config.toml names its base model and has its objective's section:
    // say so, rather than listing those keys as unknown to pollen train.
    ConfigTable t = ConfigTable::parse(config_text, config_path.string());
    auto model = t.table("model");
    if (model && model->has("base")) {
      std::string objective = "post-training";
      for (const char* section : {"sft", "dpo", "rm", "grpo"})
        if (t.has(section)) objective = section;
      fail("'", run_dir.string(), "' is a run of pollen ", objective,
           ", and eval --run evaluates runs of pollen train; evaluate its newest checkpoint with ",
           "pollen eval --model ", run_dir.string(), " --data MANIFEST (or one checkpoint with ",
           "--model ", (run_dir / "checkpoints" / "step-NNNNNNNN").string(), ")");
    }
  }
  // The resolved config holds paths as the run saw them (absolute, or relative to where it ran).
  const TrainConfig run = parse_train_config(config_text, config_path.string());
  std::vector<std::string> manifests = o.manifests;
  if (manifests.empty()) manifests = run.validation_manifests;
  for (auto& m : manifests) m = manifest_key(m);
  // One dataset named twice (a/m.json and ./a/m.json) is evaluated once.
  std::set<std::string> seen;
  std::erase_if(manifests, [&](const std::string& m) { return !seen.insert(m).second; });
  const std::string split = o.split.empty() ? run.validation_split : o.split;
  POLLEN_CHECK(!split.empty(), "'", config_path.string(),
               "': data.validation_split is empty (the run had no validation data); give the "
               "split to evaluate");
  // Data another tokenizer wrote would be scored as if it spoke the run's ids: each manifest must
  // be tokenized like the run's training data (when that is still where the run read it).
  if (!run.manifests.empty() && fs::exists(run.manifests.front())) {
    const data::Manifest trained = data::Manifest::load(run.manifests.front());
    for (const auto& m : manifests) data::check_same_tokens(trained, data::Manifest::load(m));
  }
  eval::PerplexityOptions po;
  po.split = split;
  po.seq = o.seq > 0 ? o.seq : run.seq;
  po.batch = o.batch > 0 ? o.batch : run.micro_batch;

  // One evaluation of a run at a time: each rewrites eval.jsonl whole from what it read.
  const FolderLock lock(run_dir, "run folder", run_dir / ".eval.lock");
  std::map<EvalKey, nlohmann::ordered_json> records;
  for (auto& j : read_run_evals(run_dir)) {
    const EvalKey key = key_of(j);
    records[key] = std::move(j);
  }

  RunEvalResult result;
  std::set<std::string> known(manifests.begin(), manifests.end());
  for (const auto& m : run.validation_manifests) known.insert(manifest_key(m));
  for (const auto& [key, j] : records) known.insert(std::get<1>(key));
  const std::map<std::string, std::string> labels = dataset_labels(known);
  // Each series (dataset, split, window) keeps the TensorBoard tag its first result recorded, so
  // that a dataset added later (a/fort beside b/fort) does not move an earlier one's curve; a new
  // series gets its dataset's label, with its split and window when they are not the run's.
  std::map<Series, std::string> tags;
  for (const auto& [key, j] : records)
    if (j.contains("tag")) tags.emplace(series_of(key), j["tag"].get<std::string>());
  const auto tag_of = [&](const EvalKey& key) {
    const Series s = series_of(key);
    if (const auto found = tags.find(s); found != tags.end()) return found->second;
    std::string tag = labels.at(std::get<0>(s));
    if (std::get<1>(s) != run.validation_split) tag += "/" + std::get<1>(s);
    if (std::get<2>(s) != run.seq) tag += cat("/seq", std::get<2>(s));
    const auto taken = [&](const std::string& t) {
      return std::any_of(tags.begin(), tags.end(), [&](const auto& e) { return e.second == t; });
    };
    const std::string base = tag;
    for (int k = 2; taken(tag); ++k) tag = cat(base, "-", k);
    tags.emplace(s, tag);
    return tag;
  };
  // TensorBoard's files are only appended to, and a kill may fall between a result reaching
  // eval.jsonl and reaching TensorBoard: results are written to eval.jsonl first, marked with the
  // event file and its size before their points until those are synced. A later eval --run cuts
  // that file back to the size and writes the marked results' points again, so that none is lost
  // or written twice.
  obs::EventFileWriter tb;
  const auto mark = [&](nlohmann::ordered_json& j) {
    if (!tb.file().is_open())
      tb = obs::EventFileWriter::create(run_dir / "tensorboard", std::nullopt);
    j["tensorboard"] = {{"file", tb.file().path().filename().string()},
                        {"bytes", tb.file().position()}};
  };
  const auto save = [&] {
    std::string text;
    for (const auto& [key, j] : records) text += j.dump() + "\n";
    write_file_atomic(run_dir / "eval.jsonl", text);
  };
  const auto show_pending = [&] {
    if (!run.tensorboard) return;
    std::vector<nlohmann::ordered_json*> pending;
    for (auto& [key, j] : records)
      if (!shown_in_tensorboard(j)) pending.push_back(&j);
    if (pending.empty()) return;
    if (!tb.file().is_open())
      tb = obs::EventFileWriter::create(run_dir / "tensorboard", std::nullopt);
    std::map<fs::path, uint64_t> cut;  // another (killed) evaluation's file: where its marks begin
    for (const nlohmann::ordered_json* j : pending) {
      const fs::path written =
          run_dir / "tensorboard" / (*j)["tensorboard"]["file"].get<std::string>();
      if (written == tb.file().path()) continue;
      const auto bytes = (*j)["tensorboard"]["bytes"].get<uint64_t>();
      const auto [at, added] = cut.emplace(written, bytes);
      if (!added) at->second = std::min(at->second, bytes);
    }
    for (const auto& [written, bytes] : cut)
      if (fs::exists(written)) obs::AppendFile(written, bytes, obs::Shortfall::keep_whole_records);
    // Marked again with this process's file before their points go there: a kill from here on
    // leaves marks that name where the points may be, so that the next evaluation cuts this file
    // back and writes them once.
    if (!cut.empty()) {
      for (nlohmann::ordered_json* j : pending) mark(*j);
      save();
    }
    for (auto& [key, j] : records) {
      if (shown_in_tensorboard(j)) continue;
      const std::string label = j.contains("tag") ? j["tag"].get<std::string>() : tag_of(key);
      const double wall = obs::wall_time_now();
      const auto number = [](const nlohmann::ordered_json& v) {
        return v.is_number() ? v.get<double>() : std::nan("");
      };
      tb.add_scalar(cat("eval/", label, "/loss"), number(j["loss"]), std::get<0>(key), wall);
      tb.add_scalar(cat("eval/", label, "/perplexity"), number(j["perplexity"]), std::get<0>(key),
                    wall);
      j.erase("tensorboard");
    }
    tb.file().sync();
    save();
  };
  show_pending();  // an earlier evaluation's, interrupted before its points
  for (const fs::path& dir : io::list_checkpoints(run_dir / "checkpoints")) {
    // From the folder's name (step-NNNNNNNN, which list_checkpoints parsed): its manifest may be
    // missing or damaged, or retention may remove the folder while training goes on.
    const int64_t step = std::stoll(dir.filename().string().substr(5));
    std::vector<std::string> pending;
    for (const auto& m : manifests) {
      if (!o.again && records.count({step, m, split, po.seq})) {
        ++result.already;
        continue;
      }
      pending.push_back(m);
    }
    if (pending.empty()) continue;
    if (auto why = io::verify_checkpoint(dir)) {
      log::warn("skipping checkpoint '", dir.string(), "': ", *why);
      result.unverified.emplace_back(dir, *why);
      continue;
    }
    std::optional<model::Llama> loaded;
    int64_t tokens = 0;
    try {
      loaded = io::load_model(io::resolve_model(dir.string()));
      tokens = nlohmann::json::parse(read_file(dir / "state.json")).at("tokens").get<int64_t>();
    } catch (const std::exception& e) {  // removed since it verified, say
      log::warn("skipping checkpoint '", dir.string(), "': ", e.what());
      result.unverified.emplace_back(dir, e.what());
      continue;
    }
    const model::Llama& model = *loaded;
    for (const auto& m : pending) {
      const eval::PerplexityResult r = eval::perplexity(model, m, po);
      nlohmann::ordered_json j;
      j["step"] = step;
      j["tokens"] = tokens;
      j["checkpoint"] = dir.filename().string();
      j["data"] = m;
      j["split"] = split;
      j["seq"] = po.seq;
      j["loss"] = json_number(r.loss);  // JSON has no NaN: null
      j["perplexity"] = json_number(r.perplexity);
      j["scored_tokens"] = r.tokens;
      j["documents"] = r.documents;
      j["tag"] = tag_of(key_of(j));  // its TensorBoard tags: eval/<tag>/loss and .../perplexity
      if (!o.quiet)
        log::info("step ", step, " (", dir.filename().string(), ") on ", m, " [", split, "]: loss ",
                  r.loss, ", perplexity ", r.perplexity);
      // A result TensorBoard holds already (--again giving the same numbers) is not shown again.
      const auto before = records.find(key_of(j));
      const bool shown = before != records.end() && before->second["loss"] == j["loss"] &&
                         shown_in_tensorboard(before->second);
      result.evaluated.push_back(j);
      if (run.tensorboard && !shown) mark(j);
      const EvalKey key = key_of(j);
      records[key] = std::move(j);
    }
    // Written after each checkpoint, so an interrupted evaluation keeps what it finished.
    save();
    show_pending();
  }
  return result;
}

}  // namespace pollen::train
