// llama.cpp's quantizers as qtrain runs them (qat/gguf_quants.h, every quantized row of
// gguf_block_formats()) against llama.cpp's own: ggml_quantize_chunk without an importance matrix
// (what llama-quantize writes) and the type's to_float, called in llama-cpp-python's libggml-base
// by tests/interop/ggml_quants.py. The same floats give the same bytes, and the same bytes give
// the same floats, bit for bit, on random rows and on the inputs where a port goes wrong: values
// exactly halfway between two codes (where a fused multiply-add rounds differently), zeros, constant
// blocks, one non-zero value per block, both signs of the largest magnitude, tiny and large scales;
// and on infinities, NaNs, subnormal and near-overflow values, where ggml's C is undefined and its
// x86-64 build decides.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "qat/gguf_block_format.h"
#include "support.h"

namespace qtrain::qat {
namespace {

constexpr int64_t kRowLength = 512;  // two K-quant super-blocks of 256, sixteen legacy blocks of 32
constexpr int kBlock = 32;           // the unit the cases are written in: one legacy block
constexpr int64_t kBlocksPerRow = kRowLength / kBlock;

const char* const kNoLlamaCpp =
    "no Python with llama_cpp, gguf and numpy: tools/setup.sh installs llama-cpp-python (QTRAIN_LLAMA_CPP=1; "
    "tools/run-tests.sh sets it)";

// Named cases, each whole rows, one after the other.
class Inputs {
 public:
  // `blocks` blocks of 32 values (rounded up to whole rows), `fill_block(index, values)` writing each.
  void add(const std::string& name, int64_t blocks, const std::function<void(int64_t, float*)>& fill_block) {
    const int64_t rows = (blocks + kBlocksPerRow - 1) / kBlocksPerRow;
    starts_.push_back({static_cast<int64_t>(values_.size()), name});
    std::vector<float> block(kBlock);
    for (int64_t index = 0; index < rows * kBlocksPerRow; ++index) {
      fill_block(index, block.data());
      values_.insert(values_.end(), block.begin(), block.end());
    }
  }

  const std::vector<float>& values() const { return values_; }

  // The case the value at `index` belongs to.
  const std::string& case_of(int64_t index) const {
    size_t found = 0;
    while (found + 1 < starts_.size() && starts_[found + 1].first <= index) ++found;
    return starts_[found].second;
  }

 private:
  std::vector<float> values_;
  std::vector<std::pair<int64_t, std::string>> starts_;  // first value, case name
};

// Random rows and the edge cases every type must get right.
Inputs ordinary_inputs() {
  Inputs inputs;
  std::mt19937 generator(20240611);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-8, 8);
  const auto scale_between = [&](float low_log10, float high_log10) {
    return std::pow(10.0f, low_log10 + (high_log10 - low_log10) * uniform(generator));
  };
  const auto fill_each = [](float* values, const std::function<float(int)>& value_at) {
    for (int j = 0; j < kBlock; ++j) values[j] = value_at(j);
  };

