// The CUDA entry points of kernels/cross_entropy_tiles.h in a build without nvcc: callers check
// kCudaKernelsBuilt (kernels/cuda_build.h) and take their torch-operation path.
#include "kernels/cross_entropy_tiles.h"

#ifndef QTRAIN_WITH_CUDA

#include "kernels/cuda_build.h"

namespace qtrain::kernels {

LogSumExpStatistics cross_entropy_tile_statistics_cuda(const LogSumExpStatistics&, const at::Tensor&, const at::Tensor&,
                                                       int64_t) {
  no_cuda_kernels("cross_entropy_tile_statistics_cuda");
}
LogSumExpStatistics cross_entropy_tile_exponentials_cuda(const LogSumExpStatistics&, at::Tensor&, const at::Tensor&,
                                                         int64_t, double) {
  no_cuda_kernels("cross_entropy_tile_exponentials_cuda");
}

}  // namespace qtrain::kernels

#endif  // QTRAIN_WITH_CUDA
