#pragma once
#include "tensor/tensor.h"

namespace pollen::ops {

// out (N,C) = table (V,C) rows at ids (N) int32; an id outside [0, V) is an error naming it.
// On the GPU (f32 or bf16) the ids are checked on the host, from a copy.
void embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out);
// The GPU backward's grouping of the tokens by id, made on the host: the distinct ids (rows, R),
// and for row r the tokens order[starts[r] .. starts[r+1]) (starts R+1, order N), int32 on the
// GPU.
struct EmbeddingRows {
  Tensor rows, starts, order;
};
// The grouping of ids (N) on the GPU, each id checked against [0, vocab) on the host from a copy.
// Made while the forward pass runs, it spares the backward a wait for the GPU and a sort.
EmbeddingRows embedding_rows(const Tensor& ids, int64_t vocab);

// dtable (V,C) += scatter of dout (N,C) at ids; on the GPU each row's tokens are summed in fp32 in
// token order, then added (deterministic, no atomics), grouped by `rows` when given (from
// embedding_rows of the same ids), else grouped here from a host copy of the ids.
void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dtable,
                        const EmbeddingRows* rows = nullptr);

}  // namespace pollen::ops
