// Expert banks (qat/expert_linear.h): the grouped product equals each expert's own matmul, and
// ExpertLora's update equals peft's per-expert delta (W_e + scale B[:, e::E] A[e·r:(e+1)·r])
// applied as a merged weight, in fp32 on the CPU; on a GPU in bf16 the grouped GEMM (torch's
// _grouped_mm) gives the per-expert loop's values and gradients to bf16's rounding.
#include <gtest/gtest.h>

#include "block_counting_bank.h"
#include "qat/expert_linear.h"
#include "qat/four_bit_linear.h"
#include "qat/mxfp4_linear.h"

namespace qtrain::qat {
namespace {

// `rows` rows split over `experts` experts by `counts` (some empty), fresh random values.
struct Batch {
  torch::Tensor rows, counts, weights;
};

Batch make_batch(int64_t experts, int64_t in, int64_t out, const std::vector<int64_t>& counts, torch::Device device,
                 torch::ScalarType dtype) {
  int64_t total = 0;
  for (const auto count : counts) total += count;
  const auto options = torch::TensorOptions().dtype(dtype).device(device);
  return {torch::randn({total, in}, options), torch::tensor(counts, torch::kInt64).to(device),
          torch::randn({experts, out, in}, options) * 0.1};
}

// Each expert's rows times its own weight, one matmul each, in fp64.
torch::Tensor reference_product(const Batch& batch, const std::vector<int64_t>& counts) {
  std::vector<torch::Tensor> parts;
  int64_t start = 0;
  for (size_t expert = 0; expert < counts.size(); ++expert) {
    parts.push_back(torch::matmul(batch.rows.narrow(0, start, counts[expert]).to(torch::kFloat64),
                                  batch.weights[static_cast<int64_t>(expert)].to(torch::kFloat64).t()));
    start += counts[expert];
  }
  return torch::cat(parts);
}

TEST(ExpertBank, GroupedProductIsEachExpertsOwnMatmul) {
  torch::manual_seed(3);
  const std::vector<int64_t> counts = {5, 0, 3, 9};
  const auto batch = make_batch(4, 24, 16, counts, torch::kCPU, torch::kFloat32);
  const auto ours = grouped_linear(batch.rows, batch.weights, batch.counts);
  EXPECT_LE((ours.to(torch::kFloat64) - reference_product(batch, counts)).abs().max().item<double>(), 1e-5);
}

TEST(ExpertBank, LoraIsPeftsPerExpertDelta) {
  torch::manual_seed(4);
  const int64_t experts = 4, in = 24, out = 16, rank = 3;  // rank 3 against 4 experts: the layouts cannot be confused
  DenseLinearOptions dense{in, experts * out, false, torch::kFloat32};
  auto base = std::make_shared<DenseLinear>(dense);
  LoraOptions options;
  options.rank = rank;
  options.alpha = 8;
  ExpertLora lora(base, experts, options);
  {
    torch::NoGradGuard no_grad;
    lora.named_parameters()["lora_B.weight"].normal_(0, 0.2);
  }
  const std::vector<int64_t> counts = {2, 6, 0, 4};
  auto batch = make_batch(experts, in, out, counts, torch::kCPU, torch::kFloat32);
  // peft's delta: B's columns e, e + E, ... with A's rows e·r ... (e+1)·r − 1.
  const auto& A = lora.lora_A();
  const auto& B = lora.lora_B();
  const auto W = base->weight().view({experts, out, in});
  std::vector<torch::Tensor> merged;
  for (int64_t expert = 0; expert < experts; ++expert) {
    const auto columns = torch::arange(expert, rank * experts, experts);
    merged.push_back(W[expert] + options.scale() * torch::matmul(B.index_select(1, columns), A.narrow(0, expert * rank, rank)));
  }
  batch.weights = torch::stack(merged).detach();
  const auto expected = reference_product(batch, counts);
  const auto ours = lora.grouped_forward(batch.rows, batch.counts);
  EXPECT_LE((ours.to(torch::kFloat64) - expected).abs().max().item<double>(), 1e-5);
  // The merged weight (exports) is the same per-expert delta.
  EXPECT_LE((lora.dense_weight(torch::kFloat32).view({experts, out, in}) - batch.weights).abs().max().item<double>(), 1e-6);
  // Gradients reach A and B, not the frozen base.
  ours.sum().backward();
  EXPECT_TRUE(A.grad().defined() && B.grad().defined());
  EXPECT_FALSE(base->weight().requires_grad());
}

TEST(ExpertBank, LoraRefusesDropoutAsPeftDoes) {
  DenseLinearOptions dense{8, 16, false, torch::kFloat32};
  LoraOptions options;
  options.dropout = 0.05;
  EXPECT_THROW(ExpertLora(std::make_shared<DenseLinear>(dense), 2, options), Error);
}

TEST(ExpertBank, CudaGroupedGemmMatchesThePerExpertLoopInBf16) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  torch::manual_seed(5);
  const std::vector<int64_t> counts = {40, 0, 17, 300, 1, 90, 0, 64};
  auto batch = make_batch(8, 256, 128, counts, torch::kCUDA, torch::kBFloat16);
  batch.rows.requires_grad_(true);
  const auto ours = grouped_linear(batch.rows, batch.weights, batch.counts);
  const auto expected = reference_product(batch, counts);
  const double error = (ours.to(torch::kFloat64) - expected).abs().max().item<double>() / expected.abs().max().item<double>();
  std::printf("[ measured ] grouped GEMM in bf16 vs fp64 per-expert products: %.3g relative\n", error);
  EXPECT_LE(error, 1e-2);
  // The input's gradient, through _grouped_mm's backward: each expert's rows times its weight.
  const auto grad = torch::randn_like(ours);
  ours.backward(grad);
  Batch transposed{grad, batch.counts, batch.weights.transpose(1, 2).contiguous()};
  const auto expected_grad = reference_product(transposed, counts);
  const double grad_error = (batch.rows.grad().to(torch::kFloat64) - expected_grad).abs().max().item<double>() /
                            expected_grad.abs().max().item<double>();
  EXPECT_LE(grad_error, 1e-2);
}

TEST(ExpertBank, CudaNf4BankMultipliesItsDequantizedExperts) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  torch::manual_seed(6);
  const int64_t experts = 4, in = 128, out = 64;
  const auto weight = torch::randn({experts * out, in}, torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA)) * 0.05;
  auto bank = FourBitLinear::from_dense(weight, torch::Tensor(), FourBitOptions{});
  const std::vector<int64_t> counts = {10, 33, 0, 7};
  auto batch = make_batch(experts, in, out, counts, torch::kCUDA, torch::kBFloat16);
  batch.weights = bank->dense_weight(torch::kBFloat16).view({experts, out, in});
  const auto ours = grouped_linear(batch.rows, expert_weights(*bank, experts, torch::kBFloat16), batch.counts);
  const auto expected = reference_product(batch, counts);
  EXPECT_LE((ours.to(torch::kFloat64) - expected).abs().max().item<double>() / expected.abs().max().item<double>(), 1e-2);
}

