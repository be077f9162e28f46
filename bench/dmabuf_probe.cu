// Whether this machine can map GPU memory for the CPU through DMA-BUF, what NCCL's socket RMA
// backend (the GIN proxy between hosts without InfiniBand) needs when GDRCopy's gdrdrv module is
// absent: export a device allocation as a DMA-BUF file descriptor (cuMemGetHandleForAddressRange)
// and mmap it. For plain cuMemAlloc memory and for cuMem (cuMemCreate with gpuDirectRDMACapable),
// it prints what each step returned and, when the mapping works, checks that a word the CPU writes
// through it is what the GPU reads.
//
//   nvcc -o dmabuf_probe bench/dmabuf_probe.cu -lcuda && ./dmabuf_probe
#include <cuda.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace {

const char* err(CUresult r) {
  const char* s = nullptr;
  cuGetErrorString(r, &s);
  return s ? s : "unknown";
}

// Exports [ptr, ptr + bytes) as a DMA-BUF, maps it, writes a word through the mapping and reads it
// back from the device. Returns 0 when all of it works.
int try_map(const char* what, CUdeviceptr ptr, size_t bytes) {
  int fd = -1;
  CUresult r =
      cuMemGetHandleForAddressRange(&fd, ptr, bytes, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  std::printf("%s: cuMemGetHandleForAddressRange(DMA_BUF_FD): %s (fd %d)\n", what, err(r), fd);
  if (r != CUDA_SUCCESS) return 1;
  void* host = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (host == MAP_FAILED) {
    const int e = errno;
    std::printf("%s: mmap of the DMA-BUF fd: failed, errno %d (%s)\n", what, e, std::strerror(e));
    close(fd);
    return 1;
  }
  const uint32_t word = 0x5eed1234u;
  *static_cast<volatile uint32_t*>(host) = word;
  __sync_synchronize();
  uint32_t back = 0;
  r = cuMemcpyDtoH(&back, ptr, sizeof(back));
  std::printf("%s: mmap of the DMA-BUF fd: mapped; the device reads %s (0x%08x)\n", what,
              r == CUDA_SUCCESS && back == word ? "the CPU's word" : "something else", back);
  munmap(host, bytes);
  close(fd);
  return r == CUDA_SUCCESS && back == word ? 0 : 1;
}

}  // namespace

int main() {
  if (cuInit(0) != CUDA_SUCCESS) {
    std::printf("dmabuf_probe: cuInit failed\n");
    return 2;
  }
  CUdevice dev;
  CUcontext ctx;
  cuDeviceGet(&dev, 0);
  cuDevicePrimaryCtxRetain(&ctx, dev);
  cuCtxSetCurrent(ctx);
  int dmabuf = 0, rdma = 0, drv = 0;
  cuDeviceGetAttribute(&dmabuf, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev);
  cuDeviceGetAttribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED, dev);
  cuDriverGetVersion(&drv);
  std::printf("driver API %d, DMA_BUF_SUPPORTED %d, GPU_DIRECT_RDMA_SUPPORTED %d\n", drv, dmabuf,
              rdma);
  for (const char* path : {"/dev/gdrdrv", "/sys/module/nvidia_peermem", "/sys/module/nv_peer_mem"})
    std::printf("%s: %s\n", path, access(path, F_OK) == 0 ? "present" : "absent");

  const size_t bytes = size_t(2) << 20;
  int failed = 0;
  CUdeviceptr plain = 0;
  CUresult r = cuMemAlloc(&plain, bytes);
  if (r == CUDA_SUCCESS) {
    failed += try_map("cuMemAlloc", plain, bytes);
    cuMemFree(plain);
  } else {
    std::printf("cuMemAlloc: %s\n", err(r));
    ++failed;
  }

  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  prop.allocFlags.gpuDirectRDMACapable = 1;
  size_t gran = 0;
  cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  const size_t vm_bytes = (bytes + gran - 1) / gran * gran;
  CUmemGenericAllocationHandle handle;
  CUdeviceptr va = 0;
  r = cuMemCreate(&handle, vm_bytes, &prop, 0);
  if (r == CUDA_SUCCESS && cuMemAddressReserve(&va, vm_bytes, gran, 0, 0) == CUDA_SUCCESS &&
      cuMemMap(va, vm_bytes, 0, handle, 0) == CUDA_SUCCESS) {
    CUmemAccessDesc access_desc = {};
    access_desc.location = prop.location;
    access_desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    cuMemSetAccess(va, vm_bytes, &access_desc, 1);
    failed += try_map("cuMemCreate(gpuDirectRDMACapable)", va, vm_bytes);
    cuMemUnmap(va, vm_bytes);
    cuMemAddressFree(va, vm_bytes);
    cuMemRelease(handle);
  } else {
    std::printf("cuMemCreate(gpuDirectRDMACapable): %s\n", err(r));
    ++failed;
  }
  std::printf("dmabuf_probe: %s\n", failed ? "the CPU cannot map GPU memory through DMA-BUF here"
                                           : "the CPU maps GPU memory through DMA-BUF here");
  return failed ? 1 : 0;
}
