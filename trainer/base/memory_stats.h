#pragma once
// Memory in use, for progress lines and metrics: the CUDA caching allocator's allocated bytes
// on a GPU, the process's resident set on the CPU.
#include <torch/torch.h>

#include <string>
#include <vector>

namespace qtrain::trainer {

struct MemoryUsage {
  double current_bytes = 0;   // CUDA: allocated by tensors; CPU: resident set
  double peak_bytes = 0;      // since the start, or the last reset_peak_memory
  double reserved_bytes = 0;  // CUDA: held by the caching allocator (allocated + cached); CPU: 0
};

MemoryUsage memory_usage(const torch::Device& device);
void reset_peak_memory(const torch::Device& device);
// Gives the caching allocator's unused blocks back to the driver (transformers'
// torch_empty_cache_steps); nothing on a CPU.
void release_cached_memory(const torch::Device& device);
std::string format_bytes(double bytes);  // "312.4 MiB", "13.20 GiB"
// The bytes the device can still give now (CUDA: the driver's free memory); 0 on a CPU.
double device_free_bytes(const torch::Device& device);

// Where a step's device memory peaks (qtrain bench --memory-phases): mark(name) ends the phase
// open before it and opens `name`, resetting the allocator's peak, so each phase's peak is its
// own. A phase met again (each micro-batch, each step) keeps its highest figures, in the order
// the phases were first met. On a CPU the figures are the process's resident set and its
// high-water mark, which no reset lowers.
class MemoryPhases {
 public:
  struct Phase {
    std::string name;
    double at_start_bytes = 0;  // allocated as it opened
    double peak_bytes = 0;      // the most allocated while it was open
  };
  explicit MemoryPhases(const torch::Device& device) : device_(device) {}
  void mark(const std::string& phase);
  void finish();  // ends the open phase
  const std::vector<Phase>& phases() const { return phases_; }

 private:
  torch::Device device_;
  std::vector<Phase> phases_;
  int open_ = -1;  // index into phases_
};

}  // namespace qtrain::trainer
