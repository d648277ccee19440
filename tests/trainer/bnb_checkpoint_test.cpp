// bitsandbytes 4-bit, bit for bit, against outputs of bitsandbytes itself (../shared/fixtures,
// made with bitsandbytes 0.50.2 on CUDA): the 24 codec cases of bnb-4bit-reference.safetensors,
// the pre-quantized tiny-llama-bnb-nf4 checkpoint and its logits. The Cuda* tests run the same
// cases through the CUDA kernels (exact everywhere, where the CPU path is not) and skip without a GPU.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "qat/four_bit_codec.h"
#include "qat/four_bit_linear.h"
#include "support.h"
#include "tensor_support.h"
#include "trainer/formats/bnb_checkpoint.h"
#include "trainer/formats/hf_checkpoint.h"
#include "trainer/formats/safetensors.h"

namespace qtrain::trainer {
namespace {

using testing::fixture;

using testing::same_bits;

torch::Tensor unpack(const torch::Tensor& packed, int64_t n) {
  const auto bytes = packed.reshape({-1}).to(torch::kInt);
  return torch::stack({torch::bitwise_right_shift(bytes, 4), torch::bitwise_and(bytes, 15)}, 1).reshape({-1}).narrow(0, 0, n);
}

struct CodecCase {
  std::string prefix;  // e.g. "odd_64x100.fp4.b64.dq"
  std::string weight;  // e.g. "odd_64x100", whose `.input` all its cases quantize
  qat::FourBitType type;
  int64_t blocksize;
  bool double_quant;
};

std::vector<CodecCase> codec_cases(const SafetensorsFile& file) {
  std::vector<CodecCase> cases;
  const std::string suffix = ".packed";
  for (const auto& name : file.names()) {
    if (name.size() < suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
    CodecCase item;
    item.prefix = name.substr(0, name.size() - suffix.size());
    // <weight>.<nf4|fp4>.b<blocksize>.<dq|nodq>
    const auto last = item.prefix.rfind('.');
    const auto middle = item.prefix.rfind('.', last - 1);
    const auto first = item.prefix.rfind('.', middle - 1);
    item.double_quant = item.prefix.substr(last + 1) == "dq";
    item.blocksize = std::stoll(item.prefix.substr(middle + 2, last - middle - 2));
    item.weight = item.prefix.substr(0, first);
    item.type = qat::parse_four_bit_type(item.prefix.substr(first + 1, middle - first - 1), name);
    cases.push_back(item);
  }
  return cases;
}

// The quantization state bnb wrote for `item`: its code table and absmax, double-quantized or not.
void expect_state_equals_bnb(const qat::FourBitQuantState& ours, const SafetensorsFile& file, const CodecCase& item) {
  auto tensor = [&](const std::string& field) { return file.tensor(item.prefix + "." + field); };
  EXPECT_TRUE(same_bits(ours.code.cpu(), tensor("code")));
  if (!item.double_quant) {
    EXPECT_TRUE(same_bits(ours.absmax.cpu(), tensor("absmax")));
    return;
  }
  EXPECT_TRUE(same_bits(ours.absmax.cpu(), tensor("absmax_q")))
      << (ours.absmax.cpu() != tensor("absmax_q")).sum().item<int64_t>() << " absmax codes differ";
  EXPECT_TRUE(same_bits(ours.nested_absmax.cpu(), tensor("nested_absmax")));
  EXPECT_TRUE(same_bits(ours.nested_code.cpu(), tensor("nested_code")));
  EXPECT_EQ(ours.offset, tensor("offset").item<float>());
}

TEST(Bnb4bitReference, AllCasesEqualBitsandbytesBitForBit) {
  const auto file = SafetensorsFile::open(fixture("bnb-4bit-reference.safetensors"));
  const auto cases = codec_cases(file);
  ASSERT_EQ(cases.size(), 24u);
  for (const auto& item : cases) {
    SCOPED_TRACE(item.prefix);
    const auto tensor = [&](const std::string& field) { return file.tensor(item.prefix + "." + field); };
    const auto input = file.tensor(item.weight + ".input");
    const auto ours = qat::quantize_4bit(input, item.type, item.blocksize, item.double_quant);
    // bitsandbytes' CUDA build takes 1 / absmax with the GPU's approximate reciprocal (within one
    // fp32 step of the exact one, not reproducible off the GPU). Where that step moves x * (1 / absmax)
    // across a pivot, bnb's code differs from ours; any other difference is a failure.
    const auto ours_codes = unpack(ours.packed, input.numel());
    const auto bnb_codes = unpack(tensor("packed"), input.numel());
    const auto differing = (ours_codes != bnb_codes).nonzero().view(-1);
    const auto& format = qat::four_bit_format(item.type);
    const auto values = input.to(torch::kFloat32).reshape({-1});
    const auto absmax = qat::dequantize_absmax(ours.state);
    const auto raw_absmax = qat::quantize_4bit(input, item.type, item.blocksize, false).state.absmax;
    for (int64_t k = 0; k < differing.numel(); ++k) {
      const int64_t i = differing[k].item<int64_t>();
      const float inverse = 1.0f / raw_absmax[i / item.blocksize].item<float>();
      const float x = values[i].item<float>();
      const int bnb_code = bnb_codes[i].item<int>();
      EXPECT_TRUE(format.quantize(x * std::nextafter(inverse, 0.0f)) == bnb_code ||
                  format.quantize(x * std::nextafter(inverse, 1e30f)) == bnb_code)
          << "element " << i << " differs by more than the reciprocal's rounding";
    }
    std::printf("%-32s %lld of %lld codes differ (reciprocal rounding at a pivot)\n", item.prefix.c_str(),
                static_cast<long long>(differing.numel()), static_cast<long long>(input.numel()));
    EXPECT_LE(differing.numel(), input.numel() / 5000);  // measured: at most 16 of 131072 (FP4), 0 for NF4
    if (item.type == qat::FourBitType::kNf4) EXPECT_EQ(differing.numel(), 0);
    expect_state_equals_bnb(ours.state, file, item);
    // Dequantizing: bitwise equal wherever the codes agree.
    const auto agree = (ours_codes == bnb_codes).view(input.sizes());
    const auto dequantized = qat::dequantize_4bit(ours.packed, ours.state, torch::kBFloat16);
    EXPECT_TRUE(same_bits(dequantized.masked_select(agree), tensor("dequant").masked_select(agree)));
  }
}

// bitsandbytes' own quant state for a case, as the fixture stores it.
qat::FourBitQuantState bnb_state(const SafetensorsFile& file, const CodecCase& item) {
  auto tensor = [&](const std::string& field) { return file.tensor(item.prefix + "." + field); };
  qat::FourBitQuantState state;
  state.quant_type = item.type;
  state.blocksize = item.blocksize;
  state.shape = file.tensor(item.weight + ".input").sizes().vec();
  state.dtype = torch::kBFloat16;
  state.code = tensor("code");
  if (item.double_quant) {
    state.absmax = tensor("absmax_q");
    state.nested_absmax = tensor("nested_absmax");
    state.nested_code = tensor("nested_code");
    state.offset = tensor("offset").item<float>();
  } else {
    state.absmax = tensor("absmax");
  }
  state.check(tensor("packed"), item.prefix);
  return state;
}

qat::FourBitQuantState state_on(const qat::FourBitQuantState& state, const torch::Device& device) {
  qat::FourBitQuantState moved = state;
  for (auto* tensor : {&moved.code, &moved.absmax, &moved.nested_absmax, &moved.nested_code}) {
    if (tensor->defined()) *tensor = tensor->to(device);
  }
  return moved;
}

// Dequantizing bitsandbytes' own quant state (not ours) gives its dequant too.
TEST(Bnb4bitReference, DequantizingBitsandbytesStateGivesItsOutput) {
  const auto file = SafetensorsFile::open(fixture("bnb-4bit-reference.safetensors"));
  for (const auto& item : codec_cases(file)) {
    SCOPED_TRACE(item.prefix);
    const auto packed = file.tensor(item.prefix + ".packed");
    EXPECT_TRUE(same_bits(qat::dequantize_4bit(packed, bnb_state(file, item), torch::kBFloat16),
                          file.tensor(item.prefix + ".dequant")));
  }
}

// On CUDA every case is bit-exact, codes included: the kernels take 1 / absmax with the same
// approximate reciprocal as bnb's fast-math build (the CPU test above documents the gap without it).
TEST(Bnb4bitReference, CudaQuantizeEqualsBitsandbytesBitForBit) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  const torch::Device cuda(torch::kCUDA, 0);
  const auto file = SafetensorsFile::open(fixture("bnb-4bit-reference.safetensors"));
  for (const auto& item : codec_cases(file)) {
    SCOPED_TRACE(item.prefix);
    const auto packed = file.tensor(item.prefix + ".packed");
    const auto input = file.tensor(item.weight + ".input").to(cuda);
    const auto ours = qat::quantize_4bit(input, item.type, item.blocksize, item.double_quant);
    ASSERT_TRUE(ours.packed.is_cuda() && ours.state.absmax.is_cuda());
    EXPECT_TRUE(same_bits(ours.packed.cpu(), packed))
        << (unpack(ours.packed.cpu(), input.numel()) != unpack(packed, input.numel())).sum().item<int64_t>()
        << " codes differ";
    expect_state_equals_bnb(ours.state, file, item);
    const auto dequantized = qat::dequantize_4bit(ours.packed, ours.state, torch::kBFloat16);
    ASSERT_TRUE(dequantized.is_cuda());
    EXPECT_TRUE(same_bits(dequantized.cpu(), file.tensor(item.prefix + ".dequant")));
  }
}

TEST(Bnb4bitReference, CudaDequantizingBitsandbytesStateGivesItsOutput) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  const torch::Device cuda(torch::kCUDA, 0);
  const auto file = SafetensorsFile::open(fixture("bnb-4bit-reference.safetensors"));
  for (const auto& item : codec_cases(file)) {
    SCOPED_TRACE(item.prefix);
    const auto packed = file.tensor(item.prefix + ".packed").to(cuda);
    const auto dequantized = qat::dequantize_4bit(packed, state_on(bnb_state(file, item), cuda), torch::kBFloat16);
    ASSERT_TRUE(dequantized.is_cuda());
    EXPECT_TRUE(same_bits(dequantized.cpu(), file.tensor(item.prefix + ".dequant")));
  }
}

// bnb's 8-bit quantize_blockwise (what double quantization applies to the absmax), signed and
// unsigned dynamic maps, blocksizes 256 and 2048: codes and absmax equal on CUDA.
TEST(Bnb8bitReference, CudaBlockwiseQuantizeEqualsBitsandbytesBitForBit) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  const torch::Device cuda(torch::kCUDA, 0);
  const auto file = SafetensorsFile::open(fixture("bnb-8bit-reference.safetensors"));
  for (const std::string map : {"signed", "unsigned"}) {
    for (const int64_t blocksize : {256, 2048}) {
      const std::string prefix = "blockwise." + map + ".b" + std::to_string(blocksize) + ".";
      SCOPED_TRACE(prefix);
      const auto code = file.tensor(prefix + "code");
      const auto ours = qat::quantize_blockwise_8bit(file.tensor(prefix + "input").to(cuda), code.to(cuda), blocksize);
      ASSERT_TRUE(ours.codes.is_cuda());
      EXPECT_TRUE(same_bits(ours.codes.cpu(), file.tensor(prefix + "q")))
          << (ours.codes.cpu() != file.tensor(prefix + "q")).sum().item<int64_t>() << " codes differ";
      EXPECT_TRUE(same_bits(ours.absmax.cpu(), file.tensor(prefix + "absmax")));
      const auto restored = qat::dequantize_blockwise_8bit(ours.codes, ours.absmax, code.to(cuda), blocksize);
      EXPECT_TRUE(same_bits(restored.cpu(), file.tensor(prefix + "dequant")));
    }
  }
}

