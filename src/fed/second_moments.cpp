#include "fed/second_moments.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "base/error.h"

namespace pollen::fed {

namespace {

bool is_matrix(const ParamSpec& s) {
  return s.shape.size() == 2;
}

// How many values one tensor's factored form has.
int64_t factored_values(const ParamSpec& s) {
  return is_matrix(s) ? s.shape[0] + s.shape[1] : shape_numel(s.shape);
}

// Where the k-th tensor's values start in the factored form.
int64_t factored_offset(const ParamSpecs& specs, size_t k) {
  int64_t n = 0;
  for (size_t i = 0; i < k; ++i) n += factored_values(specs[i]);
  return n;
}

}  // namespace

int64_t factored_size(const ParamSpecs& specs) {
  return factored_offset(specs, specs.size());
}

void add_factor_sums(const ParamSpecs& specs, size_t k, int64_t first, const float* v,
                     int64_t count, std::vector<double>& sums) {
  POLLEN_ASSERT(k < specs.size() && first >= 0 && first + count <= shape_numel(specs[k].shape) &&
                static_cast<int64_t>(sums.size()) == factored_size(specs));
  double* s = sums.data() + factored_offset(specs, k);
  if (!is_matrix(specs[k])) {
    for (int64_t e = 0; e < count; ++e) s[first + e] += v[e];
    return;
  }
  // [rows, cols], walked row by row from element `first` (row first / cols, column first % cols)
  const int64_t rows = specs[k].shape[0], cols = specs[k].shape[1];
  double* row = s;
  double* col = s + rows;
  for (int64_t e = first, end = first + count; e < end;) {
    const int64_t i = e / cols, j0 = e % cols, n = std::min(cols - j0, end - e);
    const float* x = v + (e - first);
    for (int64_t j = 0; j < n; ++j) {
      row[i] += x[j];
      col[j0 + j] += x[j];
    }
    e += n;
  }
}

std::vector<float> factor_means(const ParamSpecs& specs, const std::vector<double>& sums) {
  POLLEN_ASSERT(static_cast<int64_t>(sums.size()) == factored_size(specs));
  std::vector<float> out;
  out.reserve(sums.size());
  const double* s = sums.data();
  for (const auto& spec : specs) {
    if (!is_matrix(spec)) {
      for (int64_t j = 0; j < shape_numel(spec.shape); ++j) out.push_back(static_cast<float>(*s++));
      continue;
    }
    const int64_t rows = spec.shape[0], cols = spec.shape[1];
    for (int64_t i = 0; i < rows; ++i) out.push_back(static_cast<float>(*s++ / cols));
    for (int64_t j = 0; j < cols; ++j) out.push_back(static_cast<float>(*s++ / rows));
  }
  return out;
}

std::vector<float> factor_second_moments(const ParamSpecs& specs,
                                         const std::vector<const Tensor*>& v) {
  POLLEN_ASSERT(v.size() == specs.size());
  std::vector<double> sums(static_cast<size_t>(factored_size(specs)), 0.0);
  for (size_t k = 0; k < specs.size(); ++k) {
    POLLEN_ASSERT(v[k]->shape() == specs[k].shape && v[k]->dtype() == DType::f32);
    add_factor_sums(specs, k, 0, v[k]->data<float>(), v[k]->numel(), sums);
  }
  return factor_means(specs, sums);
}

void expand_second_moments_range(const ParamSpecs& specs, const std::vector<float>& factored,
                                 size_t k, int64_t first, int64_t count, float* out) {
  POLLEN_ASSERT(k < specs.size() && first >= 0 && first + count <= shape_numel(specs[k].shape) &&
                static_cast<int64_t>(factored.size()) == factored_size(specs));
  const float* f = factored.data() + factored_offset(specs, k);
  if (!is_matrix(specs[k])) {
    std::copy(f + first, f + first + count, out);
    return;
  }
  const int64_t rows = specs[k].shape[0], cols = specs[k].shape[1];
  const float* row = f;
  const float* col = f + rows;
  double mean = 0;
  for (int64_t i = 0; i < rows; ++i) mean += row[i];
  mean /= static_cast<double>(rows);
  // Clamped to float32's range: hostile or extreme means must not make v infinite.
  const double most = std::numeric_limits<float>::max();
  for (int64_t e = first, end = first + count; e < end;) {
    const int64_t i = e / cols, j0 = e % cols, n = std::min(cols - j0, end - e);
    float* o = out + (e - first);
    for (int64_t j = 0; j < n; ++j) {
      const double value = mean > 0 ? static_cast<double>(row[i]) * col[j0 + j] / mean : 0.0;
      o[j] = static_cast<float>(std::min(value, most));
    }
    e += n;
  }
}

void expand_second_moments(const ParamSpecs& specs, const std::vector<float>& factored,
                           const std::vector<Tensor*>& v) {
  POLLEN_ASSERT(v.size() == specs.size());
  for (size_t k = 0; k < specs.size(); ++k) {
    POLLEN_ASSERT(v[k]->shape() == specs[k].shape && v[k]->dtype() == DType::f32);
    expand_second_moments_range(specs, factored, k, 0, v[k]->numel(), v[k]->data<float>());
  }
}

std::vector<float> average_second_moments(const std::vector<const std::vector<float>*>& factored,
                                          const std::vector<double>& weights) {
  POLLEN_ASSERT(!factored.empty() && factored.size() == weights.size());
  const size_t n = factored.front()->size();
  std::vector<double> sum(n, 0.0);
  double total = 0;
  for (size_t c = 0; c < factored.size(); ++c) {
    POLLEN_ASSERT(factored[c]->size() == n);
    for (size_t j = 0; j < n; ++j) sum[j] += weights[c] * (*factored[c])[j];
    total += weights[c];
  }
  POLLEN_ASSERT(total > 0);
  std::vector<float> out(n);
  for (size_t j = 0; j < n; ++j) out[j] = static_cast<float>(sum[j] / total);
  return out;
}

void check_second_moments(const float* values, int64_t count, int64_t size,
                          const std::string& what) {
  POLLEN_CHECK(count == size, what, ": ", count, " second-moment values, the model's factored ",
               "second moments have ", size);
  for (int64_t j = 0; j < count; ++j) {
    POLLEN_CHECK(std::isfinite(values[j]) && values[j] >= 0, what, ": second-moment value ", j,
                 " is ", values[j], "; they are finite and not negative");
  }
}

namespace {

// The factored form's segments: each matrix's row means and column means, each other tensor.
std::vector<int64_t> segment_sizes(const ParamSpecs& specs) {
  std::vector<int64_t> out;
  for (const auto& s : specs) {
    if (is_matrix(s)) {
      out.push_back(s.shape[0]);
      out.push_back(s.shape[1]);
    } else {
      out.push_back(shape_numel(s.shape));
    }
  }
  return out;
}

constexpr double kLevels = 254;  // the steps between codes 1 and 255

void put_f32(std::string& out, float f) {
  char b[4];
  std::memcpy(b, &f, 4);
  out.append(b, 4);
}

float get_f32(const std::string& bytes, size_t at) {
  float f;
  std::memcpy(&f, bytes.data() + at, 4);
  return f;
}

}  // namespace

std::string pack_second_moments(const ParamSpecs& specs, const std::vector<float>& factored) {
  if (factored.empty()) return {};
  POLLEN_ASSERT(static_cast<int64_t>(factored.size()) == factored_size(specs));
  std::string out;
  const float* v = factored.data();
  for (int64_t n : segment_sizes(specs)) {
    double lo = 0, hi = 0;
    bool any = false;
    for (int64_t j = 0; j < n; ++j) {
      POLLEN_ASSERT(std::isfinite(v[j]) && v[j] >= 0);
      if (v[j] <= 0) continue;
      const double l = std::log2(static_cast<double>(v[j]));
      lo = any ? std::min(lo, l) : l;
      hi = any ? std::max(hi, l) : l;
      any = true;
    }
    // lo and hi as sent: decoding uses the float32 values, so coding does too (hi below 128
    // even for a value within float rounding of float32's largest)
    const float hi32 = std::min(static_cast<float>(hi), std::nextafter(128.0f, 0.0f));
    const float lo32 = std::min(static_cast<float>(lo), hi32);
    put_f32(out, lo32);
    put_f32(out, hi32);
    const double span = static_cast<double>(hi32) - lo32;
    for (int64_t j = 0; j < n; ++j) {
      if (v[j] <= 0) {
        out.push_back('\0');
        continue;
      }
      const double t = span > 0 ? (std::log2(static_cast<double>(v[j])) - lo32) / span : 0.0;
      const double code = 1 + std::nearbyint(std::clamp(t, 0.0, 1.0) * kLevels);
      out.push_back(static_cast<char>(static_cast<uint8_t>(code)));
    }
    v += n;
  }
  return out;
}

std::vector<float> unpack_second_moments(const ParamSpecs& specs, const std::string& bytes,
                                         const std::string& what) {
  const std::vector<int64_t> segments = segment_sizes(specs);
  const auto want = static_cast<size_t>(factored_size(specs)) + 8 * segments.size();
  POLLEN_CHECK(bytes.size() == want, what, ": ", bytes.size(),
               " bytes of second moments; the model's factored second moments take ", want);
  std::vector<float> out;
  out.reserve(static_cast<size_t>(factored_size(specs)));
  size_t at = 0;
  for (size_t k = 0; k < segments.size(); ++k) {
    const float lo = get_f32(bytes, at), hi = get_f32(bytes, at + 4);
    at += 8;
    POLLEN_CHECK(std::isfinite(lo) && std::isfinite(hi) && lo <= hi && hi < 128, what,
                 ": second-moment segment ", k, " has log2 range [", lo, ", ", hi,
                 "]; expected finite lo <= hi < 128");
    const double span = static_cast<double>(hi) - lo;
    for (int64_t j = 0; j < segments[k]; ++j, ++at) {
      const auto c = static_cast<uint8_t>(bytes[at]);
      out.push_back(c == 0 ? 0.0f : static_cast<float>(std::exp2(lo + (c - 1) * span / kLevels)));
    }
  }
  check_second_moments(out.data(), static_cast<int64_t>(out.size()), factored_size(specs), what);
  return out;
}

}  // namespace pollen::fed
