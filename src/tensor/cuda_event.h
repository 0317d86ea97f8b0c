#pragma once
// Timing GPU work without waiting for it, for code that does not include CUDA's headers: an
// event recorded on the current GPU's default stream marks a point in that stream's work; the
// time between two such points is read once the later one has happened. In a build without the
// CUDA backend creating one throws, naming the missing backend.
namespace pollen::cuda {

class Event {
 public:
  Event();  // a timing event of the current GPU
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record();  // marks the current end of the default stream's work
  // Milliseconds of GPU time from `start`'s mark to this one's; waits until this one is reached.
  float ms_since(const Event& start) const;

 private:
  void* event_ = nullptr;  // cudaEvent_t
};

}  // namespace pollen::cuda
