#pragma once
// cuBLASLt's functions that pollen calls, from libcublasLt loaded at the first GEMM on a GPU
// (dlopen), not linked: the library maps about 150 MB into every process that links it, and a
// CPU run of a CUDA build never calls it.
#include <cublasLt.h>

#include <string>

namespace pollen::ops::cuda {

struct CublasLt {
  decltype(&cublasLtCreate) create;
  decltype(&cublasLtMatmul) matmul;
  decltype(&cublasLtMatmulDescCreate) matmul_desc_create;
  decltype(&cublasLtMatmulDescDestroy) matmul_desc_destroy;
  decltype(&cublasLtMatmulDescSetAttribute) matmul_desc_set_attribute;
  decltype(&cublasLtMatrixLayoutCreate) matrix_layout_create;
  decltype(&cublasLtMatrixLayoutDestroy) matrix_layout_destroy;
  decltype(&cublasLtMatmulPreferenceCreate) matmul_preference_create;
  decltype(&cublasLtMatmulPreferenceDestroy) matmul_preference_destroy;
  decltype(&cublasLtMatmulPreferenceSetAttribute) matmul_preference_set_attribute;
  decltype(&cublasLtMatmulAlgoGetHeuristic) matmul_algo_get_heuristic;
  decltype(&cublasLtGetStatusName) get_status_name;
  decltype(&cublasLtGetStatusString) get_status_string;
  decltype(&cublasLtGetVersion) get_version;
};

// The library, loaded at the first call: LD_LIBRARY_PATH and the loader's paths first, then the
// CUDA toolkit's library folder that pollen was built against. Fails naming both when neither
// has it.
const CublasLt& cublaslt();

// "cuBLASLt 13.1.0 from /usr/local/cuda/lib64/libcublasLt.so.13", loading the library first (for
// `pollen version` on a machine with a GPU); throws as cublaslt() does.
std::string cublaslt_description();

}  // namespace pollen::ops::cuda
