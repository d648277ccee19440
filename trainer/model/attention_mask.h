#pragma once
// Which keys each query of a batch may see beyond causality. An unpacked batch says nothing
// (causal). A packed batch holds several samples in a row, and each query sees only the earlier
// tokens of its own sample: flash attention takes that as the samples' cumulative lengths over
// the batch's tokens, without a [T, T] mask; the paths that need the mask written out (the CPU,
// fp32, Gemma 2's soft cap) build it on first use, once per forward pass.
#include <torch/torch.h>

#include <memory>

namespace qtrain::trainer {

// [batch, 1, seq, seq] bool, true where query i may attend to key j: j <= i and both tokens
// belong to the same sample (sample_ids [batch, seq]).
torch::Tensor block_causal_mask(const torch::Tensor& sample_ids);

// The runs of one sample id along each row of sample_ids [batch, seq] (the padding after a row's
// last sample, id -1, is a run of its own, as the mask lets it see itself), as flash attention's
// cumulative lengths over the flattened batch * seq tokens.
struct SampleSpans {
  torch::Tensor cumulative_lengths;  // int32 [runs + 1]: 0, the end of run 0, ..., batch * seq
  int64_t longest = 0;               // tokens in the longest run
  int64_t tokens = 0;                // batch * seq
  // The leading rows that are one sample end to end (data::collate puts them first): plain
  // causal attention is exactly theirs. The runs of the rows after them, over those rows' tokens
  // alone, as above (undefined when every row is whole).
  int64_t whole_rows = 0;
  torch::Tensor rest_cumulative_lengths;
  int64_t rest_longest = 0;
  // int32 [2, batch * seq]: each token's run as [start, end) over the batch's tokens, for kernels
  // that test visibility per token (kernels/softcapped_flash_attention.h).
  torch::Tensor run_bounds;
};
SampleSpans sample_spans(const torch::Tensor& sample_ids);

// How a packed batch's attention is given to the model: as spans where flash attention applies
// (the default), or always as the written-out mask (`qtrain bench --packed-mask`, to compare).
enum class PackedAttention { kSpans, kWrittenOutMask };

class AttentionMask {
 public:
  AttentionMask() = default;  // causal
  // A boolean or additive mask broadcastable to [batch, heads, seq, seq].
  static AttentionMask written_out(torch::Tensor mask);
  // A packed batch: sample_ids [batch, seq] int64 (-1 on padding), for a model on `device`.
  static AttentionMask packed(const torch::Tensor& sample_ids, const torch::Device& device,
                              PackedAttention how = PackedAttention::kSpans);

  bool defined() const { return state_ != nullptr; }
  // The mask written out ([batch, 1, seq, seq] for a packed batch, built on the first call).
  const torch::Tensor& dense() const;
  // A packed batch's spans on its device; nullptr when the mask must be written out.
  const SampleSpans* spans() const;

 private:
  struct State {
    torch::Tensor mask;        // written out (or built from sample_ids on first use)
    torch::Tensor sample_ids;  // packed batches, where the loader left them
    torch::Device device = torch::kCPU;  // the model's: where a written-out mask goes
    SampleSpans spans;         // packed batches given as spans, on the model's device
  };
  std::shared_ptr<State> state_;  // shared by the copies the checkpointed layers hold
};

}  // namespace qtrain::trainer
