#pragma once
// The per-tile arithmetic of the fused linear cross-entropy (trainer/model/fused_linear_cross_entropy.h)
// as one CUDA kernel. The loss walks the vocabulary in tiles of logits [rows, tile] (up to 512 x
// 32768); left to torch operations, each tile's cast to fp32, max, subtraction, exp, sum and the
// exponentials' cast back are a dozen passes over an fp32 copy of the tile: about 25 ms of a
// training step on a 200k-token vocabulary.
//
// The kernels read the tile in the model dtype and compute in fp32 as those operations do (the
// *_reference functions of trainer/model/fused_linear_cross_entropy.h, the CPU path): exp is the
// full-precision expf that torch's exp runs, every product and sum is rounded on its own (no
// fused multiply-add). The statistics equal theirs up to the order of the fp32 sum over the tile.
//
// Raw entry points: contiguous CUDA tensors on one device, fresh tensors out, on the logits'
// device and current stream.
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace qtrain::kernels {

// A chunk's online log-sum-exp over the vocabulary tiles seen so far, [rows] fp32 each.
struct LogSumExpStatistics {
  at::Tensor max;           // max_v z_v; -inf before the first tile
  at::Tensor sum;           // sum_v exp(z_v - max); 0 before the first tile
  at::Tensor target_logit;  // z at the row's target once its tile was seen; 0 before
};

// logits [rows, tile] (fp32, fp16 or bf16): the vocabulary's columns begin .. begin + tile - 1 of
// each row; targets [rows] int64 (a target outside the tile, or ignored (-100), takes no part in
// target_logit); `seen` the statistics of the tiles before. Returns them with the tile folded
// in, z = fp32(logits):
//   max          = max(seen.max, max_j z_j)
//   sum          = seen.sum * exp(seen.max - max) + sum_j exp(z_j - max)
//   target_logit = z[target - begin] where begin <= target < begin + tile, else seen.target_logit.
// NaNs stay as torch's amax and maximum keep them; a row whose max is still -inf gets a NaN sum
// (exp(-inf - -inf)), as the torch operations give it.
LogSumExpStatistics cross_entropy_tile_statistics_cuda(const LogSumExpStatistics& seen, const at::Tensor& logits,
                                                       const at::Tensor& targets, int64_t begin);

// The same statistics, and the tile's logits overwritten in place (contiguous) by the weights of
// the gradient's pass in the forward (trainer/model/fused_linear_cross_entropy.h):
//   logits[i, j] = dtype(exp(z[i, j] - max[i]) * (1 - (z[i, j] / softcap)^2)), max the folded one,
// the factor only where softcap > 0 (the capped logit's derivative, z = cap tanh(x / cap)); 0 at the
// row's target column (its term is taken apart, in fp32). exp is the same expf whose fp32 values
// the sum adds; the factor's steps round alone.
LogSumExpStatistics cross_entropy_tile_exponentials_cuda(const LogSumExpStatistics& seen, at::Tensor& logits,
                                                         const at::Tensor& targets, int64_t begin, double softcap = 0);

}  // namespace qtrain::kernels