  float row_scale = 1.0f;
  inputs.add("normal, a scale per row", 8 * kBlocksPerRow, [&](int64_t index, float* values) {
    if (index % kBlocksPerRow == 0) row_scale = scale_between(-3, 1);
    fill_each(values, [&](int) { return normal(generator) * row_scale; });
  });
  // Cauchy-like: a normal over a uniform, a few values per row far above the rest.
  inputs.add("heavy tails", 4 * kBlocksPerRow, [&](int64_t, float* values) {
    fill_each(values, [&](int) { return 0.02f * normal(generator) / (uniform(generator) + 1e-3f); });
  });
  inputs.add("zeros", kBlocksPerRow, [&](int64_t, float* values) { fill_each(values, [](int) { return 0.0f; }); });
  inputs.add("negative zeros", kBlocksPerRow, [&](int64_t, float* values) { fill_each(values, [](int) { return -0.0f; }); });
  const float constants[] = {1.0f, -1.0f, 0.5f, -3.0f, 0.1f, -7.25f, 1e-8f, -1e4f, 65504.0f, 7e4f};
  inputs.add("constant blocks", 2 * kBlocksPerRow, [&](int64_t index, float* values) {
    const auto kinds = static_cast<int64_t>(std::size(constants));
    const float constant = constants[index % kinds] * static_cast<float>(1 + index / kinds);
    fill_each(values, [&](int) { return constant; });
  });
  inputs.add("one non-zero value per block", 2 * kBlocksPerRow, [&](int64_t index, float* values) {
    const float value = normal(generator) * scale_between(-4, 4);
    fill_each(values, [&](int j) { return j == index % kBlock ? value : 0.0f; });
  });
  inputs.add("all negative", 2 * kBlocksPerRow, [&](int64_t, float* values) {
    fill_each(values, [&](int) { return -std::fabs(normal(generator)); });
  });
  inputs.add("tiny (1e-8)", 2 * kBlocksPerRow, [&](int64_t, float* values) {
    fill_each(values, [&](int) { return 1e-8f * normal(generator); });
  });
  inputs.add("large (1e4)", 2 * kBlocksPerRow, [&](int64_t, float* values) {
    fill_each(values, [&](int) { return 1e4f * normal(generator); });
  });
  // The largest magnitude with both signs in one block, in either order, once or repeated: the first
  // of them sets the symmetric types' sign of d.
  inputs.add("+max and -max in one block", 2 * kBlocksPerRow, [&](int64_t index, float* values) {
    const float largest = scale_between(-2, 2);
    fill_each(values, [&](int) { return largest * (uniform(generator) * 1.8f - 0.9f); });
    const float first = index % 2 == 0 ? largest : -largest;
    values[index % kBlock] = first;
    values[(index * 7 + 5) % kBlock] = -first;
    if (index % 3 == 0) values[(index * 11 + 3) % kBlock] = first;
  });
  // Values on the half-steps of a type's grid: the largest magnitude (the symmetric types) or the
  // range (the asymmetric ones) is a whole number of steps, every value a whole or half step, so
  // x / d + offset lands on a rounding boundary. Levels are the types' own (8, 16, 127 steps each
  // side; 15, 31 over the range). With a power-of-two step every product is exact and the blocks
  // test how a tie rounds; with any other step x * (1 / d) rounds to within an ulp or two of the
  // boundary, on either side, and a fused multiply-add would round differently from ggml.
  const int levels[] = {8, 16, 127, 15, 31};
  inputs.add("values halfway between two codes", 12 * kBlocksPerRow, [&](int64_t index, float* values) {
    const int level = levels[index % static_cast<int64_t>(std::size(levels))];
    const float mantissa = index % 2 == 0 ? 1.0f : 1.0f + uniform(generator);
    const float step = std::ldexp(mantissa, exponent(generator));
    const bool asymmetric = level == 15 || level == 31;
    const float offset = asymmetric ? step * static_cast<float>(static_cast<int>(uniform(generator) * 9) - 4) : 0.0f;
    std::uniform_int_distribution<int> half_steps(asymmetric ? 0 : -2 * level, 2 * level);
    fill_each(values, [&](int) { return offset + step * 0.5f * static_cast<float>(half_steps(generator)); });
    if (asymmetric) {
      values[index % kBlock] = offset;
      values[(index + 9) % kBlock] = offset + step * static_cast<float>(level);
    } else {
      values[index % kBlock] = step * static_cast<float>(index % 2 == 0 ? level : -level);
    }
  });
  inputs.add("ramps", 2 * kBlocksPerRow, [&](int64_t index, float* values) {
    const int divisor = levels[index % static_cast<int64_t>(std::size(levels))];
    const float scale = scale_between(-3, 3);
    fill_each(values, [&](int j) { return scale * static_cast<float>(j - static_cast<int>(index % kBlock)) / static_cast<float>(divisor); });
  });
  return inputs;
}

// What no model should hold but a quantizer must still treat as ggml does: subnormal and
// near-overflow magnitudes (where 1 / d overflows or the scale's fp16 becomes infinite), infinities
// and NaNs. Some of ggml's integer casts of these are undefined in C; qtrain gives what ggml's
// x86-64 build gives.
Inputs extreme_inputs() {
  Inputs inputs;
  std::mt19937 generator(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto fill_each = [](float* values, const std::function<float(int)>& value_at) {
    for (int j = 0; j < kBlock; ++j) values[j] = value_at(j);
  };
  const float magnitudes[] = {1e-36f, 1e-38f, 5e-39f, 1e-40f, 1e-43f, 1e30f, 1e37f, 3e38f};
  inputs.add("subnormal and near-overflow magnitudes", 4 * kBlocksPerRow, [&](int64_t index, float* values) {
    const float magnitude = magnitudes[index % static_cast<int64_t>(std::size(magnitudes))];
    fill_each(values, [&](int) { return magnitude * normal(generator); });
  });
  const float specials[] = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::max(),
                            -std::numeric_limits<float>::max()};
  inputs.add("an infinity, NaN or +-FLT_MAX in a block", 2 * kBlocksPerRow, [&](int64_t index, float* values) {
    fill_each(values, [&](int) { return normal(generator); });
    values[index % kBlock] = specials[index % static_cast<int64_t>(std::size(specials))];
  });
  inputs.add("all NaN", kBlocksPerRow, [&](int64_t, float* values) {
    fill_each(values, [](int) { return std::numeric_limits<float>::quiet_NaN(); });
  });
  return inputs;
}

std::vector<uint8_t> read_bytes(const std::string& path) {
  const std::string text = testing::read_text(path);
  return std::vector<uint8_t>(text.begin(), text.end());
}

std::string hex(const uint8_t* bytes, int64_t count) {
  std::string text;
  char digits[4];
  for (int64_t index = 0; index < count; ++index) {
    std::snprintf(digits, sizeof digits, "%02x", bytes[index]);
    text += digits;
  }
  return text;
}

std::string values_text(const float* values, int64_t count) {
  std::string text;
  char number[32];
  for (int64_t index = 0; index < count; ++index) {
    std::snprintf(number, sizeof number, "%s%a", index == 0 ? "" : " ", values[index]);
    text += number;
  }
  return text;
}

uint32_t bits_of(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

// For each row: its quantizer's bytes of `inputs` equal ggml's, and its dequantizer's floats of
// ggml's bytes equal ggml's (bits, NaNs included). One Python run for all rows.
void expect_ggml_agrees(const std::string& python, const Inputs& inputs, const std::vector<const GgufBlockFormat*>& rows) {
  const auto& values = inputs.values();
  const auto count = static_cast<int64_t>(values.size());
  testing::TempDir temp;
  std::ofstream(temp.file("values.f32"), std::ios::binary)
      .write(reinterpret_cast<const char*>(values.data()), static_cast<std::streamsize>(values.size() * sizeof(float)));
  std::string type_names;
  for (const auto* row : rows) type_names += std::string(" ") + row->name;
  const std::string command = "'" + python + "' '" + testing::source_dir() + "/tests/interop/ggml_quants.py' quantize '" +
                              temp.file("values.f32") + "' " + std::to_string(kRowLength) + " '" + temp.path() + "'" +
                              type_names + " 2>&1";
  const auto run = testing::run_command(command);
  ASSERT_EQ(run.status, 0) << command << "\n" << run.output;

  for (const auto* row : rows) {
    SCOPED_TRACE(row->name);
    const int64_t blocks = count / row->block_elements;
    const auto ggml_bytes = read_bytes(temp.file(std::string(row->name) + ".quantized"));
    const auto ggml_floats_raw = read_bytes(temp.file(std::string(row->name) + ".dequantized"));
    ASSERT_EQ(static_cast<int64_t>(ggml_bytes.size()), blocks * row->block_bytes);
    ASSERT_EQ(static_cast<int64_t>(ggml_floats_raw.size()), count * 4);
    std::vector<float> ggml_floats(count);
    std::memcpy(ggml_floats.data(), ggml_floats_raw.data(), ggml_floats_raw.size());

    std::vector<uint8_t> ours(ggml_bytes.size());
    row->quantize(values.data(), ours.data(), count);
    int64_t differing_blocks = 0;
    int64_t first_block = -1;
    for (int64_t block = 0; block < blocks; ++block) {
      if (std::memcmp(ours.data() + block * row->block_bytes, ggml_bytes.data() + block * row->block_bytes, row->block_bytes) != 0) {
        if (first_block < 0) first_block = block;
        ++differing_blocks;
      }
    }
    if (first_block >= 0) {
      const int64_t first_value = first_block * row->block_elements;
      ADD_FAILURE() << differing_blocks << " of " << blocks << " blocks differ from ggml's; the first, block " << first_block
                    << " (case '" << inputs.case_of(first_value) << "'):\n  ours " << hex(ours.data() + first_block * row->block_bytes, row->block_bytes)
                    << "\n  ggml " << hex(ggml_bytes.data() + first_block * row->block_bytes, row->block_bytes)
                    << "\n  of the values " << values_text(values.data() + first_value, row->block_elements);
    }

    std::vector<float> dequantized(count);
    row->dequantize(ggml_bytes.data(), dequantized.data(), count);
    int64_t differing_values = 0;
    int64_t first_index = -1;
    for (int64_t index = 0; index < count; ++index) {
      if (bits_of(dequantized[index]) != bits_of(ggml_floats[index])) {
        if (first_index < 0) first_index = index;
        ++differing_values;
      }
    }
    if (first_index >= 0) {
      const int64_t block = first_index / row->block_elements;
      ADD_FAILURE() << differing_values << " of " << count << " dequantized values differ from ggml's; the first, value "
                    << first_index << " (block " << block << ", case '" << inputs.case_of(first_index) << "'): ours "
                    << values_text(&dequantized[first_index], 1) << ", ggml " << values_text(&ggml_floats[first_index], 1)
                    << ", from the block " << hex(ggml_bytes.data() + block * row->block_bytes, row->block_bytes);
    }
  }
}

std::vector<const GgufBlockFormat*> quantized_rows() {
  std::vector<const GgufBlockFormat*> rows;
  for (const auto& row : gguf_block_formats()) {
    if (row.quantize != nullptr) rows.push_back(&row);
  }
  return rows;
}

TEST(GgufQuants, EveryQuantizedTypeHasGgmlsBytesAndFloats) {
  const auto python = testing::find_python_with("llama_cpp gguf numpy");
  if (python.empty()) GTEST_SKIP() << kNoLlamaCpp;
  const auto rows = quantized_rows();
  ASSERT_GE(rows.size(), 10u);  // Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K .. Q6_K
  for (const auto* row : rows) ASSERT_NE(row->dequantize, nullptr) << row->name;
  expect_ggml_agrees(python, ordinary_inputs(), rows);
}

TEST(GgufQuants, NonFiniteAndExtremeValuesGiveGgmlsBytesAndFloats) {
  const auto python = testing::find_python_with("llama_cpp gguf numpy");
  if (python.empty()) GTEST_SKIP() << kNoLlamaCpp;
  expect_ggml_agrees(python, extreme_inputs(), quantized_rows());
}

}  // namespace
}  // namespace qtrain::qat
