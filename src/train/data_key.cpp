#include "train/data_key.h"

#include "base/error.h"

namespace pollen::train {

void add_data_identity(Sha256& key, const std::filesystem::path& data,
                       const std::filesystem::path& validation, const ObjectiveContext& context) {
  key.update(sha256_file(data));
  key.update(validation.empty() ? std::string("-") : sha256_file(validation));
  key.update(context.tokenizer->fingerprint());
  key.update(tokenizer::chat_template_name(context.chat_format.kind));
  key.update(context.chat_format.default_system.value_or("-"));
}

std::string data_key(const std::filesystem::path& data, const std::filesystem::path& validation,
                     const ObjectiveContext& context) {
  Sha256 key;
  add_data_identity(key, data, validation, context);
  return key.hex_digest();
}

void check_data_key(const nlohmann::ordered_json& state, const std::string& key,
                    const std::string& objective, const std::string& files) {
  if (!state.contains("data_key")) return;  // written before checkpoints recorded it
  const nlohmann::ordered_json& saved = state["data_key"];
  POLLEN_CHECK(saved.is_string(), objective,
               ": the checkpoint's objective state has a data_key that is not a string");
  POLLEN_CHECK(saved.get<std::string>() == key, objective, ": cannot resume: the data (", files,
               "), the tokenizer or the chat template changed since the checkpoint was written; "
               "resume with the run's own data, or start a new run");
}

}  // namespace pollen::train
