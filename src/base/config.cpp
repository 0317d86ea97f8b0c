#include "base/config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <sstream>

#include "base/error.h"

namespace pollen {
namespace {
const char* type_name(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::table:
      return "a table";
    case toml::node_type::array:
      return "an array";
    case toml::node_type::string:
      return "a string";
    case toml::node_type::integer:
      return "an integer";
    case toml::node_type::floating_point:
      return "a float";
    case toml::node_type::boolean:
      return "a boolean";
    default:
      return "a date or time";
  }
}
}  // namespace

ConfigTable::ConfigTable(std::shared_ptr<const toml::table> root, const toml::table* node,
                         std::string source, std::string prefix)
    : root_(std::move(root)), node_(node), source_(std::move(source)), prefix_(std::move(prefix)) {}
ConfigTable::ConfigTable(const ConfigTable&) = default;
ConfigTable& ConfigTable::operator=(const ConfigTable&) = default;
ConfigTable::~ConfigTable() = default;

ConfigTable ConfigTable::load(const std::filesystem::path& path) {
  std::ifstream in(path);
  POLLEN_CHECK(in, "cannot open config file '", path.string(), "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse(ss.str(), path.string());
}

ConfigTable ConfigTable::parse(const std::string& text, const std::string& source_name) {
  try {
    auto root = std::make_shared<const toml::table>(toml::parse(text, source_name));
    return ConfigTable(root, root.get(), source_name, "");
  } catch (const toml::parse_error& e) {
    fail("config file '", source_name, "', line ", e.source().begin.line, ", column ",
         e.source().begin.column, ": ", e.description());
  }
}

namespace {
void flatten(const toml::table& t, const std::string& prefix,
             std::map<std::string, std::string>& out) {
  for (const auto& [key, node] : t) {
    const std::string name = prefix + std::string(key.str());
    if (const toml::table* sub = node.as_table()) {
      flatten(*sub, name + ".", out);
    } else if (const auto* number = node.as_floating_point()) {
      char text[32];  // the shortest text that reads back as the value: 0.7, not 0.69999...
      const auto end = std::to_chars(text, text + sizeof text, number->get()).ptr;
      out[name] = std::string(text, end);
    } else {
      std::ostringstream value;
      node.visit([&](const auto& v) { value << v; });
      out[name] = value.str();
    }
  }
}
}  // namespace

std::map<std::string, std::string> ConfigTable::flat() const {
  std::map<std::string, std::string> out;
  flatten(*node_, prefix_, out);
  return out;
}

std::string ConfigTable::where(const std::string& key) const {
  return cat("config file '", source_, "', key '", prefix_, key, "'");
}

void ConfigTable::type_error(const std::string& key, const char* expected) const {
  fail(where(key), ": expected ", expected, ", got ", type_name(*node_->get(key)));
}

bool ConfigTable::has(const std::string& key) const {
  return node_->contains(key);
}

const void* ConfigTable::node_at(const std::string& key, const char*) {
  read_.insert(key);
  return node_->get(key);
}

int64_t ConfigTable::get_int(const std::string& key, int64_t fallback) {
  auto* n = static_cast<const toml::node*>(node_at(key, "an integer"));
  if (!n) return fallback;
  if (!n->is_integer()) type_error(key, "an integer");
  return n->as_integer()->get();
}

int64_t ConfigTable::get_int_in(const std::string& key, int64_t fallback, int64_t min,
                                int64_t max) {
  const int64_t v = get_int(key, fallback);
  POLLEN_CHECK(v >= min && v <= max, where(key), ": expected an integer from ", min, " to ", max,
               ", got ", v);
  return v;
}

namespace {

// Levenshtein distance, stopping early past `most` (only small distances matter here).
size_t edit_distance(std::string_view a, std::string_view b, size_t most) {
  if ((a.size() > b.size() ? a.size() - b.size() : b.size() - a.size()) > most) return most + 1;
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
      diagonal = up;
    }
  }
  return row[b.size()];
}

}  // namespace

