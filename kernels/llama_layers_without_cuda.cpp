// The CUDA entry points of kernels/llama_layers.h in a build without nvcc: callers check
// kCudaKernelsBuilt (kernels/cuda_build.h) and take their torch-operation path.
#include "kernels/llama_layers.h"

#ifndef QTRAIN_WITH_CUDA

#include "kernels/cuda_build.h"

namespace qtrain::kernels {

std::pair<at::Tensor, at::Tensor> rms_norm_forward_cuda(const at::Tensor&, const at::Tensor&, double, bool) {
  no_cuda_kernels("rms_norm_forward_cuda");
}
at::Tensor rms_norm_backward_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, bool) {
  no_cuda_kernels("rms_norm_backward_cuda");
}
at::Tensor rotary_embedding_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool) {
  no_cuda_kernels("rotary_embedding_cuda");
}
void rotary_embedding_into_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool, const at::Tensor&) {
  no_cuda_kernels("rotary_embedding_into_cuda");
}
at::Tensor swiglu_forward_cuda(const at::Tensor&, const at::Tensor&) { no_cuda_kernels("swiglu_forward_cuda"); }
std::pair<at::Tensor, at::Tensor> swiglu_backward_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  no_cuda_kernels("swiglu_backward_cuda");
}
at::Tensor geglu_forward_cuda(const at::Tensor&, const at::Tensor&) { no_cuda_kernels("geglu_forward_cuda"); }
std::pair<at::Tensor, at::Tensor> geglu_backward_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  no_cuda_kernels("geglu_backward_cuda");
}
at::Tensor swiglu_fused_forward_cuda(const at::Tensor&) { no_cuda_kernels("swiglu_fused_forward_cuda"); }
at::Tensor swiglu_fused_backward_cuda(const at::Tensor&, const at::Tensor&) { no_cuda_kernels("swiglu_fused_backward_cuda"); }
at::Tensor geglu_fused_forward_cuda(const at::Tensor&) { no_cuda_kernels("geglu_fused_forward_cuda"); }
at::Tensor geglu_fused_backward_cuda(const at::Tensor&, const at::Tensor&) { no_cuda_kernels("geglu_fused_backward_cuda"); }

}  // namespace qtrain::kernels

#endif  // QTRAIN_WITH_CUDA
