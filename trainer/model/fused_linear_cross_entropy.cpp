#include "trainer/model/fused_linear_cross_entropy.h"

#include <torch/csrc/autograd/function.h>

#include <limits>

#include "data/batching.h"
#include "kernels/error.h"
#include "trainer/model/llama_layers.h"

namespace qtrain::trainer {

namespace {

using data::kIgnoreLabel;
using torch::autograd::variable_list;

// The logits [rows, end - begin] of one vocabulary tile in the compute dtype, computed as
// LlamaForCausalLMImpl::logits computes them: the matmul in the compute dtype, the cap in it too.
// `tile` is the weight's rows [begin, end).
torch::Tensor tile_logits(const torch::Tensor& states, const torch::Tensor& tile, const torch::Tensor& bias,
                          int64_t begin, int64_t end, double softcap) {
  auto logits = torch::nn::functional::linear(states, tile, bias.defined() ? bias.slice(0, begin, end) : torch::Tensor());
  if (softcap > 0) logits.div_(softcap).tanh_().mul_(softcap);  // in place
  return logits;
}

// Where each row's target falls in the tile [begin, end): in_tile [rows] bool, and the column
// [rows, 1] int64 (clamped into the tile where it does not fall there).
std::pair<torch::Tensor, torch::Tensor> target_columns(const torch::Tensor& targets, int64_t begin, int64_t end) {
  const auto in_tile = targets.ge(begin).logical_and(targets.lt(end));
  return {in_tile, (targets - begin).clamp(0, end - begin - 1).unsqueeze(1)};
}

// The tile's arithmetic, by the kernels where they take the logits (on CUDA, in fp32 / fp16 / bf16),
// else by the torch operations.
kernels::LogSumExpStatistics fold_tile_statistics(const kernels::LogSumExpStatistics& seen, torch::Tensor logits,
                                                  const torch::Tensor& targets, int64_t begin) {
  if (on_fused_kernels(logits)) {
    return kernels::cross_entropy_tile_statistics_cuda(seen, logits, targets.contiguous(), begin);
  }
  return fold_tile_statistics_reference(seen, std::move(logits), targets, begin);
}

kernels::LogSumExpStatistics fold_tile_exponentials(const kernels::LogSumExpStatistics& seen, torch::Tensor& logits,
                                                    const torch::Tensor& targets, int64_t begin, double softcap) {
  if (on_fused_kernels(logits)) {
    return kernels::cross_entropy_tile_exponentials_cuda(seen, logits, targets.contiguous(), begin, softcap);
  }
  return fold_tile_exponentials_reference(seen, logits, targets, begin, softcap);
}

// The projection's weight [vocab, hidden] in the compute dtype, a vocabulary tile at a time: slices
// of it on the device, or tiles copied from the host (OutputProjection::host_tiles).
class WeightTiles {
 public:
  WeightTiles(const OutputProjection& projection, torch::ScalarType dtype, const torch::Device& device,
              int64_t tokens, int64_t tile_columns)
      : host_(projection.host_tiles), dtype_(dtype), device_(device), bias_(projection.bias()) {
    if (!host_) {
      whole_ = projection.matmul_weight(dtype);
      return;
    }
    const auto& host = host_->host();
    ahead_ = streamed_tiles(tokens, host.size(0), host.size(1) * host.element_size(), projection.host_block_bytes,
                            tile_columns)
                 .on_device -
             1;
  }

  int64_t vocab() const { return host_ ? host_->host().size(0) : whole_.size(0); }
  const torch::Tensor& bias() const { return bias_; }
  // The weight whole on the device, or undefined where it comes from the host in tiles.
  const torch::Tensor& whole() const { return whole_; }

  torch::Tensor tile(int64_t begin, int64_t end) const {
    return host_ ? host_->take_rows(device_, begin, end, ahead_).to(dtype_) : whole_.slice(0, begin, end);
  }

