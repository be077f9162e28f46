// The part of NCCL's RMA plugin ABI that the test plugin gin_ipc_rma.cpp implements, declared here
// so that it builds without NCCL's internal headers. The layouts match, field for field:
// - RmaV14: ncclRma_v14_t, NCCL's src/include/plugin/rma/rma_v14.h (NCCL 2.30.7 and 2.31; NCCL
//   2.32.3 still loads it: its library looks up ncclRmaPlugin_v16 down to ncclRmaPlugin_v13);
// - NetProperties: ncclNetProperties_v12_t, src/include/plugin/net/net_v12.h (the same in 2.30.7,
//   2.31 and 2.32, whose newest net interface is v12);
// - RmaConfig: ncclRmaConfig_v14_t; Logger: ncclDebugLogger_t (src/include/nccl_common.h);
// - the result codes (nccl.h), log levels and subsystems (nccl_common.h), pointer types, signal
//   ops and limits (src/include/plugin/nccl_net.h) and the device type of NCCL's GIN proxy
//   (src/include/nccl_device/net_device.h).
#pragma once

#include <cstddef>
#include <cstdint>

namespace moe_echo::gin_ipc::abi {

// ncclResult_t (an int-sized C enum).
enum Result : int {
  kSuccess = 0,
  kUnhandledCudaError = 1,
  kSystemError = 2,
  kInternalError = 3,
  kInvalidArgument = 4,
  kInvalidUsage = 5,
  kRemoteError = 6,
};

// ncclDebugLogLevel and ncclDebugLogSubSys.
constexpr int kLogWarn = 2;
constexpr int kLogInfo = 3;
constexpr unsigned long kSubsysInit = 0x1;
constexpr unsigned long kSubsysNet = 0x10;
constexpr unsigned long kSubsysAll = ~0ul;

using Logger = void (*)(int level, unsigned long flags, const char* file, int line, const char* fmt,
                        ...);

constexpr int kPtrHost = 0x1;           // NCCL_PTR_HOST
constexpr int kPtrCuda = 0x2;           // NCCL_PTR_CUDA
constexpr uint32_t kSignalInc = 0x1;    // NCCL_NET_SIGNAL_OP_INC: add 1
constexpr uint32_t kSignalAdd = 0x2;    // NCCL_NET_SIGNAL_OP_ADD: add the signal value
constexpr size_t kHandleMaxSize = 128;  // NCCL_NET_HANDLE_MAXSIZE
constexpr int kDeviceGinProxy = 2;      // NCCL_NET_DEVICE_GIN_PROXY
constexpr int kMaxDevsPerNic = 8;       // NCCL_NET_MAX_DEVS_PER_NIC_V12
constexpr int16_t kIdUndef = -1;        // NCCL_NET_ID_UNDEF

struct VDeviceProps {  // ncclNetVDeviceProps_v12_t
  int ndevs;
  int devs[kMaxDevsPerNic];
};

struct NetProperties {  // ncclNetProperties_v12_t
  char* name;
  char* pciPath;
  uint64_t guid;
  int ptrSupport;
  int regIsGlobal;
  int forceFlush;
  int speed;  // Mbps
  int port;
  float latency;
  int maxComms;
  int maxRecvs;  // NCCL's GIN proxy queues NCCL_NET_MAX_REQUESTS (32) x this per peer and context
  int netDeviceType;  // ncclNetDeviceType
  int netDeviceVersion;
  VDeviceProps vProps;
  size_t maxP2pBytes;
  size_t maxCollBytes;
  int maxMultiRequestSize;
  int16_t railId;
  int16_t planeId;
};
static_assert(offsetof(NetProperties, vProps) == 64 &&
                  offsetof(NetProperties, maxP2pBytes) == 104 &&
                  offsetof(NetProperties, planeId) == 126 && sizeof(NetProperties) == 128,
              "ncclNetProperties_v12_t layout");

struct RmaConfig {  // ncclRmaConfig_v14_t
  int nContexts;
  int trafficClass;
  int rankStride;
};

struct RmaV14 {  // ncclRma_v14_t, in its order
  const char* name;
  Result (*init)(void** ctx, uint64_t commId, Logger logFunction);
  Result (*devices)(int* ndev);
  Result (*getProperties)(int dev, NetProperties* props);
  Result (*listen)(void* ctx, int dev, void* handle, void** listenComm);
  Result (*connect)(void* ctx, void* handles[], int nranks, int rank, void* listenComm,
                    void** collComm);
  Result (*createContext)(void* collComm, RmaConfig* config, void** rmaCtx);
  Result (*regMrSym)(void* collComm, void* data, size_t size, int type, uint64_t mrFlags,
                     void** mhandle);
  Result (*regMrSymDmaBuf)(void* collComm, void* data, size_t size, int type, uint64_t offset,
                           int fd, uint64_t mrFlags, void** mhandle);
  Result (*deregMrSym)(void* collComm, void* mhandle);
  Result (*destroyContext)(void* rmaCtx);
  Result (*closeColl)(void* collComm);
  Result (*closeListen)(void* listenComm);
  Result (*iput)(void* rmaCtx, int context, uint64_t srcOff, void* srcMhandle, size_t size,
                 uint64_t dstOff, void* dstMhandle, uint32_t rank, void** request);
  Result (*iputSignal)(void* rmaCtx, int context, uint64_t srcOff, void* srcMhandle, size_t size,
                       uint64_t dstOff, void* dstMhandle, uint32_t rank, uint64_t signalOff,
                       void* signalMhandle, uint64_t signalValue, uint32_t signalOp,
                       bool isStrongSignal, void** request);
  Result (*iget)(void* rmaCtx, int context, uint64_t remoteOff, void* remoteMhandle, size_t size,
                 uint64_t localOff, void* localMhandle, uint32_t rank, void** request);
  Result (*iflush)(void* rmaCtx, int context, void* mhandle, uint32_t rank, void** request);
  Result (*test)(void* collComm, void* request, int* done);
  Result (*rmaProgress)(void* rmaCtx);
  Result (*queryLastError)(void* rmaCtx, bool* hasError);
  Result (*finalize)(void* ctx);
};
static_assert(sizeof(RmaV14) == 21 * sizeof(void*), "ncclRma_v14_t: a name and 20 functions");

}  // namespace moe_echo::gin_ipc::abi
