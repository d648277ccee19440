// The CUDA entry points of kernels/float8_rows.h in a build without nvcc: callers check
// kCudaKernelsBuilt (kernels/cuda_build.h) and take their torch-operation path.
#include "kernels/float8_rows.h"

#ifndef QTRAIN_WITH_CUDA

#include "kernels/cuda_build.h"

namespace qtrain::kernels {

std::pair<at::Tensor, at::Tensor> quantize_rows_float8_cuda(const at::Tensor&, const at::Tensor&) {
  no_cuda_kernels("quantize_rows_float8_cuda");
}

at::Tensor transpose_float8_cuda(const at::Tensor&) { no_cuda_kernels("transpose_float8_cuda"); }

bool float8_tensor_cores(int) { return false; }

}  // namespace qtrain::kernels

#endif  // QTRAIN_WITH_CUDA
