#include "trainer/dist/process_group.h"

#include <cstdlib>
#include <sstream>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef QTRAIN_WITH_GLOO
#define USE_C10D_GLOO 1
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#ifdef QTRAIN_WITH_NCCL
#define USE_C10D_NCCL 1
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "kernels/error.h"

namespace qtrain::trainer {

namespace {

constexpr std::chrono::milliseconds kHeartbeatPeriod{1000};
// A rank whose heartbeat counter stood still this long is taken for dead while we wait on NCCL.
constexpr std::chrono::milliseconds kPeerSilence{3 * kHeartbeatPeriod};

std::string heartbeat_key(int64_t rank) { return "heartbeat/" + std::to_string(rank); }
std::string failure_key(int64_t rank) { return "failed/" + std::to_string(rank); }

std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

bool is_loopback(const std::string& address) {
  return address == "localhost" || address.rfind("127.", 0) == 0 || address == "::1";
}

#ifdef QTRAIN_WITH_GLOO
c10::intrusive_ptr<c10d::Backend> make_gloo(const c10::intrusive_ptr<c10d::Store>& store,
                                            const LaunchEnvironment& environment, std::chrono::seconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create();
  options->timeout = timeout;
  // The interface others reach this rank on: GLOO_SOCKET_IFNAME as in PyTorch, the loopback
  // for a run on one machine, else the address the host name resolves to.
  if (const char* interface = std::getenv("GLOO_SOCKET_IFNAME"); interface != nullptr && *interface != '\0') {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(interface));
  } else if (is_loopback(environment.master_addr)) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  } else {
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(environment.rank),
                                                     static_cast<int>(environment.world_size), options);
}
#else
c10::intrusive_ptr<c10d::Backend> make_gloo(const c10::intrusive_ptr<c10d::Store>&, const LaunchEnvironment&,
                                            std::chrono::seconds) {
  throw Error(ErrorCode::kDistributed, "this qtrain was built without Gloo (libgloo-dev was missing): it cannot run on several CPU "
              "processes; install libgloo-dev and rebuild (tools/setup.sh)");
}
#endif

#ifdef QTRAIN_WITH_NCCL
c10::intrusive_ptr<c10d::Backend> make_nccl(const c10::intrusive_ptr<c10d::Store>& store,
                                            const LaunchEnvironment& environment, std::chrono::seconds timeout) {
  // Without blocking waits NCCL's wait() only orders streams, and a dead peer is found by a
  // watchdog that aborts the process; blocking waits throw at the timeout, which we report.
  setenv("TORCH_NCCL_BLOCKING_WAIT", "1", /*overwrite=*/0);
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, static_cast<int>(environment.rank),
                                                     static_cast<int>(environment.world_size), options);
}
#else
c10::intrusive_ptr<c10d::Backend> make_nccl(const c10::intrusive_ptr<c10d::Store>&, const LaunchEnvironment&,
                                            std::chrono::seconds) {
  throw Error(ErrorCode::kDistributed, "this qtrain was built without NCCL (no CUDA toolkit or nccl.h at build time): it cannot run on "
              "several GPUs; rebuild on a machine with CUDA");
}
#endif

}  // namespace

