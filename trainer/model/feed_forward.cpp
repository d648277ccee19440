#include "trainer/model/feed_forward.h"

#include "kernels/error.h"
#include "trainer/model/dense_mlp.h"
#include "trainer/model/sparse_moe.h"

namespace qtrain::trainer {

std::vector<std::string> dense_base_projections(const LlamaOptions& options) {
  std::vector<std::string> names;
  const auto& row = feed_forward_row(options);
  for (const auto& shape : row.projections(options)) {
    if (shape.stays_dense) names.push_back(std::string(row.module_name) + "." + shape.name);
  }
  return names;
}

const FeedForwardRow& feed_forward_row(FeedForwardKind kind) {
  // No default: a new FeedForwardKind is a warning here until it has its row.
  switch (kind) {
    case FeedForwardKind::kDense: return dense_mlp_row();
    case FeedForwardKind::kExperts: return sparse_moe_row();
  }
  throw Error(ErrorCode::kInternal, "feed-forward kind " + std::to_string(static_cast<int>(kind)) +
                                        " has no row in trainer/model/feed_forward.cpp");
}

}  // namespace qtrain::trainer
