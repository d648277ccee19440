// The CUDA entry point of kernels/merged_fake_quantize.h in a build without nvcc: callers check
// kCudaKernelsBuilt (kernels/cuda_build.h) and take their torch-operation path.
#include "kernels/merged_fake_quantize.h"

#ifndef QTRAIN_WITH_CUDA

namespace qtrain::kernels {

MergedFakeQuantized merged_fake_quantize_int_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                                  const MergedFakeQuantizeOptions&) {
  no_cuda_kernels("merged_fake_quantize_int_cuda");
}

}  // namespace qtrain::kernels

#endif  // QTRAIN_WITH_CUDA
