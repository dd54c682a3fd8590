// TEST ONLY: the few HIP names csrc/cumem_compat.h uses, mapped onto the CUDA
// driver API, so the allocator's ROCm code path (USE_ROCM) runs on an NVIDIA GPU.
//
// Built by `cmake -DGRAPH_SLEEP_TARGET=rocm-on-cuda` (CMakeLists.txt), which puts
// this folder first on the include path so that <hip/hip_runtime_api.h> is this
// file. Never installed, never part of a wheel.
//
// What it proves and what it does not (docs/design.md, "ROCm"): the ROCm branch
// of the allocator (placeholder reservation while asleep, the address taken back
// on wake, my_free of a sleeping allocation, zero-on-wake chosen by Python) runs
// against a real VMM driver. AMD's driver semantics are NOT reproduced: on CUDA
// the physical memory returns on cuMemRelease whether or not the range stays
// reserved, hipGetDevice/hipSetDevice are emulated with the primary context, and
// granularity, stale VRAM and hint-address behaviour are NVIDIA's.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>

using hipError_t = CUresult;
using hipMemGenericAllocationHandle_t = CUmemGenericAllocationHandle;
using hipStream_t = CUstream;
using hipMemAllocationProp = CUmemAllocationProp;
using hipMemAccessDesc = CUmemAccessDesc;
using hipMemAllocationGranularity_flags = CUmemAllocationGranularity_flags;

constexpr hipError_t hipSuccess = CUDA_SUCCESS;
constexpr CUmemAllocationType hipMemAllocationTypePinned = CU_MEM_ALLOCATION_TYPE_PINNED;
constexpr CUmemLocationType hipMemLocationTypeDevice = CU_MEM_LOCATION_TYPE_DEVICE;
constexpr CUmemAccess_flags hipMemAccessFlagsProtReadWrite = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
constexpr hipMemAllocationGranularity_flags hipMemAllocationGranularityMinimum =
    CU_MEM_ALLOC_GRANULARITY_MINIMUM;

inline const char* hipGetErrorString(hipError_t status) {
  const char* message = nullptr;
  if (cuGetErrorString(status, &message) != CUDA_SUCCESS || message == nullptr) {
    return "unrecognized error code";
  }
  return message;
}

// HIP's runtime makes device 0 current on a thread that never chose one; the
// driver API has no current context there, so take device 0's primary context.
inline hipError_t hipSetDevice(int device) {
  CUcontext primary = nullptr;
  CUresult status = cuDevicePrimaryCtxRetain(&primary, device);
  return status == CUDA_SUCCESS ? cuCtxSetCurrent(primary) : status;
}

inline hipError_t hipGetDevice(int* device) {
  CUcontext current = nullptr;
  CUresult status = cuCtxGetCurrent(&current);
  if (status == CUDA_SUCCESS && current == nullptr) {
    status = hipSetDevice(0);
  }
  CUdevice ordinal = 0;
  if (status == CUDA_SUCCESS) {
    status = cuCtxGetDevice(&ordinal);
  }
  *device = static_cast<int>(ordinal);
  return status;
}

inline hipError_t hipMemGetAllocationGranularity(size_t* granularity,
                                                 const hipMemAllocationProp* prop,
                                                 hipMemAllocationGranularity_flags option) {
  return cuMemGetAllocationGranularity(granularity, prop, option);
}

inline hipError_t hipMemAddressReserve(void** ptr, size_t size, size_t alignment, void* addr,
                                       unsigned long long flags) {
  CUdeviceptr reserved = 0;
  CUresult status =
      cuMemAddressReserve(&reserved, size, alignment, reinterpret_cast<CUdeviceptr>(addr), flags);
  *ptr = reinterpret_cast<void*>(reserved);
  return status;
}

namespace hip_shim {
// One-shot "another thread wins the race" for the test that loses the
// placeholder: armed by hip_shim_steal_next_freed_range().
inline bool steal_armed = false;
inline CUdeviceptr stolen_address = 0;
inline size_t stolen_size = 0;
}  // namespace hip_shim

inline hipError_t hipMemAddressFree(void* ptr, size_t size) {
  const auto address = reinterpret_cast<CUdeviceptr>(ptr);
  CUresult status = cuMemAddressFree(address, size);
  if (status == CUDA_SUCCESS && hip_shim::steal_armed) {
    hip_shim::steal_armed = false;
    if (cuMemAddressReserve(&hip_shim::stolen_address, size, 0, address, 0) == CUDA_SUCCESS) {
      hip_shim::stolen_size = size;
    }
  }
  return status;
}

inline hipError_t hipMemCreate(hipMemGenericAllocationHandle_t* handle, size_t size,
                               const hipMemAllocationProp* prop, unsigned long long flags) {
  return cuMemCreate(handle, size, prop, flags);
}

inline hipError_t hipMemRelease(hipMemGenericAllocationHandle_t handle) {
  return cuMemRelease(handle);
}

inline hipError_t hipMemMap(void* ptr, size_t size, size_t offset,
                            hipMemGenericAllocationHandle_t handle, unsigned long long flags) {
  return cuMemMap(reinterpret_cast<CUdeviceptr>(ptr), size, offset, handle, flags);
}

inline hipError_t hipMemUnmap(void* ptr, size_t size) {
  return cuMemUnmap(reinterpret_cast<CUdeviceptr>(ptr), size);
}

inline hipError_t hipMemSetAccess(void* ptr, size_t size, const hipMemAccessDesc* desc,
                                  size_t count) {
  return cuMemSetAccess(reinterpret_cast<CUdeviceptr>(ptr), size, desc, count);
}

// Test hooks, exported from the rocm-on-cuda build only (tests/basic_correctness/
// memory/cumem/test_cumem.py calls them through ctypes).
#define HIP_SHIM_EXPORT extern "C" __attribute__((visibility("default")))

// The next range the allocator frees is reserved again at once, as if another
// thread of the process had taken it between the free and the placeholder.
HIP_SHIM_EXPORT void hip_shim_steal_next_freed_range() { hip_shim::steal_armed = true; }

// Gives a stolen range back; returns the address it held (0 if none).
HIP_SHIM_EXPORT unsigned long long hip_shim_return_stolen_range() {
  const CUdeviceptr address = hip_shim::stolen_address;
  if (address != 0 && cuMemAddressFree(address, hip_shim::stolen_size) == CUDA_SUCCESS) {
    hip_shim::stolen_address = 0;
    hip_shim::stolen_size = 0;
  }
  return address;
}
