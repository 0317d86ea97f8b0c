#include "obs/plot.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "base/error.h"
#include "base/json_depth.h"
#include "base/log.h"
#include "base/path_labels.h"

namespace pollen::obs {
namespace {

constexpr const char* kColours[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                                    "#9467bd", "#8c564b", "#e377c2", "#17becf"};

std::string fmt(double v) {
  char buf[32];
  const double a = std::fabs(v);
  if (v == 0) return "0";
  if (a >= 1e9)
    std::snprintf(buf, sizeof(buf), "%.3gG", v / 1e9);
  else if (a >= 1e6)
    std::snprintf(buf, sizeof(buf), "%.3gM", v / 1e6);
  else if (a >= 1e4)
    std::snprintf(buf, sizeof(buf), "%.3gk", v / 1e3);
  else if (a < 1e-2)
    std::snprintf(buf, sizeof(buf), "%.2g", v);
  else
    std::snprintf(buf, sizeof(buf), "%.4g", v);
  return buf;
}

std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '<')
      o += "&lt;";
    else if (c == '>')
      o += "&gt;";
    else if (c == '&')
      o += "&amp;";
    else if (c == '"')
      o += "&quot;";
    else
      o += c;
  }
  return o;
}

// About five round ticks covering [lo, hi].
std::vector<double> ticks(double lo, double hi) {
  const double span = hi - lo;
  const double raw = span / 5;
  const double mag = std::pow(10, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (raw <= m * mag) {
      step = m * mag;
      break;
    }
  std::vector<double> t;
  // Each tick from its index (adding steps would pile up rounding: -1.4e-17 for 0).
  const double first = std::ceil(lo / step);
  for (double k = first; k * step <= hi + step * 1e-9; ++k)
    t.push_back(std::abs(k) < 0.5 ? 0.0 : k * step);
  return t;
}

struct Panel {
  double left, top, width, height;
  double x0, x1, y0, y1;
  double px(double x) const { return left + (x - x0) / (x1 - x0) * width; }
  double py(double y) const { return top + height - (y - y0) / (y1 - y0) * height; }
};

void range_of(const std::vector<const Curve*>& curves, double* lo, double* hi, bool x) {
  *lo = INFINITY;
  *hi = -INFINITY;
  for (const Curve* c : curves)
    for (double v : x ? c->x : c->y) {
      *lo = std::min(*lo, v);
      *hi = std::max(*hi, v);
    }
  if (!std::isfinite(*lo)) *lo = 0, *hi = 1;
  if (*hi - *lo < 1e-12 * std::max(1.0, std::fabs(*hi))) {
    *lo -= std::max(1e-12, std::fabs(*lo) * 0.05);
    *hi += std::max(1e-12, std::fabs(*hi) * 0.05);
  }
}

void axes(std::ostringstream& o, const Panel& p, const std::string& ylabel, bool xlabel) {
  o << "<rect x='" << p.left << "' y='" << p.top << "' width='" << p.width << "' height='"
    << p.height << "' fill='none' stroke='#444'/>\n";
  for (double t : ticks(p.x0, p.x1)) {
    o << "<line x1='" << p.px(t) << "' y1='" << p.top << "' x2='" << p.px(t) << "' y2='"
      << p.top + p.height << "' stroke='#ddd'/>\n";
    o << "<text x='" << p.px(t) << "' y='" << p.top + p.height + 16 << "' text-anchor='middle'>"
      << fmt(t) << "</text>\n";
  }
  for (double t : ticks(p.y0, p.y1)) {
    o << "<line x1='" << p.left << "' y1='" << p.py(t) << "' x2='" << p.left + p.width << "' y2='"
      << p.py(t) << "' stroke='#ddd'/>\n";
    o << "<text x='" << p.left - 6 << "' y='" << p.py(t) + 4 << "' text-anchor='end'>" << fmt(t)
      << "</text>\n";
  }
  o << "<text x='" << p.left - 52 << "' y='" << p.top + p.height / 2
    << "' text-anchor='middle' transform='rotate(-90 " << p.left - 52 << " " << p.top + p.height / 2
    << ")'>" << ylabel << "</text>\n";
  if (xlabel)
    o << "<text x='" << p.left + p.width / 2 << "' y='" << p.top + p.height + 36
      << "' text-anchor='middle'>tokens</text>\n";
}

void polyline(std::ostringstream& o, const Panel& p, const Curve& c, const char* colour,
              const char* extra) {
  if (c.x.empty()) return;
  o << "<polyline fill='none' stroke='" << colour << "' stroke-width='1.5' " << extra
    << " points='";
  for (size_t i = 0; i < c.x.size(); ++i) o << p.px(c.x[i]) << "," << p.py(c.y[i]) << " ";
  o << "'/>\n";
}

}  // namespace

