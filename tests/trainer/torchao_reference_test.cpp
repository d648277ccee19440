// Our fake quantizers against torchao's own (torchao 0.18.0, which tools/setup.sh installs, run
// by tests/interop/torchao_fake_quant.py) on the CPU, for the schemes our recipes name after it:
// Int8DynActInt4Weight (8da4w), int4 weight-only and the GGUF grids. Fresh random inputs, fp32
// and bf16 as torchao takes them, each with an outlier, an all-zero block and a negative-only
// block; the values, the scales and zero points torchao keeps, and torchao's autograd gradient.
// In tests/trainer, not tests/qat, because it reads and writes safetensors files.
//
// Where the numerics differ, the test states how and allows exactly that:
//   - torchao's integer grids quantize with x * (1 / s), ours with a true division x / s
//     (quant_spec.h, and the CUDA kernels that equal it bit for bit): the two round apart, by
//     one step, where x / s lies within an ulp of a tie. For symmetric fp32 weights that is
//     often the group's -absmax, which lands on -7.5 by construction.
//   - torchao's symmetric weight scale is at least fp32's smallest normal number, ours at least
//     2^-23: only all-zero groups here tell them apart, and both quantize those to zeros.
//   - torchao's gradient is the upstream one multiplied by s and by 1 / s on its way through
//     dequantize and quantize, each product rounded (in bf16 too for a bf16 x); ours passes it
//     through unchanged. In all-zero groups its s * g is subnormal and loses precision.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "qat/fake_quantizer.h"
#include "support.h"
#include "trainer/formats/safetensors.h"

