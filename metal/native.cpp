// tiered's native launcher: CUDA kernels as one MLX primitive that may update its inputs in
// place (built and loaded by tiered/metal/native.py; see its docstring for why).
//
// A program is one or more launches of already-compiled kernels (CUfunction handles from
// load_function) over one parameter list: the 64-bit integers, then the device address of every
// new output, then of the first n_read inputs (the inputs after those are only waited for). An
// output either gets a fresh buffer or aliases an input (the kernel writes that input in place). Every launch declares to MLX's CUDA command
// encoder each input as read and each new output and each written input as written, so the CUDA
// graph orders it after their last writers, later readers after it, and the program's launches
// one after another.
//
// The CUDA side of MLX is reached through dlsym, not linked: the module then loads on every MLX
// build (the CPU one has no such symbols) and says with cuda_ready() whether it can launch.

#include <dlfcn.h>

#include <array>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

namespace nb = nanobind;
using namespace mlx::core;

namespace {

struct Dim3 {  // the layout of CUDA's dim3 (three unsigned ints), passed by value
  unsigned x, y, z;
};
struct CUfuncOpaque;  // CUfunc_st
using CUfunction = CUfuncOpaque*;

// mlx::core::cu entry points and the driver calls, found at run time
struct Cuda {
  void* (*get_command_encoder)(Stream) = nullptr;
  void (*set_input_array)(void*, const array&) = nullptr;
  void (*set_output_array)(void*, const array&) = nullptr;
  void (*add_kernel_node)(void*, CUfunction, Dim3, Dim3, Dim3, unsigned, void**) = nullptr;
  void* (*device_of)(Device) = nullptr;
  void (*make_current)(void*) = nullptr;
  int (*module_load_data)(void**, const void*) = nullptr;
  int (*module_get_function)(CUfunction*, void*, const char*) = nullptr;
  int (*func_set_attribute)(CUfunction, int, int) = nullptr;
  std::string missing;

  Cuda() {
    auto find = [this](auto& fn, void* lib, const char* name) {
      void* p = dlsym(lib, name);
      if (p == nullptr && missing.empty()) missing = name;
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
    };
    void* self = RTLD_DEFAULT;  // libmlx.so is loaded by `import mlx.core`
    find(get_command_encoder, self, "_ZN3mlx4core2cu19get_command_encoderENS0_6StreamE");
    find(set_input_array, self, "_ZN3mlx4core2cu14CommandEncoder15set_input_arrayERKNS0_5arrayE");
    find(set_output_array, self,
         "_ZN3mlx4core2cu14CommandEncoder16set_output_arrayERKNS0_5arrayE");
    find(add_kernel_node, self,
         "_ZN3mlx4core2cu14CommandEncoder19add_kernel_node_rawEP9CUfunc_st4dim3S5_S5_jPPv");
    find(device_of, self, "_ZN3mlx4core2cu6deviceENS0_6DeviceE");
    find(make_current, self, "_ZN3mlx4core2cu6Device12make_currentEv");
    void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (driver == nullptr) {
      if (missing.empty()) missing = "libcuda.so.1";
      return;
    }
    find(module_load_data, driver, "cuModuleLoadData");
    find(module_get_function, driver, "cuModuleGetFunction");
    find(func_set_attribute, driver, "cuFuncSetAttribute");
  }
  bool ready() const {
    return missing.empty();
  }
};

Cuda& cuda() {
  static Cuda c;
  return c;
}

void* device_address(const array& x) {
  // mlx::core::cu::CudaBuffer begins with the device pointer (backend/cuda/allocator.h)
  void* buf = x.buffer().ptr();
  if (buf == nullptr) return nullptr;
  return static_cast<char*>(*static_cast<void**>(buf)) + x.offset();
}

struct Launch {
  uintptr_t function;
  std::array<unsigned, 3> blocks;   // grid, in blocks
  std::array<unsigned, 3> threads;  // block
  unsigned shared_bytes;
};

class Program : public Primitive {
 public:
  Program(Stream s, std::vector<Launch> launches, int n_read, std::vector<int> aliases,
          std::vector<int> written, std::vector<int64_t> ints)
      : Primitive(s),
        launches_(std::move(launches)),
        n_read_(n_read),
        aliases_(std::move(aliases)),
        written_(std::move(written)),
        ints_(std::move(ints)) {}

  void eval_cpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("[tiered.native] programs run only on MLX's CUDA backend");
  }

  void eval_gpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    Cuda& c = cuda();
    if (!c.ready()) throw std::runtime_error("[tiered.native] not on MLX's CUDA backend");
    for (int i = 0; i < n_read_; ++i) {
      if (inputs[i].size() && !inputs[i].flags().row_contiguous)
        throw std::runtime_error("[tiered.native] an input is not row-contiguous");
    }
    for (size_t o = 0; o < outputs.size(); ++o) {
      if (aliases_[o] >= 0) {
        outputs[o].copy_shared_buffer(inputs[aliases_[o]]);
      } else {
        outputs[o].set_data(allocator::malloc(outputs[o].nbytes()));
      }
    }
    std::vector<uint64_t> values;
    values.reserve(ints_.size() + outputs.size() + n_read_);
    for (int64_t v : ints_) values.push_back(static_cast<uint64_t>(v));
    for (size_t o = 0; o < outputs.size(); ++o) {
      if (aliases_[o] < 0)
        values.push_back(reinterpret_cast<uint64_t>(device_address(outputs[o])));
    }
    for (int i = 0; i < n_read_; ++i)
      values.push_back(reinterpret_cast<uint64_t>(device_address(inputs[i])));
    std::vector<void*> params(values.size());
    for (size_t i = 0; i < values.size(); ++i) params[i] = &values[i];

