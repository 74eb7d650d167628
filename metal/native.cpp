// tiered's native launcher: CUDA kernels as one MLX primitive that may update its inputs in
// place (built and loaded by tiered/metal/native.py; see its docstring for why).
//
// A program is one or more launches of already-compiled kernels (CUfunction handles from
// load_function), each with its own argument list: literal integers or floats, the device
// address of an input or an output, or an input's shape, strides or ndim as MLX's custom kernels
// take them (cuda::std::array<int32_t, 10>, <int64_t, 10>, int). An output either gets a fresh
// buffer or aliases an input (the kernel writes that input in place). Inputs named as
// contiguous are copied first where they are not row-contiguous (MLX's custom kernels do the
// same), into buffers kept until the GPU is done with them. Every launch declares to MLX's CUDA
// command encoder each input as read and each new output and each written input as written, so
// the CUDA graph orders it after their last writers, later readers after it, and the program's
// launches one after another.
//
// The CUDA side of MLX is reached through dlsym, not linked: the module then loads on every MLX
// build (the CPU one has no such symbols) and says with cuda_ready() whether it can launch.

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <functional>
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

constexpr int MAX_NDIM = 10;  // mlx/backend/cuda/device/config.h: Shape and Strides hold 10

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
  void (*add_completed_handler)(void*, std::function<void()>) = nullptr;
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
    find(add_completed_handler, self,
         "_ZN3mlx4core2cu14CommandEncoder21add_completed_handlerESt8functionIFvvEE");
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

// What one kernel parameter is (native.py's Arg helpers build them)
enum Kind : int { INT64 = 0, INT32 = 1, FLOAT32 = 2, INPUT = 3, OUTPUT = 4, SHAPE = 5,
                  STRIDES = 6, NDIM = 7 };
using Arg = std::tuple<int, int64_t>;  // (kind, literal value or input / output index)

struct Launch {
  uintptr_t function;
  std::array<unsigned, 3> blocks;   // grid, in blocks
  std::array<unsigned, 3> threads;  // block
  unsigned shared_bytes;
  std::vector<Arg> args;
};

// A parameter's bytes, as large as the largest (Strides: 10 int64)
using Slot = std::array<int64_t, MAX_NDIM>;

void put(Slot& slot, int kind, int64_t v, const std::vector<array>& inputs,
         const std::vector<array>& outputs) {
  slot.fill(0);
  switch (kind) {
    case INT64: slot[0] = v; break;
    case INT32: { int32_t x = static_cast<int32_t>(v); std::memcpy(slot.data(), &x, 4); break; }
    case FLOAT32: {  // the float's bits, sent as an integer
      uint32_t x = static_cast<uint32_t>(v); std::memcpy(slot.data(), &x, 4); break;
    }
    case INPUT: slot[0] = reinterpret_cast<int64_t>(device_address(inputs.at(v))); break;
    case OUTPUT: slot[0] = reinterpret_cast<int64_t>(device_address(outputs.at(v))); break;
    case SHAPE: {
      const auto& sh = inputs.at(v).shape();
      if (sh.size() > MAX_NDIM) throw std::runtime_error("[tiered.native] more than 10 dims");
      int32_t x[MAX_NDIM] = {};
      for (size_t i = 0; i < sh.size(); ++i) x[i] = sh[i];
      std::memcpy(slot.data(), x, sizeof(x));
      break;
    }
    case STRIDES: {
      const auto& st = inputs.at(v).strides();
      if (st.size() > MAX_NDIM) throw std::runtime_error("[tiered.native] more than 10 dims");
      for (size_t i = 0; i < st.size(); ++i) slot[i] = st[i];
      break;
    }
    case NDIM: {
      int32_t x = static_cast<int32_t>(inputs.at(v).ndim()); std::memcpy(slot.data(), &x, 4);
      break;
    }
    default: throw std::runtime_error("[tiered.native] unknown argument kind");
  }
}

// Kernels that copy a strided input into a row-contiguous buffer, by element size (1, 2, 4,
// 8 bytes): (const T* in, T* out, Shape, Strides, int ndim, long long n); set by native.py
std::array<uintptr_t, 4> copy_functions{};

int log2_size(size_t bytes) {
  switch (bytes) {
    case 1: return 0; case 2: return 1; case 4: return 2; case 8: return 3;
    default: throw std::runtime_error("[tiered.native] no copy for this element size");
  }
}

class Program : public Primitive {
 public:
  Program(Stream s, std::vector<Launch> launches, std::vector<int> contiguous,
          std::vector<int> aliases, std::vector<int> written)
      : Primitive(s),
        launches_(std::move(launches)),
        contiguous_(std::move(contiguous)),
        aliases_(std::move(aliases)),
        written_(std::move(written)) {}

