#pragma once
// Reductions over one CUDA block (whole warps), for the kernels that give each row of a tensor one
// block (softcapped_softmax.cu, float8_rows.cu, cross_entropy_tiles.cu, rms_norm.cu), and over the
// lanes of a warp, for those that give a short row a few lanes (rms_norm.cu).
#include <cuda_runtime.h>

namespace qtrain::kernels {

// The reduction of `value` with `op` over each aligned group of `lanes` lanes of the warp (a power
// of two, at most 32), returned to every lane of the group. Every lane of the warp calls it.
template <typename Op>
__device__ __forceinline__ float warp_reduce(float value, Op op, int lanes = 32) {
  for (int offset = lanes / 2; offset > 0; offset /= 2) value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

// The block's reduction of `value` with `op`, returned to every thread. The block is a whole
// number of warps, at most 1024 threads.
template <typename Op>
__device__ float block_reduce(float value, Op op, float identity) {
  __shared__ float partial[32];
  __shared__ float total;
  value = warp_reduce(value, op);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = value;
  __syncthreads();
  if (threadIdx.x < 32) {
    const float reduced = warp_reduce(threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : identity, op);
    if (threadIdx.x == 0) total = reduced;
  }
  __syncthreads();
  const float result = total;
  __syncthreads();  // `total` is read by every thread before a next reduction writes it
  return result;
}

struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
// max that keeps a NaN, as torch's amax and maximum do, so a NaN input shows in what follows from it.
struct MaxKeepingNan {
  __device__ float operator()(float a, float b) const { return (a != a || a > b) ? a : b; }
};
struct SumOp {
  __device__ float operator()(float a, float b) const { return a + b; }
};

}  // namespace qtrain::kernels
