// moe_echo._ext: the C++ layer for Python (nanobind). It knows nothing of torch: tensors cross as
// data pointers (int), shapes are checked by the Python side, and streams are cudaStream_t
// handles as ints. Buffers the layer owns come back as DLPack tensors (torch views that share the
// layer's C++ state, not the Layer object: see LayerState), so Python reads and writes them in
// place without a copy.
//
// The layer's MoeConfig and EchoConfig cross as dicts of fields named as in the field lists
// (moe_echo/config_fields.hpp), which moe_config_fields() and echo_config_fields() give to
// Python: the PyTorch module's keywords are those fields (tests/python/test_config_fields.py).
//
// Errors: moe_echo::ConfigError becomes ValueError (a parameter out of range, message naming it),
// a field's value of another Python type TypeError, moe_echo::OutOfMemoryError MemoryError, any
// other moe_echo::Error RuntimeError.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "moe_echo/backends.hpp"
#include "moe_echo/comm.hpp"
#include "moe_echo/config.hpp"
#include "moe_echo/cost_model.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/host_collectives.hpp"
#include "moe_echo/layer.hpp"

#ifdef MOE_ECHO_WITH_CUDA
#include "moe_echo/cuda.hpp"
#endif
#ifdef MOE_ECHO_WITH_NCCL
#include "moe_echo/nccl.hpp"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace moe_echo {
namespace {

Stream as_stream(uintptr_t s) { return reinterpret_cast<Stream>(s); }
void* as_ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

DType parse_dtype(const std::string& s, const char* field) {
  if (s == "float32") return DType::f32;
  if (s == "float64") return DType::f64;
  if (s == "bfloat16") return DType::bf16;
  if (s == "int32") return DType::i32;
  reject(field, "'" + s + "'", "float32, float64, bfloat16 or int32");
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::bf16: return "bfloat16";
    case DType::i32: return "int32";
    case DType::e4m3: return "float8_e4m3fn";
  }
  return "?";
}

nb::dlpack::dtype dlpack_dtype(DType t) {
  switch (t) {
    case DType::f32: return nb::dtype<float>();
    case DType::f64: return nb::dtype<double>();
    case DType::i32: return nb::dtype<int32_t>();
    case DType::e4m3: return nb::dtype<uint8_t>();  // the bits (no layer buffer is e4m3 yet)
    case DType::bf16: return {uint8_t(nb::dlpack::dtype_code::Bfloat), 16, 1};
  }
  throw Error("unknown dtype");
}

// HostCollectives over a Python object with `rank` and `size` (ints) and the methods
// all_gather(data: bytes) -> bytes, all_to_all_v(data: bytes, send_sizes: list[int],
// recv_sizes: list[int]) -> bytes and barrier() (moe_echo.torch.dist.TorchCollectives implements
// them on torch.distributed). Called with the GIL held (from inside the layer's calls).
class PyCollectives final : public HostCollectives {
 public:
  explicit PyCollectives(nb::object impl)
      : impl_(std::move(impl)),
        rank_(nb::cast<int>(impl_.attr("rank"))),
        size_(nb::cast<int>(impl_.attr("size"))) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_gather(const void* send, void* recv, size_t bytes) override {
    nb::bytes out = nb::cast<nb::bytes>(impl_.attr("all_gather")(nb::bytes(send, bytes)));
    expect_size(out, bytes * size_t(size_), "all_gather");
    std::memcpy(recv, out.c_str(), out.size());
  }
  void all_to_all_v(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                    const std::vector<size_t>& recv_bytes) override {
    size_t total_send = 0, total_recv = 0;
    for (size_t b : send_bytes) total_send += b;
    for (size_t b : recv_bytes) total_recv += b;
    nb::bytes out = nb::cast<nb::bytes>(
        impl_.attr("all_to_all_v")(nb::bytes(send, total_send), send_bytes, recv_bytes));
    expect_size(out, total_recv, "all_to_all_v");
    if (total_recv) std::memcpy(recv, out.c_str(), total_recv);
  }
  void barrier() override { impl_.attr("barrier")(); }

 private:
  static void expect_size(const nb::bytes& b, size_t want, const char* what) {
    MOE_ECHO_CHECK(b.size() == want, "collectives." << what << " returned " << b.size()
                                                    << " bytes, expected " << want);
  }
  nb::object impl_;
  int rank_, size_;
};

