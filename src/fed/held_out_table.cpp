#include "fed/held_out_table.h"

#include <cmath>
#include <cstdio>

namespace pollen::fed {

namespace {

std::string cell(double v) {
  if (std::isnan(v)) return "-";
  char s[32];
  std::snprintf(s, sizeof s, "%.4f", v);
  return s;
}

// s padded with spaces to width, then one space
std::string column(const std::string& s, size_t width) {
  return s + std::string(s.size() < width ? width - s.size() : 0, ' ') + " ";
}

std::string row(const std::string& first, const std::string& second, const std::string& third) {
  if (third.empty()) return column(first, 24) + second + "\n";
  return column(first, 24) + column(second, 14) + third + "\n";
}

}  // namespace

std::string held_out_table(const SimulationResult& r, const std::string& loss_header) {
  if (r.clients.empty()) return "";
  const bool headline = !r.headline.empty();
  std::string out = row("silo", loss_header, headline ? "held-out " + r.headline : "");
  bool missing = false;
  for (size_t i = 0; i < r.clients.size(); ++i) {
    out += row(r.clients[i], cell(r.eval_loss[i]), headline ? cell(r.eval_headline[i]) : "");
    missing = missing || std::isnan(r.eval_loss[i]);
  }
  if (missing) out += "-: the silo has no held-out data\n";
  return out;
}

}  // namespace pollen::fed
