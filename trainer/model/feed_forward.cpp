#include "trainer/model/feed_forward.h"

#include <algorithm>

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

std::vector<std::string> projections_but_dense_base(const LlamaOptions& options) {
  const auto dense = dense_base_projections(options);
  std::vector<std::string> names;
  for (const auto& name : options.projection_names()) {
    const bool kept = std::any_of(dense.begin(), dense.end(), [&](const std::string& entry) {
      return entry.size() >= name.size() && entry.compare(entry.size() - name.size(), name.size(), name) == 0;
    });
    if (!kept) names.push_back(name);
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
