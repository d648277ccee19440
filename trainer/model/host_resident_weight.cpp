#include "trainer/model/host_resident_weight.h"

#include "kernels/error.h"

namespace qtrain::trainer {

HostResidentWeight::HostResidentWeight(const torch::Tensor& weight, const torch::Device& device,
                                       const std::string& for_what) {
  const auto source = weight.detach().contiguous();
  const int64_t bytes = source.numel() * source.element_size();
  torch::Tensor buffer;
  try {
    buffer = pinned_host_bytes(device, std::max<int64_t>(bytes, 1), for_what);
  } catch (const Error& error) {
    throw Error(error.code(), std::string(error.what()) + ". Free host memory, or set " + for_what + ": false");
  }
  host_ = typed_view(buffer, 0, source.sizes(), source.scalar_type());
  host_.copy_(source);
}

void HostResidentWeight::prefetch(const torch::Device& device, int64_t pieces) {
  if (device.is_cpu()) {
    throw Error(ErrorCode::kInternal, "a host-resident weight was prefetched to the CPU, where it already is");
  }
  if (on_device_.defined() && on_device_.device() == device) return;
  // Allocated on the current stream, so that the block returns to its pool once the consumers,
  // which run there, let go of it; the first piece's copy waits for the work that last used it.
  on_device_ = torch::empty_like(host_, host_.options().device(device));
  piece_rows_ = (rows() + std::max<int64_t>(pieces, 1) - 1) / std::max<int64_t>(pieces, 1);
  queued_rows_ = 0;
  continue_prefetch();
}

void HostResidentWeight::continue_prefetch() {
  if (!on_device_.defined() || queued_rows_ >= rows()) return;
  const auto device = on_device_.device();
  if (host_.dim() == 0) {
    copy_after_compute(on_device_, host_, device, CopyLane::kPrefetch);
    queued_rows_ = 1;
  } else {
    const int64_t end = std::min(rows(), queued_rows_ + piece_rows_);
    copy_after_compute(on_device_.slice(0, queued_rows_, end), host_.slice(0, queued_rows_, end), device, CopyLane::kPrefetch);
    queued_rows_ = end;
  }
  arrived_.record(device, CopyLane::kPrefetch);
}

void HostResidentWeight::queue_tile(const torch::Device& device, int64_t begin, int64_t end) {
  Tile tile;
  tile.begin = begin;
  tile.end = end;
  // As prefetch(): allocated on the current stream, where the loss uses and frees it.
  tile.rows = torch::empty({end - begin, host_.size(1)}, host_.options().device(device));
  copy_after_compute(tile.rows, host_.slice(0, begin, end), device, CopyLane::kPrefetch);
  tile.arrived.record(device, CopyLane::kPrefetch);
  tiles_.push_back(std::move(tile));
}

void HostResidentWeight::prefetch_tiles(const torch::Device& device, int64_t rows, int64_t count) {
  if (host_.dim() != 2 || rows <= 0) {
    throw Error(ErrorCode::kInternal, "a host-resident weight's tiles were asked of a weight that is not a matrix, or of no rows");
  }
  int64_t begin = tiles_.empty() ? 0 : tiles_.back().end;
  for (int64_t queued = 0; queued < count && begin < host_.size(0); ++queued, begin += rows) {
    queue_tile(device, begin, std::min(host_.size(0), begin + rows));
  }
}

torch::Tensor HostResidentWeight::take_rows(const torch::Device& device, int64_t begin, int64_t end, int64_t ahead) {
  if (host_.dim() != 2 || begin < 0 || end <= begin || end > host_.size(0)) {
    throw Error(ErrorCode::kInternal, "rows " + std::to_string(begin) + ".." + std::to_string(end) +
                                          " were asked of a host-resident weight of " + std::to_string(host_.size(0)));
  }
  while (!tiles_.empty() && tiles_.front().begin < begin) tiles_.pop_front();  // walked past
  if (!tiles_.empty() && (tiles_.front().begin != begin || tiles_.front().end != end)) tiles_.clear();  // other tiles
  if (tiles_.empty()) queue_tile(device, begin, end);
  Tile tile = std::move(tiles_.front());
  tiles_.pop_front();
  tile.arrived.wait(device);
  for (int64_t next = tiles_.empty() ? end : tiles_.back().end;
       static_cast<int64_t>(tiles_.size()) < ahead && next < host_.size(0); next += end - begin) {
    queue_tile(device, next, std::min(host_.size(0), next + (end - begin)));
  }
  return tile.rows;
}

torch::Tensor HostResidentWeight::take(const torch::Device& device) {
  tiles_.clear();  // taken whole: queued tiles will not be asked for
  prefetch(device);
  while (queued_rows_ < rows()) continue_prefetch();
  arrived_.wait(device);
  auto taken = std::move(on_device_);
  on_device_ = torch::Tensor();
  return taken;
}

}  // namespace qtrain::trainer