 private:
  HostResidentWeight* host_;
  torch::ScalarType dtype_;
  torch::Device device_;
  torch::Tensor bias_;
  torch::Tensor whole_;
  int64_t ahead_ = 0;
};

struct ChunkLogSumExp {
  torch::Tensor lse;            // [rows] fp32: log sum_v exp(z_v)
  torch::Tensor target_logit;   // [rows] fp32: z at the target (0 where it is ignored)
};

// One chunk's pass over the vocabulary, a tile at a time: the running max and sum of exp per row.
ChunkLogSumExp chunk_log_sum_exp(const torch::Tensor& states, const torch::Tensor& targets, const WeightTiles& weight,
                                 double softcap, int64_t tile_columns) {
  const auto fp32 = states.options().dtype(torch::kFloat32);
  const int64_t rows = states.size(0);
  const int64_t vocab = weight.vocab();
  auto statistics = unfolded_statistics(rows, fp32);
  for (int64_t begin = 0; begin < vocab; begin += tile_columns) {
    const int64_t end = std::min(vocab, begin + tile_columns);
    statistics = fold_tile_statistics(
        statistics, tile_logits(states, weight.tile(begin, end), weight.bias(), begin, end, softcap), targets, begin);
  }
  return {statistics.max + statistics.sum.log(), statistics.target_logit};
}

// The same pass computing the chunk's gradient as it goes (the header's forward-gradient formulas):
// `gradient` is g, and the states' gradient [rows, hidden] is written into grad_states.
ChunkLogSumExp chunk_log_sum_exp_and_gradient(const torch::Tensor& states, const torch::Tensor& targets,
                                              const WeightTiles& weight, double softcap, int64_t tile_columns,
                                              double gradient, torch::Tensor grad_states) {
  const auto fp32 = states.options().dtype(torch::kFloat32);
  const int64_t rows = states.size(0);
  const int64_t vocab = weight.vocab();
  auto statistics = unfolded_statistics(rows, fp32);
  auto weighted = torch::zeros({rows, states.size(1)}, fp32);  // sum of exp(z - max) W over the tiles, target apart
  // W at each row's target (row 0 where it is ignored): gathered whole, or from the tiles as they pass.
  torch::Tensor target_rows;
  if (weight.whole().defined()) target_rows = weight.whole().index_select(0, targets.clamp(0, vocab - 1));
  for (int64_t begin = 0; begin < vocab; begin += tile_columns) {
    const int64_t end = std::min(vocab, begin + tile_columns);
    const auto tile = weight.tile(begin, end);
    auto exponentials = tile_logits(states, tile, weight.bias(), begin, end, softcap);
    auto folded = fold_tile_exponentials(statistics, exponentials, targets, begin, softcap);
    // The sum so far was taken against the max before this tile: rescaled to the new one (0 at first).
    weighted.mul_(torch::exp(statistics.max - folded.max).unsqueeze(1));
    weighted.add_(torch::mm(exponentials, tile));
    statistics = std::move(folded);
    if (!weight.whole().defined()) {
      const auto [in_tile, column] = target_columns(targets, begin, end);
      const auto picked = tile.index_select(0, column.squeeze(1));
      target_rows = target_rows.defined() ? torch::where(in_tile.unsqueeze(1), picked, target_rows) : picked;
    }
  }
  const auto lse = statistics.max + statistics.sum.log();
  const auto row_grad = targets.ne(kIgnoreLabel).to(torch::kFloat32) * gradient;  // g on learned rows, as backward's
  target_rows = target_rows.to(torch::kFloat32);
  auto target_weight = torch::exp(statistics.target_logit - lse) - 1.0;  // p - 1 at the target
  if (softcap > 0) target_weight.mul_(1.0 - (statistics.target_logit / softcap).square());  // the cap's derivative
  weighted.div_(statistics.sum.unsqueeze(1))
      .add_(target_rows.mul_(target_weight.unsqueeze(1)))
      .mul_(row_grad.unsqueeze(1));
  grad_states.copy_(weighted);
  return {lse, statistics.target_logit};
}

int64_t chunk_rows(int64_t chunk_tokens, int64_t total) {
  return chunk_tokens > 0 ? std::min(chunk_tokens, std::max<int64_t>(total, 1)) : std::max<int64_t>(total, 1);
}

// The backward of a loss whose forward computed its gradient for the loss gradient g: that
// gradient times (the loss gradient it gets) / g, exactly itself when that is g; per-token losses'
// (g = 1, kept in fp32) row by row, each times its own loss gradient, then in the states' dtype.
class ForwardGradientBackward : public torch::autograd::Node {
 public:
  ForwardGradientBackward(torch::Tensor grad_states, double gradient, torch::ScalarType dtype)
      : grad_states_(std::move(grad_states)), gradient_(gradient), dtype_(dtype) {}

