#include "qat/gguf_block.h"

#include <cstring>

#include "kernels/error.h"

namespace qtrain::qat {

namespace {

constexpr int kQ4Offset = 8;  // Q4_0 stores q + 8 in a nibble

int64_t numel_of(c10::IntArrayRef shape) {
  int64_t count = 1;
  for (const auto size : shape) count *= size;
  return count;
}

}  // namespace

GgufBlockType gguf_block_type_for(const QuantSpec& spec, const std::string& what) {
  const std::string scheme = " (" + spec.describe() + ")";
  if (!spec.is_integer() || (spec.bits != 4 && spec.bits != 8)) {
    throw Error(ErrorCode::kRecipe, what + ": GGUF export holds int4 (Q4_0) or int8 (Q8_0) weights only, not " + spec.describe() +
                "; export it as safetensors-int");
  }
  if (!spec.symmetric) {
    throw Error(ErrorCode::kRecipe, what + ".symmetric: false cannot be written as GGUF Q4_0 / Q8_0, which are symmetric (no zero point)" +
                scheme + "; set symmetric: true or export as safetensors-int");
  }
  if (spec.granularity != Granularity::kPerGroup || spec.group_size != kGgufBlockElements) {
    throw Error(ErrorCode::kRecipe, what + ".group_size: GGUF Q4_0 / Q8_0 need granularity per_group with group_size 32" + scheme);
  }
  if (spec.scale_dtype != torch::kFloat16) {
    throw Error(ErrorCode::kRecipe, what + ".scale_dtype: GGUF stores each block's scale as fp16, so the fake-quant scale must be fp16-rounded" +
                scheme + " (QuantSpec::gguf_q4_0() / gguf_q8_0() set it)");
  }
  return spec.bits == 4 ? GgufBlockType::kQ4_0 : GgufBlockType::kQ8_0;
}

std::vector<uint8_t> encode_gguf_blocks(const QuantizedTensor& tensor, const std::string& what) {
  const auto type = gguf_block_type_for(tensor.spec, what);
  const auto& format = gguf_block_format(type);
  const auto shape = tensor.codes.sizes();
  tensor.spec.validate_for_shape(what, shape);
  const auto codes = tensor.codes.to(torch::kCPU, torch::kInt8).contiguous();
  const auto scale = tensor.params.scale.to(torch::kCPU, torch::kFloat32).contiguous();
  const auto half_scale = scale.to(torch::kFloat16);
  if (!torch::equal(half_scale.to(torch::kFloat32), scale)) {
    throw Error(ErrorCode::kWeights, what + ": a scale of tensor " + shape_text(shape) + " is not an fp16 value, so GGUF cannot store it exactly");
  }
  if (tensor.params.zero_point.defined() && tensor.params.zero_point.ne(0).any().item<bool>()) {
    throw Error(ErrorCode::kWeights, what + ": tensor " + shape_text(shape) + " has non-zero zero points, which GGUF Q4_0 / Q8_0 cannot store");
  }

  const int64_t blocks = codes.numel() / kGgufBlockElements;
  std::vector<uint8_t> bytes(static_cast<size_t>(blocks * format.block_bytes));
  const int8_t* q = codes.data_ptr<int8_t>();
  const auto* d = reinterpret_cast<const uint16_t*>(half_scale.data_ptr<at::Half>());
  for (int64_t block = 0; block < blocks; ++block) {
    const int8_t* block_q = q + block * kGgufBlockElements;
    uint8_t* out = bytes.data() + block * format.block_bytes;
    if (type == GgufBlockType::kQ4_0) {
      GgufBlockQ4_0 packed{};
      packed.d = d[block];
      for (int64_t j = 0; j < kGgufBlockElements / 2; ++j) {
        const int low = block_q[j] + kQ4Offset;
        const int high = block_q[j + kGgufBlockElements / 2] + kQ4Offset;
        packed.qs[j] = static_cast<uint8_t>(low | (high << 4));
      }
      std::memcpy(out, &packed, sizeof(packed));
    } else {
      GgufBlockQ8_0 packed{};
      packed.d = d[block];
      std::memcpy(packed.qs, block_q, kGgufBlockElements);
      std::memcpy(out, &packed, sizeof(packed));
    }
  }
  return bytes;
}

torch::Tensor decode_gguf_blocks(const std::vector<uint8_t>& bytes, GgufBlockType type, c10::IntArrayRef shape) {
  const auto& format = gguf_block_format(type);
  const int64_t numel = numel_of(shape);
  const int64_t blocks = numel / kGgufBlockElements;
  if (numel % kGgufBlockElements != 0 || static_cast<int64_t>(bytes.size()) != blocks * format.block_bytes) {
    throw Error(ErrorCode::kWeights, std::string(format.name) + " data of " + std::to_string(bytes.size()) + " bytes does not hold a tensor of shape " +
                shape_text(shape));
  }
  auto values = torch::empty({numel}, torch::kFloat32);
  float* y = values.data_ptr<float>();
  for (int64_t block = 0; block < blocks; ++block) {
    const uint8_t* in = bytes.data() + block * format.block_bytes;
    uint16_t d_bits = 0;
    std::memcpy(&d_bits, in, sizeof(d_bits));
    const float d = static_cast<float>(c10::Half(d_bits, c10::Half::from_bits()));
    float* out = y + block * kGgufBlockElements;
    if (type == GgufBlockType::kQ4_0) {
      GgufBlockQ4_0 packed;
      std::memcpy(&packed, in, sizeof(packed));
      for (int64_t j = 0; j < kGgufBlockElements / 2; ++j) {
        out[j] = static_cast<float>((packed.qs[j] & 0x0F) - kQ4Offset) * d;
        out[j + kGgufBlockElements / 2] = static_cast<float>((packed.qs[j] >> 4) - kQ4Offset) * d;
      }
    } else {
      GgufBlockQ8_0 packed;
      std::memcpy(&packed, in, sizeof(packed));
      for (int64_t j = 0; j < kGgufBlockElements; ++j) out[j] = static_cast<float>(packed.qs[j]) * d;
    }
  }
  return values.reshape(shape);
}

}  // namespace qtrain::qat