    void* enc = c.get_command_encoder(stream());
    for (const Launch& l : launches_) {
      for (const array& x : inputs) {
        if (x.buffer().ptr() != nullptr) c.set_input_array(enc, x);
      }
      for (int w : written_) c.set_output_array(enc, inputs[w]);
      for (size_t o = 0; o < outputs.size(); ++o) {
        if (aliases_[o] < 0 && outputs[o].buffer().ptr() != nullptr)
          c.set_output_array(enc, outputs[o]);
      }
      c.add_kernel_node(enc, reinterpret_cast<CUfunction>(l.function),
                        Dim3{l.blocks[0], l.blocks[1], l.blocks[2]},
                        Dim3{l.threads[0], l.threads[1], l.threads[2]}, Dim3{1, 1, 1},
                        l.shared_bytes, params.data());
    }
  }

  const char* name() const override {
    return "TieredNativeProgram";
  }

 private:
  std::vector<Launch> launches_;
  int n_read_;
  std::vector<int> aliases_;
  std::vector<int> written_;
  std::vector<int64_t> ints_;
};

uintptr_t load_function(nb::bytes image, const std::string& name, unsigned shared_bytes) {
  Cuda& c = cuda();
  if (!c.ready()) throw std::runtime_error("[tiered.native] not on MLX's CUDA backend: " + c.missing);
  c.make_current(c.device_of(Device(Device::gpu, 0)));
  std::string data(image.c_str(), image.size());
  data.push_back('\0');  // PTX is read as a C string; a cubin ignores the extra byte
  void* module = nullptr;
  if (int err = c.module_load_data(&module, data.data()); err != 0)
    throw std::runtime_error("[tiered.native] cuModuleLoadData failed: " + std::to_string(err));
  CUfunction fn = nullptr;
  if (int err = c.module_get_function(&fn, module, name.c_str()); err != 0)
    throw std::runtime_error("[tiered.native] no kernel " + name + ": " + std::to_string(err));
  if (shared_bytes > 48 * 1024) {
    const int max_dynamic_shared = 8;  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    c.func_set_attribute(fn, max_dynamic_shared, static_cast<int>(shared_bytes));
  }
  return reinterpret_cast<uintptr_t>(fn);  // the module stays loaded for the process
}

std::vector<array> run(const std::vector<Launch>& launches, const std::vector<array>& inputs,
                       int n_read, const std::vector<std::vector<int>>& out_shapes,
                       const std::vector<Dtype>& out_dtypes, const std::vector<int>& aliases,
                       const std::vector<int>& written, const std::vector<int64_t>& ints,
                       Stream stream) {
  if (launches.empty()) throw std::invalid_argument("[tiered.native] no launch");
  if (n_read < 0 || n_read > static_cast<int>(inputs.size()))
    throw std::invalid_argument("[tiered.native] n_read is not a count of the inputs");
  if (out_shapes.empty() || out_shapes.size() != out_dtypes.size() ||
      out_shapes.size() != aliases.size())
    throw std::invalid_argument("[tiered.native] outputs: shapes, dtypes and aliases differ in number");
  std::vector<Shape> shapes;
  for (size_t o = 0; o < out_shapes.size(); ++o) {
    Shape s(out_shapes[o].begin(), out_shapes[o].end());
    int a = aliases[o];
    if (a >= static_cast<int>(inputs.size()))
      throw std::invalid_argument("[tiered.native] an alias names no input");
    if (a >= 0) {
      if (inputs[a].shape() != s || inputs[a].dtype() != out_dtypes[o])
        throw std::invalid_argument("[tiered.native] an alias differs from its input's shape or dtype");
      bool listed = false;
      for (int w : written) listed |= w == a;
      if (!listed) throw std::invalid_argument("[tiered.native] an aliased input is not written");
    }
    shapes.push_back(std::move(s));
  }
  for (int w : written) {
    if (w < 0 || w >= static_cast<int>(inputs.size()))
      throw std::invalid_argument("[tiered.native] a written index names no input");
  }
  for (const Launch& l : launches) {
    if (l.function == 0) throw std::invalid_argument("[tiered.native] a launch has no kernel");
  }
  auto prim = std::make_shared<Program>(stream, launches, n_read, aliases, written, ints);
  return array::make_arrays(std::move(shapes), out_dtypes, prim, inputs);
}

}  // namespace

NB_MODULE(_tiered_native, m) {
  m.doc() = "tiered's native launcher (tiered/metal/native.py)";
  m.def("cuda_ready", []() { return cuda().ready(); });
  m.def("cuda_missing", []() { return cuda().missing; });
  m.def("load_function", &load_function, nb::arg("image"), nb::arg("name"),
        nb::arg("shared_bytes") = 0);
  nb::class_<Launch>(m, "Launch")
      .def(nb::init<uintptr_t, std::array<unsigned, 3>, std::array<unsigned, 3>, unsigned>(),
           nb::arg("function"), nb::arg("blocks"), nb::arg("threads"),
           nb::arg("shared_bytes") = 0)
      .def_ro("function", &Launch::function)
      .def_ro("blocks", &Launch::blocks)
      .def_ro("threads", &Launch::threads);
  m.def("run", &run, nb::arg("launches"), nb::arg("inputs"), nb::arg("n_read"),
        nb::arg("out_shapes"),
        nb::arg("out_dtypes"), nb::arg("aliases"), nb::arg("written"), nb::arg("ints"),
        nb::arg("stream"));
}
