// The CUDA entry point of kernels/adamw8bit_step.h in a build without nvcc: callers check
// kCudaKernelsBuilt (kernels/cuda_build.h) and take their torch-operation path.
#include "kernels/adamw8bit_step.h"

#ifndef QTRAIN_WITH_CUDA

namespace qtrain::kernels {

void adamw8bit_step_cuda(at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&,
                         const at::Tensor&, const at::Tensor&, const AdamW8bitStepScalars&) {
  no_cuda_kernels("adamw8bit_step_cuda");
}

}  // namespace qtrain::kernels

#endif  // QTRAIN_WITH_CUDA