// A frozen bank that counts how often its weights are built (dequantized): the layer keeps them for
// backward only under KeepBuiltWeights, as the frozen 4-bit layers do.
class CountingBank : public LinearLayer {
 public:
  explicit CountingBank(std::shared_ptr<LinearLayer> inner) : inner_(register_module("inner", std::move(inner))) {}
  torch::Tensor forward(const torch::Tensor& input) override { return inner_->forward(input); }
  int64_t in_features() const override { return inner_->in_features(); }
  int64_t out_features() const override { return inner_->out_features(); }
  torch::Tensor dense_weight(torch::ScalarType dtype) const override {
    ++builds;
    return inner_->dense_weight(dtype);
  }
  torch::Tensor bias() const override { return inner_->bias(); }
  mutable int builds = 0;

 private:
  std::shared_ptr<LinearLayer> inner_;
};

// Values and gradients of the rebuilt path equal the kept path's (and each expert's own matmul);
// with grad off, or a bank that trains, nothing is rebuilt.
void expect_rebuilt_in_backward_unless_kept(torch::Device device, torch::ScalarType dtype, double tolerance) {
  torch::manual_seed(8);
  const int64_t experts = 4, in = 64, out = 32;
  const auto weight = torch::randn({experts * out, in}, torch::TensorOptions().dtype(torch::kBFloat16).device(device)) * 0.05;
  auto bank = std::make_shared<CountingBank>(FourBitLinear::from_dense(weight, torch::Tensor(), FourBitOptions{}));
  const std::vector<int64_t> counts = {10, 33, 0, 7};
  auto batch = make_batch(experts, in, out, counts, device, dtype);
  batch.weights = expert_weights(*bank, experts, torch::kFloat32).view({experts, out, in});
  const auto grad_out = torch::randn({50, out}, batch.rows.options());
  auto run = [&](bool keep) {
    KeepBuiltWeights kept(keep);
    bank->builds = 0;
    auto rows = batch.rows.detach().requires_grad_(true);
    const auto product = bank_product(*bank, experts, rows, batch.counts);
    product.backward(grad_out);
    return std::make_tuple(product.detach(), rows.grad(), bank->builds);
  };
  const auto [kept_out, kept_grad, kept_builds] = run(true);
  const auto [rebuilt_out, rebuilt_grad, rebuilt_builds] = run(false);
  EXPECT_EQ(kept_builds, 1);
  EXPECT_EQ(rebuilt_builds, 2);  // forward, then backward
  EXPECT_TRUE(torch::allclose(rebuilt_out, kept_out, tolerance, tolerance));
  EXPECT_LE((rebuilt_grad - kept_grad).abs().max().item<double>(), tolerance * kept_grad.abs().max().item<double>());
  const auto expected = reference_product(batch, counts);
  EXPECT_LE((rebuilt_out.to(torch::kFloat64) - expected).abs().max().item<double>(),
            std::max(tolerance, 1e-5) * expected.abs().max().item<double>() * 10);
  {
    torch::NoGradGuard no_grad;
    bank->builds = 0;
    bank_product(*bank, experts, batch.rows, batch.counts);
    EXPECT_EQ(bank->builds, 1);
  }
}

