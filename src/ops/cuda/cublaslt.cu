#include "ops/cuda/cublaslt.h"

#include <dlfcn.h>

#include <mutex>
#include <string>

#include "base/error.h"

namespace pollen::ops::cuda {
namespace {

template <typename F>
void bind(void* handle, const std::string& path, const char* name, F& f) {
  f = reinterpret_cast<F>(dlsym(handle, name));
  POLLEN_CHECK(f != nullptr, path, " has no symbol ", name, ": ", dlerror());
}

}  // namespace

const CublasLt& cublaslt() {
  static CublasLt lib;
  static std::once_flag once;
  std::call_once(once, [] {
    const std::string soname = POLLEN_CUBLASLT_SONAME;
    std::string path = soname;
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
      const std::string first_error = dlerror();
      path = std::string(POLLEN_CUDA_LIBRARY_DIR) + "/" + soname;
      handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      POLLEN_CHECK(handle != nullptr, "GEMMs on GPUs need cuBLASLt: ", soname,
                   " could not be loaded (", first_error, "), nor ", path, " (", dlerror(),
                   "); name the folder holding it in LD_LIBRARY_PATH");
    }
    bind(handle, path, "cublasLtCreate", lib.create);
    bind(handle, path, "cublasLtMatmul", lib.matmul);
    bind(handle, path, "cublasLtMatmulDescCreate", lib.matmul_desc_create);
    bind(handle, path, "cublasLtMatmulDescDestroy", lib.matmul_desc_destroy);
    bind(handle, path, "cublasLtMatmulDescSetAttribute", lib.matmul_desc_set_attribute);
    bind(handle, path, "cublasLtMatrixLayoutCreate", lib.matrix_layout_create);
    bind(handle, path, "cublasLtMatrixLayoutDestroy", lib.matrix_layout_destroy);
    bind(handle, path, "cublasLtMatmulPreferenceCreate", lib.matmul_preference_create);
    bind(handle, path, "cublasLtMatmulPreferenceDestroy", lib.matmul_preference_destroy);
    bind(handle, path, "cublasLtMatmulPreferenceSetAttribute", lib.matmul_preference_set_attribute);
    bind(handle, path, "cublasLtMatmulAlgoGetHeuristic", lib.matmul_algo_get_heuristic);
    bind(handle, path, "cublasLtGetStatusName", lib.get_status_name);
    bind(handle, path, "cublasLtGetStatusString", lib.get_status_string);
    bind(handle, path, "cublasLtGetVersion", lib.get_version);
  });
  return lib;
}

std::string cublaslt_description() {
  const CublasLt& lib = cublaslt();
  const size_t v = lib.get_version();  // major * 10000 + minor * 100 + patch
  Dl_info info{};
  const bool found = dladdr(reinterpret_cast<const void*>(lib.create), &info) != 0;
  return "cuBLASLt " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100) + " from " +
         (found && info.dli_fname ? info.dli_fname : std::string("an unknown file"));
}

}  // namespace pollen::ops::cuda