ProcessGroup::ProcessGroup(const LaunchEnvironment& environment, const torch::Device& device,
                           const ProcessGroupOptions& options)
    : rank_(environment.rank),
      world_size_(environment.world_size),
      device_(device),
      address_(environment.master_addr + ":" + std::to_string(environment.master_port)),
      agent_store_(environment.agent_store),
      timeout_(options.timeout) {
  backend_name_ = options.backend == "auto" ? (device.is_cuda() ? "nccl" : "gloo") : options.backend;
  if (backend_name_ == "nccl" && !device.is_cuda()) {
    throw Error(ErrorCode::kDistributed, "dist.backend nccl needs train.device cuda; use gloo for a run on CPUs");
  }
  if (backend_name_ == "gloo" && device.is_cuda()) {
    throw Error(ErrorCode::kDistributed, "dist.backend gloo reduces CPU tensors; with train.device cuda use nccl (or auto)");
  }
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(environment.master_port);
  store_options.isServer = environment.rank == 0 && !environment.agent_store;
  store_options.numWorkers = static_cast<std::size_t>(environment.world_size);
  store_options.timeout = timeout_;
  try {
    auto tcp_store = c10::make_intrusive<c10d::TCPStore>(environment.master_addr, store_options);
    // torchrun keeps its store across restarts: each attempt gets keys of its own.
    store_ = c10::make_intrusive<c10d::PrefixStore>("qtrain/" + std::to_string(environment.restart_count), tcp_store);
    backend_ = backend_name_ == "gloo" ? make_gloo(store_, environment, timeout_) : make_nccl(store_, environment, timeout_);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& error) {
    throw Error(ErrorCode::kDistributed, "rank " + std::to_string(rank_) + ": the rendezvous at " + address_ + " failed: not all " +
                std::to_string(world_size_) + " ranks joined within dist.timeout_s (" +
                std::to_string(timeout_.count()) + " s), or the address is not reachable. Start every rank with the "
                "same MASTER_ADDR, MASTER_PORT and world size. (" + first_line(error.what()) + ")");
  }
  heartbeat_ = std::thread([this] { beat_heart(); });
}

ProcessGroup::~ProcessGroup() {
  stopping_ = true;
  if (heartbeat_.joinable()) heartbeat_.join();
}

