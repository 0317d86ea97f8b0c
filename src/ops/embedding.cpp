#include "ops/embedding.h"

#include <algorithm>
#include <numeric>
#include <vector>

#include "ops/check.h"
#include "ops/cpu/kernels.h"
#include "ops/cuda/kernels.h"
#include "ops/profile.h"

namespace pollen::ops {
namespace {
// Checks every id (on the host: ids on the GPU are copied over) and returns the host copy.
Tensor checked_ids(const Tensor& ids, int64_t vocab, Device device) {
  expect("embedding", "ids", ids, {-1}, DType::i32, device);
  const Tensor host = ids.cpu();
  const int32_t* p = host.data<int32_t>();
  for (int64_t i = 0; i < host.numel(); ++i) {
    POLLEN_CHECK(p[i] >= 0 && p[i] < vocab, "embedding: token id ", p[i], " at position ", i,
                 " is outside the vocabulary [0, ", vocab, ")");
  }
  return host;
}

// The grouping of embedding_rows from checked host ids (N): the distinct ids in increasing order
// and each one's tokens in token order.
EmbeddingRows group_by_id(const Tensor& host_ids, Device device) {
  const int64_t n = host_ids.numel();
  const int32_t* id = host_ids.data<int32_t>();
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return id[a] < id[b]; });
  std::vector<int32_t> rows, starts;
  for (int64_t k = 0; k < n; ++k) {
    const int32_t row = id[order[static_cast<size_t>(k)]];
    if (rows.empty() || rows.back() != row) {
      rows.push_back(row);
      starts.push_back(static_cast<int32_t>(k));
    }
  }
  starts.push_back(static_cast<int32_t>(n));
  const int64_t r = static_cast<int64_t>(rows.size());
  return {Tensor::from<int32_t>({r}, rows).to(device),
          Tensor::from<int32_t>({r + 1}, starts).to(device),
          Tensor::from<int32_t>({n}, order).to(device)};
}

#if POLLEN_HAVE_CUDA
// The GPU backward sums each id's tokens in token order, as `rows` groups them.
void embedding_backward_cuda(const Tensor& dout, const EmbeddingRows& rows, Tensor& dtable) {
  const int64_t n = rows.order.numel();
  if (n == 0) return;
  expect("embedding_backward", "rows.order", rows.order, {n}, DType::i32, Device::cuda);
  expect("embedding_backward", "rows.rows", rows.rows, {-1}, DType::i32, Device::cuda);
  const int64_t r = rows.rows.numel();
  expect("embedding_backward", "rows.starts", rows.starts, {r + 1}, DType::i32, Device::cuda);
  cuda::embedding_backward(dtable.dtype(), dout.raw(), rows.rows.data<int32_t>(),
                           rows.starts.data<int32_t>(), rows.order.data<int32_t>(), r, dtable.raw(),
                           dtable.size(1));
}
#endif
}  // namespace

void embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out) {
  const OpTimer timer("embedding_forward", table);
  const int64_t v = table.size(0), c = table.size(1), n = ids.numel();
  const Device dev = table.device();
  checked_ids(ids, v, dev);
  expect("embedding", "table", table, {v, c}, table.dtype(), dev);
  expect("embedding", "out", out, {n, c}, table.dtype(), dev);
#if POLLEN_HAVE_CUDA
  if (dev == Device::cuda)
    return cuda::embedding_forward(table.dtype(), table.raw(), ids.data<int32_t>(), out.raw(), n,
                                   c);
#endif
  dispatch_float("embedding", table.dtype(), [&]<typename T>(T) {
    cpu::embedding_forward(table.data<T>(), ids.data<int32_t>(), out.data<T>(), n, c);
  });
}

EmbeddingRows embedding_rows(const Tensor& ids, int64_t vocab) {
  return group_by_id(checked_ids(ids, vocab, ids.device()), Device::cuda);
}

void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dtable,
                        const EmbeddingRows* rows) {
  const OpTimer timer("embedding_backward", dtable);
  const int64_t v = dtable.size(0), c = dtable.size(1), n = ids.numel();
  const Device dev = dtable.device();
  expect("embedding_backward", "dout", dout, {n, c}, dtable.dtype(), dev);
  expect("embedding_backward", "dtable", dtable, {v, c}, dtable.dtype(), dev);
#if POLLEN_HAVE_CUDA
  if (dev == Device::cuda) {
    if (rows) {
      POLLEN_CHECK(rows->order.numel() == n, "embedding_backward: rows group ", rows->order.numel(),
                   " tokens, the ids ", n);
      return embedding_backward_cuda(dout, *rows, dtable);
    }
    return embedding_backward_cuda(dout, group_by_id(checked_ids(ids, v, dev), dev), dtable);
  }
#endif
  checked_ids(ids, v, dev);
  dispatch_float("embedding_backward", dtable.dtype(), [&]<typename T>(T) {
    cpu::embedding_backward(dout.data<T>(), ids.data<int32_t>(), dtable.data<T>(), n, c);
  });
}

}  // namespace pollen::ops