// The backend and communicator layers run on: without collectives, EP size 1 (the in-process
// communicator on the CPU, the single-GPU communicator on CUDA); with them, the ranks of
// `collectives`, over `transport`: "host" (the host-collectives communicator: every byte through
// the collectives) or, on the CUDA backend of a build with NCCL, "nccl" (the sync-free NCCL
// communicator, bootstrapped through the collectives). A Layer built alone has its own; the
// layers of a Workspace share the workspace's.
struct Runtime {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<InProcessWorld> world;
  std::unique_ptr<PyCollectives> collectives;  // before the communicator that uses it
  std::unique_ptr<Communicator> owned_comm;
  Communicator* comm = nullptr;
  ParallelConfig par;
  std::string backend_name, dtype;

  Runtime(const std::string& backend_name_, const std::string& dtype_, nb::object py_collectives,
          const std::string& transport)
      : backend_name(backend_name_), dtype(dtype_) {
    if (transport != "host" && transport != "nccl")
      reject("transport", "'" + transport + "'", "host or nccl");
    if (backend_name == "cpu") {
      const DType dt = parse_dtype(dtype, "dtype");
      if (dt != DType::f32 && dt != DType::f64)
        reject("dtype", "'" + dtype + "'", "float32 or float64 on the CPU backend");
      backend = make_cpu_backend(dt);
      world = std::make_unique<InProcessWorld>(1);
      comm = &world->communicator(0);
    } else if (backend_name == "cuda") {
#ifdef MOE_ECHO_WITH_CUDA
      if (dtype != "bfloat16") reject("dtype", "'" + dtype + "'", "bfloat16 on the CUDA backend");
      backend = make_backend("cuda");
      owned_comm = cuda::make_local_communicator();
      comm = owned_comm.get();
#else
      reject("backend", "'cuda'", "cpu: this build of moe_echo has no CUDA backend");
#endif
    } else {
      reject("backend", "'" + backend_name + "'", "cpu or cuda");
    }
    if (!py_collectives.is_none()) {
      collectives = std::make_unique<PyCollectives>(std::move(py_collectives));
      if (transport == "nccl") {
#ifdef MOE_ECHO_WITH_NCCL
        if (backend_name != "cuda")
          reject("transport", "'nccl'",
                 "host with the " + backend_name + " backend (nccl needs cuda)");
        owned_comm = make_nccl_communicator(*collectives);
#else
        reject("transport", "'nccl'", "host: this build of moe_echo has no NCCL communicator");
#endif
      } else {
        owned_comm = make_host_collectives_communicator(*collectives, *backend);
      }
      comm = owned_comm.get();
      par.ep_size = collectives->size();
      par.ep_rank = collectives->rank();
    }
  }
  ~Runtime() {
    owned_comm.reset();  // before the collectives and the backend it uses
  }
};

// One workspace for several layers (MoeWorkspace): their receive windows, temporaries and echo
// slots, sized for the largest of the configs it is built for, with the backend and
// communicator they all run on. The C++ objects live in a shared WorkspaceState, which the
// layers built on it share, so that a layer never keeps the Python Workspace object alive.
struct WorkspaceState {
  std::shared_ptr<Runtime> rt;
  std::vector<MoeConfig> layers;
  std::unique_ptr<MoeWorkspace> ws;  // destroyed first: before the runtime it uses
};

class Workspace {
 public:
  Workspace(const std::string& backend, const std::string& dtype,
            const std::vector<MoeConfig>& layers, const EchoConfig& echo, nb::object collectives,
            const std::string& transport)
      : s_(std::make_shared<WorkspaceState>()) {
    s_->rt = std::make_shared<Runtime>(backend, dtype, std::move(collectives), transport);
    s_->layers = layers;
    s_->ws =
        std::make_unique<MoeWorkspace>(*s_->rt->backend, *s_->rt->comm, layers, s_->rt->par, echo);
  }
  const std::shared_ptr<WorkspaceState>& state() const { return s_; }
  const std::shared_ptr<Runtime>& runtime() const { return s_->rt; }
  MoeWorkspace& workspace() { return *s_->ws; }
  const std::vector<MoeConfig>& layers() const { return s_->layers; }

 private:
  std::shared_ptr<WorkspaceState> s_;
};

