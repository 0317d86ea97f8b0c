// NCCL's calls behind dist/nccl.h, each checked: a failure names the call, its arguments and
// NCCL's error string.
//
// libnccl.so.2 is loaded at the first use (dlopen), not linked: pollen then starts on a machine
// without NCCL, and only data parallelism on GPUs needs it. A machine that keeps it outside the
// loader's path (PyTorch's wheels install it under nvidia/nccl/lib) names that folder in
// LD_LIBRARY_PATH.
#include <dlfcn.h>
#include <nccl.h>

#include <cstring>
#include <memory>
#include <mutex>

#include "base/log.h"
#include "dist/nccl.h"
#include "tensor/cuda_context.h"

namespace pollen::dist::nccl {

class Comm {
 public:
  ncclComm_t handle = nullptr;
  cudaStream_t stream = nullptr;  // NCCL's own, so that the default stream's kernels go on
};

class Event {
 public:
  cudaEvent_t handle = nullptr;
};

namespace {

// NCCL's functions, from the library loaded at first use.
struct Library {
  decltype(&ncclGetUniqueId) get_unique_id;
  decltype(&ncclCommInitRank) comm_init_rank;
  decltype(&ncclCommDestroy) comm_destroy;
  decltype(&ncclCommAbort) comm_abort;
  decltype(&ncclCommGetAsyncError) comm_get_async_error;
  decltype(&ncclAllReduce) all_reduce;
  decltype(&ncclReduceScatter) reduce_scatter;
  decltype(&ncclAllGather) all_gather;
  decltype(&ncclBroadcast) broadcast;
  decltype(&ncclGetErrorString) get_error_string;
  decltype(&ncclGetLastError) get_last_error;
};

template <typename F>
void bind(void* handle, const char* name, F& f) {
  f = reinterpret_cast<F>(dlsym(handle, name));
  POLLEN_CHECK(f != nullptr, "libnccl.so.2 has no symbol ", name, ": ", dlerror());
}

const Library& library() {
  static Library lib;
  static std::once_flag once;
  std::call_once(once, [] {
    void* handle = dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
    POLLEN_CHECK(handle != nullptr, "data parallelism on GPUs needs NCCL: libnccl.so.2 could ",
                 "not be loaded (", dlerror(), "); name the folder holding it in ",
                 "LD_LIBRARY_PATH");
    bind(handle, "ncclGetUniqueId", lib.get_unique_id);
    bind(handle, "ncclCommInitRank", lib.comm_init_rank);
    bind(handle, "ncclCommDestroy", lib.comm_destroy);
    bind(handle, "ncclCommAbort", lib.comm_abort);
    bind(handle, "ncclCommGetAsyncError", lib.comm_get_async_error);
    bind(handle, "ncclAllReduce", lib.all_reduce);
    bind(handle, "ncclReduceScatter", lib.reduce_scatter);
    bind(handle, "ncclAllGather", lib.all_gather);
    bind(handle, "ncclBroadcast", lib.broadcast);
    bind(handle, "ncclGetErrorString", lib.get_error_string);
    bind(handle, "ncclGetLastError", lib.get_last_error);
  });
  return lib;
}

// "call [args] failed: NCCL's error string (its last error's text)".
std::string describe_failure(ncclResult_t result, const char* call, const std::string& args) {
  return cat(call, " [", args, "] failed: ", library().get_error_string(result), " (",
             library().get_last_error(nullptr), ")");
}

void check(ncclResult_t result, const char* call, const std::string& args) {
  if (result != ncclSuccess) throw Error(describe_failure(result, call, args));
}

// For cleanup, which must not throw: a failure is written as a warning.
void warn_on_failure(ncclResult_t result, const char* call, const std::string& args) {
  if (result != ncclSuccess) log::warn(describe_failure(result, call, args));
}

size_t count(int64_t n) {
  POLLEN_CHECK(n >= 0, "NCCL collective of ", n, " elements");
  return static_cast<size_t>(n);
}

}  // namespace

bool built() {
  return true;
}

UniqueId make_unique_id() {
  ncclUniqueId id;
  check(library().get_unique_id(&id), "ncclGetUniqueId", "");
  UniqueId out;
  static_assert(sizeof(id.internal) == sizeof(UniqueId));
  std::memcpy(out.data(), id.internal, out.size());
  return out;
}

Comm* init(const UniqueId& id, int world, int rank) {
  ncclUniqueId nid;
  std::memcpy(nid.internal, id.data(), id.size());
  const Library& lib = library();  // loaded before anything is made that a failure would leak
  const int device = cuda::current_device();
  // The stream first: if joining then fails, the stream is destroyed and the struct freed; made
  // after the communicator, a stream that could not be made would leak both.
  auto comm = std::make_unique<Comm>();
  POLLEN_CUDA_CHECK(cudaStreamCreateWithFlags(&comm->stream, cudaStreamNonBlocking),
                    "device=", device);
  const ncclResult_t r = lib.comm_init_rank(&comm->handle, world, nid, rank);
  if (r != ncclSuccess) {
    POLLEN_CUDA_WARN(cudaStreamDestroy(comm->stream), "after ncclCommInitRank failed");
    check(r, "ncclCommInitRank", cat("world=", world, " rank=", rank, " device=", device));
  }
  return comm.release();
}

// Cleanup, from NcclCommunicator's destructor, and abort also after a failed or timed-out
// collective, whose error is on its way: failures are warnings, and the rest of the cleanup still
// runs.
void destroy(Comm* comm) {
  if (!comm) return;
  POLLEN_CUDA_WARN(cudaStreamSynchronize(comm->stream), "NCCL's stream, before ncclCommDestroy");
  warn_on_failure(library().comm_destroy(comm->handle), "ncclCommDestroy", "");
  POLLEN_CUDA_WARN(cudaStreamDestroy(comm->stream), "NCCL's stream");
  delete comm;
}

void abort(Comm* comm) {
  if (!comm) return;
  // Ends the kernels in flight on comm->stream.
  warn_on_failure(library().comm_abort(comm->handle), "ncclCommAbort", "");
  POLLEN_CUDA_WARN(cudaStreamDestroy(comm->stream), "NCCL's stream, after ncclCommAbort");
  delete comm;
}

namespace {
// NCCL's stream waits for what the default stream has enqueued so far (the inputs' producers).
cudaStream_t after_default_stream(Comm* comm) {
  cudaEvent_t ready = nullptr;
  POLLEN_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "");
  POLLEN_CUDA_CHECK(cudaEventRecord(ready, cuda::default_stream()), "");
  POLLEN_CUDA_CHECK(cudaStreamWaitEvent(comm->stream, ready, 0), "");
  // Released once the wait has happened. The wait is enqueued, so a failure here loses nothing
  // but the event: a warning.
  POLLEN_CUDA_WARN(cudaEventDestroy(ready), "the default stream's marker for NCCL's stream");
  return comm->stream;
}
}  // namespace

