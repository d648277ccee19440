#include "trainer/model/feed_forward.h"

#include "kernels/error.h"
#include "trainer/model/dense_mlp.h"

namespace qtrain::trainer {

const FeedForwardRow& feed_forward_row(const LlamaOptions& options) {
  // No default: a new FeedForwardKind is a warning here until it has its row.
  switch (options.feed_forward) {
    case FeedForwardKind::kDense: return dense_mlp_row();
  }
  throw Error(ErrorCode::kInternal, "feed-forward kind " + std::to_string(static_cast<int>(options.feed_forward)) +
                                        " has no row in trainer/model/feed_forward.cpp");
}

}  // namespace qtrain::trainer
