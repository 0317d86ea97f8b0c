// cuBLASLt is loaded at the first GEMM on a GPU, not linked (src/ops/cuda/cublaslt.h). These run
// with or without a GPU: loading the library and its status names need no driver.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#if POLLEN_HAVE_CUDA
#include "ops/cuda/cublaslt.h"
#endif

namespace pollen::ops::cuda {
namespace {

#if POLLEN_HAVE_CUDA

std::string mapped_files() {
  std::ifstream maps("/proc/self/maps");
  std::stringstream text;
  text << maps.rdbuf();
  return text.str();
}

TEST(CudaCublasLt, LoadsAtFirstUseWithEveryFunctionBound) {
  const CublasLt& lib = cublaslt();
  EXPECT_STREQ(lib.get_status_name(CUBLAS_STATUS_NOT_SUPPORTED), "CUBLAS_STATUS_NOT_SUPPORTED");
  for (const void* f :
       {(const void*)lib.create, (const void*)lib.matmul, (const void*)lib.matmul_desc_create,
        (const void*)lib.matmul_desc_destroy, (const void*)lib.matmul_desc_set_attribute,
        (const void*)lib.matrix_layout_create, (const void*)lib.matrix_layout_destroy,
        (const void*)lib.matmul_preference_create, (const void*)lib.matmul_preference_destroy,
        (const void*)lib.matmul_preference_set_attribute,
        (const void*)lib.matmul_algo_get_heuristic, (const void*)lib.get_status_string})
    EXPECT_NE(f, nullptr);
  EXPECT_NE(mapped_files().find("libcublasLt.so"), std::string::npos);
  EXPECT_EQ(&cublaslt(), &lib);  // loaded once
}

TEST(CudaCublasLt, DescriptionNamesTheVersionAndTheFile) {
  const std::string d = cublaslt_description();
  EXPECT_TRUE(d.starts_with("cuBLASLt " + std::to_string(CUBLAS_VER_MAJOR) + ".")) << d;
  EXPECT_NE(d.find("libcublasLt.so"), std::string::npos) << d;
}

#else
TEST(CudaCublasLt, NeedsTheCudaBackend) {
  GTEST_SKIP() << "built without the CUDA backend";
}
#endif  // POLLEN_HAVE_CUDA

}  // namespace
}  // namespace pollen::ops::cuda
