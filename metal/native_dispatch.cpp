// tiered's dispatcher thread in C++ (tiered/runtime/dispatch.py: NativeDispatch).
//
// The Python dispatcher thread ran mx.async_eval on what the main thread handed it, and needed
// the GIL between hand-offs: on an H200 (py-spy, 32k, Llama-3-8B shape) it spent ~3/4 of its
// time waiting for the GIL, and the main thread, made to hand it over every 20 us, built its
// graphs 1.5-2.3x slower. This thread never takes the GIL: it pops arrays from a queue and
// calls mlx::core::async_eval on them, in order. An error is kept for the main thread's next
// drain; arrays made on another thread's stream ("in current thread") are handed back whole
// to be evaluated there.

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "mlx/array.h"
#include "mlx/transforms.h"

namespace nb = nanobind;
using namespace mlx::core;

namespace {

class Dispatch {
 public:
  ~Dispatch() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    work_.notify_all();
    if (thread_.joinable()) thread_.join();  // it stops once the evaluation in hand is done
  }

  // Queue async_eval(arrays); returns the submission's ticket (1, 2, ...)
  uint64_t submit(std::vector<array> arrays) {
    std::lock_guard<std::mutex> l(mu_);
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
    queue_.emplace_back(++submitted_, std::move(arrays));
    work_.notify_one();
    return submitted_;
  }

  bool handed(uint64_t ticket) {
    std::lock_guard<std::mutex> l(mu_);
    return handed_ >= ticket;
  }

  // Wait (the GIL released) until the submission of `ticket` and all before it were handed
  // over; 0: everything submitted so far. Returns the seconds waited.
  double wait(uint64_t ticket) {
    auto t0 = std::chrono::steady_clock::now();
    {
      nb::gil_scoped_release nogil;
      std::unique_lock<std::mutex> l(mu_);
      uint64_t until = ticket == 0 ? submitted_ : ticket;
      done_.wait(l, [&] { return handed_ >= until; });
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  uint64_t queued() {
    std::lock_guard<std::mutex> l(mu_);
    return submitted_ - handed_;
  }

  // (error kind, message, arrays handed back), cleared. Kind: "" none, "value", "runtime"
  std::tuple<std::string, std::string, std::vector<array>> take() {
    std::lock_guard<std::mutex> l(mu_);
    auto got = std::make_tuple(kind_, error_, std::move(left_));
    kind_.clear();
    error_.clear();
    left_.clear();
    return got;
  }

  bool failed() {  // an error kept, or arrays handed back, not yet taken
    std::lock_guard<std::mutex> l(mu_);
    return !kind_.empty() || !left_.empty();
  }

  double busy_s() {
    std::lock_guard<std::mutex> l(mu_);
    return busy_s_;
  }

 private:
  void run() {
    for (;;) {
      std::pair<uint64_t, std::vector<array>> item;
      bool skip;
      {
        std::unique_lock<std::mutex> l(mu_);
        work_.wait(l, [&] { return stop_ || !queue_.empty(); });
        if (stop_) return;
        item = std::move(queue_.front());
        queue_.pop_front();
        skip = !kind_.empty() || !left_.empty();
        if (skip && kind_.empty())  // the main thread takes the rest of the step
          left_.insert(left_.end(), item.second.begin(), item.second.end());
      }
      if (!skip) {
        std::string kind, what;
        auto t0 = std::chrono::steady_clock::now();
        try {
          async_eval(item.second);
        } catch (const std::invalid_argument& e) {
          kind = "value", what = e.what();
        } catch (const std::exception& e) {
          kind = "runtime", what = e.what();
        }
        double spent = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::lock_guard<std::mutex> l(mu_);
        busy_s_ += spent;
        if (what.find("in current thread") != std::string::npos) {
          left_.insert(left_.end(), item.second.begin(), item.second.end());
        } else if (!kind.empty() && kind_.empty()) {
          kind_ = kind, error_ = what;
        }
      }
      item.second.clear();  // the arrays' references dropped here, as the Python thread did
      {
        std::lock_guard<std::mutex> l(mu_);
        handed_ = item.first;
      }
      done_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable work_, done_;
  std::deque<std::pair<uint64_t, std::vector<array>>> queue_;
  uint64_t submitted_ = 0, handed_ = 0;
  std::string kind_, error_;
  std::vector<array> left_;
  double busy_s_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace

void bind_dispatch(nb::module_& m) {
  nb::class_<Dispatch>(m, "Dispatch")
      .def(nb::init<>())
      .def("submit", &Dispatch::submit)
      .def("handed", &Dispatch::handed)
      .def("wait", &Dispatch::wait, nb::arg("ticket") = 0)
      .def("queued", &Dispatch::queued)
      .def("take", &Dispatch::take)
      .def("failed", &Dispatch::failed)
      .def("busy_s", &Dispatch::busy_s);
}
