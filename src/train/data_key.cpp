#include "train/data_key.h"

#include "base/error.h"
#include "base/hash.h"

namespace pollen::train {

namespace {

std::string quoted_file(const std::string& key, const std::filesystem::path& file) {
  return file.empty() ? cat(key, " (none)") : cat(key, " '", file.string(), "'");
}

std::string listed(const std::vector<std::string>& items) {
  std::string out;
  for (const std::string& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

// A value as an error shows it: hashes shortened.
std::string shown(const std::string& value) {
  return value.size() == 64 ? value.substr(0, 12) : cat("\"", value, "\"");
}

}  // namespace

DataIdentity::DataIdentity(const std::string& data_key, const std::filesystem::path& data,
                           const std::string& validation_key,
                           const std::filesystem::path& validation,
                           const ObjectiveContext& context) {
  add("data", quoted_file(data_key, data), sha256_file(data));
  add("validation", quoted_file(validation_key, validation),
      validation.empty() ? std::string("-") : sha256_file(validation));
  add("tokenizer", "the tokenizer", context.tokenizer->fingerprint());
  add("chat_template", "the chat template",
      std::string(tokenizer::chat_template_name(context.chat_format.kind)));
  add("system_prompt", "the chat template's default system prompt",
      context.chat_format.default_system.value_or("-"));
}

void DataIdentity::add(const std::string& id, const std::string& name, const std::string& value) {
  parts_.push_back({id, name, value});
}

std::string DataIdentity::key() const {
  Sha256 key;
  for (const Part& part : parts_) key.update(part.value);
  return key.hex_digest();
}

nlohmann::ordered_json DataIdentity::state() const {
  nlohmann::ordered_json parts = nlohmann::ordered_json::object();
  for (const Part& part : parts_) parts[part.id] = part.value;
  return {{"data_key", key()}, {"data_parts", parts}};
}

void DataIdentity::check(const nlohmann::ordered_json& state, const std::string& objective) const {
  if (!state.contains("data_key")) return;  // written before checkpoints recorded it
  const nlohmann::ordered_json& saved = state["data_key"];
  POLLEN_CHECK(saved.is_string(), objective,
               ": the checkpoint's objective state has a data_key that is not a string");
  if (saved.get<std::string>() == key()) return;
  const nlohmann::ordered_json parts = state.value("data_parts", nlohmann::ordered_json::object());
  std::vector<std::string> changed;
  if (parts.is_object() && !parts.empty()) {
    for (const Part& part : parts_) {
      if (!parts.contains(part.id) || !parts[part.id].is_string())
        changed.push_back(cat(part.name, " (not recorded then)"));
      else if (parts[part.id].get<std::string>() != part.value)
        changed.push_back(cat(part.name, " (", shown(parts[part.id].get<std::string>()), " then, ",
                              shown(part.value), " now)"));
    }
  }
  if (changed.empty()) {  // recorded before the parts were
    std::vector<std::string> files;
    for (const Part& part : parts_)
      if (part.id == "data" || part.id == "validation") files.push_back(part.name);
    changed = {cat("the data (", listed(files), "), the tokenizer or the chat template")};
  }
  fail(objective, ": cannot resume: ", listed(changed),
       " changed since the checkpoint was written; resume with the run's own data, or start a "
       "new run");
}

}  // namespace pollen::train
