// Device side of the CUDA IPC activation ring (include/stagewise/ring.h): the
// shared allocation and the stream-ordered counters.
//
// Counters are 32-bit words in device memory (inside the shared allocation).
// They are waited on and written with the driver's stream memory operations
// (cuStreamWaitValue32 / cuStreamWriteValue32: executed by the GPU's front
// end, no SM held, no host involvement). The driver functions are looked up
// through the runtime's entry-point query, so the extension does not link
// libcuda itself. Where the driver has no stream memory operations, a
// one-thread kernel does the same (it occupies a block while it waits).
#include <cuda.h>  // driver types and flags only; no driver symbol is linked
#include <cuda_runtime.h>

#include <cstring>

#include "stagewise/ring.h"

namespace stagewise::cuda {
namespace {

using WaitValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using WriteValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

struct StreamMemOps {
  WaitValue32 wait = nullptr;
  WriteValue32 write = nullptr;
};

void* driver_entry_point(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) != cudaSuccess) {
    return nullptr;
  }
#else
  if (cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &found) != cudaSuccess) return nullptr;
#endif
  return found == cudaDriverEntryPointSuccess ? fn : nullptr;
}

// Looked up once per process; null members select the kernel fallback.
const StreamMemOps& stream_mem_ops() {
  static const StreamMemOps ops = [] {
    StreamMemOps o;
    o.wait = reinterpret_cast<WaitValue32>(driver_entry_point("cuStreamWaitValue32"));
    o.write = reinterpret_cast<WriteValue32>(driver_entry_point("cuStreamWriteValue32"));
    if (o.wait == nullptr || o.write == nullptr) o = StreamMemOps{};
    return o;
  }();
  return ops;
}

// Wrap-aware "counter has reached value", as CU_STREAM_WAIT_VALUE_GEQ.
__global__ void wait_counter_kernel(const volatile uint32_t* counter, uint32_t value) {
  while (static_cast<int32_t>(*counter - value) < 0) __nanosleep(200);
  __threadfence_system();  // later reads of the slot see the producer's bytes
}

__global__ void write_counter_kernel(volatile uint32_t* counter, uint32_t value) {
  __threadfence_system();  // the stream's earlier writes first
  *counter = value;
}

cudaError_t from_driver(CUresult r) { return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorUnknown; }

}  // namespace

cudaError_t ipc_alloc(void** ptr, uint64_t nbytes) {
  // Plain cudaMalloc, not a caching allocator: an IPC handle names a whole
  // allocation, and the peer maps exactly this one.
  cudaError_t err = cudaMalloc(ptr, nbytes);
  if (err != cudaSuccess) return err;
  err = cudaMemset(*ptr, 0, nbytes);  // counters start at 0; synchronous w.r.t. the host
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) cudaFree(*ptr);
  return err;
}

cudaError_t ipc_free(void* ptr) { return cudaFree(ptr); }

cudaError_t ipc_get_handle(void* ptr, uint8_t* handle) {
  static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes, "unexpected cudaIpcMemHandle_t size");
  cudaIpcMemHandle_t h;
  const cudaError_t err = cudaIpcGetMemHandle(&h, ptr);
  if (err == cudaSuccess) memcpy(handle, &h, sizeof h);
  return err;
}

cudaError_t ipc_open(const uint8_t* handle, void** ptr) {
  // The device's context must exist first (a process that has only selected the device has
  // none yet: "invalid device context"); cudaFree(nullptr) creates it.
  const cudaError_t ctx = cudaFree(nullptr);
  if (ctx != cudaSuccess) return ctx;
  cudaIpcMemHandle_t h;
  memcpy(&h, handle, sizeof h);
  // Lazy peer access: the peer's allocation may live on another GPU.
  return cudaIpcOpenMemHandle(ptr, h, cudaIpcMemLazyEnablePeerAccess);
}

cudaError_t ipc_close(void* ptr) { return cudaIpcCloseMemHandle(ptr); }

cudaError_t pointer_device(const void* ptr, int* device) {
  cudaPointerAttributes attr;
  const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err == cudaSuccess) *device = attr.device;
  return err;
}

cudaError_t can_access_peer(int device, int peer, bool* ok) {
  int can = 0;
  const cudaError_t err = cudaDeviceCanAccessPeer(&can, device, peer);
  *ok = err == cudaSuccess && can != 0;
  return err;
}

cudaError_t stream_wait_counter(cudaStream_t stream, uint32_t* addr, uint32_t value) {
  const StreamMemOps& ops = stream_mem_ops();
  if (ops.wait != nullptr) {
    return from_driver(ops.wait(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(addr), value,
                                CU_STREAM_WAIT_VALUE_GEQ));
  }
  wait_counter_kernel<<<1, 1, 0, stream>>>(addr, value);
  return cudaGetLastError();
}

cudaError_t stream_write_counter(cudaStream_t stream, uint32_t* addr, uint32_t value) {
  const StreamMemOps& ops = stream_mem_ops();
  if (ops.write != nullptr) {
    // Default flags: the write is preceded by a system-wide memory barrier.
    return from_driver(
        ops.write(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(addr), value, 0));
  }
  write_counter_kernel<<<1, 1, 0, stream>>>(addr, value);
  return cudaGetLastError();
}

}  // namespace stagewise::cuda