// What a layer's memory needs: the MoeLayer, and the workspace and runtime it uses. Shared by
// the Layer object and by every torch view of the layer's buffers (through a capsule, see
// Layer::view), so the memory lives while a view does, and a view never keeps a Python object of
// this extension alive: tensors that torch still holds when the interpreter exits (a global
// optimizer's parameters, an output whose graph reaches them) leave no nanobind instance behind.
struct LayerState {
  std::shared_ptr<Runtime> rt;
  std::shared_ptr<WorkspaceState> ws;  // the workspace whose buffers the layer uses, or null
  std::unique_ptr<MoeLayer> layer;     // destroyed first: before the workspace and the runtime
};

// One MoE layer on one rank: on a runtime of its own, or on a workspace's (`workspace` not None:
// the layer's receive windows, temporaries and echo slots are the workspace's, and it runs on
// the workspace's backend and communicator; the workspace is kept alive by the layer).
class Layer {
 public:
  Layer(const std::string& backend, const std::string& dtype, const MoeConfig& moe,
        const EchoConfig& echo, uint64_t seed, nb::object collectives, const std::string& transport,
        nb::object workspace, bool expert_grads)
      : s_(std::make_shared<LayerState>()) {
    MoeWorkspace* ws = nullptr;
    if (workspace.is_none()) {
      s_->rt = std::make_shared<Runtime>(backend, dtype, std::move(collectives), transport);
    } else {
      Workspace& w = nb::cast<Workspace&>(workspace);
      s_->rt = w.runtime();
      if (s_->rt->backend_name != backend || s_->rt->dtype != dtype)
        reject("workspace", "one on backend " + s_->rt->backend_name + " (" + s_->rt->dtype + ")",
               "a workspace on the layer's backend " + backend + " (" + dtype + ")");
      if (!collectives.is_none())
        reject("collectives", "given with a workspace",
               "None: the layer runs on the workspace's communicator");
      s_->ws = w.state();
      ws = &w.workspace();
    }
    s_->layer = std::make_unique<MoeLayer>(*s_->rt->backend, *s_->rt->comm, moe, s_->rt->par, echo,
                                           seed, LayerOwns(/*optimizer=*/false, expert_grads), ws);
  }

  void forward(uintptr_t x, uintptr_t y, int64_t tokens, uintptr_t stream, int micro_batch) {
    const DType act = backend().activation_dtype();
    const int64_t H = s_->layer->moe_config().hidden;
    s_->layer->forward(Tensor(as_ptr(x), act, {tokens, H}), Tensor(as_ptr(y), act, {tokens, H}),
                       as_stream(stream), micro_batch);
  }

  void backward(uintptr_t x, uintptr_t dy, uintptr_t dx, int64_t tokens, uintptr_t stream,
                int micro_batch) {
    const DType act = backend().activation_dtype();
    const int64_t H = s_->layer->moe_config().hidden;
    s_->layer->backward(Tensor(as_ptr(x), act, {tokens, H}), Tensor(as_ptr(dy), act, {tokens, H}),
                        Tensor(as_ptr(dx), act, {tokens, H}), as_stream(stream), micro_batch);
  }

  void backward_into(uintptr_t x, uintptr_t dy, uintptr_t dx, uintptr_t dw1, uintptr_t dw2,
                     int64_t tokens, uintptr_t stream, int micro_batch, bool act_grads) {
    const DType act = backend().activation_dtype();
    const int64_t H = s_->layer->moe_config().hidden;
    s_->layer->backward_into(Tensor(as_ptr(x), act, {tokens, H}),
                             Tensor(as_ptr(dy), act, {tokens, H}),
                             Tensor(as_ptr(dx), act, {tokens, H}),
                             expert_grads(dw1, dw2, act_grads), as_stream(stream), micro_batch);
  }