// The two frozen bases that build rows of a bank: NF4, and gpt-oss's MXFP4 (random codes, scales
// near 2^-6).
std::shared_ptr<LinearLayer> nf4_bank(int64_t rows, int64_t in, torch::Device device) {
  const auto weight = torch::randn({rows, in}, torch::TensorOptions().dtype(torch::kBFloat16).device(device)) * 0.05;
  return FourBitLinear::from_dense(weight, torch::Tensor(), FourBitOptions{});
}

std::shared_ptr<LinearLayer> mxfp4_bank(int64_t rows, int64_t in, torch::Device device) {
  const auto bytes = torch::TensorOptions().dtype(torch::kUInt8).device(device);
  return std::make_shared<Mxfp4Linear>(torch::randint(256, {rows, in / 32, 16}, bytes), torch::randint(118, 124, {rows, in / 32}, bytes),
                                       torch::Tensor(), torch::kBFloat16);
}

// A bank built again in blocks of experts (BuildBanksInBlocks) gives the whole bank's product and
// input gradient: bit for bit on the CPU, where each expert's product is its own. A block whose
// experts have no rows is not built. A product without grad (a checkpointed forward) is built in
// the same blocks: gpt-oss-20b's whole gate_up bank built there set the step's peak.
void expect_blocks_give_the_whole_banks_products(torch::Device device, torch::ScalarType dtype, double tolerance,
                                                 std::shared_ptr<LinearLayer> (*make_bank)(int64_t, int64_t, torch::Device)) {
  torch::manual_seed(10);
  const int64_t experts = 5, in = 192, out = 40;
  const auto bank = std::make_shared<qtrain::testing::BlockCountingBank>(make_bank(experts * out, in, device));
  const std::vector<int64_t> counts = {10, 33, 0, 0, 7};
  const auto batch = make_batch(experts, in, out, counts, device, dtype);
  const auto grad_out = torch::randn({50, out}, batch.rows.options());
  const int64_t expert_bytes = out * in * static_cast<int64_t>(c10::elementSize(dtype));
  auto run = [&](int64_t block_bytes) {
    const KeepBuiltWeights rebuilt(false);
    const BuildBanksInBlocks blocks(block_bytes);
    auto rows = batch.rows.detach().requires_grad_(true);
    const auto product = bank_product(*bank, experts, rows, batch.counts);
    product.backward(grad_out);
    torch::NoGradGuard no_grad;
    return std::make_tuple(product.detach(), rows.grad(), bank_product(*bank, experts, batch.rows, batch.counts));
  };
  const auto [whole_out, whole_grad, whole_no_grad] = run(0);
  EXPECT_EQ(bank->wholes, 3);  // forward, backward, the product without grad
  EXPECT_EQ(bank->row_blocks, 0);
  bank->reset_counts();
  // Two experts a block: {0, 1}, {2, 3} (no rows: not built), {4}.
  const auto [out_blocks, grad_blocks, no_grad_blocks] = run(2 * expert_bytes + expert_bytes / 2);
  EXPECT_EQ(bank->wholes, 0);
  EXPECT_EQ(bank->row_blocks, 3 * 2);  // forward, backward and the product without grad
  EXPECT_EQ(bank->most_rows, 2 * out);
  const auto scale = [](const torch::Tensor& t) { return t.abs().max().item<double>(); };
  EXPECT_LE(scale(out_blocks - whole_out), tolerance * scale(whole_out));
  EXPECT_LE(scale(grad_blocks - whole_grad), tolerance * scale(whole_grad));
  EXPECT_LE(scale(no_grad_blocks - whole_no_grad), tolerance * scale(whole_no_grad));
  EXPECT_TRUE(torch::equal(whole_no_grad, whole_out));
  // Without grad, a bank up to WholeBanksWithoutGrad's bytes is built whole.
  {
    torch::NoGradGuard no_grad;
    const BuildBanksInBlocks blocks(2 * expert_bytes);
    const int64_t whole_bytes = experts * expert_bytes;
    for (const int64_t allowed : {whole_bytes, whole_bytes - 1}) {
      const WholeBanksWithoutGrad up_to(allowed);
      bank->reset_counts();
      EXPECT_TRUE(torch::equal(bank_product(*bank, experts, batch.rows, batch.counts), no_grad_blocks));
      EXPECT_EQ(bank->wholes, allowed == whole_bytes ? 1 : 0);
      EXPECT_EQ(bank->row_blocks, allowed == whole_bytes ? 0 : 2);
    }
  }
  // A block smaller than an expert still builds one expert at a time.
  bank->reset_counts();
  run(expert_bytes / 4);
  EXPECT_EQ(bank->row_blocks, 3 * 3);
  EXPECT_EQ(bank->most_rows, out);
}

