// Flash attention's own masks against SDPA over the written-out mask, in fp32 from the same bf16
// inputs: the sliding window and packed samples (cumulative lengths), outputs and the gradients of
// query, key and value (GPU only); and the spans a packed batch's sample ids give (CPU).
#include "trainer/model/flash_attention.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <tuple>

#include "trainer/base/memory_stats.h"
#include "trainer/model/attention_sinks.h"
#include "tensor_support.h"

namespace qtrain::trainer {
namespace {

// Query i sees keys i - window + 1 .. i (transformers' sliding-window mask).
torch::Tensor window_mask(int64_t length, int64_t window, const torch::Device& device) {
  const auto positions = torch::arange(length, torch::TensorOptions().dtype(torch::kInt64).device(device));
  const auto keys = positions.unsqueeze(0), queries = positions.unsqueeze(1);
  return (keys <= queries) & (keys > queries - window);
}

torch::Tensor masked_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t window,
                               double scale) {
  return at::scaled_dot_product_attention(q, k, v, window_mask(q.size(2), window, q.device()), 0.0, false, scale,
                                          /*enable_gqa=*/q.size(1) != k.size(1));
}

using testing::max_relative_error;
struct Attended {
  torch::Tensor out, grad_q, grad_k, grad_v;
};
template <typename Attention>
Attended run_attention(Attention attention, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
             const torch::Tensor& grad_out, torch::ScalarType dtype) {
  auto q_ = q.to(dtype).detach().requires_grad_(true), k_ = k.to(dtype).detach().requires_grad_(true),
       v_ = v.to(dtype).detach().requires_grad_(true);
  auto out = attention(q_, k_, v_);
  out.backward(grad_out.to(dtype));
  return {out.detach(), q_.grad(), k_.grad(), v_.grad()};
}

// Flash (ours) against SDPA over the mask in bf16, both relative to fp32 (reference): within bf16
// rounding of the output and the gradients (2^-8 relative each, a few roundings deep), and no
// further off than the masked path itself. `label` names the case in the printed figures.
void expect_as_close_as_the_mask(const Attended& ours, const Attended& dense_bf16, const Attended& reference,
                                 const std::string& label) {
  const std::tuple<const char*, torch::Tensor, torch::Tensor, torch::Tensor> parts[] = {
      {"output", ours.out, dense_bf16.out, reference.out},
      {"grad query", ours.grad_q, dense_bf16.grad_q, reference.grad_q},
      {"grad key", ours.grad_k, dense_bf16.grad_k, reference.grad_k},
      {"grad value", ours.grad_v, dense_bf16.grad_v, reference.grad_v}};
  for (const auto& [what, flash, dense, exact] : parts) {
    const double error = max_relative_error(flash, exact);
    const double dense_error = max_relative_error(dense, exact);
    std::printf("[ measured ] %s, %s: flash %.3g, SDPA with the mask in bf16 %.3g (relative to fp32)\n", label.c_str(),
                what, error, dense_error);
    EXPECT_LE(error, 2e-2) << label << ", " << what;
    EXPECT_LE(error, 2 * dense_error + 4e-3) << label << ", " << what;
  }
}

TEST(SlidingWindowAttention, CudaFlashWindowEqualsTheMaskedAttentionWithItsGradients) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU";
  torch::manual_seed(0);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const int64_t window = 64;
  const double scale = 0.125;
  // GQA (8 query heads over 2 key / value heads), a length that is not a multiple of any tile.
  const auto q = torch::randn({2, 8, 300, 64}, cuda).to(torch::kBFloat16).to(torch::kFloat32);
  const auto k = torch::randn({2, 2, 300, 64}, cuda).to(torch::kBFloat16).to(torch::kFloat32);
  const auto v = torch::randn({2, 2, 300, 64}, cuda).to(torch::kBFloat16).to(torch::kFloat32);
  const auto grad_out = torch::randn({2, 8, 300, 64}, cuda).to(torch::kBFloat16).to(torch::kFloat32);
  ASSERT_TRUE(flash_attention_applies(q.to(torch::kBFloat16), k.to(torch::kBFloat16)));
  ASSERT_FALSE(flash_attention_applies(q, k));  // fp32: the masked path