namespace qtrain::qat {
namespace {

using testing::TempDir;

struct Outputs {
  torch::Tensor values;  // fake-quantized x, x's dtype
  torch::Tensor grad;    // d sum(values * upstream) / dx, x's dtype
  torch::Tensor scale;   // fp32, where the quantizer keeps it
  torch::Tensor zero_point;
};

struct TorchaoCase {
  std::string name;  // the dtype's
  torch::Tensor x;
  torch::Tensor upstream;  // x's shape and dtype
};

// torchao's fake quantizer `scheme` (torchao_fake_quant.py names them) on each case's x, in one
// Python process; by case name, empty when the script failed.
std::map<std::string, Outputs> torchao_fake_quant(const std::string& python, const std::string& scheme,
                                                  const std::vector<TorchaoCase>& cases) {
  TempDir temp;
  std::vector<std::pair<std::string, torch::Tensor>> inputs;
  for (const auto& input : cases) {
    inputs.emplace_back(input.name + ".x", input.x);
    inputs.emplace_back(input.name + ".upstream", input.upstream);
  }
  trainer::write_safetensors(temp.file("in.safetensors"), inputs);
  const std::string command = "'" + python + "' '" + testing::source_dir() + "/tests/interop/torchao_fake_quant.py' " + scheme +
                              " '" + temp.file("in.safetensors") + "' '" + temp.file("out.safetensors") + "' 2>&1";
  const auto result = testing::run_command(command);
  EXPECT_EQ(result.status, 0) << command << "\n" << result.output;
  if (result.status != 0) return {};
  const auto file = trainer::SafetensorsFile::open(temp.file("out.safetensors"));
  std::map<std::string, Outputs> outputs;
  for (const auto& input : cases) {
    auto& output = outputs[input.name];
    output.values = file.tensor(input.name + ".values");
    output.grad = file.tensor(input.name + ".grad");
    if (file.contains(input.name + ".scale")) output.scale = file.tensor(input.name + ".scale");
    if (file.contains(input.name + ".zero_point")) output.zero_point = file.tensor(input.name + ".zero_point");
  }
  return outputs;
}

struct Ours {
  Outputs outputs;
  QuantParams params;
};

// Our FakeQuantizer (observer dynamic, as torchao's) on x, with the straight-through gradient.
Ours our_fake_quant(const QuantSpec& spec, const torch::Tensor& x, const torch::Tensor& upstream, bool is_weight) {
  FakeQuantizerOptions options;
  options.spec = spec;
  FakeQuantizer quantizer(options, "torchao_reference", is_weight ? x.sizes().vec() : std::vector<int64_t>{});
  const auto input = x.clone().requires_grad_(true);
  const auto values = quantizer.forward(input);
  values.backward(upstream);
  return {{values.detach(), input.grad()}, quantizer.current_qparams(x)};
}

// For fp32 and bf16, a standard normal x of `shape` with what quantizers get wrong, block by block
// (blocks of `block_length` along the last dimension): every 7th an outlier 40x its values, the
// 3rd all zeros, the 5th negative only; and a standard normal upstream gradient.
std::vector<TorchaoCase> hard_inputs(const std::vector<int64_t>& shape, int64_t block_length) {
  std::vector<TorchaoCase> cases;
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    auto x = torch::randn(shape);
    auto blocks = x.view({-1, block_length});
    for (int64_t block = 0; block < blocks.size(0); block += 7) blocks[block][block % block_length] *= 40.0;
    blocks[3].zero_();
    blocks[5] = -blocks[5].abs();
    cases.push_back({c10::toString(dtype), x.to(dtype), torch::randn(shape).to(dtype)});
  }
  return cases;
}

// Per element of x (block view of `spec`): whether its block is all zeros.
torch::Tensor in_zero_block(const QuantSpec& spec, const torch::Tensor& x) {
  const auto blocks = x.to(torch::kFloat32).reshape(block_view_shape(spec, x.sizes()));
  return blocks.eq(0).all(-1, /*keepdim=*/true).expand(blocks.sizes()).reshape(x.sizes());
}

// Per element: whether x / s lies within `relative` of a rounding tie (float64), where torchao's
// x * (1 / s) and our x / s may round apart.
torch::Tensor near_tie(const QuantSpec& spec, const torch::Tensor& x, const QuantParams& params, double relative) {
  const auto blocks = x.to(torch::kFloat64).reshape(block_view_shape(spec, x.sizes()));
  const auto steps = blocks / params.scale.to(torch::kFloat64).unsqueeze(-1);
  const auto from_tie = (steps - torch::floor(steps) - 0.5).abs();
  return (from_tie <= steps.abs() * relative).reshape(x.sizes());
}

// torchao's values equal ours bit for bit, except where x / s lies near a tie (`ties`), and there
// its code is ours +- 1.
void expect_values_equal_but_at_ties(const QuantSpec& spec, const torch::Tensor& x, const QuantParams& params,
                                     const torch::Tensor& ours, const torch::Tensor& theirs, const torch::Tensor& ties) {
  EXPECT_EQ(theirs.scalar_type(), ours.scalar_type());
  const auto differ = ours.ne(theirs);
  EXPECT_FALSE((differ & ties.logical_not()).any().item<bool>())
      << (differ & ties.logical_not()).sum().item<int64_t>() << " values differ away from a rounding tie";
  // Codes back from the values: |value / s| is an integer within bf16's rounding of it (<= 2^-9
  // relative, under half a step for codes up to 255).
  const auto view = block_view_shape(spec, x.sizes());
  const auto scale = params.scale.unsqueeze(-1);
  const auto code = [&](const torch::Tensor& values) {
    return torch::round(values.to(torch::kFloat32).reshape(view) / scale).reshape(x.sizes());
  };
  const auto step_apart = (code(ours) - code(theirs)).abs().eq(1);
  EXPECT_TRUE(step_apart.masked_select(differ).all().item<bool>()) << "values at ties differ by more than one step";
}

// torchao's gradient is ours within `relative` of the upstream gradient, and zero exactly where
// ours is, except at `excluded` elements.
void expect_gradient_matches(const torch::Tensor& ours, const torch::Tensor& theirs, const torch::Tensor& upstream,
                             const torch::Tensor& excluded, double relative) {
  ASSERT_EQ(theirs.scalar_type(), ours.scalar_type());
  const auto compared = excluded.logical_not();
  EXPECT_TRUE(ours.eq(0).masked_select(compared).equal(theirs.eq(0).masked_select(compared)))
      << "torchao's straight-through mask differs from ours";
  const auto error = (ours.to(torch::kFloat64) - theirs.to(torch::kFloat64)).abs().masked_select(compared);
  const auto bound = upstream.to(torch::kFloat64).abs().masked_select(compared) * relative;
  EXPECT_TRUE(error.le(bound).all().item<bool>()) << "largest gradient error " << error.max().item<double>();
}

class TorchaoReference : public ::testing::Test {
 protected:
  void SetUp() override {
    python_ = testing::find_python_with("torchao safetensors torch");
    if (python_.empty()) {
      GTEST_SKIP() << "no Python with torchao: tools/setup.sh installs it (torchao==0.18.0, a wheel without "
                      "dependencies beyond torch)";
    }
  }
  std::string python_;
};

// Two roundings, relative: fp32's unit roundoff twice (torchao's g * s * (1 / s), or its
// reciprocal against our division); in bf16, whose gradient torchao rounds to bf16 twice, one
// unit in the last place of the bf16 upstream gradient, at most 2^-7 of it.
double two_roundings(torch::ScalarType dtype) { return dtype == torch::kBFloat16 ? std::ldexp(1.0, -7) : std::ldexp(1.0, -22); }

// Int8DynActInt4WeightQATQuantizer(groupsize=32)'s weights: int4 symmetric in groups of 32, fp32
// scales absmax / 7.5, computed in the weight's dtype.
TEST_F(TorchaoReference, Int8DynActInt4WeightWeightsAreTorchaos) {
  const auto spec = QuantSpec::int4_weight(32);
  torch::manual_seed(11);
  const auto cases = hard_inputs({64, 256}, 32);
  const auto torchao = torchao_fake_quant(python_, "8da4w-weight-32", cases);
  ASSERT_EQ(torchao.size(), cases.size());
  for (const auto& [name, x, upstream] : cases) {
    SCOPED_TRACE(name);
    const auto& theirs = torchao.at(name);
    const auto ours = our_fake_quant(spec, x, upstream, /*is_weight=*/true);

    const auto nonzero_groups = in_zero_block(spec, x).view({64, 8, 32}).all(-1).logical_not();
    ASSERT_EQ(theirs.scale.sizes(), ours.params.scale.sizes());
    EXPECT_TRUE(theirs.scale.masked_select(nonzero_groups).equal(ours.params.scale.masked_select(nonzero_groups)));
    EXPECT_TRUE(theirs.zero_point.eq(0).all().item<bool>());

    const auto ties = near_tie(spec, x, ours.params, two_roundings(torch::kFloat32));
    expect_values_equal_but_at_ties(spec, x, ours.params, ours.outputs.values, theirs.values, ties);
    expect_gradient_matches(ours.outputs.grad, theirs.grad, upstream, ties | in_zero_block(spec, x),
                            two_roundings(x.scalar_type()));
  }
}

// Its activations: int8 asymmetric per token, fp32 scales and integer zero points, eps 2^-23,
// computed in the activation's dtype; [batch, sequence, hidden] as a linear layer sees them.
TEST_F(TorchaoReference, Int8DynActInt4WeightActivationsAreTorchaos) {
  const auto spec = QuantSpec::int8_dynamic_per_token_activation();
  torch::manual_seed(12);
  const auto cases = hard_inputs({4, 16, 128}, 128);
  const auto torchao = torchao_fake_quant(python_, "8da4w-activation", cases);
  ASSERT_EQ(torchao.size(), cases.size());
  for (const auto& [name, x, upstream] : cases) {
    SCOPED_TRACE(name);
    const auto& theirs = torchao.at(name);
    const auto ours = our_fake_quant(spec, x, upstream, /*is_weight=*/false);

    EXPECT_TRUE(theirs.scale.flatten().equal(ours.params.scale.flatten()));
    EXPECT_TRUE(theirs.zero_point.flatten().equal(ours.params.zero_point.flatten()));
    const auto ties = near_tie(spec, x, ours.params, two_roundings(torch::kFloat32));
    expect_values_equal_but_at_ties(spec, x, ours.params, ours.outputs.values, theirs.values, ties);
    expect_gradient_matches(ours.outputs.grad, theirs.grad, upstream, ties | in_zero_block(spec, x),
                            two_roundings(x.scalar_type()));
  }
}

// QATConfig(Int4WeightOnlyConfig(group_size)): asymmetric int4 on each group's own [min, max]
// with a float zero point (quant_spec.h), all in fp32: bit for bit, for its documented group
// sizes. Its gradient also flows through the group's min and max (its scale and zero point are
// not detached), into the elements that hold them; elsewhere it is the straight-through one.
TEST_F(TorchaoReference, Int4WeightOnlyIsTorchaosBitForBit) {
  torch::manual_seed(13);
  for (const int64_t group_size : {32, 128}) {
    const auto spec = QuantSpec::int4_weight_only(group_size);
    const auto cases = hard_inputs({64, 256}, group_size);
    const auto torchao = torchao_fake_quant(python_, "int4-weight-only-" + std::to_string(group_size), cases);
    ASSERT_EQ(torchao.size(), cases.size());
    for (const auto& [name, x, upstream] : cases) {
      SCOPED_TRACE(name + ", groups of " + std::to_string(group_size));
      const auto& theirs = torchao.at(name);
      const auto ours = our_fake_quant(spec, x, upstream, /*is_weight=*/true);

      EXPECT_TRUE(ours.outputs.values.equal(theirs.values)) << ours.outputs.values.ne(theirs.values).sum().item<int64_t>()
                                                            << " values differ";
      const auto blocks = x.to(torch::kFloat32).view({64, -1, group_size});
      const auto extreme = blocks.eq(std::get<0>(blocks.min(-1, true))) | blocks.eq(std::get<0>(blocks.max(-1, true)));
      expect_gradient_matches(ours.outputs.grad, theirs.grad, upstream, extreme.view({64, 256}), two_roundings(x.scalar_type()));
    }
  }
}

// The GGUF grids (Q4_0 / Q8_0: symmetric int4 / int8 in groups of 32, fp16 scales) in torchao's
// terms, IntxFakeQuantizeConfig(..., scale_precision=torch.float16): the same fp16 scales, but
// torchao quantizes with x times the reciprocal of the scale rounded to fp16 (2^-11 relative),
// so codes may differ by one where x / s lies within 2^-10 of a tie; its gradient carries that
// reciprocal too. In all-zero groups torchao's scale rounds to an fp16 zero and it returns NaN;
// ours returns zeros.
TEST_F(TorchaoReference, GgufGridsAreTorchaosWithFp16Scales) {
  torch::manual_seed(14);
  const double fp16_reciprocal = std::ldexp(1.0, -10);
  for (const auto& [scheme, spec] :
       {std::pair{"gguf-q4_0", QuantSpec::gguf_q4_0()}, std::pair{"gguf-q8_0", QuantSpec::gguf_q8_0()}}) {
    const auto cases = hard_inputs({64, 256}, 32);
    const auto torchao = torchao_fake_quant(python_, scheme, cases);
    ASSERT_EQ(torchao.size(), cases.size());
    for (const auto& [name, x, upstream] : cases) {
      SCOPED_TRACE(std::string(scheme) + ", " + name);
      const auto& theirs = torchao.at(name);
      const auto ours = our_fake_quant(spec, x, upstream, /*is_weight=*/true);

      const auto zero_blocks = in_zero_block(spec, x);
      const auto nonzero_groups = zero_blocks.view({64, 8, 32}).all(-1).logical_not();
      EXPECT_TRUE(theirs.scale.masked_select(nonzero_groups).equal(ours.params.scale.masked_select(nonzero_groups)));
      EXPECT_TRUE(theirs.values.masked_select(zero_blocks).isnan().all().item<bool>());
      EXPECT_TRUE(ours.outputs.values.masked_select(zero_blocks).eq(0).all().item<bool>());

      const auto ties = near_tie(spec, x, ours.params, fp16_reciprocal);
      const auto theirs_where_defined = torch::where(zero_blocks, ours.outputs.values, theirs.values);
      expect_values_equal_but_at_ties(spec, x, ours.params, ours.outputs.values, theirs_where_defined, ties);
      expect_gradient_matches(ours.outputs.grad, theirs.grad, upstream, ties | zero_blocks,
                              fp16_reciprocal + two_roundings(x.scalar_type()));
    }
  }
}

}  // namespace
}  // namespace qtrain::qat