TEST(BnbCheckpoint, RecognisesBitsandbytes4bitConfig) {
  const auto config = read_hf_config(fixture("tiny-llama-bnb-nf4"));
  ASSERT_TRUE(is_bnb_4bit_checkpoint(config));
  EXPECT_FALSE(is_bnb_8bit_checkpoint(config));
  const auto bnb = read_bnb_quantization_config(config);
  EXPECT_EQ(bnb->quant_type, "nf4");
  EXPECT_TRUE(bnb->double_quant);
  EXPECT_EQ(bnb->compute_dtype, torch::kBFloat16);
  EXPECT_TRUE(bnb->skip_modules.empty());
  EXPECT_FALSE(is_bnb_4bit_checkpoint(read_hf_config(fixture("tiny-llama"))));
}

TEST(BnbCheckpoint, LoadsProjectionsAsFrozenFourBitLayersAndTheRestDense) {
  const auto loaded = load_llama(fixture("tiny-llama-bnb-nf4"));
  int64_t four_bit_layers = 0;
  for (const auto& item : loaded.model->named_modules()) {
    if (auto layer = std::dynamic_pointer_cast<qat::FourBitLinear>(item.value())) {
      ++four_bit_layers;
      EXPECT_TRUE(layer->quant_state().double_quant());
      EXPECT_EQ(layer->quant_state().blocksize, 64);
      EXPECT_TRUE(layer->parameters().empty());
    }
  }
  EXPECT_EQ(four_bit_layers, 4 * 7);
  EXPECT_TRUE(std::dynamic_pointer_cast<qat::DenseLinear>(loaded.model->lm_head) != nullptr);
  for (const auto& item : loaded.model->named_parameters()) {
    EXPECT_TRUE(item.key() == "lm_head.weight" || item.key().find("embed_tokens") != std::string::npos ||
                item.key().find("norm") != std::string::npos)
        << item.key();
  }
}

