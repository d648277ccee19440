// GGUF Q4_0 / Q8_0 blocks: the bytes follow llama.cpp's layout (checked on a hand-built block),
// decode as llama.cpp's dequantize_row_q4_0 / _q8_0 to exactly the fake-quant weights, and
// schemes GGUF cannot hold are refused with the key and the reason.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iterator>
#include <string>

#include "kernels/error.h"
#include "qat/gguf_block.h"

namespace qtrain::qat {
namespace {

QuantizedTensor quantized(const QuantSpec& spec, const torch::Tensor& x) {
  return quantize_tensor(spec, x, choose_qparams(spec, block_min_max(spec, x)));
}

std::string error_of(const QuantSpec& spec) {
  try {
    gguf_block_type_for(spec, "qat.weights");
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

TEST(GgufBlock, FormatsAreLlamaCppsSizesAndTypeIds) {
  EXPECT_EQ(gguf_block_format(GgufBlockType::kQ4_0).block_bytes, 18);
  EXPECT_EQ(gguf_block_format(GgufBlockType::kQ8_0).block_bytes, 34);
  EXPECT_EQ(gguf_block_format(GgufBlockType::kQ4_0).ggml_type, 2u);
  EXPECT_EQ(gguf_block_format(GgufBlockType::kQ8_0).ggml_type, 8u);
}

// One row per type, indexed by the enum, with ggml.h's ids, ggml-common.h's block sizes and
// llama.h's llama_ftype (ALL_F32 0, MOSTLY_F16 1, MOSTLY_Q4_0 2, MOSTLY_Q8_0 7, MOSTLY_BF16 32).
TEST(GgufBlock, EveryTypeIsOneRowOfGgmlsTypeTraits) {
  // ggml.h's ids, ggml-common.h's block sizes, llama.h's file types (a k-quant's: its _S mix).
  struct Expected {
    const char* name;
    uint32_t ggml_type;
    int64_t block_elements;
    int64_t block_bytes;
    uint32_t file_type;
    bool quantized;   // llama.cpp's quantizer and dequantizer
    bool qat_codes;   // a QAT grid written as codes + scales
  };
  const Expected expected[] = {{"F32", 0, 1, 4, 0, false, false},      {"F16", 1, 1, 2, 1, false, false},
                               {"BF16", 30, 1, 2, 32, false, false},   {"Q4_0", 2, 32, 18, 2, true, true},
                               {"Q4_1", 3, 32, 20, 3, true, false},    {"Q5_0", 6, 32, 22, 8, true, false},
                               {"Q5_1", 7, 32, 24, 9, true, false},    {"Q8_0", 8, 32, 34, 7, true, true},
                               {"Q2_K", 10, 256, 84, 10, true, false}, {"Q3_K", 11, 256, 110, 11, true, false},
                               {"Q4_K", 12, 256, 144, 14, true, false}, {"Q5_K", 13, 256, 176, 16, true, false},
                               {"Q6_K", 14, 256, 210, 18, true, false}, {"MXFP4", 39, 32, 17, 38, true, false}};
  ASSERT_EQ(gguf_block_formats().size(), std::size(expected));
  for (size_t index = 0; index < std::size(expected); ++index) {
    const auto& row = gguf_block_formats()[index];
    SCOPED_TRACE(row.name);
    EXPECT_EQ(static_cast<size_t>(row.type), index);
    EXPECT_EQ(&gguf_block_format(row.type), &row);
    EXPECT_EQ(gguf_block_format_by_id(row.ggml_type), &row);
    EXPECT_STREQ(row.name, expected[index].name);
    EXPECT_EQ(row.ggml_type, expected[index].ggml_type);
    EXPECT_EQ(row.block_elements, expected[index].block_elements);
    EXPECT_EQ(row.block_bytes, expected[index].block_bytes);
    EXPECT_EQ(row.file_type, expected[index].file_type);
    EXPECT_EQ(row.quantize != nullptr, expected[index].quantized);
    EXPECT_EQ(row.dequantize != nullptr, expected[index].quantized);
    EXPECT_EQ(row.grid.has_value(), expected[index].qat_codes);
    EXPECT_EQ(row.encode != nullptr, expected[index].qat_codes);
    EXPECT_EQ(row.decode != nullptr, expected[index].qat_codes);
    EXPECT_EQ(row.integer_codes, expected[index].quantized && row.type != GgufBlockType::kMXFP4);  // E2M1 values
  }
  EXPECT_EQ(gguf_block_format_by_id(40), nullptr);  // NVFP4: not a type qtrain reads yet
}

// general.file_type names a file by its densest type, as the exporter's Q4_0-over-Q8_0-over-F16
// choice did.
TEST(GgufBlock, FileTypeIsTheDensestTensorTypes) {
  using T = GgufBlockType;
  EXPECT_EQ(gguf_file_type({T::kF32}), 0u);
  EXPECT_EQ(gguf_file_type({T::kF32, T::kF16, T::kF32}), 1u);
  EXPECT_EQ(gguf_file_type({T::kF32, T::kQ8_0, T::kF16}), 7u);
  EXPECT_EQ(gguf_file_type({T::kQ8_0, T::kF32, T::kQ4_0, T::kF16}), 2u);
}

TEST(GgufBlock, EachQuantizedTypeFitsItsOwnSchemeOnly) {
  const auto& q4_0 = gguf_block_format(GgufBlockType::kQ4_0);
  const auto& q8_0 = gguf_block_format(GgufBlockType::kQ8_0);
  EXPECT_TRUE(gguf_block_fits(q4_0, QuantSpec::gguf_q4_0()));
  EXPECT_FALSE(gguf_block_fits(q4_0, QuantSpec::gguf_q8_0()));
  EXPECT_TRUE(gguf_block_fits(q8_0, QuantSpec::gguf_q8_0()));
  EXPECT_FALSE(gguf_block_fits(gguf_block_format(GgufBlockType::kF16), QuantSpec::gguf_q4_0()));
  EXPECT_EQ(gguf_block_type_for(QuantSpec::gguf_q8_0(), "qat.weights"), GgufBlockType::kQ8_0);
}

// Q4_0 / Q8_0 keep one fp16 scale per block: a spec with a second level of scales (a K-quant's
// super-block) does not fit them.
TEST(GgufBlock, TwoLevelScalesDoNotFitQ4_0OrQ8_0) {
  auto spec = QuantSpec::gguf_q4_0();
  spec.group_scales.encoding = ScaleEncoding::kInteger;
  spec.group_scales.bits = 6;
  spec.group_scales.has_mins = true;
  spec.group_scales.super_block_size = 256;
  EXPECT_FALSE(gguf_block_fits(gguf_block_format(GgufBlockType::kQ4_0), spec));
  EXPECT_EQ(error_of(spec).rfind("qat.weights.group_scales: GGUF Q4_0 ", 0), 0u) << error_of(spec);
  EXPECT_THROW(spec.validate("qat.weights"), Error);  // described, not computed by qtrain's quantizers yet
}

TEST(GgufBlock, Q4_0LayoutIsLowNibblesFirstHalfHighNibblesSecondHalf) {
  QuantizedTensor tensor;
  tensor.spec = QuantSpec::gguf_q4_0();
  tensor.codes = torch::zeros({1, 32}, torch::kInt8);
  tensor.codes[0][0] = -8;  // nibble 0
  tensor.codes[0][16] = 7;  // nibble 15
  tensor.codes[0][1] = 3;   // nibble 11
  tensor.codes[0][17] = -1;  // nibble 7
  tensor.params = {torch::full({1, 1}, 0.5f), torch::zeros({1, 1})};
  const auto bytes = encode_gguf_blocks(tensor, "qat.weights");
  ASSERT_EQ(bytes.size(), 18u);
  EXPECT_EQ(bytes[0], 0x00);  // fp16 0.5 = 0x3800, little-endian
  EXPECT_EQ(bytes[1], 0x38);
  EXPECT_EQ(bytes[2], 0xF0);  // element 0 low, element 16 high
  EXPECT_EQ(bytes[3], 0x7B);  // element 1 = 3 + 8 = 0xB low, element 17 = -1 + 8 = 7 high
  EXPECT_EQ(bytes[4], 0x88);  // zeros are stored as 8
}

// encode -> decode equals the fake-quant forward's weights, bit for bit.
TEST(GgufBlock, EncodeThenDecodeEqualsFakeQuantExactly) {
  torch::manual_seed(1);
  const auto weight = torch::randn({48, 96}) * 0.05 + torch::rand({48, 96}).pow(8) * 0.3;
  for (const auto& spec : {QuantSpec::gguf_q4_0(), QuantSpec::gguf_q8_0()}) {
    SCOPED_TRACE(spec.describe());
    const auto tensor = quantized(spec, weight);
    const auto type = gguf_block_type_for(spec, "qat.weights");
    const auto bytes = encode_gguf_blocks(tensor, "qat.weights");
    EXPECT_EQ(static_cast<int64_t>(bytes.size()), weight.numel() / 32 * gguf_block_format(type).block_bytes);
    const auto decoded = decode_gguf_blocks(bytes, type, weight.sizes());
    EXPECT_TRUE(torch::equal(decoded, fake_quantize_values(spec, weight, tensor.params).values));
  }
}

TEST(GgufBlock, SchemesGgufCannotHoldAreRefusedWithTheReason) {
  auto spec = QuantSpec::gguf_q4_0();
  spec.symmetric = false;
  EXPECT_EQ(error_of(spec).rfind("qat.weights.symmetric: false cannot be written as GGUF Q4_0 / Q8_0", 0), 0u) << error_of(spec);
  spec = QuantSpec::gguf_q4_0();
  spec.group_size = 64;
  EXPECT_EQ(error_of(spec).rfind("qat.weights.group_size: GGUF Q4_0 / Q8_0 need granularity per_group with group_size 32", 0), 0u);
  spec = QuantSpec::gguf_q4_0();
  spec.scale_dtype = torch::kFloat32;
  EXPECT_EQ(error_of(spec).rfind("qat.weights.scale_dtype: ", 0), 0u);
  spec = QuantSpec::gguf_q4_0();
  spec.bits = 3;
  EXPECT_NE(error_of(spec).find("safetensors-int"), std::string::npos);
  spec = QuantSpec::gguf_q4_0();
  spec.format = QuantFormat::kNf4;
  EXPECT_NE(error_of(spec).find("int4 (Q4_0) or int8 (Q8_0) weights only"), std::string::npos);
}

}  // namespace
}  // namespace qtrain::qat