  // The split-phase forward and backward (MoeLayer::forward_dispatch ...).
  void forward_dispatch(uintptr_t x, uintptr_t y, int64_t tokens, uintptr_t stream,
                        int micro_batch) {
    const DType act = backend().activation_dtype();
    const int64_t H = s_->layer->moe_config().hidden;
    s_->layer->forward_dispatch(Tensor(as_ptr(x), act, {tokens, H}),
                                Tensor(as_ptr(y), act, {tokens, H}), as_stream(stream),
                                micro_batch);
  }
  // dw1, dw2: 0, or where the split backward writes the home experts' gradients.
  void backward_dispatch(uintptr_t dy, uintptr_t dx, int64_t tokens, uintptr_t stream,
                         int micro_batch, uintptr_t dw1, uintptr_t dw2, bool act_grads) {
    const DType act = backend().activation_dtype();
    const int64_t H = s_->layer->moe_config().hidden;
    const Tensor tdy(as_ptr(dy), act, {tokens, H}), tdx(as_ptr(dx), act, {tokens, H});
    if (dw1 == 0 && dw2 == 0) {
      s_->layer->backward_dispatch(tdy, tdx, as_stream(stream), micro_batch);
      return;
    }
    s_->layer->backward_dispatch(tdy, tdx, expert_grads(dw1, dw2, act_grads), as_stream(stream),
                                 micro_batch);
  }

  // dw1, dw2 as the home experts' gradient tensors of the backend's float dtype, or of its
  // activation dtype with `act` (MoeLayer::activation_dtype_grads).
  MoeLayer::ExpertGrads expert_grads(uintptr_t dw1, uintptr_t dw2, bool act) const {
    const DType fl = act ? backend().activation_dtype() : backend().float_dtype();
    const MoeConfig& m = s_->layer->moe_config();
    const int64_t H = m.hidden, F = m.ffn, EPR = m.experts / s_->layer->parallel_config().ep_size;
    return {Tensor(as_ptr(dw1), fl, {EPR, H, 2 * F}), Tensor(as_ptr(dw2), fl, {EPR, F, H})};
  }

  void zero_grad(uintptr_t stream) { s_->layer->zero_grad(as_stream(stream)); }
  void discard_grad(uintptr_t stream) { s_->layer->discard_grad(as_stream(stream)); }

  // A DLPack view of a buffer of the layer, owned by a capsule that shares the layer's state.
  nb::object view(const Tensor& t) const {
    std::vector<size_t> shape;
    for (int d = 0; d < t.ndim; ++d) shape.push_back(size_t(t.size(d)));
    const bool cuda = std::string(backend().name()) == "cuda";
    int device_id = 0;
#ifdef MOE_ECHO_WITH_CUDA
    if (cuda) device_id = cuda::current_device();
#endif
    nb::capsule owner(new std::shared_ptr<LayerState>(s_), [](void* p) noexcept {
      delete static_cast<std::shared_ptr<LayerState>*>(p);
    });
    nb::ndarray<nb::pytorch> a(t.data, size_t(t.ndim), shape.data(), owner, nullptr,
                               dlpack_dtype(t.dtype),
                               cuda ? nb::device::cuda::value : nb::device::cpu::value, device_id);
    return nb::cast(a, nb::rv_policy::reference);
  }

  MoeLayer& layer() { return *s_->layer; }
  const Backend& backend() const { return *s_->rt->backend; }
  bool has_expert_grads() const { return s_->layer->holds_expert_grads(); }
  bool activation_dtype_grads() const { return s_->layer->activation_dtype_grads(); }

 private:
  std::shared_ptr<LayerState> s_;
};

// The text of field `f`'s Python value (set_field reads it), or TypeError naming `keyword` when
// the value is of another type than the field's: an int (not a bool) for "int", an int or a
// float for "float", a bool or an int for "bool", a str for "str".
std::string field_text_of(nb::handle value, const ConfigField& f, const std::string& keyword) {
  const std::string type = f.type;
  PyObject* v = value.ptr();
  const bool is_bool = PyBool_Check(v), is_int = PyLong_Check(v) && !is_bool;
  bool ok = false;
  std::string text;
  if (type == "int" && is_int) {
    ok = true, text = nb::cast<std::string>(nb::str(value));
  } else if (type == "float" && (is_int || PyFloat_Check(v))) {
    // repr of the float: the shortest text that reads back to the same double
    ok = true, text = nb::cast<std::string>(nb::repr(nb::float_(value)));
  } else if (type == "bool" && (is_bool || is_int)) {
    ok = true, text = PyObject_IsTrue(v) ? "true" : "false";
  } else if (type == "str" && PyUnicode_Check(v)) {
    ok = true, text = nb::cast<std::string>(value);
  }
  if (!ok) {
    const char* allowed = type == "int"     ? "an int"
                          : type == "float" ? "a float"
                          : type == "bool"  ? "a bool"
                                            : "a str";
    throw nb::type_error((keyword + " = " + nb::cast<std::string>(nb::repr(value)) +
                          " is invalid: allowed " + allowed)
                             .c_str());
  }
  return text;
}

