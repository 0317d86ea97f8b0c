#include "ops/embedding.h"

#include "ops/check.h"
#include "ops/cpu/kernels.h"

namespace pollen::ops {
namespace {
void check_ids(const Tensor& ids, int64_t vocab) {
  expect("embedding", "ids", ids, {-1}, DType::i32);
  const int32_t* p = ids.data<int32_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    POLLEN_CHECK(p[i] >= 0 && p[i] < vocab, "embedding: token id ", p[i], " at position ", i,
                 " is outside the vocabulary [0, ", vocab, ")");
  }
}
}  // namespace

void embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out) {
  const int64_t v = table.size(0), c = table.size(1), n = ids.numel();
  check_ids(ids, v);
  expect("embedding", "table", table, {v, c}, table.dtype());
  expect("embedding", "out", out, {n, c}, table.dtype());
  dispatch_float("embedding", table.dtype(), [&]<typename T>(T) {
    cpu::embedding_forward(table.data<T>(), ids.data<int32_t>(), out.data<T>(), n, c);
  });
}

void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dtable) {
  const int64_t v = dtable.size(0), c = dtable.size(1), n = ids.numel();
  check_ids(ids, v);
  expect("embedding_backward", "dout", dout, {n, c}, dtable.dtype());
  expect("embedding_backward", "dtable", dtable, {v, c}, dtable.dtype());
  dispatch_float("embedding_backward", dtable.dtype(), [&]<typename T>(T) {
    cpu::embedding_backward(dout.data<T>(), ids.data<int32_t>(), dtable.data<T>(), n, c);
  });
}

}  // namespace pollen::ops
