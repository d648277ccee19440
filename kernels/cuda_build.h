#pragma once
// Whether this build compiled the CUDA kernels (nvcc was found at configure time), and what their
// stand-ins in a build without them throw. Callers check kCudaKernelsBuilt and take their CPU or
// torch-operation path, so reaching a stand-in is a build problem.
#include <string>

#include "kernels/error.h"

namespace qtrain::kernels {

#ifdef QTRAIN_WITH_CUDA
constexpr bool kCudaKernelsBuilt = true;
#else
constexpr bool kCudaKernelsBuilt = false;
#endif

[[noreturn]] inline void no_cuda_kernels(const std::string& entry_point) {
  throw Error(ErrorCode::kUsage, entry_point + ": qtrain was built without its CUDA kernels (CMake found no nvcc); install the CUDA "
              "Toolkit and reconfigure, or keep the tensors on the CPU");
}

}  // namespace qtrain::kernels
