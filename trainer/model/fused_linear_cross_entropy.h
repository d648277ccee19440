#pragma once
// Next-token cross-entropy fused with a frozen output projection: the loss never holds a
// [chunk, vocab] fp32 logits block. For each chunk of tokens it walks the vocabulary in tiles,
// once, and computes the states' gradient in the same pass, as flash attention accumulates its
// output:
//
//   per tile  z = tile logits (the matmul in the compute dtype, Gemma 2's cap in it, then fp32);
//             the running max m and sum s of exp(z - m) per row (online log-sum-exp), z at the
//             target where it falls in the tile, and e = exp(z - m) in the compute dtype (0 at
//             the target), acc = acc exp(m_before - m) + e W_tile in fp32.
//   at the end  loss = (m + log s) - z[target]; grad_states = g (acc / s + (p_target - 1) W[target]),
//             p_target in fp32, g the loss's gradient (0 on ignored rows).
//
// Under Gemma 2's cap each e and the target's term carry the cap's derivative 1 - (z / cap)^2, z
// the capped logit. g is the gradient the caller declares the summed loss will get
// (FusedLossOptions::gradient: the training step's loss weight); backward then only scales the
// gradient by (the gradient it gets) / g, exactly 1 when that is g. Where no gradient is declared,
// and for per-token losses (a preference objective's log-probabilities), the forward computes it
// for g = 1 on every row, kept in fp32 until backward weighs each row by its own. Kept from forward
// to backward: that gradient [tokens, hidden]; nothing vocabulary-sized outlives a tile. The loss
// equals log_softmax's up to fp32 rounding of the log-sum-exp; the gradient equals autograd's for
// logits(states).to(fp32) -> cross_entropy to the compute dtype's rounding (the exponentials are
// rounded before the matmul).
//
// On CUDA in fp32 / fp16 / bf16 a tile's fp32 arithmetic is one kernel (kernels/cross_entropy_tiles.h),
// which reads the tile in the compute dtype and keeps no fp32 copy of it; elsewhere it is the
// torch operations of the *_reference functions below.
#include <torch/torch.h>

#include <memory>

#include "kernels/cross_entropy_tiles.h"
#include "qat/linear.h"
#include "trainer/model/host_resident_weight.h"

namespace qtrain::trainer {

// What the fused loss multiplies by: a frozen [vocab, hidden] weight, either a tensor (tied
// embeddings, or lm_head's copy from the host: train.lm_head_on_host) or a layer whose forward is x W^T + b (LinearLayer::matmul_weight_kind() != kNone;
// a 4-bit layer builds W again for each pass), or tiles of a weight on the host
// (train.lm_head_block_mb), and Gemma 2's final logit cap.
struct OutputProjection {
  torch::Tensor weight;                      // [vocab, hidden]; undefined when `layer` or `host_tiles` is set
  torch::Tensor weight_bias;                 // [vocab] beside `weight` or `host_tiles`, or undefined
  std::shared_ptr<qat::LinearLayer> layer;   // frozen; its matmul weight is W
  // W on the host, copied to the device a vocabulary tile at a time as the loss walks it, at most
  // `host_block_bytes` of it there at once (the tile in use and the next ones, on their way; at
  // least the one). The loss then walks it once, every token in one chunk.
  HostResidentWeight* host_tiles = nullptr;
  int64_t host_block_bytes = 0;
  double softcap = 0;                        // logits = tanh(logits / cap) * cap; 0: none

