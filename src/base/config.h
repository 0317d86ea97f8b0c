#pragma once
// TOML configs read key by key: every key read is typed and checked, and finish() makes any key
// nobody read an error, so a misspelt key never turns into a silent default. Errors name the
// file, the dotted key and what was expected.
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace toml {
inline namespace v3 {
class table;
}
}  // namespace toml

namespace pollen {

// Bounds for get_int_in: any TOML integer (seeds, sizes), and a thread count (0: every core).
inline constexpr int64_t kConfigIntMax = std::numeric_limits<int64_t>::max();
inline constexpr int64_t kConfigThreadsMax = int64_t{1} << 16;

class ConfigTable {
 public:
  // Parses a TOML file; a syntax error names the file, line and column.
  static ConfigTable load(const std::filesystem::path& path);
  static ConfigTable parse(const std::string& text, const std::string& source_name);

  ConfigTable(const ConfigTable&);
  ConfigTable& operator=(const ConfigTable&);
  ~ConfigTable();

  bool has(const std::string& key) const;
  int64_t get_int(const std::string& key, int64_t fallback);
  int64_t require_int(const std::string& key);
  // An integer from min to max: a value outside names the key and the range, rather than
  // wrapping where it is narrowed (a thread count of 2^32 read as 0, a negative seed as 2^64 - 1).
  int64_t get_int_in(const std::string& key, int64_t fallback, int64_t min, int64_t max);
  double get_double(const std::string& key, double fallback);  // integers are accepted too
  double require_double(const std::string& key);
  bool get_bool(const std::string& key, bool fallback);
  std::string get_string(const std::string& key, const std::string& fallback);
  std::string require_string(const std::string& key);
  std::vector<std::string> get_strings(const std::string& key);
  std::vector<double> get_doubles(const std::string& key);  // integers are accepted too
  std::optional<ConfigTable> table(const std::string& key);

  // Throws naming every key that was present but never read.
  void finish() const;
  // For a key that is missing: " ('noise_multipler' is there: misspelt?)" when the table holds a
  // key one edit from it (two for a key of eight characters or more), else "".
  std::string near_miss(const std::string& key) const;

  // Every key of the table and the tables under it, dotted from this table's prefix, with its
  // value as TOML writes it: what a run can record of its config and compare on resume.
  std::map<std::string, std::string> flat() const;

  // "file 'x.toml', key 'model.hidden'"
  std::string where(const std::string& key) const;
  // The file (or text) the table was read from, as where() names it.
  const std::string& source() const { return source_; }

 private:
  ConfigTable(std::shared_ptr<const toml::table> root, const toml::table* node, std::string source,
              std::string prefix);
  const void* node_at(const std::string& key, const char* expected);
  [[noreturn]] void type_error(const std::string& key, const char* expected) const;

  std::shared_ptr<const toml::table> root_;
  const toml::table* node_;
  std::string source_;
  std::string prefix_;
  std::set<std::string> read_;
};

}  // namespace pollen