  auto masked = [&](auto&& a, auto&& b, auto&& c) { return masked_attention(a, b, c, window, scale); };
  auto flash = [&](auto&& a, auto&& b, auto&& c) { return flash_window_attention(a, b, c, window, scale); };
  const auto reference = run_attention(masked, q, k, v, grad_out, torch::kFloat32);
  const auto dense_bf16 = run_attention(masked, q, k, v, grad_out, torch::kBFloat16);
  const auto ours = run_attention(flash, q, k, v, grad_out, torch::kBFloat16);
  expect_as_close_as_the_mask(ours, dense_bf16, reference, "window 64");
  // Keys outside the window get no gradient from the query that cannot see them: query 299 with
  // window 64 sees 236..299, so grad_out on query 299 alone moves keys 236..299 only.
  auto q_ = q.to(torch::kBFloat16).detach().requires_grad_(true), k_ = k.to(torch::kBFloat16).detach().requires_grad_(true);
  auto out = flash_window_attention(q_, k_, v.to(torch::kBFloat16), window, scale);
  auto only_last = torch::zeros_like(out);
  only_last.select(2, 299).fill_(1);
  out.backward(only_last);
  const auto moved = k_.grad().abs().sum({0, 1, 3}).ne(0).nonzero().flatten();
  EXPECT_EQ(moved.min().item<int64_t>(), 236);
  EXPECT_EQ(moved.max().item<int64_t>(), 299);
}

// gpt-oss's sinks on flash attention (its output times sigmoid(logsumexp - sink), the logsumexp's
// gradient folded into flash's backward) against the written-out path of transformers' eager
// attention, with and without a window: output and the gradients of q, k, v and the sinks, each
// within bf16's rounding of the fp32 written-out values and no further than that path in bf16.
TEST(SinkAttention, CudaFlashWithSinksEqualsTheWrittenOutPathWithItsGradients) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU";
  torch::manual_seed(1);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const double scale = 0.125;
  const auto q = torch::randn({2, 8, 300, 64}, cuda).to(torch::kBFloat16).to(torch::kFloat32);
  const auto k = torch::randn({2, 2, 300, 64}, cuda).to(torch::kBFloat16).to(torch::kFloat32);
  const auto v = torch::randn({2, 2, 300, 64}, cuda).to(torch::kBFloat16).to(torch::kFloat32);
  const auto grad_out = torch::randn({2, 8, 300, 64}, cuda).to(torch::kBFloat16).to(torch::kFloat32);
  // Sinks around the scores' own scale, so that they take a real share of each row.
  const auto sinks = (torch::randn({8}, cuda) * 2).to(torch::kBFloat16).to(torch::kFloat32);
  for (const int64_t window : {0, 64}) {
    const auto visible = window_mask(300, window > 0 ? window : 300, q.device());
    struct Result {
      Attended attended;
      torch::Tensor grad_sinks;
    };
    const auto run_with = [&](bool flash, torch::ScalarType dtype) {
      auto s_ = sinks.to(dtype).detach().requires_grad_(true);
      Result result;
      result.attended = run_attention(
          [&](auto&& a, auto&& b, auto&& c) {
            return flash ? flash_window_attention(a, b, c, window, scale, s_) : sink_attention(a, b, c, visible, scale, s_);
          },
          q, k, v, grad_out, dtype);
      result.grad_sinks = s_.grad();
      return result;
    };
    const auto reference = run_with(false, torch::kFloat32);
    const auto dense_bf16 = run_with(false, torch::kBFloat16);
    const auto ours = run_with(true, torch::kBFloat16);
    const std::string label = window > 0 ? "sinks, window 64" : "sinks, causal";
    expect_as_close_as_the_mask(ours.attended, dense_bf16.attended, reference.attended, label);
    const double sink_error = max_relative_error(ours.grad_sinks, reference.grad_sinks);
    std::printf("[ measured ] %s, grad sinks: flash %.3g, written out in bf16 %.3g (relative to fp32)\n", label.c_str(),
                sink_error, max_relative_error(dense_bf16.grad_sinks, reference.grad_sinks));
    EXPECT_LE(sink_error, 2e-2) << label;
  }
}

