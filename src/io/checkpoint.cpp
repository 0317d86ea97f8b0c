#include "io/checkpoint.h"

#include <signal.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/files.h"
#include "base/hash.h"
#include "base/json_depth.h"
#include "base/log.h"
#include "io/folder_swap.h"

namespace fs = std::filesystem;

namespace pollen::io {
namespace {

bool parse_step_name(const std::string& name, int64_t* step) {
  if (!name.starts_with("step-") || name.size() <= 5) return false;
  const char* end = name.data() + name.size();
  const auto [last, ec] = std::from_chars(name.data() + 5, end, *step);
  return ec == std::errc() && last == end && *step >= 0;  // digits only, within int64
}

}  // namespace

std::string checkpoint_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%08lld", static_cast<long long>(step));
  return buf;
}

CheckpointWriter::CheckpointWriter(const fs::path& root, int64_t step)
    : final_(root / checkpoint_name(step)), step_(step) {
  fs::create_directories(root);
  tmp_ = root / cat(".tmp-", checkpoint_name(step), ".", ::getpid());
  fs::remove_all(tmp_);
  fs::create_directory(tmp_);
}

CheckpointWriter::~CheckpointWriter() {
  if (!committed_) {
    std::error_code ec;
    fs::remove_all(tmp_, ec);
  }
}

void CheckpointWriter::record(const std::string& file, const WriteStats& s) {
  files_.emplace_back(file, s);
  stats_ += s;
}

void CheckpointWriter::add_tensors(const std::string& file, const NamedTensors& tensors,
                                   const std::map<std::string, std::string>& metadata) {
  record(file, write_safetensors(tmp_ / file, tensors, metadata));
}

void CheckpointWriter::add_text(const std::string& file, std::string_view text) {
  record(file, write_synced(tmp_ / file, text));
}

fs::path CheckpointWriter::commit() {
  POLLEN_ASSERT(!committed_);
  nlohmann::ordered_json m;
  m["format"] = "pollen-checkpoint-1";
  m["step"] = step_;
  nlohmann::ordered_json files = nlohmann::ordered_json::object();
  for (const auto& [name, s] : files_) files[name] = {{"bytes", s.bytes}, {"sha256", s.sha256}};
  m["files"] = files;
  const auto ms = write_synced(tmp_ / "manifest.json", m.dump(2) + "\n");
  stats_.sync_s += ms.sync_s;
  const auto t0 = std::chrono::steady_clock::now();
  sync_folder(tmp_);
  // A folder of the same name is one that failed to verify (resume went past it) or one written
  // again with newer state (a federated server's privacy accountant after a round it accounted
  // but did not apply): it is replaced in one step, so that a crash leaves one of them.
  replace_folder(tmp_, final_);
  stats_.sync_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  committed_ = true;
  return final_;
}

