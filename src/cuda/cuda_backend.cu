// The CUDA backend: device memory through cudaMalloc (never managed memory), every per-step op a
// kernel (or an async memset/copy) on the caller's stream, expert GEMMs through GroupedGemm
// (CUTLASS, grouped_gemm*.cu), run_if as a CUDA-graph conditional IF node while the stream is
// capturing (and a host read of its flag otherwise), enqueue_as_graph as a capture on a stream of
// the backend's launched as a graph. Op semantics are those of the CPU reference (src/cpu); see
// ops.hpp for the kernels.
#include <algorithm>
#include <sstream>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/cuda_backend.hpp"
#include "cuda/gemm/grouped_gemm.hpp"
#include "cuda/gemm/grouped_gemm_fp8.hpp"
#include "cuda/ops.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo::cuda {
namespace {

// The capture state of a stream; throws when a capture was invalidated by an earlier error.
bool is_capturing(cudaStream_t s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  MOE_ECHO_CUDA_CHECK(cudaStreamIsCapturing(s, &st));
  MOE_ECHO_CHECK(st != cudaStreamCaptureStatusInvalidated,
                 "the stream's graph capture was invalidated by an earlier error");
  return st == cudaStreamCaptureStatusActive;
}

// The graph of the work `enqueue` puts on `s` (a stream other than the legacy default stream).
// When enqueue throws, the capture is ended and its graph dropped before the exception goes on.
cudaGraph_t capture_graph(cudaStream_t s, const std::function<void()>& enqueue) {
  MOE_ECHO_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  try {
    enqueue();
  } catch (...) {
    cudaGraph_t discard = nullptr;
    if (cudaStreamEndCapture(s, &discard) == cudaSuccess && discard)
      (void)cudaGraphDestroy(discard);
    (void)cudaGetLastError();
    throw;
  }
  cudaGraph_t graph = nullptr;
  MOE_ECHO_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  return graph;
}

class CudaBackend final : public Backend {
 public:
  CudaBackend() { MOE_ECHO_CUDA_CHECK(cudaGetDevice(&device_)); }
  ~CudaBackend() override {
    (void)cudaDeviceSynchronize();
    destroy_retired();
    retired_gemms_.clear();
    retired_fp8_gemms_.clear();
    for (Lane& l : lanes_) {
      l.gemm.reset();
      l.fp8_gemm.reset();
      l.side_gemm.reset();
      l.overlap_gemm.reset();
      l.overlap_fp8_gemm.reset();
      if (l.side_stream) (void)cudaStreamDestroy(l.side_stream);
      if (l.fork_event) (void)cudaEventDestroy(l.fork_event);
      if (l.join_event) (void)cudaEventDestroy(l.join_event);
    }
    for (void* p : arenas_) (void)cudaFree(p);
    if (capture_stream_) (void)cudaStreamDestroy(capture_stream_);
    for (cudaStream_t bs : body_streams_) (void)cudaStreamDestroy(bs);
  }

  const char* name() const override { return "cuda"; }
  DType activation_dtype() const override { return DType::bf16; }
  DType float_dtype() const override { return DType::f32; }

  void* allocate(size_t bytes) override {
    void* p = nullptr;
    const cudaError_t rc = cudaMalloc(&p, bytes == 0 ? 256 : bytes);
    if (rc == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      size_t free_bytes = 0, total_bytes = 0;
      (void)cudaMemGetInfo(&free_bytes, &total_bytes);
      std::ostringstream m;
      m << "out of GPU memory: a buffer of " << bytes << " bytes (" << (bytes >> 20)
        << " MiB) with " << (free_bytes >> 20) << " MiB of " << (total_bytes >> 20)
        << " MiB free on device " << device_ << " (cudaErrorMemoryAllocation)";
      throw OutOfMemoryError(m.str());
    }
    MOE_ECHO_CUDA_CHECK(rc);
    return p;
  }
  void deallocate(void* p) override {
    if (p) MOE_ECHO_CUDA_CHECK(cudaFree(p));
  }
  void copy_from_host(void* dst, const void* src, size_t bytes) override {
    if (!bytes) return;
    MOE_ECHO_CUDA_CHECK(cudaDeviceSynchronize());  // after all queued work, on any stream
    MOE_ECHO_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
    // A copy from pageable memory may return before it lands; work on a non-blocking stream
    // would not wait for it.
    MOE_ECHO_CUDA_CHECK(cudaDeviceSynchronize());
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    if (!bytes) return;
    MOE_ECHO_CUDA_CHECK(cudaDeviceSynchronize());
    MOE_ECHO_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
    destroy_retired();
  }
  void synchronize() override {
    MOE_ECHO_CUDA_CHECK(cudaDeviceSynchronize());
    destroy_retired();
  }

