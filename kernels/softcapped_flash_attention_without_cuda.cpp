// The CUDA entry points of kernels/softcapped_flash_attention.h in a build without nvcc: the
// kernels take nothing, so callers keep their torch-operation path.
#include "kernels/softcapped_flash_attention.h"

#ifndef QTRAIN_WITH_CUDA

#include "kernels/cuda_build.h"

namespace qtrain::kernels {

bool softcapped_flash_takes(const at::Tensor&, const at::Tensor&) { return false; }
bool softcapped_flash_takes(at::ScalarType, int64_t) { return false; }

std::tuple<at::Tensor, at::Tensor> softcapped_flash_forward_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                                 const SoftcappedFlash&) {
  no_cuda_kernels("softcapped_flash_forward_cuda");
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> softcapped_flash_backward_cuda(const at::Tensor&, const at::Tensor&,
                                                                              const at::Tensor&, const at::Tensor&,
                                                                              const at::Tensor&, const at::Tensor&,
                                                                              const SoftcappedFlash&) {
  no_cuda_kernels("softcapped_flash_backward_cuda");
}

}  // namespace qtrain::kernels

#endif  // QTRAIN_WITH_CUDA