std::string ConfigTable::near_miss(const std::string& key) const {
  for (const auto& [k, v] : *node_) {
    const std::string present(k.str());
    // One edit, two in a long key: "data" and "beta" (both real keys) are two apart.
    const size_t most = key.size() >= 8 ? 2 : 1;
    if (present != key && edit_distance(present, key, most) <= most)
      return cat(" ('", prefix_, present, "' is there: misspelt?)");
  }
  return "";
}

int64_t ConfigTable::require_int(const std::string& key) {
  POLLEN_CHECK(has(key), where(key), ": missing; expected an integer", near_miss(key));
  return get_int(key, 0);
}

double ConfigTable::get_double(const std::string& key, double fallback) {
  auto* n = static_cast<const toml::node*>(node_at(key, "a number"));
  if (!n) return fallback;
  if (n->is_integer()) return static_cast<double>(n->as_integer()->get());
  if (!n->is_floating_point()) type_error(key, "a number");
  // TOML allows inf and nan; no setting means them (a weight of inf hung the loader).
  const double v = n->as_floating_point()->get();
  POLLEN_CHECK(std::isfinite(v), where(key), ": expected a finite number, got ", v);
  return v;
}

double ConfigTable::require_double(const std::string& key) {
  POLLEN_CHECK(has(key), where(key), ": missing; expected a number", near_miss(key));
  return get_double(key, 0);
}

bool ConfigTable::get_bool(const std::string& key, bool fallback) {
  auto* n = static_cast<const toml::node*>(node_at(key, "a boolean"));
  if (!n) return fallback;
  if (!n->is_boolean()) type_error(key, "a boolean");
  return n->as_boolean()->get();
}

std::string ConfigTable::get_string(const std::string& key, const std::string& fallback) {
  auto* n = static_cast<const toml::node*>(node_at(key, "a string"));
  if (!n) return fallback;
  if (!n->is_string()) type_error(key, "a string");
  return n->as_string()->get();
}

std::string ConfigTable::require_string(const std::string& key) {
  POLLEN_CHECK(has(key), where(key), ": missing; expected a string", near_miss(key));
  return get_string(key, "");
}

std::vector<std::string> ConfigTable::get_strings(const std::string& key) {
  auto* n = static_cast<const toml::node*>(node_at(key, "an array of strings"));
  std::vector<std::string> out;
  if (!n) return out;
  if (!n->is_array()) type_error(key, "an array of strings");
  for (const auto& item : *n->as_array()) {
    POLLEN_CHECK(item.is_string(), where(key), ": expected an array of strings, found ",
                 type_name(item), " in it");
    out.push_back(item.as_string()->get());
  }
  return out;
}

std::vector<double> ConfigTable::get_doubles(const std::string& key) {
  auto* n = static_cast<const toml::node*>(node_at(key, "an array of numbers"));
  std::vector<double> out;
  if (!n) return out;
  if (!n->is_array()) type_error(key, "an array of numbers");
  for (const auto& item : *n->as_array()) {
    if (item.is_integer()) {
      out.push_back(static_cast<double>(item.as_integer()->get()));
    } else {
      POLLEN_CHECK(item.is_floating_point(), where(key), ": expected an array of numbers, found ",
                   type_name(item), " in it");
      out.push_back(item.as_floating_point()->get());
      POLLEN_CHECK(std::isfinite(out.back()), where(key), ": expected finite numbers, found ",
                   out.back(), " in it");
    }
  }
  return out;
}

std::optional<ConfigTable> ConfigTable::table(const std::string& key) {
  auto* n = static_cast<const toml::node*>(node_at(key, "a table"));
  if (!n) return std::nullopt;
  if (!n->is_table()) type_error(key, "a table");
  return ConfigTable(root_, n->as_table(), source_, prefix_ + key + ".");
}

void ConfigTable::finish() const {
  std::vector<std::string> unknown;
  for (const auto& [k, v] : *node_) {
    if (!read_.count(std::string(k.str()))) unknown.push_back(prefix_ + std::string(k.str()));
  }
  if (unknown.empty()) return;
  std::string list;
  for (const auto& k : unknown) list += (list.empty() ? "'" : ", '") + k + "'";
  fail("config file '", source_, "': unknown key", unknown.size() > 1 ? "s " : " ", list);
}

}  // namespace pollen
