#pragma once
// What an objective's data is, as its checkpoints record it, so that a resumed run notices data
// that changed under it: its data position, its stored batch or its cached references would then
// stand for other examples.
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "base/hash.h"
#include "train/objective.h"

namespace pollen::train {

// Adds to `key` the SHA-256 of the data file and of the held-out file (empty: none), the
// tokenizer's fingerprint and the chat template: what turns the files into tokens.
void add_data_identity(Sha256& key, const std::filesystem::path& data,
                       const std::filesystem::path& validation, const ObjectiveContext& context);

// The hex SHA-256 of add_data_identity alone.
std::string data_key(const std::filesystem::path& data, const std::filesystem::path& validation,
                     const ObjectiveContext& context);

// A resumed run's check: the checkpoint's objective state holds "data_key" (older checkpoints may
// not, and are taken as they are) and it must be `key`. `files` names the data in the error
// ("sft.data 'a.jsonl', sft.validation 'b.jsonl'").
void check_data_key(const nlohmann::ordered_json& state, const std::string& key,
                    const std::string& objective, const std::string& files);

}  // namespace pollen::train