RunCurves read_run_curves(const std::filesystem::path& run) {
  const std::filesystem::path file =
      std::filesystem::is_directory(run) ? run / "metrics.jsonl" : run;
  std::ifstream in(file);
  POLLEN_CHECK(in.good(), "cannot read '", file.string(), "' (is '", run.string(),
               "' a run folder of pollen train?)");
  RunCurves r;
  r.file = file;
  // Runs are told apart by their folders (one run file with other --set values makes runs of
  // one run.name).
  // runs/r3/ (a trailing separator, as shells complete it) is named r3 as runs/r3 is, and a bare
  // metrics.jsonl by the folder it is in.
  std::filesystem::path folder = std::filesystem::is_directory(run) ? run : run.parent_path();
  if (folder.empty()) folder = ".";
  const auto last_name = [](const std::filesystem::path& p) {
    return p.filename().empty() ? p.parent_path().filename().string() : p.filename().string();
  };
  r.name = last_name(folder.lexically_normal());
  if (r.name.empty() || r.name == ".")
    r.name = last_name(std::filesystem::absolute(folder).lexically_normal());
  std::string line;
  int64_t n = 0;
  double fed_tokens = 0;  // a federation's tokens trained over the rounds so far
  while (std::getline(in, line)) {
    ++n;
    if (line.empty()) continue;
    if (in.eof()) {
      // No line end: the record a crash cut short (or one being written now).
      log::warn("'", file.string(), "' line ", n, ": unfinished (no line end); left out");
      break;
    }
    nlohmann::json j;
    check_json_depth(line, cat("'", file.string(), "' line ", n));
    try {
      j = nlohmann::json::parse(line);
    } catch (const std::exception& e) {
      fail("'", file.string(), "' line ", n, ": not JSON: ", e.what());
    }
    if (!j.contains("tokens") || !j["tokens"].is_number()) continue;
    if (j.contains("round") && j.contains("train_loss")) {
      // A federated server's round: the global model's evaluation before it trained, its
      // clients' train loss after; tokens count up over the rounds.
      const double before = fed_tokens;
      fed_tokens += j["tokens"].get<double>();
      auto add_at = [&](const char* key, double x, Curve& c) {
        if (j[key].is_number() && std::isfinite(j[key].get<double>())) {
          c.x.push_back(x);
          c.y.push_back(j[key].get<double>());
        }
      };
      add_at("train_loss", fed_tokens, r.train_loss);
      if (j.contains("eval_loss")) add_at("eval_loss", before, r.val_loss);
      continue;
    }
    const double x = j["tokens"].get<double>();
    auto add = [&](const char* key, Curve& c) {
      if (j.contains(key) && j[key].is_number() && std::isfinite(j[key].get<double>())) {
        c.x.push_back(x);
        c.y.push_back(j[key].get<double>());
      }
    };
    add("loss", r.train_loss);
    add("val_loss", r.val_loss);
    add("lr", r.lr);
  }
  const std::filesystem::path evals = file.parent_path() / "eval.jsonl";
  std::ifstream ein(evals);
  n = 0;
  while (ein && std::getline(ein, line)) {
    ++n;
    if (line.empty()) continue;
    if (ein.eof()) {
      log::warn("'", evals.string(), "' line ", n, ": unfinished (no line end); left out");
      break;
    }
    check_json_depth(line, cat("'", evals.string(), "' line ", n));
    const auto j = nlohmann::json::parse(line, nullptr, false);
    POLLEN_CHECK(!j.is_discarded() && j.is_object() && j.contains("tokens") &&
                     j["tokens"].is_number() && j.contains("loss") &&
                     (j["loss"].is_number() || j["loss"].is_null()) && j.contains("data") &&
                     j["data"].is_string() && (!j.contains("split") || j["split"].is_string()),
                 "'", evals.string(), "' line ", n,
                 ": expected a JSON object with tokens, loss (a number, or null when not finite), "
                 "data and split (strings)");
    if (j["loss"].is_null()) continue;  // a checkpoint whose loss was not finite: no point
    // One curve per dataset, split and window (evaluations at two windows are two curves).
    std::string data = j["data"].get<std::string>() + " [" + j.value("split", "") + "]";
    if (j.contains("seq") && j["seq"].is_number_integer())
      data += cat(" seq ", j["seq"].get<int64_t>());
    auto it = std::find_if(r.checkpoint_loss.begin(), r.checkpoint_loss.end(),
                           [&](const auto& c) { return c.first == data; });
    if (it == r.checkpoint_loss.end()) it = r.checkpoint_loss.insert(it, {data, Curve{}});
    it->second.x.push_back(j["tokens"].get<double>());
    it->second.y.push_back(j["loss"].get<double>());
  }
  return r;
}

