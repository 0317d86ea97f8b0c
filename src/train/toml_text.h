#pragma once
// TOML text of a parsed node, as run files are written back (resolved configs, --set).
#include <toml++/toml.h>

#include <string>

namespace pollen::train {

// Every string as a one-line basic string with escapes: toml++'s multi-line literal form would
// lose a line break that opens the string (TOML drops one right after the opening quotes), and
// its one-line literal form would hold a line break raw, which TOML refuses.
std::string toml_text(const toml::node& node);

}  // namespace pollen::train