// bitsandbytes computed the reference logits on CUDA in bf16; ours on CPU in fp32 and in bf16.
TEST(BnbCheckpoint, LogitsMatchBitsandbytesAtBf16Level) {
  const auto reference = SafetensorsFile::open(fixture("tiny-llama-bnb-nf4-reference.safetensors"));
  const auto input_ids = reference.tensor("input_ids").to(torch::kLong);
  const auto expected = reference.tensor("logits").to(torch::kFloat32);
  const float scale = expected.abs().max().item<float>();
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    ModelLoadOptions options;
    options.dtype = dtype;
    auto loaded = load_llama(fixture("tiny-llama-bnb-nf4"), options);
    torch::NoGradGuard no_grad;
    const auto logits = loaded.model->forward({input_ids}).to(torch::kFloat32);
    ASSERT_EQ(logits.sizes(), expected.sizes());
    const float relative = (logits - expected).abs().max().item<float>() / scale;
    std::printf("tiny-llama-bnb-nf4 %s logits: max |ours - bnb| / max |bnb| = %.3g\n",
                dtype == torch::kFloat32 ? "fp32" : "bf16", relative);
    EXPECT_LT(relative, 2e-2);
    EXPECT_TRUE(torch::equal(logits.argmax(-1), expected.argmax(-1)) || relative < 1e-2);
  }
}