  int64_t vocab_size() const;
  torch::Tensor matmul_weight(torch::ScalarType dtype) const;  // W [vocab, hidden] in `dtype`
  torch::Tensor bias() const;                                  // [vocab] or undefined
};

struct FusedLossOptions {
  int64_t chunk_tokens = 0;  // tokens per pass over the vocabulary; <= 0: every token at once
  int64_t tile_columns = 0;  // vocabulary columns per tile; 0: fused_loss_tile_columns(chunk, vocab)
  // The gradient the summed loss will get in backward, where the caller knows it before the
  // forward (the training step's loss weight): the forward's gradient is computed for it (above).
  // 0: for 1, kept in fp32 and scaled in backward, as per-token losses always are.
  double gradient = 0;
};

// states [tokens, hidden] in the compute dtype; targets [tokens] int64, kIgnoreLabel where no
// loss is taken -> scalar fp32: the sum of the per-token losses. With grad mode on and states
// requiring grad, differentiable with respect to states (the projection is frozen).
torch::Tensor fused_linear_cross_entropy(const torch::Tensor& states, const torch::Tensor& targets,
                                         const OutputProjection& projection, const FusedLossOptions& options);

// The same pass, the per-token losses kept: [tokens] fp32, 0 where the target is ignored;
// differentiable with respect to states under any gradient of the losses (a preference loss
// weighs each sequence's tokens by its own factor).
torch::Tensor fused_linear_token_losses(const torch::Tensor& states, const torch::Tensor& targets,
                                        const OutputProjection& projection, const FusedLossOptions& options);

// The torch operations of one tile's arithmetic: the CPU path, and the reference the CUDA kernels
// (kernels/cross_entropy_tiles.h, same formulas) are tested against. logits [rows, tile] in the
// compute dtype, the vocabulary's columns begin .. begin + tile - 1; targets [rows] int64. The
// logits are taken, not copied: an fp32 tile's storage is worked on in place (the fp32 block is
// the tile's only one), a narrower tile's is let go once its fp32 copy exists.
//
// The statistics before any tile: max -inf, sum 0, target logit 0, [rows] each (`fp32`: their options).
kernels::LogSumExpStatistics unfolded_statistics(int64_t rows, const torch::TensorOptions& fp32);
// `seen` with the tile folded in: max, sum of exp(z - max) and z at the target, z = fp32(logits).
kernels::LogSumExpStatistics fold_tile_statistics_reference(const kernels::LogSumExpStatistics& seen,
                                                            torch::Tensor logits, const torch::Tensor& targets,
                                                            int64_t begin);
// The same fold, the tile's logits overwritten in place by exp(z - max) in their dtype (max the
// folded one), times 1 - (z / softcap)^2 where softcap > 0, 0 at the row's target:
// kernels/cross_entropy_tiles.h's exponentials.
kernels::LogSumExpStatistics fold_tile_exponentials_reference(const kernels::LogSumExpStatistics& seen,
                                                              torch::Tensor& logits, const torch::Tensor& targets,
                                                              int64_t begin, double softcap = 0);

// Columns per tile: an fp32 [chunk, tile] block of at most 64 MiB, in multiples of 256 (the
// widest N tile of the GPU's GEMM kernels, so only the vocabulary's last tile is ragged; rows of
// a bf16 block stay 512-byte aligned), at least 256, at most the vocabulary.
int64_t fused_loss_tile_columns(int64_t chunk_tokens, int64_t vocab_size);

// Tiles of a host weight on the device at once under `block_bytes` (OutputProjection::
// host_block_bytes): the one in use and those queued ahead of it, at least the one.
int64_t host_tiles_on_device(int64_t block_bytes, int64_t tile_bytes);

// A weight of `rows` rows of `row_bytes` streamed from the host to the fused loss
// (OutputProjection::host_tiles), which walks all `tokens` in one chunk: the rows of its tiles
// (`tile_columns`, or fused_loss_tile_columns(tokens, rows) where 0) and how many of them are on
// the device at once under `block_bytes`. The loss, the model's prefetch of the first tiles and
// the memory estimate all ask it.
struct StreamedTiles {
  int64_t rows = 0;
  int64_t on_device = 0;
};
StreamedTiles streamed_tiles(int64_t tokens, int64_t rows, int64_t row_bytes, int64_t block_bytes,
                             int64_t tile_columns = 0);

}  // namespace qtrain::trainer