  // Build time: the grouped GEMM for the largest group count seen, and a scratch arena for the
  // largest router/layout/planner/fan needs of the reserved layers' planner configs.
  void reserve(const Reservation& r) override {
    MOE_ECHO_CHECK(r.lanes >= 1, "Reservation::lanes = " << r.lanes << ": allowed 1 or more");
    if (int(lanes_.size()) < r.lanes) lanes_.resize(size_t(r.lanes));
    const int current = lane_;
    for (lane_ = 0; lane_ < r.lanes; ++lane_) reserve_lane(r);
    lane_ = current;
  }
  void set_lane(int lane) override {
    MOE_ECHO_CHECK(lane >= 0 && lane < int(lanes_.size()),
                   "lane " << lane << " of a backend reserved for " << lanes_.size()
                           << " lane(s): reserve (build the layer) first");
    lane_ = lane;
  }
  // reserve() for the current lane.
  void reserve_lane(const Reservation& r) {
    if (!L().gemm || L().gemm->max_groups() < r.max_groups) {
      if (L().gemm) retired_gemms_.push_back(std::move(L().gemm));  // captured graphs may use it
      L().gemm = std::make_unique<GroupedGemm>(r.max_groups);
    }
    if (r.fp8) fp8_gemm(r.max_groups, nullptr);  // built now, before any capture
    if (r.overlap_sms >= 0) {  // the side stream's GEMMs of many groups, on fewer SMs
      int sms = 0;
      MOE_ECHO_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_));
      MOE_ECHO_CHECK(r.overlap_sms < sms, "overlap_sms = " << r.overlap_sms
                                                           << " leaves no SM to the GEMMs: "
                                                              "allowed 0 to "
                                                           << sms - 1 << " on this GPU");
      const int gemm_sms = sms - r.overlap_sms;
      if (!L().overlap_gemm || L().overlap_gemm->max_groups() < r.max_groups ||
          L().overlap_gemm_sms != gemm_sms) {
        if (L().overlap_gemm) retired_gemms_.push_back(std::move(L().overlap_gemm));
        L().overlap_gemm = std::make_unique<GroupedGemm>(r.max_groups, gemm_sms);
      }
      if (r.fp8 && (!L().overlap_fp8_gemm || L().overlap_fp8_gemm->max_groups() < r.max_groups ||
                    L().overlap_gemm_sms != gemm_sms)) {
        if (L().overlap_fp8_gemm) retired_fp8_gemms_.push_back(std::move(L().overlap_fp8_gemm));
        L().overlap_fp8_gemm = std::make_unique<GroupedGemmFp8>(r.max_groups, gemm_sms);
      }
      L().overlap_gemm_sms = gemm_sms;
    }
    const PlannerConfig& cfg = r.planner;
    const int64_t entries = r.max_tokens * r.top_k;
    size_t need = router_scratch_bytes(r.max_tokens, r.experts, r.hidden);
    need = std::max(need, layout_scratch_bytes(cfg, r.max_groups, entries));
    need = std::max(need, planner_scratch_bytes(cfg));
    need = std::max(need, fan_scratch_bytes(r.max_rows));
    grow_arena(need);
    if (!L().side_stream) {  // fork_side: the stream, its events and its one-group GEMM
      MOE_ECHO_CUDA_CHECK(cudaStreamCreateWithFlags(&L().side_stream, cudaStreamNonBlocking));
      MOE_ECHO_CUDA_CHECK(cudaEventCreateWithFlags(&L().fork_event, cudaEventDisableTiming));
      MOE_ECHO_CUDA_CHECK(cudaEventCreateWithFlags(&L().join_event, cudaEventDisableTiming));
      L().side_gemm = std::make_unique<GroupedGemm>(1);
    }
  }

  void fork_side(const std::function<void(Stream)>& body, Stream s) override {
    MOE_ECHO_CHECK(L().side_stream != nullptr, "fork_side before reserve(): build the layer first");
    MOE_ECHO_CUDA_CHECK(cudaEventRecord(L().fork_event, as_cuda(s)));
    MOE_ECHO_CUDA_CHECK(cudaStreamWaitEvent(L().side_stream, L().fork_event, 0));
    body(L().side_stream);
    MOE_ECHO_CUDA_CHECK(cudaEventRecord(L().join_event, L().side_stream));
  }
  void join_side(Stream s) override {
    MOE_ECHO_CUDA_CHECK(cudaStreamWaitEvent(as_cuda(s), L().join_event, 0));
  }

  void fill_zero(const Tensor& t, Stream s) override {
    if (t.bytes()) MOE_ECHO_CUDA_CHECK(cudaMemsetAsync(t.data, 0, t.bytes(), as_cuda(s)));
  }
  void copy(const Tensor& dst, const Tensor& src, Stream s) override {
    MOE_ECHO_CHECK(dst.bytes() == src.bytes(),
                   "copy " << src.describe() << " into " << dst.describe());
    if (src.bytes() && dst.data != src.data)
      MOE_ECHO_CUDA_CHECK(
          cudaMemcpyAsync(dst.data, src.data, src.bytes(), cudaMemcpyDeviceToDevice, as_cuda(s)));
  }
  void router_forward(const RouterForwardArgs& a, Stream s) override {
    const cudaStream_t cs = as_cuda(s);
    const RouterTensors& t = a.tensors;
    void* sc = scratch(router_scratch_bytes(t.x.size(0), t.weight.size(0), t.weight.size(1)), cs);
    cuda::router_forward(a, sc, &gemm(1, s), cs);
  }
  void router_backward(const RouterBackwardArgs& a, Stream s) override {
    const cudaStream_t cs = as_cuda(s);
    const RouterTensors& t = a.tensors;
    void* sc = scratch(router_scratch_bytes(t.x.size(0), t.weight.size(0), t.weight.size(1)), cs);
    cuda::router_backward(a, sc, &gemm(1, s), cs);
  }
  void router_bias_update(const Tensor& routing_map, const Tensor& bias, double rate,
                          Stream s) override {
    cuda::router_bias_update(routing_map, bias, rate, as_cuda(s));
  }
  void plan(const Tensor& routing_map, const PlannerConfig& cfg, bool echo, const Tensor& plan,
            Stream s) override {
    const cudaStream_t cs = as_cuda(s);
    cuda::plan(routing_map, cfg, echo, plan, scratch(planner_scratch_bytes(cfg), cs), cs);
  }
  void plan_placed(const Tensor& routing_map, const PlannerConfig& cfg, const Tensor& placement,
                   const Tensor& plan, Stream s) override {
    const cudaStream_t cs = as_cuda(s);
    cuda::plan_placed(routing_map, cfg, placement, plan, scratch(planner_scratch_bytes(cfg), cs),
                      cs);
  }
  void layout(const LayoutArgs& a, Stream s) override {
    const cudaStream_t cs = as_cuda(s);
    cuda::layout(a, scratch(layout_scratch_bytes(a.planner, a.slots, a.topk_idx.numel()), cs), cs);
  }
  void chunk_plan(const ChunkPlanArgs& a, Stream s) override { cuda::chunk_plan(a, as_cuda(s)); }
  void gemm_fprop(const GemmArgs& a, Stream s) override {
    gemm(a.window.groups, s).fprop(a, as_cuda(s));
  }
  void gemm_dgrad(const GemmArgs& a, Stream s) override {
    gemm(a.window.groups, s).dgrad(a, as_cuda(s));
  }
  void gemm_wgrad(const GemmArgs& a, Stream s) override {
    gemm(a.window.groups, s).wgrad(a, as_cuda(s));
  }
  void swiglu_forward(const SwigluArgs& a, Stream s) override {
    cuda::swiglu_forward(a, as_cuda(s));
  }
  void swiglu_backward(const SwigluArgs& a, Stream s) override {
    cuda::swiglu_backward(a, as_cuda(s));
  }
  void fan_out(const FanArgs& a, Stream s) override {
    const cudaStream_t cs = as_cuda(s);
    cuda::fan_out(a, scratch(fan_scratch_bytes(a.window.rows), cs), cs);
  }
  void fan_in(const FanArgs& a, Stream s) override {
    const cudaStream_t cs = as_cuda(s);
    cuda::fan_in(a, scratch(fan_scratch_bytes(a.window.rows), cs), cs);
  }
  void adamw(const AdamWArgs& a, Stream s) override { cuda::adamw(a, as_cuda(s)); }
  void fan_out_fp8(const Fp8FanArgs& a, Stream s) override {
    const cudaStream_t cs = as_cuda(s);
    cuda::fan_out_fp8(a, scratch(fan_scratch_bytes(a.window.rows), cs), cs);
  }
  void quantize_fp8_rows(const Fp8RowArgs& a, Stream s) override {
    cuda::quantize_fp8_rows(a, as_cuda(s));
  }
  void dequantize_fp8_rows(const Fp8RowArgs& a, Stream s) override {
    cuda::dequantize_fp8_rows(a, as_cuda(s));
  }
  void quantize_fp8_blocks(const Fp8BlockArgs& a, Stream s) override {
    cuda::quantize_fp8_blocks(a, as_cuda(s));
  }
  void quantize_fp8_cols(const Fp8ColArgs& a, Stream s) override {
    cuda::quantize_fp8_cols(a, as_cuda(s));
  }
  void gemm_fp8_fprop(const Fp8GemmArgs& a, Stream s) override {
    fp8_gemm(a.window.groups, s).fprop(a, as_cuda(s));
  }
  void gemm_fp8_dgrad(const Fp8GemmArgs& a, Stream s) override {
    fp8_gemm(a.window.groups, s).dgrad(a, as_cuda(s));
  }
  void gemm_fp8_wgrad(const Fp8GemmArgs& a, Stream s) override {
    fp8_gemm(a.window.groups, s).wgrad(a, as_cuda(s));
  }
  void add_i32(const Tensor& t, int32_t value, Stream s) override {
    cuda::add_i32(t, value, as_cuda(s));
  }

  // Not capturing: the flag is read on the host (after the work queued before it on the stream)
  // and the body runs on `s` or not, as on the CPU backend. Running it regardless would not be
  // exact: a round's combine writes every token of its output (0, or the old value, where the
  // token has no row in the window), so an idle round would overwrite what the rounds before it
  // wrote. MoeLayer avoids this path with enqueue_as_graph.
  // Capturing: a one-thread kernel sets a conditional handle from the flag, an IF node follows,
  // and the body is captured into the IF node's body graph on a stream of the backend's, so the
  // capture of `s` goes on undisturbed (its capture id too: PyTorch's graph pool keys
  // allocations by it).
  void run_if(const int32_t* device_flag, const std::function<void(Stream)>& body,
              Stream stream) override {
    const cudaStream_t s = as_cuda(stream);
    if (!is_capturing(s)) {
      int32_t flag = 0;
      MOE_ECHO_CUDA_CHECK(
          cudaMemcpyAsync(&flag, device_flag, sizeof(flag), cudaMemcpyDeviceToHost, s));
      MOE_ECHO_CUDA_CHECK(cudaStreamSynchronize(s));
      if (flag != 0) body(stream);
      return;
    }
    cudaStreamCaptureStatus st;
    cudaGraph_t graph = nullptr;
    MOE_ECHO_CUDA_CHECK(cudaStreamGetCaptureInfo(s, &st, nullptr, &graph));
    cudaGraphConditionalHandle handle;
    MOE_ECHO_CUDA_CHECK(
        cudaGraphConditionalHandleCreate(&handle, graph, 0, cudaGraphCondAssignDefault));
    set_conditional_from_flag(handle, device_flag, s);

    const cudaGraphNode_t* deps = nullptr;
    size_t num_deps = 0;
    MOE_ECHO_CUDA_CHECK(
        cudaStreamGetCaptureInfo(s, &st, nullptr, &graph, &deps, nullptr, &num_deps));
    cudaGraphNodeParams params{};
    params.type = cudaGraphNodeTypeConditional;
    params.conditional.handle = handle;
    params.conditional.type = cudaGraphCondTypeIf;
    params.conditional.size = 1;
    cudaGraphNode_t node;
    MOE_ECHO_CUDA_CHECK(cudaGraphAddNode(&node, graph, deps, nullptr, num_deps, &params));
    cudaGraph_t body_graph = params.conditional.phGraph_out[0];
    MOE_ECHO_CUDA_CHECK(cudaStreamUpdateCaptureDependencies(s, &node, nullptr, 1,
                                                            cudaStreamSetCaptureDependencies));
    // The body, captured on a stream of its nesting depth into the IF node's graph.
    if (body_streams_.size() <= size_t(body_depth_)) {
      cudaStream_t bs = nullptr;
      MOE_ECHO_CUDA_CHECK(cudaStreamCreateWithFlags(&bs, cudaStreamNonBlocking));
      body_streams_.push_back(bs);
    }
    const cudaStream_t bs = body_streams_[size_t(body_depth_)];
    MOE_ECHO_CUDA_CHECK(cudaStreamBeginCaptureToGraph(bs, body_graph, nullptr, nullptr, 0,
                                                      cudaStreamCaptureModeThreadLocal));
    ++body_depth_;
    try {
      body(bs);
    } catch (...) {
      --body_depth_;
      cudaGraph_t discard = nullptr;
      (void)cudaStreamEndCapture(bs, &discard);
      (void)cudaGetLastError();
      throw;
    }
    --body_depth_;
    cudaGraph_t captured_body = nullptr;
    MOE_ECHO_CUDA_CHECK(cudaStreamEndCapture(bs, &captured_body));
  }

  // Not capturing: the body is captured on capture_stream_ (never the caller's stream, which may
  // be the legacy default stream, which cannot capture) and the graph launched on `s`, so the
  // work runs in `s`'s order. A key seen before relaunches its graph; a new one is instantiated,
  // or with the cache full updated into the least recently launched graph in place when the new
  // capture has the same topology (new pointers, sizes, grids), re-instantiated otherwise.
  // cudaGraphExecUpdate leaves launches already enqueued as they were.
  void enqueue_as_graph(std::unique_ptr<GraphCache>& cache, const std::vector<uint64_t>& key,
                        const std::function<void(Stream)>& body, Stream stream) override {
    const cudaStream_t s = as_cuda(stream);
    if (is_capturing(s)) {
      body(stream);
      return;
    }
    if (!cache) cache = std::make_unique<ExecCache>();
    auto& c = static_cast<ExecCache&>(*cache);
    ++c.clock;
    for (ExecCache::Entry& e : c.entries)
      if (e.key == key) {
        e.used = c.clock;
        MOE_ECHO_CUDA_CHECK(cudaGraphLaunch(e.exec, s));
        return;
      }
    if (!capture_stream_)
      MOE_ECHO_CUDA_CHECK(cudaStreamCreateWithFlags(&capture_stream_, cudaStreamNonBlocking));
    cudaGraph_t graph = capture_graph(capture_stream_, [&] { body(capture_stream_); });
    // A new key gets its own graph until the cache holds kMaxGraphs; then the least recently
    // launched one is updated to it (or replaced when its topology differs).
    ExecCache::Entry* e = nullptr;
    if (c.entries.size() < ExecCache::kMaxGraphs) {
      e = &c.entries.emplace_back();
    } else {
      e = &*std::min_element(c.entries.begin(), c.entries.end(),
                             [](const auto& a, const auto& b) { return a.used < b.used; });
      e->key.clear();  // until the new graph is in place
      cudaGraphExecUpdateResultInfo info{};
      if (cudaGraphExecUpdate(e->exec, graph, &info) != cudaSuccess) {
        (void)cudaGetLastError();
        retire(e->exec);
        e->exec = nullptr;
      }
    }
    if (!e->exec) {
      const cudaError_t rc = cudaGraphInstantiate(&e->exec, graph, 0);
      if (rc != cudaSuccess) {
        (void)cudaGraphDestroy(graph);
        e->exec = nullptr;
        if (e->key.empty()) c.entries.erase(c.entries.begin() + (e - c.entries.data()));
        MOE_ECHO_CUDA_CHECK(rc);
      }
    }
    (void)cudaGraphDestroy(graph);
    e->key = key;
    e->used = c.clock;
    MOE_ECHO_CUDA_CHECK(cudaGraphLaunch(e->exec, s));
  }

 private:
  // An executable graph replaced by one of another topology. Destroying it at once can wait for
  // the device (seen with FP8 steps whose graphs hold conditional nodes), which would put a host
  // sync into the step that re-captures: it is destroyed once the device is known idle
  // (synchronize(), copy_to_host(), the backend's end), or when more than kMaxRetired wait.
  void retire(cudaGraphExec_t exec) {
    static constexpr size_t kMaxRetired = 64;
    if (retired_execs_.size() >= kMaxRetired) {
      (void)cudaGraphExecDestroy(retired_execs_.front());
      retired_execs_.erase(retired_execs_.begin());
    }
    retired_execs_.push_back(exec);
  }
  void destroy_retired() {  // the device is idle
    for (cudaGraphExec_t e : retired_execs_) (void)cudaGraphExecDestroy(e);
    retired_execs_.clear();
  }

  GroupedGemm& gemm(int groups, Stream s) {
    if (s != nullptr && as_cuda(s) == L().side_stream) {
      if (groups == 1) return *L().side_gemm;
      MOE_ECHO_CHECK(L().overlap_gemm && L().overlap_gemm->max_groups() >= groups,
                     "the side stream's grouped GEMM of "
                         << groups << " groups was not reserved (a layer with overlap wgrad)");
      return *L().overlap_gemm;
    }
    if (!L().gemm || L().gemm->max_groups() < groups) {
      MOE_ECHO_CHECK(!is_capturing(as_cuda(s)), "grouped GEMM for "
                                                    << groups
                                                    << " groups not reserved before capture: "
                                                       "build the layer (Backend::reserve) first");
      if (L().gemm) retired_gemms_.push_back(std::move(L().gemm));
      L().gemm = std::make_unique<GroupedGemm>(groups);
    }
    return *L().gemm;
  }

  // The FP8 grouped GEMMs, built on first use with at least the reserved groups (their kernels
  // are built outside a capture, as the bf16 ones).
  GroupedGemmFp8& fp8_gemm(int groups, Stream s) {
    if (s != nullptr && as_cuda(s) == L().side_stream) {
      MOE_ECHO_CHECK(L().overlap_fp8_gemm && L().overlap_fp8_gemm->max_groups() >= groups,
                     "the side stream's FP8 grouped GEMM of "
                         << groups << " groups was not reserved (a layer with overlap wgrad)");
      return *L().overlap_fp8_gemm;
    }
    const int want = std::max(groups, L().gemm ? L().gemm->max_groups() : 1);
    if (!L().fp8_gemm || L().fp8_gemm->max_groups() < groups) {
      MOE_ECHO_CHECK(!is_capturing(as_cuda(s)),
                     "FP8 grouped GEMM for " << groups
                                             << " groups built during a capture: call it once "
                                                "before capturing");
      if (L().fp8_gemm) retired_fp8_gemms_.push_back(std::move(L().fp8_gemm));
      L().fp8_gemm = std::make_unique<GroupedGemmFp8>(want);
    }
    return *L().fp8_gemm;
  }

  // Scratch of `bytes` for the op about to be enqueued on `s`. The arena only grows, outside a
  // capture; old arenas stay allocated until the backend dies (captured graphs may use them).
  void* scratch(size_t bytes, cudaStream_t s) {
    if (bytes > L().arena_bytes) {
      MOE_ECHO_CHECK(!is_capturing(s), "op scratch of " << bytes << " bytes exceeds the "
                                                        << L().arena_bytes
                                                        << " reserved: reserve() before capture");
      grow_arena(bytes);
    }
    return L().arena;
  }
  void grow_arena(size_t bytes) {
    if (bytes <= L().arena_bytes) return;
    bytes = std::max(bytes, 2 * L().arena_bytes);
    L().arena = allocate(bytes);
    arenas_.push_back(L().arena);
    L().arena_bytes = bytes;
  }

  // The graphs of one call site, one per key (the call whose work it holds), at most
  // kMaxGraphs: a training loop that alternates calls (a first micro-batch's backward writes the
  // gradients, the next ones add to them) relaunches each without capturing it again.
  struct ExecCache final : GraphCache {
    static constexpr size_t kMaxGraphs = 8;
    struct Entry {
      std::vector<uint64_t> key;  // empty: none yet
      cudaGraphExec_t exec = nullptr;
      uint64_t used = 0;  // the clock at its last launch
    };
    std::vector<Entry> entries;
    uint64_t clock = 0;
    ~ExecCache() override {
      for (Entry& e : entries)
        if (e.exec) (void)cudaGraphExecDestroy(e.exec);
    }
  };

  int device_ = 0;
  cudaStream_t capture_stream_ = nullptr;   // enqueue_as_graph's captures
  std::vector<cudaStream_t> body_streams_;  // run_if bodies, one per nesting depth
  int body_depth_ = 0;
  // What one lane's ops use (Backend::set_lane): its grouped GEMMs, its side stream with its
  // events and GEMMs, and its scratch arena.
  struct Lane {
    std::unique_ptr<GroupedGemm> gemm;
    std::unique_ptr<GroupedGemmFp8> fp8_gemm;
    cudaStream_t side_stream = nullptr;  // fork_side's, with its events and its own GEMM
    cudaEvent_t fork_event = nullptr, join_event = nullptr;
    std::unique_ptr<GroupedGemm> side_gemm;
    // The side stream's GEMMs of many groups (MoeConfig::overlap wgrad) on overlap_gemm_sms SMs.
    std::unique_ptr<GroupedGemm> overlap_gemm;
    std::unique_ptr<GroupedGemmFp8> overlap_fp8_gemm;
    int overlap_gemm_sms = 0;
    void* arena = nullptr;
    size_t arena_bytes = 0;
  };
  Lane& L() { return lanes_[size_t(lane_)]; }
  std::vector<Lane> lanes_ = std::vector<Lane>(1);
  int lane_ = 0;
  std::vector<std::unique_ptr<GroupedGemm>> retired_gemms_;
  std::vector<cudaGraphExec_t> retired_execs_;  // see retire()
  std::vector<std::unique_ptr<GroupedGemmFp8>> retired_fp8_gemms_;
  std::vector<void*> arenas_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend() { return std::make_unique<CudaBackend>(); }

