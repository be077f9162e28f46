// make_nccl_communicator (include/moe_echo/nccl.hpp): bootstraps the NCCL communicator and picks
// its type from the options and the topology (nccl_base.hpp), so that no op asks which
// configuration it runs in:
//
//   dispatcher  host_api  ranks in one NVLink team  type            collective ops
//   syncfree    false     yes                       NcclDeviceComm  device API
//   syncfree    false     no, GIN (gin_ready)       NcclGinComm     host API, symmetric windows
//   syncfree    false     no, no GIN                refused, saying why
//   baseline    false     yes                       NcclHostComm    device API
//   baseline    false     no                        NcclHostComm    host API (host-API mode)
//   baseline    true      either                    NcclHostComm    host API (host-API mode)
//   syncfree    true      either                    refused: needs the baseline dispatcher
#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <utility>

#include "comm/nccl_base.hpp"
#include "moe_echo/cuda_check.hpp"
#include "moe_echo/error.hpp"
#include "moe_echo/nccl.hpp"
#include "moe_echo/nccl_check.hpp"

namespace moe_echo {

const char* to_string(Dispatcher d) { return d == Dispatcher::baseline ? "baseline" : "syncfree"; }

Dispatcher parse_dispatcher(const std::string& text, const std::string& field) {
  if (text == "syncfree") return Dispatcher::syncfree;
  if (text == "baseline") return Dispatcher::baseline;
  reject(field, "'" + text + "'", "syncfree or baseline");
}

int select_device(const DistEnv& env) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  if (env.local_rank >= count) {
    (void)cudaGetLastError();
    if (count == 0)
      reject("LOCAL_RANK", env.local_rank,
             "a GPU for this rank, and this process sees none: GPU ranks need one GPU each; "
             "ranks on the CPU backend run as threads of one process (moe-echo bench --backend "
             "cpu --ep N, without launch)");
    reject("LOCAL_RANK", env.local_rank,
           "0 <= LOCAL_RANK < " + std::to_string(count) +
               " (the GPUs this process sees): one process per GPU");
  }
  MOE_ECHO_CUDA_CHECK(cudaSetDevice(env.local_rank));
  return env.local_rank;
}

namespace {

std::unique_ptr<Communicator> make(HostCollectives& boot, std::unique_ptr<HostCollectives> owned,
                                   std::unique_ptr<Rendezvous> owned_rv, const NcclOptions& o) {
  const int rank = boot.rank(), size = boot.size();
  if (size < 1 || rank < 0 || rank >= size)
    reject("bootstrap rank", rank, "0 <= rank < size (" + std::to_string(size) + ")");
  if (o.ctas < 1 || o.ctas > nccl::kMaxCtas)
    reject("ctas", o.ctas, "1 <= ctas <= " + std::to_string(nccl::kMaxCtas));
  if (o.max_gather_ints < 1) reject("max_gather_ints", o.max_gather_ints, ">= 1");
  if (o.host_api && o.dispatcher != Dispatcher::baseline)
    reject("host_api", "true",
           "with the baseline dispatcher (the sync-free one needs the device API)");

  auto ctx = std::make_unique<nccl::Context>(boot, std::move(owned), std::move(owned_rv));
  bool device_api = !o.host_api;
  if (device_api) {
    ctx->create_device_comm();
    if (!ctx->lsa_team_is_world()) {
      const ncclDevComm& dev = ctx->dev();
      if (o.dispatcher != Dispatcher::baseline) {
        std::string why;
        if (nccl::gin_ready(*ctx, &why)) {
          if (rank == 0)
            std::fprintf(stderr,
                         "moe-echo: the %d ranks span %d NVLink teams of %d: the sync-free "
                         "dispatch and combine reach other nodes through NCCL's GIN\n",
                         size, size / dev.lsaSize, dev.lsaSize);
          auto comm = nccl::make_gin_comm(std::move(ctx), o);
          boot.barrier();
          return comm;
        }
        std::ostringstream m;
        m << "the NCCL communicator's NVLink (LSA) team holds " << dev.lsaSize << " of " << size
          << " ranks (this rank is " << dev.lsaRank << " in it, " << rank
          << " in the world), and the sync-free dispatcher across nodes cannot run: " << why
          << "; across nodes without it use the baseline dispatcher (--dispatcher baseline), "
             "which runs every op on NCCL's host API";
        throw Error(m.str());
      }
      device_api = false;
      if (rank == 0)
        std::fprintf(stderr,
                     "moe-echo: the %d ranks span more than one NVLink team (this one holds "
                     "%d): every communication op runs on NCCL's host API\n",
                     size, dev.lsaSize);
    }
  }
  std::unique_ptr<Communicator> comm;
  if (o.dispatcher == Dispatcher::syncfree) {
    comm = nccl::make_device_comm(std::move(ctx), o);
  } else {
    auto ops = device_api ? nccl::make_device_collective_ops(*ctx, o)
                          : nccl::make_host_api_collective_ops(*ctx);
    comm = nccl::make_host_comm(std::move(ctx), std::move(ops), o);
  }
  boot.barrier();
  return comm;
}

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(HostCollectives& bootstrap,
                                                     const NcclOptions& options) {
  return make(bootstrap, nullptr, nullptr, options);
}

std::unique_ptr<Communicator> make_nccl_communicator(Rendezvous& rendezvous,
                                                     const NcclOptions& options) {
  auto boot = make_rendezvous_collectives(rendezvous);
  HostCollectives& ref = *boot;
  return make(ref, std::move(boot), nullptr, options);
}

std::unique_ptr<Communicator> make_nccl_communicator(const DistEnv& env,
                                                     const NcclOptions& options) {
  auto rv = std::make_unique<Rendezvous>(env);
  auto boot = make_rendezvous_collectives(*rv);
  HostCollectives& ref = *boot;
  return make(ref, std::move(boot), std::move(rv), options);
}

int nccl_runtime_version() {
  int v = 0;
  MOE_ECHO_NCCL_CHECK(ncclGetVersion(&v));
  return v;
}

void* nccl_comm_handle(Communicator& comm) {
  auto* c = dynamic_cast<nccl::NcclCommBase*>(&comm);
  return c ? static_cast<void*>(c->handle()) : nullptr;
}

bool nccl_uses_host_api(Communicator& comm) {
  auto* c = dynamic_cast<nccl::NcclCommBase*>(&comm);
  return c && c->host_api();
}

}  // namespace moe_echo
