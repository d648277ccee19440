#pragma once
// A frozen weight that lives in pinned host memory and visits the device for one use at a time
// (train.lm_head_on_host: Llama-3-8B's lm_head is 1 GiB of bf16 that only the loss reads).
//
// prefetch() queues its copy to the device on the prefetch lane (trainer/model/device_copies.h),
// so that it travels while the decoder layers run forward; take() hands the copy over, ready for
// the current stream. The copy may travel in pieces of rows, one queued as each layer starts
// (continue_prefetch()): a whole gigabyte queued at once holds up, for its 20-odd ms, the copies
// a layer waits for on the other lanes (the optimizer state's share, trainer/deferred_update.h). The caller's references are the only ones: the device memory goes back to
// the caching allocator as soon as the last user (the loss's backward) lets go of it, before the
// layers' backward, where a checkpointed run peaks.
//
// Or it visits a tile of rows at a time (train.lm_head_block_mb: the fused loss walks the
// vocabulary in tiles): prefetch_tiles() queues the first tiles' copies, and take_rows() hands
// over one tile and queues the next ones of its width, so that at most a tile in use and `ahead`
// on their way are on the device. On the CPU a tile is a copy of the rows, made at once.
#include <torch/torch.h>

#include <deque>

#include "trainer/model/device_copies.h"

namespace qtrain::trainer {

class HostResidentWeight {
 public:
  // Copies `weight` (any device) into host memory, pinned when `device`, where it will be used, is
  // a GPU; `for_what` names the recipe key in errors.
  HostResidentWeight(const torch::Tensor& weight, const torch::Device& device, const std::string& for_what);

  // The host tensor (pinned where CUDA is): what the module's parameter is set to.
  const torch::Tensor& host() const { return host_; }

  // Starts the copy to `device` after the work queued so far, in `pieces` pieces of rows (1: whole;
  // a matrix's rows): the first now, each next one at continue_prefetch(), what is left at take().
  // A copy already on its way stays.
  void prefetch(const torch::Device& device, int64_t pieces = 1);

  // Queues the next piece of the copy prefetch() started, after the work queued so far; nothing
  // where none is left.
  void continue_prefetch();

  // The weight on `device`, ready for the current stream: the prefetched copy, or one made now.
  torch::Tensor take(const torch::Device& device);

  // Queues the copies of the first `count` tiles of `rows` rows each (after any queued already).
  void prefetch_tiles(const torch::Device& device, int64_t rows, int64_t count);

  // Rows [begin, end) on `device`, ready for the current stream: the first queued tile where it
  // is that one, else a copy made now (queued tiles before `begin` or of another shape are
  // dropped). Then queues the tiles of its width that follow it, up to the last row, until
  // `ahead` are queued. Tiles taken in order, [0, w), [w, 2w), ..., each arrive ahead of use.
  torch::Tensor take_rows(const torch::Device& device, int64_t begin, int64_t end, int64_t ahead);

  // Tiles queued and not yet taken (their device memory is held).
  int64_t queued_tiles() const { return static_cast<int64_t>(tiles_.size()); }

 private:
  struct Tile {
    int64_t begin = 0, end = 0;  // the weight's rows it holds
    torch::Tensor rows;          // on the device
    CopyArrival arrived;
  };
  void queue_tile(const torch::Device& device, int64_t begin, int64_t end);
  int64_t rows() const { return host_.dim() == 0 ? 1 : host_.size(0); }  // a scalar is one piece

  torch::Tensor host_;
  torch::Tensor on_device_;  // prefetched, not yet taken
  int64_t piece_rows_ = 0;   // of on_device_'s copy: rows a piece
  int64_t queued_rows_ = 0;  // rows whose copy is queued
  CopyArrival arrived_;      // the last piece queued
  std::deque<Tile> tiles_;   // queued by prefetch_tiles / take_rows, in row order
};

}  // namespace qtrain::trainer
