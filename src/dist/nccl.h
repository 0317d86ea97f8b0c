#pragma once
// NCCL for code that does not include CUDA's or NCCL's headers: a communicator over the GPUs of
// a job's ranks (one GPU per rank) and its collectives on f32 GPU buffers. They run in order on
// the communicator's own stream, each after everything enqueued on the default stream before it
// (the work that made its input), while the default stream goes on with later kernels; a buffer
// must stay untouched until the collective's event is done. NcclCommunicator
// (nccl_communicator.h) builds the data-parallel interface on it.
//
// In a build without NCCL (no CUDA toolkit, or one without NCCL) every call but built() throws,
// naming what is missing.
#include <array>
#include <cstdint>
#include <string>

namespace pollen::dist::nccl {

bool built();  // whether this pollen was built with NCCL

// ncclUniqueId's 128 bytes: made by rank 0, handed to the other ranks through the launcher's
// communicator, then given by every rank to init().
using UniqueId = std::array<char, 128>;
UniqueId make_unique_id();

class Comm;  // ncclComm_t, owned

// Joins the NCCL communicator of `world` ranks as `rank`, on the current GPU (blocks until every
// rank has joined).
Comm* init(const UniqueId& id, int world, int rank);
void destroy(Comm* comm);  // waits for its collectives first
void abort(Comm* comm);    // ends the collectives in flight without waiting (after a timeout)

// Enqueued on the communicator's stream; pointers to GPU memory. Sum in place: data[n]. Sum of
// in[world * n], block `rank` into out[n]. Every rank's in[n] into out[world * n], in rank
// order. The root's data[n] into every rank's.
void all_reduce_sum(Comm* comm, float* data, int64_t n);
void reduce_scatter_sum(Comm* comm, const float* in, float* out, int64_t n);
void all_gather(Comm* comm, const float* in, float* out, int64_t n);
void broadcast(Comm* comm, float* data, int64_t n, int root);

// A marker after every collective enqueued so far on the communicator's stream, to poll.
class Event;
Event* record(Comm* comm);
bool done(Event* event);  // throws on a CUDA error
void destroy(Event* event);

// An error NCCL reports asynchronously for the communicator (a peer's failure, a network error),
// or "" when there is none.
std::string async_error(Comm* comm);

}  // namespace pollen::dist::nccl