// ---- CapturedGraph ------------------------------------------------------------------------------

CapturedGraph::CapturedGraph(cudaStream_t stream, const std::function<void()>& enqueue) {
  MOE_ECHO_CHECK(stream != nullptr, "capture needs a stream other than the legacy default stream");
  graph_ = capture_graph(stream, enqueue);
  MOE_ECHO_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
}

CapturedGraph::~CapturedGraph() {
  if (exec_) (void)cudaGraphExecDestroy(exec_);
  if (graph_) (void)cudaGraphDestroy(graph_);
}

void CapturedGraph::launch(cudaStream_t stream) {
  MOE_ECHO_CUDA_CHECK(cudaGraphLaunch(exec_, stream));
}

size_t CapturedGraph::top_level_nodes() const {
  size_t n = 0;
  MOE_ECHO_CUDA_CHECK(cudaGraphGetNodes(graph_, nullptr, &n));
  return n;
}

size_t CapturedGraph::conditional_nodes() const {
  size_t n = top_level_nodes();
  std::vector<cudaGraphNode_t> nodes(n);
  MOE_ECHO_CUDA_CHECK(cudaGraphGetNodes(graph_, nodes.data(), &n));
  size_t count = 0;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    MOE_ECHO_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
    if (type == cudaGraphNodeTypeConditional) ++count;
  }
  return count;
}

}  // namespace moe_echo::cuda
