#include "data/loader.h"

namespace qtrain::data {

DataLoader::DataLoader(BatchStream stream, int64_t prefetch_batches)
    : stream_(std::move(stream)),
      prefetch_batches_(std::max<int64_t>(prefetch_batches, 0)),
      batches_per_epoch_(stream_.batches_per_epoch()),
      consumed_(stream_.state()) {
  start();
}

DataLoader::~DataLoader() { stop(); }

void DataLoader::start() {
  if (prefetch_batches_ == 0) return;
  stopping_ = false;
  producer_ = std::thread([this] { produce(); });
}

void DataLoader::stop() {
  if (!producer_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  producer_.join();
}

void DataLoader::produce() {
  try {
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [&] { return stopping_ || static_cast<int64_t>(ready_.size()) < prefetch_batches_; });
        if (stopping_) return;
      }
      Prepared prepared{stream_.next(), {}};
      prepared.after = stream_.state();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ready_.push_back(std::move(prepared));
      }
      changed_.notify_all();
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    failure_ = std::current_exception();
    changed_.notify_all();
  }
}

Batch DataLoader::next() {
  if (prefetch_batches_ == 0) {
    Batch batch = stream_.next();
    consumed_ = stream_.state();
    return batch;
  }
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return !ready_.empty() || failure_; });
  if (ready_.empty()) std::rethrow_exception(failure_);
  Prepared prepared = std::move(ready_.front());
  ready_.pop_front();
  consumed_ = prepared.after;
  lock.unlock();
  changed_.notify_all();
  return std::move(prepared.batch);
}

LoaderState DataLoader::state() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return consumed_;
}

void DataLoader::restore(const LoaderState& state) {
  stop();
  ready_.clear();
  failure_ = nullptr;
  stream_.restore(state);
  consumed_ = stream_.state();
  start();
}

}  // namespace qtrain::data
