#pragma once
// The training data loader: a BatchStream run ahead on a background thread, so that the next
// batches are collated while the model computes. The order is the stream's alone; the thread
// only changes when the work happens, so a run with prefetching sees exactly the batches of
// a run without.
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

#include "data/batching.h"

namespace qtrain::data {

class DataLoader {
 public:
  // prefetch_batches 0: no thread, batches are made on demand.
  DataLoader(BatchStream stream, int64_t prefetch_batches);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // Rethrows an error the background thread ran into.
  Batch next();
  // The position after the last batch next() returned (what a checkpoint saves).
  LoaderState state() const;
  void restore(const LoaderState& state);
  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  int64_t epoch() const { return state().epoch; }

 private:
  struct Prepared {
    Batch batch;
    LoaderState after;
  };
  void start();
  void stop();
  void produce();

  BatchStream stream_;  // touched by the producer thread only while it runs
  const int64_t prefetch_batches_;
  const int64_t batches_per_epoch_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Prepared> ready_;
  std::exception_ptr failure_;
  bool stopping_ = false;
  LoaderState consumed_;
  std::thread producer_;
};

}  // namespace qtrain::data