// Config from a dict {field name: Python value}; the fields not in it keep their defaults.
// `keywords` renames fields for messages (the PyTorch module's echo_placement for placement).
template <class Config>
Config config_from(const nb::dict& values, const std::vector<ConfigField>& fields,
                   const nb::dict& keywords) {
  Config c;
  for (auto [key, value] : values) {
    const std::string name = nb::cast<std::string>(key);
    const std::string keyword =
        keywords.contains(key) ? nb::cast<std::string>(keywords[key]) : name;
    const ConfigField* field = nullptr;
    for (const ConfigField& f : fields)
      if (name == f.name) field = &f;
    // A name of no field: set_field refuses it, naming the fields there are.
    set_field(c, name, field ? field_text_of(value, *field, keyword) : std::string(), keyword);
  }
  return c;
}

// The MoeConfig of each dict of `moe` (one per layer of a workspace or stack).
std::vector<MoeConfig> moe_configs_from(const std::vector<nb::dict>& moe,
                                        const nb::dict& keywords) {
  std::vector<MoeConfig> layers;
  for (const nb::dict& d : moe)
    layers.push_back(config_from<MoeConfig>(d, moe_config_fields(), keywords));
  return layers;
}

// The fields of a list for Python: name, type, default (a Python value of the type), allowed (in
// words), choices (the names a str field takes, or None) and help.
nb::list fields_for_python(const std::vector<ConfigField>& fields) {
  nb::list out;
  for (const ConfigField& f : fields) {
    nb::dict d;
    const std::string type = f.type;
    d["name"] = f.name;
    d["type"] = type;
    if (type == "int")
      d["default"] = nb::int_(nb::str(f.default_text.c_str()));
    else if (type == "float")
      d["default"] = nb::float_(nb::str(f.default_text.c_str()));
    else if (type == "bool")
      d["default"] = nb::bool_(f.default_text == "true");
    else
      d["default"] = f.default_text;
    d["allowed"] = f.allowed;
    d["choices"] = f.choices.empty() ? nb::none() : nb::cast(f.choices);
    d["help"] = f.help;
    out.append(d);
  }
  return out;
}

Param parse_param(const std::string& name) {
  if (name == "router_weight") return Param::router_weight;
  if (name == "router_bias") return Param::router_bias;
  if (name == "w1") return Param::w1;
  if (name == "w2") return Param::w2;
  if (name == "shared_w1") return Param::shared_w1;
  if (name == "shared_w2") return Param::shared_w2;
  reject("name", "'" + name + "'", "router_weight, router_bias, w1, w2, shared_w1 or shared_w2");
}

}  // namespace
}  // namespace moe_echo