void name_runs_apart(std::vector<RunCurves>& curves,
                     const std::vector<std::filesystem::path>& runs) {
  std::vector<std::filesystem::path> folders;
  for (const auto& run : runs)
    folders.push_back(std::filesystem::is_directory(run) ? run : run.parent_path());
  const std::vector<std::string> names = distinct_folder_labels(folders);
  for (size_t i = 0; i < curves.size(); ++i) curves[i].name = names[i];
}

std::string plot_svg(const std::vector<RunCurves>& runs) {
  constexpr double W = 900, H = 640;
  std::vector<const Curve*> losses, lrs;
  for (const auto& r : runs) {
    losses.push_back(&r.train_loss);
    losses.push_back(&r.val_loss);
    for (const auto& [data, c] : r.checkpoint_loss) losses.push_back(&c);
    lrs.push_back(&r.lr);
  }
  double x0, x1, y0, y1, l0, l1, d0, d1;
  range_of(losses, &x0, &x1, true);
  range_of(lrs, &d0, &d1, true);
  x0 = std::min(x0, d0);
  x1 = std::max(x1, d1);
  range_of(losses, &y0, &y1, false);
  range_of(lrs, &l0, &l1, false);
  l0 = std::min(l0, 0.0);
  const double pad = (y1 - y0) * 0.05;
  const Panel top{80, 40, W - 110, 340, x0, x1, y0 - pad, y1 + pad};
  const Panel bottom{80, 440, W - 110, 140, x0, x1, l0, l1 * 1.05};

  std::ostringstream o;
  o << "<svg xmlns='http://www.w3.org/2000/svg' width='" << W << "' height='" << H
    << "' viewBox='0 0 " << W << " " << H
    << "' font-family='sans-serif' font-size='12'>\n<rect width='100%' height='100%' "
       "fill='white'/>\n";
  o << "<text x='" << W / 2
    << "' y='22' text-anchor='middle' font-size='15'>loss (solid: train; dashed, dots: "
       "validation; dotted, squares: pollen eval --run)</text>\n";
  axes(o, top, "loss", false);
  axes(o, bottom, "learning rate", true);
  for (size_t i = 0; i < runs.size(); ++i) {
    const char* c = kColours[i % std::size(kColours)];
    polyline(o, top, runs[i].train_loss, c, "opacity='0.8'");
    polyline(o, top, runs[i].val_loss, c, "stroke-dasharray='6,4'");
    for (size_t k = 0; k < runs[i].val_loss.x.size(); ++k)
      o << "<circle cx='" << top.px(runs[i].val_loss.x[k]) << "' cy='"
        << top.py(runs[i].val_loss.y[k]) << "' r='3' fill='" << c << "'/>\n";
    for (const auto& [data, curve] : runs[i].checkpoint_loss) {
      polyline(o, top, curve, c, "stroke-dasharray='2,3'");
      for (size_t k = 0; k < curve.x.size(); ++k)
        o << "<rect x='" << top.px(curve.x[k]) - 3 << "' y='" << top.py(curve.y[k]) - 3
          << "' width='6' height='6' fill='" << c << "'><title>" << esc(data)
          << "</title></rect>\n";
    }
    polyline(o, bottom, runs[i].lr, c, "");
    const double ly = top.top + 16 + 18 * static_cast<double>(i);
    o << "<line x1='" << top.left + top.width - 190 << "' y1='" << ly - 4 << "' x2='"
      << top.left + top.width - 165 << "' y2='" << ly - 4 << "' stroke='" << c
      << "' stroke-width='3'/>\n<text x='" << top.left + top.width - 160 << "' y='" << ly << "'>"
      << esc(runs[i].name) << "</text>\n";
  }
  o << "</svg>\n";
  return o.str();
}

}  // namespace pollen::obs