// What the window saves at Mistral 7B v0.1's shape (32 heads over 8, head_dim 128, window 4096)
// on 16k tokens: time and peak memory of forward + backward, flash window against the mask.
TEST(SlidingWindowAttention, CudaFlashWindowAtLongSequencesMeasured) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU";
  const torch::Device device(torch::kCUDA, 0);
  const auto options = torch::TensorOptions().device(device).dtype(torch::kBFloat16);
  const int64_t length = 16384, window = 4096;
  const double scale = 1.0 / std::sqrt(128.0);
  const auto q = torch::randn({1, 32, length, 128}, options), k = torch::randn({1, 8, length, 128}, options),
             v = torch::randn({1, 8, length, 128}, options), grad_out = torch::randn({1, 32, length, 128}, options);
  auto measure = [&](const char* what, auto attention) {
    for (int warm = 0; warm < 2; ++warm) run_attention(attention, q, k, v, grad_out, torch::kBFloat16);
    torch::cuda::synchronize();
    reset_peak_memory(device);
    const double before = memory_usage(device).current_bytes;
    const auto start = std::chrono::steady_clock::now();
    const auto result = run_attention(attention, q, k, v, grad_out, torch::kBFloat16);
    torch::cuda::synchronize();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double peak = memory_usage(device).peak_bytes - before;
    std::printf("[ measured ] %s, %ld tokens, window %ld: forward + backward %.1f ms, peak %s above the inputs\n", what,
                static_cast<long>(length), static_cast<long>(window), 1e3 * seconds, format_bytes(peak).c_str());
    return result.out;
  };
  const auto flash = measure("flash window", [&](auto&& a, auto&& b, auto&& c) {
    return flash_window_attention(a, b, c, window, scale);
  });
  const auto masked = measure("SDPA with the [T, T] mask", [&](auto&& a, auto&& b, auto&& c) {
    return masked_attention(a, b, c, window, scale);
  });
  EXPECT_LE(max_relative_error(flash, masked.to(torch::kFloat32)), 2e-2);
}


// Row 0: samples of 2 and 3 tokens, then a padding token; row 1: one sample of 4, two of padding.
TEST(PackedAttention, SampleIdsGiveTheRunsAsCumulativeLengths) {
  const auto sample_ids = torch::tensor({0, 0, 1, 1, 1, -1, 0, 0, 0, 0, -1, -1}, torch::kInt64).view({2, 6});
  const auto spans = sample_spans(sample_ids);
  EXPECT_TRUE(torch::equal(spans.cumulative_lengths, torch::tensor({0, 2, 5, 6, 10, 12}, torch::kInt32)));
  EXPECT_EQ(spans.longest, 4);
  EXPECT_EQ(spans.tokens, 12);
  // Each token's run as [start, end) over the batch's tokens (the soft-capped kernels' visibility).
  EXPECT_TRUE(torch::equal(spans.run_bounds, torch::tensor({0, 0, 2, 2, 2, 5, 6, 6, 6, 6, 10, 10,  //
                                                            2, 2, 5, 5, 5, 6, 10, 10, 10, 10, 12, 12},
                                                           torch::kInt32).view({2, 12})));
  // A row that is one sample throughout is one run; runs never cross rows even with equal ids.
  const auto whole = sample_spans(torch::zeros({3, 5}, torch::kInt64));
  EXPECT_TRUE(torch::equal(whole.cumulative_lengths, torch::tensor({0, 5, 10, 15}, torch::kInt32)));
  EXPECT_EQ(whole.longest, 5);
  EXPECT_EQ(spans.whole_rows, 0);  // row 0 ends in padding
  EXPECT_TRUE(torch::equal(spans.rest_cumulative_lengths, spans.cumulative_lengths));
  EXPECT_EQ(spans.rest_longest, 4);
  EXPECT_EQ(whole.whole_rows, 3);
  EXPECT_FALSE(whole.rest_cumulative_lengths.defined());
  // Only the leading whole rows count as whole; the runs after them start at 0.
  const auto mixed = sample_spans(torch::tensor({4, 4, 4, 0, 1, 1, 2, 2, 2}, torch::kInt64).view({3, 3}));
  EXPECT_EQ(mixed.whole_rows, 1);
  EXPECT_TRUE(torch::equal(mixed.rest_cumulative_lengths, torch::tensor({0, 1, 3, 6}, torch::kInt32)));
  EXPECT_EQ(mixed.rest_longest, 3);
  EXPECT_TRUE(torch::equal(mixed.cumulative_lengths, torch::tensor({0, 3, 4, 6, 9}, torch::kInt32)));
  const auto padding_row = sample_spans(torch::tensor({-1, -1, 0, 0}, torch::kInt64).view({2, 2}));
  EXPECT_EQ(padding_row.whole_rows, 0);  // a row of padding is no sample
}

