// The CUDA entry points of kernels/blockwise_quantize.h in a build without nvcc: callers check
// kCudaKernelsBuilt (kernels/cuda_build.h) and take their CPU path.
#include "kernels/blockwise_quantize.h"

#ifndef QTRAIN_WITH_CUDA

#include "kernels/cuda_build.h"

namespace qtrain::kernels {

BlockwiseCodes quantize_4bit_cuda(const at::Tensor&, const FourBitQuantizer&, int64_t) {
  no_cuda_kernels("quantize_4bit_cuda");
}

BlockwiseCodes quantize_blockwise_8bit_cuda(const at::Tensor&, const at::Tensor&, int64_t) {
  no_cuda_kernels("quantize_blockwise_8bit_cuda");
}

at::Tensor dequantize_4bit_cuda(const at::Tensor&, int64_t, int64_t, c10::ArrayRef<float>, const FourBitScales&,
                                c10::ScalarType) {
  no_cuda_kernels("dequantize_4bit_cuda");
}

at::Tensor dequantize_4bit_to_float8_cuda(const at::Tensor&, int64_t, int64_t, c10::ArrayRef<float>,
                                          const FourBitScales&, const at::Tensor&, int64_t) {
  no_cuda_kernels("dequantize_4bit_to_float8_cuda");
}

}  // namespace qtrain::kernels

#endif  // QTRAIN_WITH_CUDA