void all_reduce_sum(Comm* comm, float* data, int64_t n) {
  check(library().all_reduce(data, data, count(n), ncclFloat32, ncclSum, comm->handle,
                             after_default_stream(comm)),
        "ncclAllReduce", cat("n=", n));
}

void reduce_scatter_sum(Comm* comm, const float* in, float* out, int64_t n) {
  check(library().reduce_scatter(in, out, count(n), ncclFloat32, ncclSum, comm->handle,
                                 after_default_stream(comm)),
        "ncclReduceScatter", cat("n=", n));
}

void all_gather(Comm* comm, const float* in, float* out, int64_t n) {
  check(library().all_gather(in, out, count(n), ncclFloat32, comm->handle,
                             after_default_stream(comm)),
        "ncclAllGather", cat("n=", n));
}

void broadcast(Comm* comm, float* data, int64_t n, int root) {
  check(library().broadcast(data, data, count(n), ncclFloat32, root, comm->handle,
                            after_default_stream(comm)),
        "ncclBroadcast", cat("n=", n, " root=", root));
}

Event* record(Comm* comm) {
  auto* e = new Event;
  POLLEN_CUDA_CHECK(cudaEventCreateWithFlags(&e->handle, cudaEventDisableTiming), "");
  POLLEN_CUDA_CHECK(cudaEventRecord(e->handle, comm->stream), "");
  return e;
}

bool done(Event* event) {
  const cudaError_t r = cudaEventQuery(event->handle);
  if (r == cudaErrorNotReady) return false;
  POLLEN_CUDA_CHECK(r, "a collective's completion");
  return true;
}

void destroy(Event* event) {  // cleanup, from NcclCommunicator's destructor too: warns
  if (!event) return;
  POLLEN_CUDA_WARN(cudaEventDestroy(event->handle), "a collective's completion event");
  delete event;
}

std::string async_error(Comm* comm) {
  ncclResult_t state = ncclSuccess;
  const ncclResult_t r = library().comm_get_async_error(comm->handle, &state);
  if (r != ncclSuccess) return cat("ncclCommGetAsyncError failed: ", library().get_error_string(r));
  return state == ncclSuccess ? "" : library().get_error_string(state);
}

}  // namespace pollen::dist::nccl