  void eval_cpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("[tiered.native] programs run only on MLX's CUDA backend");
  }

  void eval_gpu(const std::vector<array>& given, std::vector<array>& outputs) override {
    Cuda& c = cuda();
    if (!c.ready()) throw std::runtime_error("[tiered.native] not on MLX's CUDA backend");
    void* enc = c.get_command_encoder(stream());
    std::vector<array> inputs = given;
    std::vector<array> copies;
    for (int i : contiguous_) {
      const array& x = given[i];
      if (x.size() == 0 || x.flags().row_contiguous) continue;
      if (std::find(written_.begin(), written_.end(), i) != written_.end())
        throw std::runtime_error("[tiered.native] an input written in place is not contiguous");
      array y(x.shape(), x.dtype(), nullptr, {});
      y.set_data(allocator::malloc(y.nbytes()));
      copy(enc, x, y);
      inputs[i] = y;
      copies.push_back(y);
    }
    for (size_t o = 0; o < outputs.size(); ++o) {
      if (aliases_[o] >= 0) {
        outputs[o].copy_shared_buffer(given[aliases_[o]]);
      } else {
        outputs[o].set_data(allocator::malloc(outputs[o].nbytes()));
      }
    }
    std::vector<Slot> slots;
    std::vector<void*> params;
    for (const Launch& l : launches_) {
      slots.resize(l.args.size());
      params.resize(l.args.size());
      for (size_t a = 0; a < l.args.size(); ++a) {
        put(slots[a], std::get<0>(l.args[a]), std::get<1>(l.args[a]), inputs, outputs);
        params[a] = slots[a].data();
      }
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
    if (!copies.empty()) c.add_completed_handler(enc, [copies]() {});  // kept until done
  }

  const char* name() const override {
    return "TieredNativeProgram";
  }

 private:
  void copy(void* enc, const array& x, array& y) {
    Cuda& c = cuda();
    uintptr_t fn = copy_functions[log2_size(x.itemsize())];
    if (fn == 0) throw std::runtime_error("[tiered.native] no copy kernel loaded");
    std::vector<array> ins{x}, outs{y};
    std::array<Slot, 6> slots;
    std::array<void*, 6> params;
    const int kinds[6] = {INPUT, OUTPUT, SHAPE, STRIDES, NDIM, INT64};
    for (int a = 0; a < 6; ++a) {
      put(slots[a], kinds[a], a == 5 ? static_cast<int64_t>(x.size()) : 0, ins, outs);
      params[a] = slots[a].data();
    }
    c.set_input_array(enc, x);
    c.set_output_array(enc, y);
    unsigned blocks = static_cast<unsigned>((x.size() + 255) / 256);
    c.add_kernel_node(enc, reinterpret_cast<CUfunction>(fn), Dim3{blocks, 1, 1},
                      Dim3{256, 1, 1}, Dim3{1, 1, 1}, 0, params.data());
  }

  std::vector<Launch> launches_;
  std::vector<int> contiguous_;
  std::vector<int> aliases_;
  std::vector<int> written_;
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
                       const std::vector<std::vector<int>>& out_shapes,
                       const std::vector<Dtype>& out_dtypes, const std::vector<int>& aliases,
                       const std::vector<int>& written, const std::vector<int>& contiguous,
                       Stream stream) {
  const int n_in = static_cast<int>(inputs.size());
  if (launches.empty()) throw std::invalid_argument("[tiered.native] no launch");
  if (out_shapes.empty() || out_shapes.size() != out_dtypes.size() ||
      out_shapes.size() != aliases.size())
    throw std::invalid_argument("[tiered.native] outputs: shapes, dtypes and aliases differ in number");
  std::vector<Shape> shapes;
  for (size_t o = 0; o < out_shapes.size(); ++o) {
    Shape s(out_shapes[o].begin(), out_shapes[o].end());
    int a = aliases[o];
    if (a >= n_in) throw std::invalid_argument("[tiered.native] an alias names no input");
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
    if (w < 0 || w >= n_in) throw std::invalid_argument("[tiered.native] a written index names no input");
  }
  for (int i : contiguous) {
    if (i < 0 || i >= n_in) throw std::invalid_argument("[tiered.native] a contiguous index names no input");
  }
  const int n_out = static_cast<int>(out_shapes.size());
  for (const Launch& l : launches) {
    if (l.function == 0) throw std::invalid_argument("[tiered.native] a launch has no kernel");
    for (const Arg& a : l.args) {
      int kind = std::get<0>(a);
      int64_t v = std::get<1>(a);
      if (kind < INT64 || kind > NDIM) throw std::invalid_argument("[tiered.native] unknown argument kind");
      if (kind == OUTPUT && (v < 0 || v >= n_out))
        throw std::invalid_argument("[tiered.native] an argument names no output");
      if (kind >= INPUT && kind != OUTPUT && (v < 0 || v >= n_in))
        throw std::invalid_argument("[tiered.native] an argument names no input");
    }
  }
  auto prim = std::make_shared<Program>(stream, launches, contiguous, aliases, written);
  return array::make_arrays(std::move(shapes), out_dtypes, prim, inputs);
}

}  // namespace

void bind_dispatch(nb::module_& m);  // native_dispatch.cpp

NB_MODULE(_tiered_native, m) {
  m.doc() = "tiered's native launcher (tiered/metal/native.py)";
  m.def("cuda_ready", []() { return cuda().ready(); });
  m.def("cuda_missing", []() { return cuda().missing; });
  m.def("load_function", &load_function, nb::arg("image"), nb::arg("name"),
        nb::arg("shared_bytes") = 0);
  m.def("set_copy_functions", [](std::array<uintptr_t, 4> fns) { copy_functions = fns; });
  nb::class_<Launch>(m, "Launch")
      .def(nb::init<uintptr_t, std::array<unsigned, 3>, std::array<unsigned, 3>, unsigned,
                    std::vector<Arg>>(),
           nb::arg("function"), nb::arg("blocks"), nb::arg("threads"), nb::arg("shared_bytes"),
           nb::arg("args"))
      .def_ro("function", &Launch::function)
      .def_ro("blocks", &Launch::blocks)
      .def_ro("threads", &Launch::threads)
      .def_ro("args", &Launch::args);
  m.def("run", &run, nb::arg("launches"), nb::arg("inputs"), nb::arg("out_shapes"),
        nb::arg("out_dtypes"), nb::arg("aliases"), nb::arg("written"), nb::arg("contiguous"),
        nb::arg("stream"));
  bind_dispatch(m);
}
