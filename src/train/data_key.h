#pragma once
// What an objective's data is, as its checkpoints record it, so that a resumed run notices data
// that changed under it: its data position, its stored batch or its cached references would then
// stand for other examples.
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "train/objective.h"

namespace pollen::train {

// The parts that turn an objective's files into its examples, each with how errors name it.
class DataIdentity {
 public:
  // The data file under `data_key` and the held-out file (empty: none) under `validation_key`
  // ("sft.data", "sft.validation"): their SHA-256; the tokenizer's fingerprint; the chat template
  // and its default system prompt.
  DataIdentity(const std::string& data_key, const std::filesystem::path& data,
               const std::string& validation_key, const std::filesystem::path& validation,
               const ObjectiveContext& context);

  // One more part (`name` as errors say it, `value` what must stay the same).
  void add(const std::string& id, const std::string& name, const std::string& value);

  // The hex SHA-256 over every part's value, in order: the checkpoints' "data_key".
  std::string key() const;
  // {"data_key": key(), "data_parts": {id: value, ...}}, for an objective's state.
  nlohmann::ordered_json state() const;

  // A resumed run's check of the checkpoint's objective state. Older checkpoints may hold no
  // "data_key" (taken as they are) or no "data_parts" (a change is then told without naming the
  // part). `objective` starts the error ("sft").
  void check(const nlohmann::ordered_json& state, const std::string& objective) const;

 private:
  struct Part {
    std::string id, name, value;
  };
  std::vector<Part> parts_;
};

}  // namespace pollen::train