NB_MODULE(_ext, m) {
  using namespace moe_echo;
  m.doc() = "MoE Echo's C++ layer (used by moe_echo.torch; not a public API)";

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const ConfigError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const OutOfMemoryError& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    }
  });

  m.def("cuda_available", &cuda_backend_available,
        "True when this build has the CUDA backend and a GPU is visible");
  m.def(
      "has_nccl",
      [] {
#ifdef MOE_ECHO_WITH_NCCL
        return true;
#else
        return false;
#endif
      },
      "True when this build has the NCCL communicator (transport='nccl')");
  m.def(
      "nccl_version",
      [] {
#ifdef MOE_ECHO_WITH_NCCL
        return nccl_runtime_version();
#else
        return 0;
#endif
      },
      "The NCCL library's version this process runs (ncclGetVersion, e.g. 23203), 0 without NCCL");
  m.def("version", [] {
    return std::to_string(kVersionMajor) + "." + std::to_string(kVersionMinor) + "." +
           std::to_string(kVersionPatch);
  });
  m.def("capacity_rows", [](int max_tokens, int top_k, double capacity_factor) {
    MoeConfig moe;
    moe.max_tokens = max_tokens;
    moe.top_k = top_k;
    moe.capacity_factor = capacity_factor;
    return capacity_rows(moe);
  });

  m.def(
      "default_clone_cost_rows",
      [](int hidden, int ffn, int grad_bytes) {
        if (hidden < 1 || ffn < 1)
          reject("hidden, ffn", std::to_string(hidden) + ", " + std::to_string(ffn), "both >= 1");
        if (grad_bytes != 2 && grad_bytes != 4) reject("grad_bytes", grad_bytes, "2 or 4");
        return offline::CostModel{}.clone_cost_rows(hidden, ffn, grad_bytes);
      },
      "The GPU default of EchoConfig.clone_cost_rows (what `moe-echo bench` takes on a GPU): one "
      "clone's weights in and gradient out over NVLink, in rows of expert work, on the H200 cost "
      "model");
  m.def(
      "moe_config_fields", [] { return fields_for_python(moe_config_fields()); },
      "MoeConfig's fields, in order: dicts of name, type, default, allowed, choices, help");
  m.def(
      "echo_config_fields", [] { return fields_for_python(echo_config_fields()); },
      "EchoConfig's fields, in order: dicts of name, type, default, allowed, choices, help");
  m.def(
      "check_fields",
      [](const nb::dict& moe, const nb::dict& echo, const nb::dict& keywords) {
        config_from<MoeConfig>(moe, moe_config_fields(), keywords);
        config_from<EchoConfig>(echo, echo_config_fields(), keywords);
      },
      "moe"_a, "echo"_a, "keywords"_a = nb::dict(),
      "TypeError or ValueError when a value is none of its field's (ranges are checked when a "
      "Layer is built)");

  m.def(
      "activation_dtype_grads",
      [](const nb::dict& moe, const nb::dict& echo, int ranks, const nb::dict& keywords) {
        ParallelConfig par;
        par.ep_size = ranks;
        return MoeLayer::activation_dtype_grads(
            config_from<MoeConfig>(moe, moe_config_fields(), keywords), par,
            config_from<EchoConfig>(echo, echo_config_fields(), keywords));
      },
      "moe"_a, "echo"_a, "ranks"_a, "keywords"_a = nb::dict(),
      "whether layers of these configs on `ranks` ranks take w1/w2 gradients of the activation "
      "dtype in backward_into (MoeLayer::activation_dtype_grads), before building one");

  m.def(
      "stack_memory_bytes",
      [](const std::vector<nb::dict>& moe, const nb::dict& echo, int ranks,
         const std::string& activation, const std::string& float_dtype, const nb::dict& keywords,
         bool expert_grads) {
        const std::vector<MoeConfig> layers = moe_configs_from(moe, keywords);
        ParallelConfig par;
        par.ep_size = ranks;
        return MoeStack::memory_bytes(
            layers, par, config_from<EchoConfig>(echo, echo_config_fields(), keywords),
            parse_dtype(activation, "activation"), parse_dtype(float_dtype, "float_dtype"),
            LayerOwns(/*optimizer=*/false, expert_grads));
      },
      "moe"_a, "echo"_a, "ranks"_a, "activation"_a, "float_dtype"_a, "keywords"_a = nb::dict(),
      "expert_grads"_a = true,
      "bytes on one rank of layers of the MoeConfig dicts `moe` on one workspace (MoeStack), "
      "without optimizer state (and without the layers' w1/w2 gradients unless expert_grads), "
      "before building");

  nb::class_<Workspace>(m, "Workspace")
      .def(
          "__init__",
          [](Workspace* self, const std::string& backend, const std::string& dtype,
             const std::vector<nb::dict>& moe, const nb::dict& echo, nb::object collectives,
             const std::string& transport, const nb::dict& keywords) {
            new (self) Workspace(backend, dtype, moe_configs_from(moe, keywords),
                                 config_from<EchoConfig>(echo, echo_config_fields(), keywords),
                                 std::move(collectives), transport);
          },
          "backend"_a, "dtype"_a, "moe"_a, "echo"_a, "collectives"_a = nb::none(),
          "transport"_a = "host", "keywords"_a = nb::dict(),
          "one workspace (receive windows, temporaries, echo slots) for layers of the MoeConfig "
          "dicts `moe` and the EchoConfig `echo`, with the backend and communicator they share")
      .def_prop_ro("bytes", [](Workspace& w) { return w.workspace().bytes(); })
      .def_prop_ro("sets", [](Workspace& w) { return w.workspace().sets(); })
      .def_prop_ro("ranks", [](Workspace& w) { return w.runtime()->par.ep_size; })
      .def_prop_ro("rank", [](Workspace& w) { return w.runtime()->par.ep_rank; })
      .def_prop_ro("backend", [](Workspace& w) { return w.runtime()->backend_name; })
      .def_prop_ro("dtype", [](Workspace& w) { return w.runtime()->dtype; })
      .def_prop_ro("layers", [](Workspace& w) { return w.layers().size(); });

  nb::class_<Layer>(m, "Layer")
      .def(
          "__init__",
          [](Layer* self, const std::string& backend, const std::string& dtype, const nb::dict& moe,
             const nb::dict& echo, uint64_t seed, nb::object collectives,
             const std::string& transport, const nb::dict& keywords, nb::object workspace,
             bool expert_grads) {
            if (!workspace.is_none() && !nb::isinstance<Workspace>(workspace))
              throw nb::type_error(
                  "workspace is invalid: allowed a moe_echo._ext.Workspace or None");
            new (self)
                Layer(backend, dtype, config_from<MoeConfig>(moe, moe_config_fields(), keywords),
                      config_from<EchoConfig>(echo, echo_config_fields(), keywords), seed,
                      std::move(collectives), transport, std::move(workspace), expert_grads);
          },
          "backend"_a, "dtype"_a, "moe"_a, "echo"_a, "seed"_a, "collectives"_a = nb::none(),
          "transport"_a = "host", "keywords"_a = nb::dict(), "workspace"_a = nb::none(),
          "expert_grads"_a = true,
          "a layer of MoeConfig `moe` and EchoConfig `echo`, dicts of fields (moe_config_fields(), "
          "echo_config_fields(); the others keep their defaults); `keywords` renames fields in "
          "messages; with `workspace` (a Workspace built for this config among others) the "
          "layer uses its buffers, backend and communicator; without `expert_grads` it holds no "
          "w1/w2 gradients (backward_into, or backward_dispatch with dw1 and dw2, only)")
      .def("forward", &Layer::forward, "x"_a, "y"_a, "tokens"_a, "stream"_a, "micro_batch"_a = 0,
           "y <- the layer of x (data pointers of [tokens, hidden] activation tensors)")
      .def("backward", &Layer::backward, "x"_a, "dy"_a, "dx"_a, "tokens"_a, "stream"_a,
           "micro_batch"_a = 0,
           "dx <- gradient of x; parameter gradients accumulate (+=) in the layer's buffers")
      .def("backward_into", &Layer::backward_into, "x"_a, "dy"_a, "dx"_a, "dw1"_a, "dw2"_a,
           "tokens"_a, "stream"_a, "micro_batch"_a = 0, "act_grads"_a = false,
           "backward that writes the home experts' w1/w2 gradients into dw1, dw2 (float dtype; "
           "activation dtype with act_grads, where activation_dtype_grads)")
      .def(
          "forward_dispatch", &Layer::forward_dispatch, "x"_a, "y"_a, "tokens"_a, "stream"_a,
          "micro_batch"_a = 0,
          "split forward, first phase: routing, plan, clone pull, spill rounds, round 0's rows out")
      .def(
          "forward_experts",
          [](Layer& l, uintptr_t stream, int m) {
            l.layer().forward_experts(as_stream(stream), m);
          },
          "stream"_a, "micro_batch"_a = 0, "split forward, second phase: round 0's expert GEMMs")
      .def(
          "forward_combine",
          [](Layer& l, uintptr_t stream, int m) {
            l.layer().forward_combine(as_stream(stream), m);
          },
          "stream"_a, "micro_batch"_a = 0,
          "split forward, last phase: round 0's outputs back into y")
      .def("backward_dispatch", &Layer::backward_dispatch, "dy"_a, "dx"_a, "tokens"_a, "stream"_a,
           "micro_batch"_a = 0, "dw1"_a = 0, "dw2"_a = 0, "act_grads"_a = false,
           "split backward, first phase (the micro-batch's last forward's x is read again); with "
           "dw1 and dw2 the home experts' gradients are written there, as backward_into does")
      .def(
          "backward_experts",
          [](Layer& l, uintptr_t stream, int m) {
            l.layer().backward_experts(as_stream(stream), m);
          },
          "stream"_a, "micro_batch"_a = 0, "split backward, second phase: round 0's gradient GEMMs")
      .def(
          "backward_combine",
          [](Layer& l, uintptr_t stream, int m) {
            l.layer().backward_combine(as_stream(stream), m);
          },
          "stream"_a, "micro_batch"_a = 0,
          "split backward, last phase: dx, spill rounds, router, clone gradients home")
      .def("zero_grad", &Layer::zero_grad, "stream"_a)
      .def(
          "reset_parameters", [](Layer& l, uint64_t seed) { l.layer().reset_parameters(seed); },
          "seed"_a,
          "the parameters set again as a layer built with `seed` has them (per global expert), "
          "the router bias zeroed; waits for the device")
      .def(
          "weights_changed", [](Layer& l) { l.layer().weights_changed(); },
          "the expert weights changed: the next forward quantizes them again (fp8) and plans a "
          "new clone placement (echo_placement 'step')")
      .def(
          "hold_clone_grads", [](Layer& l, bool hold) { l.layer().hold_clone_grads(hold); },
          "hold"_a,
          "echo_placement 'step': backwards keep their clone gradients in the echo slots; the "
          "next one without reduces them all home")
      .def_prop_ro("clone_grads_held", [](Layer& l) { return l.layer().clone_grads_held(); })
      .def_prop_ro(
          "echo_placement",
          [](Layer& l) { return std::string(to_string(l.layer().echo_config().placement)); })
      .def("discard_grad", &Layer::discard_grad, "stream"_a,
           "the next backward writes the gradients without zeroing them first")
      .def(
          "param",
          [](Layer& l, const std::string& name) {
            return l.view(l.layer().param(parse_param(name)));
          },
          "name"_a, "the layer's own buffer of a parameter, as a torch view")
      .def(
          "grad",
          [](Layer& l, const std::string& name) {
            return l.view(l.layer().grad(parse_param(name)));
          },
          "name"_a, "the layer's gradient buffer of a parameter, as a torch view")
      .def(
          "plan_buffer", [](Layer& l, int m) { return l.view(l.layer().plan_buffer(m)); },
          "micro_batch"_a = 0,
          "the micro-batch's last forward's plan (int32, PlanView layout), as a torch view")
      .def(
          "losses", [](Layer& l, int m) { return l.view(l.layer().losses(m)); },
          "micro_batch"_a = 0,
          "the micro-batch's last forward's [aux, z, sequence aux] losses, as a torch view")
      .def_prop_ro(
          "activation_dtype",
          [](const Layer& l) { return std::string(dtype_name(l.backend().activation_dtype())); })
      .def_prop_ro(
          "float_dtype",
          [](const Layer& l) { return std::string(dtype_name(l.backend().float_dtype())); })
      .def_prop_ro("capacity", [](Layer& l) { return l.layer().capacity(); })
      .def_prop_ro("expert_grads", &Layer::has_expert_grads)
      .def_prop_ro("activation_dtype_grads", &Layer::activation_dtype_grads)
      .def_prop_ro("in_flight", [](Layer& l) { return l.layer().moe_config().in_flight; })
      .def_prop_ro("chunks", [](Layer& l) { return l.layer().moe_config().chunks; })
      .def_prop_ro("slots", [](Layer& l) { return l.layer().slots(); })
      .def_prop_ro("ranks", [](Layer& l) { return l.layer().parallel_config().ep_size; })
      .def_prop_ro("rank", [](Layer& l) { return l.layer().parallel_config().ep_rank; })
      .def_prop_ro("workspace_bytes", [](Layer& l) { return l.layer().workspace_bytes(); })
      .def_prop_ro("layer_bytes", [](Layer& l) { return l.layer().layer_bytes(); })
      .def_prop_ro("plan_layout", [](Layer& l) {
        // Offsets (in int32 entries) of the PlanView arrays in plan_buffer.
        const PlannerConfig& cfg = l.layer().planner_config();
        std::vector<int32_t> base(size_t(plan_ints(cfg)));
        const PlanView v = plan_view(base.data(), cfg);
        auto off = [&](const int32_t* p) { return int64_t(p - base.data()); };
        nb::dict d;
        d["load_before"] = off(v.load_before);
        d["load_after"] = off(v.load_after);
        d["num_clones"] = off(v.num_clones);
        d["ranks"] = cfg.ranks;
        return d;
      });
}
