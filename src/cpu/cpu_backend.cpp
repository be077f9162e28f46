// The CPU backend: host memory, ops run synchronously on the calling thread (one rank).
#include <cstdlib>
#include <cstring>
#include <new>

#include "cpu/cpu_ops.hpp"
#include "moe_echo/backends.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo {
namespace {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(DType dtype) : dtype_(dtype) {
    MOE_ECHO_CHECK(dtype == DType::f32 || dtype == DType::f64,
                   "the CPU backend computes in f32 or f64, not " << to_string(dtype));
  }
  const char* name() const override { return dtype_ == DType::f32 ? "cpu" : "cpu-f64"; }
  DType activation_dtype() const override { return dtype_; }
  DType float_dtype() const override { return dtype_; }

  void* allocate(size_t bytes) override {
    if (bytes == 0) bytes = 64;
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) throw std::bad_alloc();
    return p;
  }
  void deallocate(void* p) override { std::free(p); }
  void copy_from_host(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void synchronize() override {}

  void fill_zero(const Tensor& t, Stream) override {
    if (t.bytes()) std::memset(t.data, 0, t.bytes());
  }
  void copy(const Tensor& dst, const Tensor& src, Stream) override {
    MOE_ECHO_CHECK(dst.bytes() == src.bytes(),
                   "copy " << src.describe() << " into " << dst.describe());
    if (src.bytes()) std::memmove(dst.data, src.data, src.bytes());
  }
  // Every op of MOE_ECHO_CPU_TYPED_OPS (cpu_ops.hpp) runs its template in the backend's dtype.
#define MOE_ECHO_CPU_OVERRIDE(op, Args)          \
  void op(const Args& a, Stream) override {      \
    dispatch([&]<class T>() { cpu::op<T>(a); }); \
  }
  MOE_ECHO_CPU_TYPED_OPS(MOE_ECHO_CPU_OVERRIDE)
#undef MOE_ECHO_CPU_OVERRIDE

  void router_bias_update(const Tensor& routing_map, const Tensor& bias, double rate,
                          Stream) override {
    dispatch([&]<class T>() { cpu::router_bias_update<T>(routing_map, bias, rate); });
  }
  void plan(const Tensor& routing_map, const PlannerConfig& cfg, bool echo, const Tensor& plan,
            Stream) override {
    const PlanView view = plan_view(plan.as<int32_t>(), cfg);
    if (echo)
      plan_echo(routing_map.as<int32_t>(), cfg, view);
    else
      plan_none(routing_map.as<int32_t>(), cfg, view);
  }
  void plan_placed(const Tensor& routing_map, const PlannerConfig& cfg, const Tensor& placement,
                   const Tensor& plan, Stream) override {
    check_tensor(placement, "plan_placed placement", DType::i32,
                 {int64_t(cfg.ranks) * cfg.spare_slots});
    moe_echo::plan_placed(routing_map.as<int32_t>(), cfg, placement.as<int32_t>(),
                          plan_view(plan.as<int32_t>(), cfg));
  }
  void layout(const LayoutArgs& a, Stream) override { cpu::layout(a); }
  void chunk_plan(const ChunkPlanArgs& a, Stream) override { cpu::chunk_plan(a); }
  void fan_out_fp8(const Fp8FanArgs& a, Stream) override { cpu::fan_out_fp8(a); }
  void add_i32(const Tensor& t, int32_t value, Stream) override {
    MOE_ECHO_CHECK(t.dtype == DType::i32, "add_i32 on " << t.describe());
    for (int64_t i = 0; i < t.numel(); ++i) t.as<int32_t>()[i] += value;
  }
  void run_if(const int32_t* device_flag, const std::function<void(Stream)>& body,
              Stream s) override {
    if (*device_flag != 0) body(s);
  }

 private:
  template <class F>
  void dispatch(F&& f) {
    if (dtype_ == DType::f32)
      f.template operator()<float>();
    else
      f.template operator()<double>();
  }
  DType dtype_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(DType dtype) {
  return std::make_unique<CpuBackend>(dtype);
}

}  // namespace moe_echo
