#include "fed/second_moments.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "base/error.h"

namespace pollen::fed {

namespace {
bool is_matrix(const ParamSpec& s) {
  return s.shape.size() == 2;
}
}  // namespace

int64_t factored_size(const ParamSpecs& specs) {
  int64_t n = 0;
  for (const auto& s : specs) n += is_matrix(s) ? s.shape[0] + s.shape[1] : shape_numel(s.shape);
  return n;
}

std::vector<float> factor_second_moments(const ParamSpecs& specs,
                                         const std::vector<const Tensor*>& v) {
  POLLEN_ASSERT(v.size() == specs.size());
  std::vector<float> out;
  out.reserve(static_cast<size_t>(factored_size(specs)));
  for (size_t k = 0; k < specs.size(); ++k) {
    POLLEN_ASSERT(v[k]->shape() == specs[k].shape && v[k]->dtype() == DType::f32);
    const float* x = v[k]->data<float>();
    if (!is_matrix(specs[k])) {
      out.insert(out.end(), x, x + v[k]->numel());
      continue;
    }
    // [rows, cols] -> rows means of each row, then cols means of each column
    const int64_t rows = specs[k].shape[0], cols = specs[k].shape[1];
    std::vector<double> row(static_cast<size_t>(rows), 0.0), col(static_cast<size_t>(cols), 0.0);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        row[static_cast<size_t>(i)] += x[i * cols + j];
        col[static_cast<size_t>(j)] += x[i * cols + j];
      }
    }
    for (double r : row) out.push_back(static_cast<float>(r / static_cast<double>(cols)));
    for (double c : col) out.push_back(static_cast<float>(c / static_cast<double>(rows)));
  }
  return out;
}

void expand_second_moments(const ParamSpecs& specs, const std::vector<float>& factored,
                           const std::vector<Tensor*>& v) {
  POLLEN_ASSERT(v.size() == specs.size() &&
                static_cast<int64_t>(factored.size()) == factored_size(specs));
  const float* f = factored.data();
  for (size_t k = 0; k < specs.size(); ++k) {
    POLLEN_ASSERT(v[k]->shape() == specs[k].shape && v[k]->dtype() == DType::f32);
    float* x = v[k]->data<float>();
    if (!is_matrix(specs[k])) {
      std::copy(f, f + v[k]->numel(), x);
      f += v[k]->numel();
      continue;
    }
    const int64_t rows = specs[k].shape[0], cols = specs[k].shape[1];
    const float* row = f;
    const float* col = f + rows;
    double mean = 0;
    for (int64_t i = 0; i < rows; ++i) mean += row[i];
    mean /= static_cast<double>(rows);
    // Clamped to float32's range: hostile or extreme means must not make v infinite.
    const double most = std::numeric_limits<float>::max();
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        const double value = mean > 0 ? static_cast<double>(row[i]) * col[j] / mean : 0.0;
        x[i * cols + j] = static_cast<float>(std::min(value, most));
      }
    }
    f += rows + cols;
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

std::string pack_second_moments(const std::vector<float>& factored) {
  std::string out(2 * factored.size(), '\0');
  for (size_t j = 0; j < factored.size(); ++j) {
    const uint16_t b = bf16::from_float(factored[j]).bits;
    out[2 * j] = static_cast<char>(b & 0xff);
    out[2 * j + 1] = static_cast<char>(b >> 8);
  }
  return out;
}

std::vector<float> unpack_second_moments(const std::string& bytes, int64_t size,
                                         const std::string& what) {
  POLLEN_CHECK(bytes.size() % 2 == 0, what, ": ", bytes.size(),
               " bytes of second moments, not a whole number of bfloat16 values");
  std::vector<float> out(bytes.size() / 2);
  for (size_t j = 0; j < out.size(); ++j) {
    bf16 b;
    b.bits = static_cast<uint16_t>(static_cast<uint8_t>(bytes[2 * j]) |
                                   static_cast<uint8_t>(bytes[2 * j + 1]) << 8);
    out[j] = b.to_float();
  }
  check_second_moments(out.data(), static_cast<int64_t>(out.size()), size, what);
  return out;
}

}  // namespace pollen::fed
