#pragma once
// CPU kernels behind the ops' dispatch points: raw pointers, sizes known valid, templates over
// the compute type (float for training, double for references and gradient checks).
#include <cstdint>

namespace pollen::ops::cpu {

template <typename T>
void gemm(const T* a, bool trans_a, const T* b, bool trans_b, T* c, int64_t m, int64_t n, int64_t k,
          T alpha, T beta);

template <typename T>
void embedding_forward(const T* table, const int32_t* ids, T* out, int64_t n, int64_t c);
template <typename T>
void embedding_backward(const T* dout, const int32_t* ids, T* dtable, int64_t n, int64_t c);

template <typename T>
void rmsnorm_forward(const T* x, const T* w, T* y, T* rstd, int64_t n, int64_t c, double eps);
template <typename T>
void rmsnorm_backward(const T* dy, const T* x, const T* w, const T* rstd, T* dx, T* dw, int64_t n,
                      int64_t c, bool accumulate_dx);

template <typename T>
void swiglu_forward(const T* gate, const T* up, T* out, int64_t n);
template <typename T>
void swiglu_backward(const T* dout, const T* gate, const T* up, T* dgate, T* dup, int64_t n);

template <typename T>
void add(const T* a, const T* b, T* out, int64_t n);
template <typename T>
void mul(const T* a, const T* b, T* out, int64_t n);
template <typename T>
void axpy(T alpha, const T* x, T* y, int64_t n);  // y += alpha * x
template <typename T>
void scale_into(T alpha, const T* x, T* y, int64_t n);  // y = alpha * x

}  // namespace pollen::ops::cpu