TEST(PackedAttention, APackedMaskWritesOutTheBlockCausalMaskOnlyWhenAsked) {
  const auto sample_ids = torch::tensor({0, 0, 1, 1, 1, -1}, torch::kInt64).view({1, 6});
  const auto spans = AttentionMask::packed(sample_ids, torch::kCPU);
  ASSERT_TRUE(spans.defined());
  ASSERT_NE(spans.spans(), nullptr);
  EXPECT_TRUE(torch::equal(spans.spans()->cumulative_lengths, torch::tensor({0, 2, 5, 6}, torch::kInt32)));
  EXPECT_TRUE(torch::equal(spans.dense(), block_causal_mask(sample_ids)));
  const auto written = AttentionMask::packed(sample_ids, torch::kCPU, PackedAttention::kWrittenOutMask);
  EXPECT_EQ(written.spans(), nullptr);
  EXPECT_TRUE(torch::equal(written.dense(), block_causal_mask(sample_ids)));
  EXPECT_FALSE(AttentionMask().defined());
  EXPECT_EQ(AttentionMask::written_out(torch::ones({1, 1, 2, 2}, torch::kBool)).spans(), nullptr);
}

// Samples of uneven lengths (one longer than a flash tile, one of a single token) and padding,
// GQA, with and without a window that cuts the longest sample.
TEST(PackedAttention, CudaFlashOverSpansEqualsTheBlockCausalMaskWithItsGradients) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU";
  torch::manual_seed(1);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const double scale = 0.125;
  const int64_t length = 300;
  auto sample_ids = torch::full({2, length}, -1, torch::kInt64);
  sample_ids[0].narrow(0, 0, 170).fill_(0);
  sample_ids[0].narrow(0, 170, 1).fill_(1);
  sample_ids[0].narrow(0, 171, 120).fill_(2);
  sample_ids[1].narrow(0, 0, 37).fill_(0);
  sample_ids[1].narrow(0, 37, 263).fill_(1);
  const auto mask = block_causal_mask(sample_ids.to(torch::kCUDA));
  auto spans = sample_spans(sample_ids);
  spans.cumulative_lengths = spans.cumulative_lengths.to(torch::kCUDA);
  const auto q = torch::randn({2, 8, length, 64}, cuda).to(torch::kBFloat16).to(torch::kFloat32);
  const auto k = torch::randn({2, 2, length, 64}, cuda).to(torch::kBFloat16).to(torch::kFloat32);
  const auto v = torch::randn({2, 2, length, 64}, cuda).to(torch::kBFloat16).to(torch::kFloat32);
  const auto grad_out = torch::randn({2, 8, length, 64}, cuda).to(torch::kBFloat16).to(torch::kFloat32);
  for (const int64_t window : {int64_t{0}, int64_t{64}}) {
    const auto visible = window > 0 ? mask & window_mask(length, window, mask.device()) : mask;
    auto masked = [&](auto&& a, auto&& b, auto&& c) {
      return at::scaled_dot_product_attention(a, b, c, visible, 0.0, false, scale, /*enable_gqa=*/true);
    };
    auto flash = [&](auto&& a, auto&& b, auto&& c) { return flash_packed_attention(a, b, c, spans, window, scale); };
    const auto reference = run_attention(masked, q, k, v, grad_out, torch::kFloat32);
    const auto dense_bf16 = run_attention(masked, q, k, v, grad_out, torch::kBFloat16);
    const auto ours = run_attention(flash, q, k, v, grad_out, torch::kBFloat16);
    expect_as_close_as_the_mask(ours, dense_bf16, reference, "spans, window " + std::to_string(window));
  }
  // Leading rows that are one sample each take plain causal attention, the rest the spans:
  // row 0 whole and row 1 split, then both rows whole.
  for (const bool both_whole : {false, true}) {
    auto ids = sample_ids.clone();
    ids[0].fill_(0);
    if (both_whole) ids[1].fill_(0);
    const auto leading_mask = block_causal_mask(ids.to(torch::kCUDA));
    auto leading_spans = sample_spans(ids);
    ASSERT_EQ(leading_spans.whole_rows, both_whole ? 2 : 1);
    leading_spans.cumulative_lengths = leading_spans.cumulative_lengths.to(torch::kCUDA);
    if (!both_whole) leading_spans.rest_cumulative_lengths = leading_spans.rest_cumulative_lengths.to(torch::kCUDA);
    auto masked = [&](auto&& a, auto&& b, auto&& c) {
      return at::scaled_dot_product_attention(a, b, c, leading_mask, 0.0, false, scale, /*enable_gqa=*/true);
    };
    auto packed = [&](auto&& a, auto&& b, auto&& c) { return flash_packed_attention(a, b, c, leading_spans, 0, scale); };
    const auto reference = run_attention(masked, q, k, v, grad_out, torch::kFloat32);
    const auto dense_bf16 = run_attention(masked, q, k, v, grad_out, torch::kBFloat16);
    const auto ours = run_attention(packed, q, k, v, grad_out, torch::kBFloat16);
    expect_as_close_as_the_mask(ours, dense_bf16, reference, both_whole ? "both rows whole" : "row 0 whole");
  }
  // No gradient crosses a sample boundary: the output of row 1's second sample alone moves no
  // key of its first sample (tokens 0..36).
  auto k_ = k.to(torch::kBFloat16).detach().requires_grad_(true);
  auto out = flash_packed_attention(q.to(torch::kBFloat16), k_, v.to(torch::kBFloat16), spans, 0, scale);
  auto only_second = torch::zeros_like(out);
  only_second[1].narrow(1, 37, 263).fill_(1);
  out.backward(only_second);
  const auto moved = k_.grad()[1].abs().sum(std::vector<int64_t>{0, 2}).ne(0).nonzero().flatten();
  EXPECT_EQ(moved.min().item<int64_t>(), 37);
}