// Quantizes tiny-llama's linear layers (other than lm_head) on `device` as the fixture's checkpoint
// was made (NF4, double quant, blocksize 64) and compares every one with the checkpoint's bytes.
void expect_quantized_tiny_llama_equals_the_checkpoint(const torch::Device& device) {
  auto dense = load_llama(fixture("tiny-llama"));
  dense.model->to(device);
  qat::FourBitOptions options;
  options.quant_type = "nf4";
  options.blocksize = 64;
  options.double_quant = true;
  const auto replaced = qat::quantize_linear_layers(*dense.model, options, {"lm_head"});
  EXPECT_EQ(replaced.size(), 28u);
  const auto bnb = SafetensorsCheckpoint::open(fixture("tiny-llama-bnb-nf4"));
  const auto modules = dense.model->named_modules();
  for (const auto& name : replaced) {
    SCOPED_TRACE(name);
    const auto layer = std::dynamic_pointer_cast<qat::FourBitLinear>(modules[name]);
    ASSERT_TRUE(layer);
    EXPECT_EQ(layer->packed_weight().device(), device);
    const auto stored = read_bnb_4bit_weight(bnb, name, "tiny-llama-bnb-nf4");
    EXPECT_TRUE(same_bits(layer->packed_weight().cpu(), stored.packed));
    EXPECT_TRUE(same_bits(layer->quant_state().absmax.cpu(), stored.state.absmax));
    EXPECT_TRUE(same_bits(layer->quant_state().nested_absmax.cpu(), stored.state.nested_absmax));
    EXPECT_EQ(layer->quant_state().offset, stored.state.offset);
  }
}

// The fixtures README: the bnb checkpoint is tiny-llama's bf16 weights quantized by bitsandbytes
// (NF4, double quant, blocksize 64). Quantizing tiny-llama ourselves gives the same bytes.
TEST(BnbCheckpoint, QuantizingTinyLlamaOnLoadGivesTheCheckpointsBytes) {
  expect_quantized_tiny_llama_equals_the_checkpoint(torch::kCPU);
}

TEST(BnbCheckpoint, CudaQuantizingTinyLlamaGivesTheCheckpointsBytes) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU on this machine";
  expect_quantized_tiny_llama_equals_the_checkpoint(torch::Device(torch::kCUDA, 0));
}

TEST(BnbCheckpoint, AnInconsistentQuantStateIsAnErrorNamingTheTensor) {
  testing::TempDir dir;
  const auto source = SafetensorsCheckpoint::open(fixture("tiny-llama-bnb-nf4"));
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  const std::string broken = "model.layers.1.self_attn.q_proj.weight.quant_state.bitsandbytes__nf4";
  for (const auto& name : source.names()) {
    auto tensor = source.tensor(name);
    if (name == broken) {
      auto state = nlohmann::json::parse(std::string(reinterpret_cast<const char*>(tensor.data_ptr<uint8_t>()),
                                                     tensor.numel()));
      state["shape"] = {256, 512};
      const std::string text = state.dump();
      tensor = torch::from_blob(const_cast<char*>(text.data()), {static_cast<int64_t>(text.size())}, torch::kUInt8)
                   .clone();
    }
    tensors.emplace_back(name, tensor);
  }
  write_safetensors(dir.file("model.safetensors"), tensors);
  std::filesystem::copy_file(fixture("tiny-llama-bnb-nf4/config.json"), dir.file("config.json"));
  try {
    load_llama(dir.path());
    FAIL() << "a quant state with the wrong shape loaded";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("model.layers.1.self_attn.q_proj.weight"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace qtrain::trainer
