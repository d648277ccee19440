// The CUDA entry point of kernels/packed_int_dequantize.h in a build without nvcc: callers check
// kCudaKernelsBuilt (kernels/cuda_build.h) and take their torch-operation path.
#include "kernels/packed_int_dequantize.h"

#ifndef QTRAIN_WITH_CUDA

namespace qtrain::kernels {

at::Tensor dequantize_packed_int_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t) {
  no_cuda_kernels("dequantize_packed_int_cuda");
}

}  // namespace qtrain::kernels

#endif  // QTRAIN_WITH_CUDA