// What spans save on the Llama-3-8B shape (32 heads over 8, head_dim 128): 4 rows of 2,048
// tokens, each packed with 4 samples of 512, forward + backward against SDPA over the mask.
TEST(PackedAttention, CudaSpansAgainstTheMaskMeasured) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU";
  const torch::Device device(torch::kCUDA, 0);
  const auto options = torch::TensorOptions().device(device).dtype(torch::kBFloat16);
  const int64_t rows = 4, length = 2048, sample = 512;
  const double scale = 1.0 / std::sqrt(128.0);
  const auto sample_ids =
      torch::div(torch::arange(length, torch::kInt64), sample, "floor").unsqueeze(0).expand({rows, -1}).contiguous();
  const auto mask = AttentionMask::packed(sample_ids, device);
  const auto q = torch::randn({rows, 32, length, 128}, options), k = torch::randn({rows, 8, length, 128}, options),
             v = torch::randn({rows, 8, length, 128}, options), grad_out = torch::randn({rows, 32, length, 128}, options);
  auto measure = [&](const char* what, auto attention) {
    for (int warm = 0; warm < 2; ++warm) run_attention(attention, q, k, v, grad_out, torch::kBFloat16);
    torch::cuda::synchronize();
    const auto start = std::chrono::steady_clock::now();
    const int repeats = 10;
    torch::Tensor out;
    for (int repeat = 0; repeat < repeats; ++repeat) out = run_attention(attention, q, k, v, grad_out, torch::kBFloat16).out;
    torch::cuda::synchronize();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / repeats;
    std::printf("[ measured ] %s, %ld x %ld tokens in samples of %ld: forward + backward %.2f ms\n", what,
                static_cast<long>(rows), static_cast<long>(length), static_cast<long>(sample), 1e3 * seconds);
    return out;
  };
  const auto flash = measure("flash over spans", [&](auto&& a, auto&& b, auto&& c) {
    return flash_packed_attention(a, b, c, *mask.spans(), 0, scale);
  });
  const auto masked = measure("SDPA with the block-causal mask", [&](auto&& a, auto&& b, auto&& c) {
    return at::scaled_dot_product_attention(a, b, c, mask.dense(), 0.0, false, scale, /*enable_gqa=*/true);
  });
  EXPECT_LE(max_relative_error(flash, masked.to(torch::kFloat32)), 2e-2);
}

}  // namespace
}  // namespace qtrain::trainer
