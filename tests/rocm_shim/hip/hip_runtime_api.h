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
// granularity and stale VRAM are NVIDIA's. AMD's answer to a reservation that
// asks for a freed range by address (it gets it) is emulated by the shim itself
// (hip_shim::parked below), since NVIDIA's driver does not give it.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

// The HIP release whose API this file stands in for (the stack limit is 6.0+).
#define HIP_VERSION_MAJOR 6

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

namespace hip_shim {
// AMD's driver hands a freed range back to a reservation that asks for it by
// address (vLLM's ROCm path relies on that to hold the range while asleep, see
// _python_free_callback in vllm/device_allocator/cumem.py). NVIDIA's does not:
// on the H200 a range freed with cuMemAddressFree and asked for again at once
// came back elsewhere (docs/results/rocm-on-cuda-h200.md). So the shim never
// frees a range in the driver: hipMemAddressFree parks it here, still reserved
// (no other CUDA reservation can land on it), and a hipMemAddressReserve that
// asks for its address gets it back, as AMD's would. Physical memory is not
// affected: it returns on hipMemRelease either way.
struct Range {
  CUdeviceptr address;
  size_t size;
};
inline std::mutex parked_mutex;
inline std::vector<Range> parked;

// One-shot "another thread wins the race" for the test that loses the
// placeholder: armed by hip_shim_steal_next_freed_range().
inline bool steal_armed = false;
inline Range stolen{0, 0};

// One-shot refusal of a range's free (the driver keeps it reserved): armed by
// hip_shim_refuse_next_address_free().
inline bool refuse_free_armed = false;

inline bool take_parked(CUdeviceptr address, size_t size) {
  std::lock_guard<std::mutex> lock(parked_mutex);
  for (auto it = parked.begin(); it != parked.end(); ++it) {
    if (it->address == address && it->size == size) {
      parked.erase(it);
      return true;
    }
  }
  return false;
}
}  // namespace hip_shim

inline hipError_t hipMemAddressReserve(void** ptr, size_t size, size_t alignment, void* addr,
                                       unsigned long long flags) {
  const auto wanted = reinterpret_cast<CUdeviceptr>(addr);
  if (wanted != 0 && hip_shim::take_parked(wanted, size)) {
    *ptr = addr;
    return CUDA_SUCCESS;
  }
  CUdeviceptr reserved = 0;
  CUresult status = cuMemAddressReserve(&reserved, size, alignment, wanted, flags);
  *ptr = reinterpret_cast<void*>(reserved);
  return status;
}

inline hipError_t hipMemAddressFree(void* ptr, size_t size) {
  const auto address = reinterpret_cast<CUdeviceptr>(ptr);
  if (hip_shim::refuse_free_armed) {
    hip_shim::refuse_free_armed = false;
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  if (hip_shim::steal_armed) {
    // The thief holds the range: neither parked nor freed in the driver.
    hip_shim::steal_armed = false;
    hip_shim::stolen = {address, size};
    return CUDA_SUCCESS;
  }
  std::lock_guard<std::mutex> lock(hip_shim::parked_mutex);
  hip_shim::parked.push_back({address, size});
  return CUDA_SUCCESS;
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

// hipDeviceGetLimit/hipDeviceSetLimit act on the current device, as the
// context-scoped driver calls do once the device's primary context is current.
using hipLimit_t = CUlimit;
constexpr hipLimit_t hipLimitStackSize = CU_LIMIT_STACK_SIZE;

inline hipError_t hipDeviceGetLimit(size_t* value, hipLimit_t limit) {
  return cuCtxGetLimit(value, limit);
}

inline hipError_t hipDeviceSetLimit(hipLimit_t limit, size_t value) {
  return cuCtxSetLimit(limit, value);
}

// Test hooks, exported from the rocm-on-cuda build only (tests/basic_correctness/
// memory/cumem/test_cumem.py calls them through ctypes).
#define HIP_SHIM_EXPORT extern "C" __attribute__((visibility("default")))

// The next range the allocator frees is reserved again at once, as if another
// thread of the process had taken it between the free and the placeholder.
HIP_SHIM_EXPORT void hip_shim_steal_next_freed_range() { hip_shim::steal_armed = true; }

// The driver refuses the next range's free (hipMemAddressFree), once.
HIP_SHIM_EXPORT void hip_shim_refuse_next_address_free() { hip_shim::refuse_free_armed = true; }

// Gives a stolen range back (freed, so a reservation that asks for its
// address gets it); returns the address it held (0 if none).
HIP_SHIM_EXPORT unsigned long long hip_shim_return_stolen_range() {
  const hip_shim::Range range = hip_shim::stolen;
  if (range.address != 0) {
    hip_shim::stolen = {0, 0};
    std::lock_guard<std::mutex> lock(hip_shim::parked_mutex);
    hip_shim::parked.push_back(range);
  }
  return range.address;
}

// What another HIP user of this process gets when it asks for
// [address, address + size): the address it was given (then freed again).
HIP_SHIM_EXPORT unsigned long long hip_shim_reserve_elsewhere(unsigned long long address,
                                                              size_t size) {
  void* got = nullptr;
  if (hipMemAddressReserve(&got, size, 0, reinterpret_cast<void*>(address), 0) != hipSuccess) {
    return 0;
  }
  hipMemAddressFree(got, size);
  return reinterpret_cast<unsigned long long>(got);
}
