// The CUDA entry point of kernels/float8_gemm.h in a build without nvcc: callers check
// kCudaKernelsBuilt (kernels/cuda_build.h) and take their torch-operation path.
#include "kernels/float8_gemm.h"

#ifndef QTRAIN_WITH_CUDA

#include "kernels/cuda_build.h"

namespace qtrain::kernels {

bool float8_gemm_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, bool, bool) {
  no_cuda_kernels("float8_gemm_cuda");
}

}  // namespace qtrain::kernels

#endif  // QTRAIN_WITH_CUDA
