#pragma once
// Short names that tell folders apart: a folder's own name, with as many folders above it as it
// takes for no two of a list to share one (a/fort and b/fort, silo-a/run and silo-b/run).
#include <filesystem>
#include <string>
#include <vector>

namespace pollen {

// One label per folder, in order. Folders are taken absolute and normalised; one given twice
// gets the same label.
std::vector<std::string> distinct_folder_labels(const std::vector<std::filesystem::path>& folders);

}  // namespace pollen
