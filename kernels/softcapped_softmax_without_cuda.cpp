// The CUDA entry points of kernels/softcapped_softmax.h in a build without nvcc: callers check
// kCudaKernelsBuilt (kernels/cuda_build.h) and take their torch-operation path.
#include "kernels/softcapped_softmax.h"

#ifndef QTRAIN_WITH_CUDA

#include "kernels/cuda_build.h"

namespace qtrain::kernels {

std::tuple<at::Tensor, at::Tensor, at::Tensor> softcapped_softmax_forward_cuda(const at::Tensor&, const SoftcappedScores&) {
  no_cuda_kernels("softcapped_softmax_forward_cuda");
}
at::Tensor softcapped_softmax_backward_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&, const SoftcappedScores&) {
  no_cuda_kernels("softcapped_softmax_backward_cuda");
}

}  // namespace qtrain::kernels

#endif  // QTRAIN_WITH_CUDA
