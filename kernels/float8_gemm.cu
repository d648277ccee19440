// cuBLASLt's FP8 matmul with outer-vector scales and beta (kernels/float8_gemm.h).
//
// cuBLASLt is column-major. Row-major out [m, n] is column-major out^T [n, m], so it computes
// out^T = right_t · left^T: A = right_t (stored [n, k] row-major = [k, n] column-major, read
// transposed), B = left ([k, m] column-major, as is). FP8 wants exactly this "TN" form: both
// operands K-major. cuBLAS's M is our n (A's scales: right_scales), its N our m (B's: left_scales).
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "kernels/cuda_entry.cuh"
#include "kernels/float8_gemm.h"

namespace qtrain::kernels {

namespace {

// The descriptors of one call, destroyed with it.
struct MatmulDescriptors {
  cublasLtMatmulDesc_t operation = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  ~MatmulDescriptors() {
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (operation) cublasLtMatmulDescDestroy(operation);
  }
};

// The algorithm cuBLASLt's heuristic picks depends on the shape, beta, fast accumulation and the
// device; asking costs more than a small matmul, so each key asks once. Absent: it found none.
using AlgorithmKey = std::tuple<int, int64_t, int64_t, int64_t, bool, bool>;
struct Algorithms {
  std::mutex mutex;
  std::map<AlgorithmKey, std::pair<bool, cublasLtMatmulAlgo_t>> chosen;
};
Algorithms& algorithms() {
  static auto* cache = new Algorithms();  // never destroyed: no CUDA calls during exit
  return *cache;
}

void check_operands(const at::Tensor& left, const at::Tensor& left_scales, const at::Tensor& right_t,
                    const at::Tensor& right_scales, const at::Tensor& out) {
  const std::string what = "float8_gemm_cuda: ";
  check_cuda_operands(left, {{&left, "left"}, {&left_scales, "left_scales"}, {&right_t, "right_t"},
                             {&right_scales, "right_scales"}, {&out, "out"}}, what);
  check_scalar_type(left, at::kFloat8_e4m3fn, what + "left");
  check_scalar_type(right_t, at::kFloat8_e4m3fn, what + "right_t");
  check_scalar_type(left_scales, at::kFloat, what + "left_scales");
  check_scalar_type(right_scales, at::kFloat, what + "right_scales");
  check_scalar_type(out, at::kBFloat16, what + "out");
  const int64_t m = left.size(0), k = left.size(1), n = right_t.size(0);
  if (left.dim() != 2 || right_t.dim() != 2 || out.dim() != 2 || right_t.size(1) != k || out.size(0) != m ||
      out.size(1) != n || left_scales.numel() != m || right_scales.numel() != n) {
    throw Error(ErrorCode::kInternal, what + "expected left [m, k], right_t [n, k], out [m, n] and m, n scales");
  }
  if (n % 16 != 0 || k % 16 != 0) {
    throw Error(ErrorCode::kInternal, what + "n and k must be multiples of 16, got " + std::to_string(n) + " and " +
                                          std::to_string(k));
  }
}

template <typename Value>
bool set_attribute(cublasLtMatmulDesc_t operation, cublasLtMatmulDescAttributes_t attribute, const Value& value) {
  return cublasLtMatmulDescSetAttribute(operation, attribute, &value, sizeof(value)) == CUBLAS_STATUS_SUCCESS;
}

}  // namespace

bool float8_gemm_cuda(const at::Tensor& left, const at::Tensor& left_scales, const at::Tensor& right_t,
                      const at::Tensor& right_scales, at::Tensor& out, bool accumulate, bool fast_accumulation) {
  check_operands(left, left_scales, right_t, right_scales, out);
  const c10::cuda::CUDAGuard device_guard(left.device());
  const int64_t m = left.size(0), k = left.size(1), n = right_t.size(0);
  if (m == 0 || n == 0) return true;

  MatmulDescriptors descriptors;
  if (cublasLtMatmulDescCreate(&descriptors.operation, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) return false;
  const cublasOperation_t transposed = CUBLAS_OP_T, as_is = CUBLAS_OP_N;
  const int32_t outer_vector = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
  const int8_t fast = fast_accumulation ? 1 : 0;
  const void* a_scales = right_scales.data_ptr();
  const void* b_scales = left_scales.data_ptr();
  if (!set_attribute(descriptors.operation, CUBLASLT_MATMUL_DESC_TRANSA, transposed) ||
      !set_attribute(descriptors.operation, CUBLASLT_MATMUL_DESC_TRANSB, as_is) ||
      !set_attribute(descriptors.operation, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, outer_vector) ||
      !set_attribute(descriptors.operation, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, outer_vector) ||
      !set_attribute(descriptors.operation, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a_scales) ||
      !set_attribute(descriptors.operation, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b_scales) ||
      !set_attribute(descriptors.operation, CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast)) {
    return false;  // a cuBLASLt older than outer-vector scales
  }
  if (cublasLtMatrixLayoutCreate(&descriptors.a, CUDA_R_8F_E4M3, k, n, k) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatrixLayoutCreate(&descriptors.b, CUDA_R_8F_E4M3, k, m, k) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatrixLayoutCreate(&descriptors.c, CUDA_R_16BF, n, m, n) != CUBLAS_STATUS_SUCCESS) {
    return false;
  }
  const size_t workspace_bytes = at::cuda::getCUDABlasLtWorkspaceSize();
  void* workspace = at::cuda::getCUDABlasLtWorkspace();
  const auto handle = at::cuda::getCurrentCUDABlasLtHandle();

  const AlgorithmKey key{left.get_device(), m, n, k, accumulate, fast_accumulation};
  cublasLtMatmulAlgo_t algorithm;
  {
    auto& cache = algorithms();
    const std::lock_guard<std::mutex> lock(cache.mutex);
    auto found = cache.chosen.find(key);
    if (found == cache.chosen.end()) {
      cublasLtMatmulHeuristicResult_t result{};
      int results = 0;
      const bool asked =
          cublasLtMatmulPreferenceCreate(&descriptors.preference) == CUBLAS_STATUS_SUCCESS &&
          cublasLtMatmulPreferenceSetAttribute(descriptors.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                               &workspace_bytes, sizeof(workspace_bytes)) == CUBLAS_STATUS_SUCCESS &&
          cublasLtMatmulAlgoGetHeuristic(handle, descriptors.operation, descriptors.a, descriptors.b, descriptors.c,
                                         descriptors.c, descriptors.preference, 1, &result, &results) ==
              CUBLAS_STATUS_SUCCESS;
      found = cache.chosen.emplace(key, std::make_pair(asked && results > 0, result.algo)).first;
    }
    if (!found->second.first) return false;
    algorithm = found->second.second;
  }
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  void* output = out.data_ptr();
  const auto status = cublasLtMatmul(handle, descriptors.operation, &alpha, right_t.data_ptr(), descriptors.a,
                                     left.data_ptr(), descriptors.b, &beta, output, descriptors.c, output,
                                     descriptors.c, &algorithm, workspace, workspace_bytes,
                                     at::cuda::getCurrentCUDAStream());
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw Error(ErrorCode::kInternal, std::string("float8_gemm_cuda: cublasLtMatmul failed: ") +
                                          cublasLtGetStatusString(status) + " (m " + std::to_string(m) + ", n " +
                                          std::to_string(n) + ", k " + std::to_string(k) + ")");
  }
  return true;
}

}  // namespace qtrain::kernels
