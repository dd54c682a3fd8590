// CUDA / HIP mapping for the virtual-memory allocator.
//
// Everything that differs between the CUDA driver API and HIP's VMM API lives
// here, so cumem_allocator.cpp has no platform #ifdef in its function bodies.
// Each wrapper returns a DriverResult naming the driver call it made, so the
// core can report "<call> failed: <driver message>" without knowing the
// platform.
//
// Capture safety: nothing in this header may enqueue work on a stream (no
// memset, no stream API). The mapping path runs inside CUDA/HIP graph capture;
// .ci/run checks the built binary for memset and stream imports.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(USE_ROCM)
#include <hip/hip_runtime_api.h>
#else
#include <cuda.h>
#endif

namespace graph_sleep {

#if defined(USE_ROCM)
using DriverStatus = hipError_t;
using PhysicalHandle = hipMemGenericAllocationHandle_t;
using StreamHandle = hipStream_t;
constexpr DriverStatus kDriverOk = hipSuccess;
constexpr const char* kPlatform = "rocm";
// ROCm keeps physical VRAM charged to a process while the reservation it was
// mapped under lives (vllm-project/vllm#37533), so sleep frees that reservation
// and at once reserves the same range again, empty: a placeholder that gives the
// VRAM back and keeps the address for wake (vllm-project/vllm#46203).
constexpr bool kPlaceholderWhileAsleep = true;
#else
using DriverStatus = CUresult;
using PhysicalHandle = CUmemGenericAllocationHandle;
using StreamHandle = CUstream;
constexpr DriverStatus kDriverOk = CUDA_SUCCESS;
constexpr const char* kPlatform = "cuda";
// CUDA returns physical memory on cuMemRelease; the reservation stays as it is.
constexpr bool kPlaceholderWhileAsleep = false;
#endif

struct DriverResult {
  DriverStatus status;
  const char* call;
  bool ok() const { return status == kDriverOk; }
};

inline const char* driver_message(DriverStatus status) {
#if defined(USE_ROCM)
  return hipGetErrorString(status);
#else
  const char* message = nullptr;
  if (cuGetErrorString(status, &message) != CUDA_SUCCESS || message == nullptr) {
    return "unknown driver error";
  }
  return message;
#endif
}

// Makes `device` usable from the calling thread. Torch calls the allocator from
// threads that may never have touched the device (DBO micro-batch threads).
inline DriverResult bind_device(int device) {
#if defined(USE_ROCM)
  int current = -1;
  hipError_t status = hipGetDevice(&current);
  if (status == hipSuccess && current != device) {
    status = hipSetDevice(device);
    return {status, "hipSetDevice"};
  }
  return {status, "hipGetDevice"};
#else
  CUcontext current = nullptr;
  CUresult status = cuCtxGetCurrent(&current);
  if (status != CUDA_SUCCESS || current != nullptr) {
    return {status, "cuCtxGetCurrent"};
  }
  CUcontext primary = nullptr;
  status = cuDevicePrimaryCtxRetain(&primary, device);
  if (status != CUDA_SUCCESS) {
    return {status, "cuDevicePrimaryCtxRetain"};
  }
  return {cuCtxSetCurrent(primary), "cuCtxSetCurrent"};
#endif
}

#if defined(USE_ROCM)
inline hipMemAllocationProp device_allocation_prop(int device) {
  hipMemAllocationProp prop = {};
  prop.type = hipMemAllocationTypePinned;
  prop.location.type = hipMemLocationTypeDevice;
  prop.location.id = device;
  return prop;
}
#else
inline CUmemAllocationProp device_allocation_prop(int device) {
  // No requested handle types: the memory is deliberately not exportable.
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}
#endif

inline DriverResult allocation_granularity(int device, size_t* granularity) {
  auto prop = device_allocation_prop(device);
#if defined(USE_ROCM)
  return {hipMemGetAllocationGranularity(granularity, &prop,
                                         hipMemAllocationGranularityMinimum),
          "hipMemGetAllocationGranularity"};
#else
  return {cuMemGetAllocationGranularity(granularity, &prop,
                                        CU_MEM_ALLOC_GRANULARITY_MINIMUM),
          "cuMemGetAllocationGranularity"};
#endif
}

// Reserves `size` bytes of address space; `wanted` != 0 asks for that address.
inline DriverResult reserve_address(uint64_t* address, size_t size, size_t alignment,
                                    uint64_t wanted) {
#if defined(USE_ROCM)
  void* ptr = nullptr;
  hipError_t status = hipMemAddressReserve(&ptr, size, alignment,
                                           reinterpret_cast<void*>(wanted), 0);
  *address = reinterpret_cast<uint64_t>(ptr);
  return {status, "hipMemAddressReserve"};
#else
  CUdeviceptr ptr = 0;
  CUresult status = cuMemAddressReserve(&ptr, size, alignment, wanted, 0);
  *address = static_cast<uint64_t>(ptr);
  return {status, "cuMemAddressReserve"};
#endif
}

inline DriverResult free_address(uint64_t address, size_t size) {
#if defined(USE_ROCM)
  return {hipMemAddressFree(reinterpret_cast<void*>(address), size), "hipMemAddressFree"};
#else
  return {cuMemAddressFree(address, size), "cuMemAddressFree"};
#endif
}

inline DriverResult create_physical(PhysicalHandle* handle, size_t size, int device) {
  auto prop = device_allocation_prop(device);
#if defined(USE_ROCM)
  return {hipMemCreate(handle, size, &prop, 0), "hipMemCreate"};
#else
  return {cuMemCreate(handle, size, &prop, 0), "cuMemCreate"};
#endif
}

inline DriverResult release_physical(PhysicalHandle handle) {
#if defined(USE_ROCM)
  return {hipMemRelease(handle), "hipMemRelease"};
#else
  return {cuMemRelease(handle), "cuMemRelease"};
#endif
}

inline DriverResult map_physical(uint64_t address, size_t size, PhysicalHandle handle) {
#if defined(USE_ROCM)
  return {hipMemMap(reinterpret_cast<void*>(address), size, 0, handle, 0), "hipMemMap"};
#else
  return {cuMemMap(address, size, 0, handle, 0), "cuMemMap"};
#endif
}

inline DriverResult unmap_physical(uint64_t address, size_t size) {
#if defined(USE_ROCM)
  return {hipMemUnmap(reinterpret_cast<void*>(address), size), "hipMemUnmap"};
#else
  return {cuMemUnmap(address, size), "cuMemUnmap"};
#endif
}

inline DriverResult grant_read_write(uint64_t address, size_t size, int device) {
#if defined(USE_ROCM)
  hipMemAccessDesc access = {};
  access.location.type = hipMemLocationTypeDevice;
  access.location.id = device;
  access.flags = hipMemAccessFlagsProtReadWrite;
  return {hipMemSetAccess(reinterpret_cast<void*>(address), size, &access, 1),
          "hipMemSetAccess"};
#else
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return {cuMemSetAccess(address, size, &access, 1), "cuMemSetAccess"};
#endif
}

}  // namespace graph_sleep