  std::string name() const override { return "qtrain::FusedCrossEntropyForwardGradient"; }

  variable_list apply(variable_list&& output_grads) override {
    if (!grad_states_.defined()) {
      throw Error(ErrorCode::kInternal, "the fused loss was differentiated twice (retain_graph is not supported)");
    }
    const auto& loss_grad = output_grads[0];
    if (!loss_grad.defined()) return {torch::Tensor()};
    torch::NoGradGuard no_grad;
    const auto factor = loss_grad / gradient_;
    return {(grad_states_ * (factor.dim() == 0 ? factor : factor.unsqueeze(1))).to(dtype_)};
  }

  void release_variables() override { grad_states_.reset(); }

 private:
  torch::Tensor grad_states_;  // [tokens, hidden], for the loss gradient gradient_ (each token's, per token)
  double gradient_;
  torch::ScalarType dtype_;  // the states'
};

}  // namespace

int64_t OutputProjection::vocab_size() const {
  return layer ? layer->out_features() : host_tiles ? host_tiles->host().size(0) : weight.size(0);
}

torch::Tensor OutputProjection::matmul_weight(torch::ScalarType dtype) const {
  return layer ? layer->matmul_weight(dtype) : weight.to(dtype);
}

torch::Tensor OutputProjection::bias() const { return layer ? layer->bias() : weight_bias; }

kernels::LogSumExpStatistics unfolded_statistics(int64_t rows, const torch::TensorOptions& fp32) {
  return {torch::full({rows}, -std::numeric_limits<float>::infinity(), fp32), torch::zeros({rows}, fp32),
          torch::zeros({rows}, fp32)};
}

kernels::LogSumExpStatistics fold_tile_statistics_reference(const kernels::LogSumExpStatistics& seen,
                                                            torch::Tensor logits, const torch::Tensor& targets,
                                                            int64_t begin) {
  auto z = logits.to(torch::kFloat32);  // [rows, tile]
  logits = torch::Tensor();
  const auto [in_tile, column] = target_columns(targets, begin, begin + z.size(1));
  kernels::LogSumExpStatistics folded;
  folded.target_logit = torch::where(in_tile, z.gather(1, column).squeeze(1), seen.target_logit);
  folded.max = torch::maximum(seen.max, z.amax(1));
  // exp(z - max) in place: the tile's only fp32 block.
  folded.sum = seen.sum * torch::exp(seen.max - folded.max) + z.sub_(folded.max.unsqueeze(1)).exp_().sum(1);
  return folded;
}

kernels::LogSumExpStatistics fold_tile_exponentials_reference(const kernels::LogSumExpStatistics& seen,
                                                              torch::Tensor& logits, const torch::Tensor& targets,
                                                              int64_t begin, double softcap) {
  auto z = logits.to(torch::kFloat32);  // the logits themselves when they are fp32
  const auto [in_tile, column] = target_columns(targets, begin, begin + z.size(1));
  kernels::LogSumExpStatistics folded;
  folded.target_logit = torch::where(in_tile, z.gather(1, column).squeeze(1), seen.target_logit);
  folded.max = torch::maximum(seen.max, z.amax(1));
  // The cap's derivative 1 - (z / cap)^2, from the capped logits before they become exponentials:
  // one fp32 block, each step rounded as the kernel rounds it.
  torch::Tensor cap_derivative;
  if (softcap > 0) {
    cap_derivative = z.div(softcap);
    cap_derivative.mul_(cap_derivative).neg_().add_(1.0);
  }
  z.sub_(folded.max.unsqueeze(1)).exp_();
  folded.sum = seen.sum * torch::exp(seen.max - folded.max) + z.sum(1);
  if (cap_derivative.defined()) z.mul_(cap_derivative);
  z.scatter_(1, column, z.gather(1, column) * in_tile.logical_not().to(torch::kFloat32).unsqueeze(1));  // 0 at the target
  if (!z.is_same(logits)) logits.copy_(z);
  return folded;
}

namespace {

// The pass both entry points share: the sum of the per-token losses, or the losses themselves.
torch::Tensor fused_losses(const torch::Tensor& states, const torch::Tensor& targets, const OutputProjection& projection,
                           const FusedLossOptions& options, bool per_token) {
  const int64_t total = states.size(0);
  const bool streamed = projection.host_tiles != nullptr;
  // A weight streamed from the host is walked once: every token in one chunk.
  const int64_t chunk_tokens = streamed ? std::max<int64_t>(total, 1) : chunk_rows(options.chunk_tokens, total);
  const int64_t tile_columns = options.tile_columns > 0
                                   ? options.tile_columns
                                   : fused_loss_tile_columns(chunk_tokens, projection.vocab_size());
  const bool differentiate = torch::GradMode::is_enabled() && states.requires_grad();
  // Per-token losses get each token's own gradient (for a loss gradient of 1), weighed in backward;
  // so does a summed loss whose gradient is not declared.
  const bool weighed_in_backward = per_token || options.gradient == 0;
  const double declared = weighed_in_backward ? 1.0 : options.gradient;
  const auto fp32 = states.options().dtype(torch::kFloat32);
  auto losses = per_token ? torch::zeros({total}, fp32) : torch::zeros({}, fp32);
  // fp32 where backward weighs the rows: one rounding to the compute dtype, there.
  torch::Tensor grad_states =
      differentiate ? torch::empty_like(states, weighed_in_backward ? fp32 : states.options()) : torch::Tensor();
  {
    torch::NoGradGuard no_grad;
    const WeightTiles weight(projection, states.scalar_type(), states.device(), total, tile_columns);
    for (int64_t first = 0; first < total; first += chunk_tokens) {
      const int64_t last = std::min(total, first + chunk_tokens);
      const auto chunk_targets = targets.slice(0, first, last);
      const auto chunk_states = states.slice(0, first, last);
      const auto chunk = differentiate
                             ? chunk_log_sum_exp_and_gradient(chunk_states, chunk_targets, weight, projection.softcap,
                                                              tile_columns, declared, grad_states.slice(0, first, last))
                             : chunk_log_sum_exp(chunk_states, chunk_targets, weight, projection.softcap, tile_columns);
      const auto chunk_losses = torch::where(chunk_targets.ne(kIgnoreLabel), chunk.lse - chunk.target_logit, 0.0);
      if (per_token) {
        losses.slice(0, first, last).copy_(chunk_losses);
      } else {
        losses.add_(chunk_losses.sum());
      }
    }
  }
  if (!differentiate) return losses;
  auto node = std::shared_ptr<torch::autograd::Node>(
      new ForwardGradientBackward(grad_states, declared, states.scalar_type()), torch::autograd::deleteNode);
  node->set_next_edges({torch::autograd::impl::gradient_edge(states)});
  torch::autograd::create_gradient_edge(losses, node);
  return losses;
}

}  // namespace

torch::Tensor fused_linear_cross_entropy(const torch::Tensor& states, const torch::Tensor& targets,
                                         const OutputProjection& projection, const FusedLossOptions& options) {
  return fused_losses(states, targets, projection, options, /*per_token=*/false);
}

torch::Tensor fused_linear_token_losses(const torch::Tensor& states, const torch::Tensor& targets,
                                        const OutputProjection& projection, const FusedLossOptions& options) {
  return fused_losses(states, targets, projection, options, /*per_token=*/true);
}

int64_t host_tiles_on_device(int64_t block_bytes, int64_t tile_bytes) {
  return std::max<int64_t>(1, block_bytes / std::max<int64_t>(tile_bytes, 1));
}

StreamedTiles streamed_tiles(int64_t tokens, int64_t rows, int64_t row_bytes, int64_t block_bytes,
                             int64_t tile_columns) {
  StreamedTiles tiles;
  tiles.rows = std::min(tile_columns > 0 ? tile_columns : fused_loss_tile_columns(tokens, rows), std::max<int64_t>(rows, 1));
  tiles.on_device = host_tiles_on_device(block_bytes, tiles.rows * row_bytes);
  return tiles;
}

int64_t fused_loss_tile_columns(int64_t chunk_tokens, int64_t vocab_size) {
  constexpr int64_t kBlockBytes = int64_t{64} << 20;
  constexpr int64_t kMultiple = 256;
  const int64_t columns = kBlockBytes / (std::max<int64_t>(chunk_tokens, 1) * 4) / kMultiple * kMultiple;
  return std::min(std::max(columns, kMultiple), std::max<int64_t>(vocab_size, 1));
}

}  // namespace qtrain::trainer
