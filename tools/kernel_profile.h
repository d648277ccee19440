#pragma once
// A GPU kernel profile of a stretch of work (LibTorch's Kineto profiler, CUPTI underneath): which
// kernels the device spent its time in, so a speed change is chosen by measurement (bench
// --profile). Kernels are grouped under their name and under a coarse kind (matmul, attention,
// qtrain's own, elementwise and reductions, copies).
#include <cstdint>
#include <iosfwd>
#include <string>

namespace qtrain::tools {

class KernelProfile {
 public:
  // Starts collecting CPU operators and, when `cuda`, GPU kernels.
  // record_shapes: each operator's input shapes and dtypes go into the trace (for a Chrome trace).
  KernelProfile(bool cuda, bool record_shapes);
  ~KernelProfile();
  KernelProfile(const KernelProfile&) = delete;
  KernelProfile& operator=(const KernelProfile&) = delete;

  // Stops, writes a Chrome trace to `trace_path` (when not empty) and prints the kinds and the
  // `top` most expensive kernels, then the `top` host operators by inclusive time, as time per
  // profiled step (`steps` of them).
  void finish(const std::string& trace_path, int64_t steps, int top, std::ostream& out);

 private:
  bool running_ = false;
};

}  // namespace qtrain::tools
