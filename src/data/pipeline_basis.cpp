// What a run's saved outputs depend on (its basis), and the words for what changed when a rerun
// cannot reuse them: the config keys, the input files, the rest by what it is.
#include <map>
#include <set>

#include "base/hash.h"
#include "base/log.h"
#include "data/pipeline_internal.h"

namespace pollen::data {

using json = nlohmann::json;

namespace {

// Every leaf of a config as "section.key" -> its JSON text (lists whole).
void flatten(const json& j, const std::string& prefix, std::map<std::string, std::string>& out) {
  if (j.is_object() && !j.empty()) {
    for (const auto& [k, v] : j.items()) flatten(v, prefix.empty() ? k : prefix + "." + k, out);
    return;
  }
  out[prefix] = j.dump();
}

// The first few names, then how many more.
std::string some(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 4; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > 4) out += cat(" and ", names.size() - 4, " more");
  return out;
}

void changes(const json& saved, const json& now, std::set<std::string>& out) {
  for (const auto& [key, value] : now.items()) {
    if (!saved.contains(key)) {
      out.insert("its record is of an earlier pollen");
    } else if (saved[key] == value) {
      continue;
    } else if (key == "config") {
      std::map<std::string, std::string> a, b;
      flatten(saved[key], "", a);
      flatten(value, "", b);
      std::vector<std::string> keys;
      for (const auto& [k, v] : b)
        if (!a.count(k) || a[k] != v) keys.push_back(k);
      for (const auto& [k, v] : a)
        if (!b.count(k)) keys.push_back(k);
      if (!keys.empty()) out.insert("config keys " + some(keys));
    } else if (key == "files") {
      std::map<std::string, json> a, b;
      for (const auto& f : saved[key])
        if (f.is_array() && !f.empty() && f[0].is_string()) a[f[0].get<std::string>()] = f;
      for (const auto& f : value) b[f[0].get<std::string>()] = f;
      std::vector<std::string> changed, added, removed;
      for (const auto& [name, f] : b) {
        if (!a.count(name))
          added.push_back(name);
        else if (a[name] != f)
          changed.push_back(name);
      }
      for (const auto& [name, f] : a)
        if (!b.count(name)) removed.push_back(name);
      if (!changed.empty()) out.insert("input files changed (size or time): " + some(changed));
      if (!added.empty()) out.insert("input files added: " + some(added));
      if (!removed.empty()) out.insert("input files gone: " + some(removed));
    } else if (key == "pass1") {
      changes(saved[key], value, out);
    } else if (key == "contents") {
      out.insert("the tokenizer's or eval files' contents");
    } else if (key == "pass1_docs") {
      out.insert("pass 1's output");
    } else if (key == "v") {
      out.insert("what this pollen's filters decide");
    }
  }
}

}  // namespace

std::string pass1_key(const json& basis) {
  return sha256_hex(basis.dump());
}

bool resume_point_matches(const json& saved, const std::string& key, const json& basis,
                          const std::filesystem::path& path, int pass) {
  if (!saved.is_discarded() && saved.value("key", "") == key) return true;
  log::warn("data: the resume point of an interrupted pass ", pass, " ('", path.string(),
            "') is of another config or inputs (",
            basis_changes(saved.is_object() ? saved.value("basis", json()) : json(), basis),
            "); pass ", pass, " starts over");
  return false;
}

std::string basis_changes(const json& saved, const json& now) {
  if (!saved.is_object()) return "its record is of an earlier pollen";
  std::set<std::string> found;
  changes(saved, now, found);
  std::string out;
  for (const auto& f : found) out += (out.empty() ? "" : "; ") + f;
  return out.empty() ? "its record does not say" : out;
}

}  // namespace pollen::data