void ProcessGroup::beat_heart() {
  while (!stopping_) {
    try {
      store_->add(heartbeat_key(rank_), 1);
    } catch (const std::exception&) {
      return;  // the store (rank 0) is gone; the next collective reports it
    }
    for (auto slept = std::chrono::milliseconds(0); slept < kHeartbeatPeriod && !stopping_;
         slept += std::chrono::milliseconds(50)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
}

void ProcessGroup::fail(const std::string& what, const std::string& cause) {
  std::ostringstream message;
  message << "rank " << rank_ << ": " << what << " failed";
  try {
    store_->set(failure_key(rank_), what + ": " + first_line(cause));
    // A live rank's counter moves within a heartbeat period; read them twice, three periods apart.
    std::vector<int64_t> before;
    for (int64_t rank = 0; rank < world_size_; ++rank) before.push_back(store_->add(heartbeat_key(rank), 0));
    std::this_thread::sleep_for(3 * kHeartbeatPeriod);
    std::vector<std::string> stopped;
    for (int64_t rank = 0; rank < world_size_; ++rank) {
      if (rank == rank_ || store_->add(heartbeat_key(rank), 0) != before[rank]) continue;
      std::string entry = "rank " + std::to_string(rank);
      if (store_->check({failure_key(rank)})) {
        const auto reason = store_->get(failure_key(rank));
        entry += " (it failed: " + std::string(reason.begin(), reason.end()) + ")";
      } else {
        entry += " (killed or crashed: see its log)";
      }
      stopped.push_back(entry);
    }
    if (stopped.empty()) {
      message << ", and every rank is still alive: one is stuck or slower than dist.timeout_s (" << timeout_.count()
              << " s)";
    } else {
      message << " because ";
      for (size_t index = 0; index < stopped.size(); ++index) message << (index ? ", " : "") << stopped[index];
      message << " stopped";
    }
  } catch (const std::exception&) {
    if (agent_store_) {
      message << " because torchrun's agent, which serves the rendezvous store at " << address_
              << ", ended this attempt (a rank failed or was stopped: see the other ranks' logs; with "
                 "--max-restarts torchrun starts the job again and --resume auto continues from the last checkpoint)";
    } else {
      message << " because rank 0, which serves the rendezvous store at " << address_
              << ", is gone (killed or crashed: see its log)";
    }
  }
  message << ". [" << first_line(cause) << "]";
  throw Error(ErrorCode::kDistributed, message.str());
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::start_sum(torch::Tensor& tensor) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  options.timeout = timeout_;
  try {
    return backend_->allreduce(tensors, options);
  } catch (const std::exception& error) {
    fail("all-reduce", error.what());
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroup::start_gather(torch::Tensor& tensor, torch::Tensor& gathered) {
  std::vector<at::Tensor> inputs{tensor};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int64_t rank = 0; rank < world_size_; ++rank) outputs[0].push_back(gathered[rank]);
  c10d::AllgatherOptions options;
  options.timeout = timeout_;
  try {
    return backend_->allgather(outputs, inputs, options);
  } catch (const std::exception& error) {
    fail("all-gather", error.what());
  }
}

void ProcessGroup::wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) {
  if (backend_name_ == "nccl") watch_peers_until_done(work, what);
  try {
    work->wait(timeout_);
  } catch (const std::exception& error) {
    fail(what, error.what());
  }
}

// Gloo sees a dead peer's closed socket at once; NCCL does not see processes at all, and its
// collective with a dead rank waits on the GPU until the timeout, while torchrun ends this rank
// after 30 s without a word. So we poll the work and, once a heartbeat period, the other ranks'
// counters: a rank that fell silent is named within seconds, and the communicator is aborted so
// that nothing waits on it at exit.
void ProcessGroup::watch_peers_until_done(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto next_look = start + kHeartbeatPeriod;
  std::vector<int64_t> counters(world_size_, -1);
  std::vector<Clock::time_point> last_moved(world_size_, start);
  auto abort_and_fail = [&](const std::string& cause) {
    try {
      backend_->abort();
    } catch (const std::exception&) {
      // already broken: the failure below is what the user needs
    }
    fail(what, cause);
  };
  for (int64_t polls = 0; !work->isCompleted(); ++polls) {
    // Most collectives end within microseconds of being waited on: spin briefly, then sleep.
    if (polls > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
    const auto now = Clock::now();
    if (now - start > timeout_) abort_and_fail("no answer within dist.timeout_s");
    if (now < next_look) continue;
    next_look = now + kHeartbeatPeriod;
    std::vector<int64_t> silent;
    try {
      for (int64_t rank = 0; rank < world_size_; ++rank) {
        if (rank == rank_) continue;
        const int64_t counter = store_->add(heartbeat_key(rank), 0);
        if (counter != counters[rank]) {
          counters[rank] = counter;
          last_moved[rank] = now;
        } else if (now - last_moved[rank] > kPeerSilence) {
          silent.push_back(rank);
        }
      }
    } catch (const std::exception& error) {
      abort_and_fail(error.what());
    }
    if (!silent.empty()) abort_and_fail("rank " + std::to_string(silent.front()) + "'s heartbeat stopped");
  }
}

std::vector<double> ProcessGroup::sum(const std::vector<double>& values, const std::string& what) {
  auto tensor = torch::tensor(values, torch::TensorOptions().dtype(torch::kFloat64)).to(device_);
  wait(start_sum(tensor), what);
  tensor = tensor.cpu();
  return std::vector<double>(tensor.data_ptr<double>(), tensor.data_ptr<double>() + tensor.numel());
}

std::vector<double> ProcessGroup::every_rank(double value, const std::string& what) {
  std::vector<double> own(static_cast<size_t>(world_size_), 0.0);  // a sum of one value each
  own[static_cast<size_t>(rank_)] = value;
  return sum(own, what);
}

void ProcessGroup::broadcast(std::vector<torch::Tensor>& tensors, int64_t root, const std::string& what) {
  c10d::BroadcastOptions options;
  options.rootRank = root;
  options.timeout = timeout_;
  for (auto& tensor : tensors) {
    std::vector<at::Tensor> one{tensor};
    try {
      wait(backend_->broadcast(one, options), what);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& error) {
      fail(what, error.what());
    }
  }
}

void ProcessGroup::barrier(const std::string& what) { sum({1.0}, what); }

}  // namespace qtrain::trainer
