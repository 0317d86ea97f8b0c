#include "base/path_labels.h"

#include <algorithm>

namespace pollen {

std::vector<std::string> distinct_folder_labels(const std::vector<std::filesystem::path>& folders) {
  std::vector<std::vector<std::string>> parts;
  for (const auto& f : folders) {
    parts.emplace_back();
    for (const auto& p : std::filesystem::absolute(f).lexically_normal())
      if (!p.empty() && p != "/") parts.back().push_back(p.string());
  }
  // The last `up` folders of folder i ("/" for the root itself).
  const auto label = [&](size_t i, size_t up) {
    const auto& ps = parts[i];
    std::string out;
    for (size_t k = ps.size() > up ? ps.size() - up : 0; k < ps.size(); ++k)
      out += (out.empty() ? "" : "/") + ps[k];
    return out.empty() ? std::string("/") : out;
  };
  std::vector<std::string> labels(folders.size());
  for (size_t i = 0; i < folders.size(); ++i) {
    for (size_t up = 1;; ++up) {
      labels[i] = label(i, up);
      const bool alone = std::none_of(parts.begin(), parts.end(), [&](const auto& other) {
        const size_t j = static_cast<size_t>(&other - parts.data());
        return other != parts[i] && label(j, up) == labels[i];
      });
      if (alone || up >= parts[i].size()) break;
    }
  }
  return labels;
}

}  // namespace pollen