std::optional<std::string> verify_checkpoint(const fs::path& dir,
                                             const std::vector<std::string>& only) {
  const fs::path mpath = dir / "manifest.json";
  if (!fs::exists(mpath)) return std::string("manifest.json is missing");
  nlohmann::json m;
  try {
    const std::string text = read_file(mpath);
    check_json_depth(text, "manifest.json");
    m = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    return cat("manifest.json is unreadable: ", e.what());
  }
  if (!m.is_object() || !m.contains("files") || !m["files"].is_object() || !m.contains("step") ||
      !m["step"].is_number_integer())
    return std::string("manifest.json lacks 'step' (an integer) or 'files'");
  // A step folder holds its own step: a copy under another step's name is not that step.
  const fs::path folder = (dir / "").parent_path().filename();
  if (int64_t named = 0;
      parse_step_name(folder.string(), &named) && named != m["step"].get<int64_t>())
    return cat("the folder is named '", folder.string(), "' but manifest.json says step ",
               m["step"].get<int64_t>());
  for (const auto& [name, info] : m["files"].items()) {
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos)
      return cat("manifest.json names '", name, "', not a file of the checkpoint's folder");
    if (!only.empty() && std::find(only.begin(), only.end(), name) == only.end()) continue;
    const fs::path p = dir / name;
    std::error_code ec;
    const auto size = fs::file_size(p, ec);
    if (ec) return cat(name, " is missing");
    if (!info.is_object() || !info.contains("bytes") || !info["bytes"].is_number_unsigned() ||
        !info.contains("sha256") || !info["sha256"].is_string())
      return cat("manifest entry for ", name, " lacks bytes (a count) or sha256 (a string)");
    if (size != info["bytes"].get<uint64_t>())
      return cat(name, " holds ", size, " bytes, manifest says ", info["bytes"].get<uint64_t>());
    const std::string sha = sha256_file(p);
    if (sha != info["sha256"].get<std::string>())
      return cat(name, " has SHA-256 ", sha.substr(0, 12), "..., manifest says ",
                 info["sha256"].get<std::string>().substr(0, 12), "...");
  }
  // Weights to be loaded that the manifest does not list were not written with the checkpoint
  // (a tokenizer.json may be put beside them by hand).
  for (const std::string& name : only) {
    if (name.ends_with(".safetensors") && !m["files"].contains(name) && fs::exists(dir / name))
      return cat(name, " is not in manifest.json: the checkpoint did not write it");
  }
  return std::nullopt;
}

int64_t checkpoint_step(const fs::path& dir) {
  try {
    return nlohmann::json::parse(read_file(dir / "manifest.json")).at("step").get<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    fail("checkpoint '", dir.string(), "': manifest.json has no integer 'step': ", e.what());
  }
}

std::vector<fs::path> list_checkpoints(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> found;
  if (!fs::is_directory(root)) return {};
  for (const auto& e : fs::directory_iterator(root)) {
    int64_t step = 0;
    if (e.is_directory() && parse_step_name(e.path().filename().string(), &step))
      found.emplace_back(step, e.path());
  }
  std::sort(found.begin(), found.end());
  std::vector<fs::path> out;
  for (auto& [s, p] : found) out.push_back(p);
  return out;
}

ResumeChoice choose_resume_checkpoint(const fs::path& root) {
  ResumeChoice c;
  auto all = list_checkpoints(root);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (auto why = verify_checkpoint(*it)) {
      c.skipped.emplace_back(*it, *why);
      continue;
    }
    c.dir = *it;
    break;
  }
  return c;
}

ResumePoint choose_checkpoint_to_resume(const fs::path& root, const std::string& who) {
  const auto choice = choose_resume_checkpoint(root);
  for (const auto& [dir, why] : choice.skipped)
    log::warn(who, ": skipping checkpoint '", dir.string(), "': ", why);
  const ResumePoint point{choice.dir, static_cast<int64_t>(choice.skipped.size())};
  if (!choice.dir) return point;
  for (const auto& [bad, why] : choice.skipped) {
    // Kept for inspection: one set aside earlier at the same step stays too (.corrupt-step-N.2).
    fs::path aside = bad.parent_path() / cat(".corrupt-", bad.filename().string());
    for (int n = 2; fs::exists(aside); ++n)
      aside = bad.parent_path() / cat(".corrupt-", bad.filename().string(), ".", n);
    fs::rename(bad, aside);
    log::warn(who, ": moved '", bad.string(), "' aside to '", aside.string(), "'");
  }
  return point;
}

std::vector<fs::path> apply_retention(const fs::path& root, int keep) {
  std::vector<fs::path> removed =
      remove_abandoned(root, {".tmp-step-", ".old-step-"}, /*step=*/true);
  if (keep > 0) {
    auto all = list_checkpoints(root);
    for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i) {
      std::error_code ignored;
      fs::remove_all(all[i], ignored);
      removed.push_back(all[i]);
    }
  }
  return removed;
}

}  // namespace pollen::io