TEST(ExpertBank, ABankBuiltInBlocksGivesTheWholeBanksProducts) {
  expect_blocks_give_the_whole_banks_products(torch::kCPU, torch::kFloat32, 0, nf4_bank);
  expect_blocks_give_the_whole_banks_products(torch::kCPU, torch::kFloat32, 0, mxfp4_bank);
}

TEST(ExpertBank, CudaABankBuiltInBlocksGivesTheWholeBanksProducts) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  expect_blocks_give_the_whole_banks_products(torch::kCUDA, torch::kBFloat16, 1e-2, nf4_bank);
  expect_blocks_give_the_whole_banks_products(torch::kCUDA, torch::kBFloat16, 1e-2, mxfp4_bank);
}

// A layer's banks share one copy of the counts to the host; counts changed in place since, or
// other counts with the same values, are copied again and equal their own values.
TEST(ExpertBank, CountsComeToTheHostOncePerCountsTensor) {
  auto counts = torch::tensor(std::vector<int64_t>{3, 0, 5}, torch::kInt64);
  EXPECT_EQ(host_counts(counts), (std::vector<int64_t>{3, 0, 5}));
  EXPECT_EQ(host_counts(counts), (std::vector<int64_t>{3, 0, 5}));
  counts[1] = 7;  // in place: a new version
  EXPECT_EQ(host_counts(counts), (std::vector<int64_t>{3, 7, 5}));
  const auto other = torch::tensor(std::vector<int32_t>{1, 2}, torch::kInt32);
  EXPECT_EQ(host_counts(other), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(host_counts(counts), (std::vector<int64_t>{3, 7, 5}));
  for (int i = 0; i < 4; ++i) {  // tensors freed and made again, perhaps at the same address
    const auto made = torch::full({2}, i, torch::kInt64);
    EXPECT_EQ(host_counts(made), (std::vector<int64_t>{i, i}));
  }
}

TEST(ExpertBank, AFrozenBankIsBuiltAgainInBackwardUnlessKept) {
  expect_rebuilt_in_backward_unless_kept(torch::kCPU, torch::kFloat32, 1e-6);
}

// A bank that trains (full fine-tuning of a 16-bit bank) keeps autograd's own product: its weight
// gets the gradient of each expert's rows.
TEST(ExpertBank, ATrainedBankGetsItsWeightsGradient) {
  torch::manual_seed(9);
  const int64_t experts = 3, in = 8, out = 4;
  DenseLinear bank(DenseLinearOptions{in, experts * out, false, torch::kFloat32});
  const std::vector<int64_t> counts = {2, 0, 5};
  const auto rows = torch::randn({7, in});
  bank_product(bank, experts, rows, torch::tensor(counts, torch::kInt64)).sum().backward();
  const auto& grad = bank.weight().grad();
  ASSERT_TRUE(grad.defined());
  // d(sum)/dW_e = the column sums of expert e's rows, on each of its out rows; expert 1 had none.
  const auto view = grad.view({experts, out, in});
  EXPECT_TRUE(torch::allclose(view[0], rows.narrow(0, 0, 2).sum(0).expand({out, in})));
  EXPECT_TRUE(torch::equal(view[1], torch::zeros({out, in})));
  EXPECT_TRUE(torch::allclose(view[2], rows.narrow(0, 2, 5).sum(0).expand({out, in})));
}

// An output nothing reads (bank_product_for_graph, ExpertLora's output_unread) gives the gradients
// of the computed one bit for bit: the rows' (through the frozen bank, 16-bit or NF4 built again
// in backward) and, with LoRA, A's and B's. A bank that trains keeps autograd's own product.
// `stored_tolerance`: on a GPU the 16-bit bank's rows gradient is another grouped GEMM than
// autograd's own (NF4's is the same code either way, so bitwise).
void expect_unread_output_gradients_bitwise(torch::Device device, torch::ScalarType dtype, double stored_tolerance) {
  torch::manual_seed(23);
  const int64_t experts = 4, in = 64, out = 32;
  const std::vector<int64_t> counts = {10, 0, 21, 7};
  const auto batch = make_batch(experts, in, out, counts, device, dtype);
  const auto grad_out = torch::randn({38, out}, batch.rows.options());
  DenseLinearOptions dense{in, experts * out, false, dtype};
  const auto make_bases = [&] {
    auto sixteen_bit = std::make_shared<DenseLinear>(dense);
    sixteen_bit->to(device);
    for (auto& parameter : sixteen_bit->parameters()) parameter.requires_grad_(false);
    return std::vector<std::shared_ptr<LinearLayer>>{sixteen_bit, nf4_bank(experts * out, in, device)};
  };
  for (const auto& base : make_bases()) {
    const bool stored = base->matmul_weight_kind() == LinearLayer::MatmulWeight::kStored;
    for (const bool adapted : {false, true}) {
      LoraOptions options;
      options.rank = 3;
      options.alpha = 8;
      auto lora = std::make_shared<ExpertLora>(base, experts, options);
      {
        torch::NoGradGuard no_grad;
        lora->named_parameters()["lora_B.weight"].normal_(0, 0.2);
      }
      auto run = [&](bool unread) {
        const KeepBuiltWeights kept(false);
        auto rows = batch.rows.detach().requires_grad_(true);
        const auto output = adapted ? lora->grouped_forward(rows, batch.counts, unread)
                            : unread ? bank_product_for_graph(*base, experts, rows, batch.counts)
                                     : bank_product(*base, experts, rows, batch.counts);
        output.backward(grad_out);
        std::vector<torch::Tensor> grads = {rows.grad()};
        if (adapted) {
          for (auto& parameter : lora->parameters()) {
            if (!parameter.requires_grad()) continue;
            grads.push_back(parameter.grad().clone());
            parameter.mutable_grad() = torch::Tensor();
          }
        }
        return grads;
      };
      const auto computed = run(false);
      const auto unread = run(true);
      ASSERT_EQ(computed.size(), adapted ? 3u : 1u);
      for (size_t index = 0; index < computed.size(); ++index) {
        const double largest = computed[index].abs().max().item<double>();
        ASSERT_GT(largest, 0);
        const double differs = (computed[index] - unread[index]).abs().max().item<double>();
        const std::string what = std::string(stored ? "16-bit" : "NF4") + (adapted ? " LoRA" : " bank") +
                                 ", gradient " + std::to_string(index) + " differs by " + std::to_string(differs);
        if (stored && stored_tolerance > 0) {
          EXPECT_LE(differs, stored_tolerance * largest) << what;
        } else {
          EXPECT_TRUE(torch::equal(computed[index], unread[index])) << what;
        }
      }
    }
  }
  // A 16-bit bank that trains gets its weight's gradient through the unread path too.
  DenseLinear trained(DenseLinearOptions{in, experts * out, false, torch::kFloat32});
  bank_product_for_graph(trained, experts, batch.rows.to(torch::kFloat32).cpu(), batch.counts.cpu()).sum().backward();
  EXPECT_TRUE(trained.weight().grad().defined());
}

TEST(ExpertBank, AnUnreadOutputGivesTheComputedOutputsGradientsBitwise) {
  expect_unread_output_gradients_bitwise(torch::kCPU, torch::kFloat32, 0);
}

TEST(ExpertBank, CudaAnUnreadOutputGivesTheComputedOutputsGradientsBitwise) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  expect_unread_output_gradients_bitwise(torch::kCUDA, torch::kBFloat16, 1e-2);
}

TEST(ExpertBank, CudaFrozenBankIsBuiltAgainInBackwardUnlessKept) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  expect_rebuilt_in_backward_unless_kept(torch::kCUDA, torch::kBFloat16, 1e-2);
}

}  // namespace
}  // namespace qtrain::qat
