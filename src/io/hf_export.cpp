// export_hf: the whole export is written into a staging folder beside the output, synced, and
// put in place of the output in one step, so that a reader sees the earlier export or the new
// one, never a mix; an output folder is replaced only when it holds nothing but an export's
// files.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <regex>

#include "base/error.h"
#include "base/files.h"
#include "base/log.h"
#include "io/folder_swap.h"
#include "io/hf.h"
#include "io/safetensors.h"
#include "io/synced_write.h"

namespace pollen::io {
namespace fs = std::filesystem;
namespace {

const std::map<std::string, std::string>& dtype_names() {
  static const std::map<std::string, std::string> m = {
      {"f32", "float32"}, {"bf16", "bfloat16"}, {"f16", "float16"}};
  return m;
}

// A name an export writes, or a temporary file of an atomic write of one (`.NAME.tmp.PID`).
bool written_by_export(const std::string& name) {
  static const std::regex kNames(
      R"((config|generation_config|tokenizer_config|tokenizer|special_tokens_map)\.json|)"
      R"(chat_template\.jinja|)"
      R"(model\.safetensors(\.index\.json)?|model-\d{5}-of-\d{5}\.safetensors)");
  std::smatch temp;
  static const std::regex kTemp(R"(\.(.+)\.tmp\.\d+)");
  if (std::regex_match(name, kNames)) return true;
  return std::regex_match(name, temp, kTemp) && std::regex_match(temp[1].str(), kNames);
}

// The folder an export goes to: absolute, without a trailing separator, a link to a folder
// followed (the link is kept, the folder it names replaced). An existing one must be a folder
// holding only an export's files, so that exporting into a folder of the user's never deletes
// the user's files.
fs::path export_target(const fs::path& dir) {
  fs::path target = fs::absolute(dir).lexically_normal();
  if (!target.has_filename()) target = target.parent_path();
  if (fs::is_symlink(target)) target = fs::canonical(target);
  if (!fs::exists(target)) return target;
  POLLEN_CHECK(fs::is_directory(target), "export: '", target.string(), "' is not a folder");
  // Replaced whole, the working folder would be deleted under the shell that ran the export.
  const fs::path cwd = fs::canonical(fs::current_path());
  const fs::path inside = cwd.lexically_relative(fs::canonical(target));
  POLLEN_CHECK(inside.empty() || *inside.begin() == "..", "export: '", target.string(),
               "' is the working folder or holds it, and an export replaces its output folder "
               "whole; give a folder of its own (a new one, say)");
  for (const auto& e : fs::directory_iterator(target)) {
    const std::string name = e.path().filename().string();
    POLLEN_CHECK(e.is_regular_file() && !e.is_symlink() && written_by_export(name), "export: '",
                 target.string(), "' holds '", name,
                 "', which an export does not write; give a new or empty folder, or one an ",
                 "earlier export wrote (it is replaced whole)");
  }
  return target;
}

// Writes the export's files into `dir`, each synced; returns their names in order.
std::vector<std::string> write_export(const model::Llama& model, const fs::path& dir,
                                      const HfExportOptions& options, uint64_t* weight_bytes) {
  std::vector<std::string> files;
  NamedTensors all;
  for (const auto& [name, v] : model.named_parameters()) {
    all.emplace_back(name,
                     v.value().dtype() == options.dtype ? v.value() : v.value().to(options.dtype));
    *weight_bytes += all.back().second.nbytes();
  }
  // Shards in parameter order, each up to max_shard_bytes (a tensor is never split).
  std::vector<NamedTensors> shards(1);
  uint64_t in_shard = 0;
  for (auto& nt : all) {
    if (in_shard > 0 && in_shard + nt.second.nbytes() > options.max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    in_shard += nt.second.nbytes();
    shards.back().push_back(nt);
  }
  const auto write_text = [&](const std::string& file, std::string_view text) {
    write_synced(dir / file, text);
    files.push_back(file);
  };
  const auto write_tensors = [&](const std::string& file, const NamedTensors& t) {
    write_safetensors(dir / file, t, {{"format", "pt"}});
    files.push_back(file);
  };
  if (shards.size() == 1) {
    write_tensors("model.safetensors", shards[0]);
  } else {
    nlohmann::ordered_json index;
    index["metadata"] = {{"total_size", *weight_bytes}};
    nlohmann::ordered_json map = nlohmann::ordered_json::object();
    char name[64];
    for (size_t i = 0; i < shards.size(); ++i) {
      std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
      write_tensors(name, shards[i]);
      for (const auto& [tname, t] : shards[i]) map[tname] = name;
    }
    index["weight_map"] = map;
    write_text("model.safetensors.index.json", index.dump(2) + "\n");
  }
  const std::string dname = dtype_name(options.dtype);
  nlohmann::ordered_json config = hf_config_json(model.config(), dtype_names().at(dname));
  nlohmann::json generation = nlohmann::json::object();
  for (const auto& [key, id] : {std::pair{"bos_token_id", options.bos_token_id},
                                std::pair{"eos_token_id", options.eos_token_id}}) {
    if (!id) continue;
    config[key] = *id;
    generation[key] = *id;
  }
  if (options.generation_eos_ids.size() > 1)
    generation["eos_token_id"] = options.generation_eos_ids;
  const auto in_extra = [&](const char* name) {
    return std::any_of(options.extra_files.begin(), options.extra_files.end(),
                       [&](const fs::path& f) { return f.filename() == name; });
  };
  if (!generation.empty() && !in_extra("generation_config.json"))
    write_text("generation_config.json", generation.dump(2) + "\n");
  if (!options.tokenizer_config.is_null() && !in_extra("tokenizer_config.json"))
    write_text("tokenizer_config.json", options.tokenizer_config.dump(2) + "\n");
  for (const auto& extra : options.extra_files)
    write_text(extra.filename().string(), read_file(extra));
  if (!options.tokenizer_json.empty()) write_text("tokenizer.json", options.tokenizer_json);
  write_text("config.json", config.dump(2) + "\n");
  return files;
}

}  // namespace

HfExportResult export_hf(const model::Llama& model, const fs::path& dir,
                         const HfExportOptions& options) {
  const std::string dname = dtype_name(options.dtype);
  POLLEN_CHECK(dtype_names().count(dname), "export: dtype ", dname,
               " is not one of f32, bf16, f16");
  const fs::path target = export_target(dir);
  fs::create_directories(target.parent_path());
  // An export killed midway left its staging folder, a whole model's size, beside the output;
  // one killed between the two renames of a swap without RENAME_EXCHANGE left no output, the
  // earlier export moved aside: that one is put back first.
  const std::string name = target.filename().string();
  const std::string moved_aside = cat(".old-", name, ".");
  if (!fs::exists(fs::symlink_status(target))) {
    const auto aside = find_abandoned(target.parent_path(), {moved_aside});
    if (!aside.empty()) {
      fs::rename(aside.back(), target);
      log::warn("export: put '", aside.back().string(), "' back as '", target.string(),
                "': an export that did not finish had moved it aside");
    }
  }
  for (const auto& left :
       remove_abandoned(target.parent_path(), {cat(".tmp-export-", name, "."), moved_aside}))
    log::warn("export: removed '", left.string(), "', left by an export that did not finish");
  const fs::path staging = target.parent_path() / cat(".tmp-export-", name, ".", ::getpid());
  fs::create_directory(staging);
  HfExportResult out;
  try {
    for (const auto& file : write_export(model, staging, options, &out.weight_bytes))
      out.files.push_back(dir / file);
    sync_folder(staging);
    replace_folder(staging, target);
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(staging, ignored);
    throw;
  }
  return out;
}

}  // namespace pollen::io
