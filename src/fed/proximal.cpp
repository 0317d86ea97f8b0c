#include "fed/proximal.h"

#include "base/error.h"
#include "ops/elementwise.h"

namespace pollen::fed {

void seed_proximal_gradients(std::vector<ag::Var>& params, const std::vector<Tensor>& weights,
                             const Weights& anchor, double scale) {
  POLLEN_ASSERT(anchor.size() == params.size() && weights.size() == params.size());
  // scale rounded to float first: the gradient is float(scale) * (w - anchor), in float.
  const double s = static_cast<float>(scale);
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& w = weights[i];
    POLLEN_ASSERT(w.dtype() == DType::f32 && w.shape() == anchor[i].shape());
    Tensor g = w.clone();
    ops::axpy(-1.0, anchor[i], g);  // w - anchor
    ops::scale_into(s, g, g);
    const DType dtype = params[i].value().dtype();
    params[i].grad() = g.dtype() == dtype ? std::move(g) : g.to(dtype);
  }
}

}  // namespace pollen::fed
