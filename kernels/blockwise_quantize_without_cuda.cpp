// The CUDA entry points of kernels/blockwise_quantize.h in a build without nvcc: callers check
// kCudaKernelsBuilt and take their CPU path, so reaching one of these is a build problem.
#include "kernels/blockwise_quantize.h"

#ifndef QTRAIN_WITH_CUDA

#include <string>

#include "kernels/error.h"

namespace qtrain::kernels {

namespace {

[[noreturn]] void no_cuda_kernels(const std::string& entry_point) {
  throw Error(entry_point + ": qtrain was built without its CUDA kernels (CMake found no nvcc); install the CUDA "
              "Toolkit and reconfigure, or keep the tensors on the CPU");
}

}  // namespace

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

}  // namespace qtrain::kernels

#endif  // QTRAIN_WITH_CUDA
