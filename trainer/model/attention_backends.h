#pragma once
// Which of scaled_dot_product_attention's kernels serve a stretch of work.
namespace qtrain::trainer {

// While one of these lives, SDPA does not use cuDNN's attention. SDPA prefers it for bf16 / fp16
// on Hopper, and cuDNN builds an execution plan for every new sequence length: about 50 ms of
// host time each on an H100, so decoding (a new key length every token) ran at 20 tokens/s in
// bf16 against 600 in fp32, and evaluation (batches padded to their longest) paid it for every
// new length. Flash attention, next in SDPA's order, takes any length as it comes. generate()
// and evaluate() hold one; training keeps cuDNN, whose shapes repeat.
class WithoutCudnnAttention {
 public:
  WithoutCudnnAttention();
  ~WithoutCudnnAttention();
  WithoutCudnnAttention(const WithoutCudnnAttention&) = delete;
  WithoutCudnnAttention& operator=(const WithoutCudnnAttention&) = delete;

 private:
  bool was_enabled_;
};

}  // namespace qtrain::trainer
