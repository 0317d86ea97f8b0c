#include "fed/proximal.h"

#include "base/error.h"

namespace pollen::fed {

void seed_proximal_gradients(std::vector<ag::Var>& params, const Weights& anchor, double scale) {
  POLLEN_ASSERT(anchor.size() == params.size());
  const auto s = static_cast<float>(scale);
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& w = params[i].value();
    POLLEN_ASSERT(w.dtype() == DType::f32 && w.device() == Device::cpu &&
                  w.shape() == anchor[i].shape());
    Tensor g = Tensor::empty(w.shape(), DType::f32);
    const float* p = w.data<float>();
    const float* a = anchor[i].data<float>();
    float* out = g.data<float>();
    for (int64_t j = 0; j < w.numel(); ++j) out[j] = s * (p[j] - a[j]);
    params[i].grad() = std::move(g);
  }
}

}  // namespace pollen::fed
