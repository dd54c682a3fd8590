// A host-side stand-in for the CUDA driver calls the allocator extension
// imports (nm -D --undefined-only _cumem*.so, of its rocm-on-cuda build too),
// so that its arena and runs run on a machine without a GPU
// (tests/unit/test_allocator_on_fake_driver.py).
// Loaded with RTLD_GLOBAL before the extension, whose cu* symbols resolve here.
//
// What it models, and where from: reservations, physical allocations and
// mappings with the driver's bookkeeping, no memory behind them. Like the H100
// driver of issue 38's leases (580.159.04): a mapping must start at offset 0 of
// its allocation (lease 17: CUDA_ERROR_NOT_SUPPORTED otherwise), may cross
// neighbouring reservations, and is unmapped whole (lease 18: a part of one,
// CUDA_ERROR_INVALID_VALUE); a released allocation lives until its last mapping
// goes. Not modelled: contents, streams, devices beyond their number.
#include <cuda.h>

#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <string>

namespace {

constexpr size_t kGranularity = size_t{2} << 20;

struct Physical {
  size_t size = 0;
  int mappings = 0;
  bool released = false;
};

struct Mapping {
  size_t size = 0;
  CUmemGenericAllocationHandle handle = 0;
};

std::mutex g_mutex;
std::map<uint64_t, size_t> g_reservations;  // base -> size
std::map<CUmemGenericAllocationHandle, Physical> g_physical;
std::map<uint64_t, Mapping> g_mappings;  // base -> mapping
std::map<std::string, long> g_calls;
uint64_t g_next_address = 0x100000000000ULL;
CUmemGenericAllocationHandle g_next_handle = 1;
size_t g_capacity = ~size_t{0};
size_t g_used = 0;
size_t g_stack_limit = 1024;
std::string g_fail_call;
CUresult g_fail_status = CUDA_SUCCESS;
long g_fail_skip = 0;
thread_local CUcontext t_current = nullptr;

// Counts the call; true when the test asked this one to fail.
bool failing(const char* call) {
  ++g_calls[call];
  if (g_fail_call != call) {
    return false;
  }
  if (g_fail_skip-- > 0) {
    return false;
  }
  g_fail_call.clear();
  return true;
}

bool overlaps_reservation(uint64_t base, size_t size) {
  auto it = g_reservations.upper_bound(base);
  if (it != g_reservations.begin()) {
    auto before = std::prev(it);
    if (before->first + before->second > base) {
      return true;
    }
  }
  return it != g_reservations.end() && it->first < base + size;
}

// Whether [base, base + size) lies in reservations that follow one another.
bool reserved(uint64_t base, size_t size) {
  uint64_t at = base;
  while (at < base + size) {
    auto it = g_reservations.upper_bound(at);
    if (it == g_reservations.begin()) {
      return false;
    }
    --it;
    if (it->first + it->second <= at) {
      return false;
    }
    at = it->first + it->second;
  }
  return true;
}

bool overlaps_mapping(uint64_t base, size_t size) {
  auto it = g_mappings.upper_bound(base);
  if (it != g_mappings.begin()) {
    auto before = std::prev(it);
    if (before->first + before->second.size > base) {
      return true;
    }
  }
  return it != g_mappings.end() && it->first < base + size;
}

void drop_if_done(CUmemGenericAllocationHandle handle) {
  auto it = g_physical.find(handle);
  if (it != g_physical.end() && it->second.released && it->second.mappings == 0) {
    g_used -= it->second.size;
    g_physical.erase(it);
  }
}

uint64_t align_up(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

}  // namespace

extern "C" {

CUresult cuGetErrorString(CUresult status, const char** message) {
  switch (status) {
    case CUDA_SUCCESS: *message = "no error"; break;
    case CUDA_ERROR_INVALID_VALUE: *message = "invalid argument"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *message = "out of memory"; break;
    case CUDA_ERROR_NOT_SUPPORTED: *message = "operation not supported"; break;
    default: *message = "unknown error"; break;
  }
  return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext* context) {
  *context = t_current;
  return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext* context, CUdevice device) {
  *context = reinterpret_cast<CUcontext>(static_cast<uintptr_t>(0x1000 + device));
  return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext context) {
  t_current = context;
  return CUDA_SUCCESS;
}

// The rocm-on-cuda build's hipGetDevice asks for it (tests/rocm_shim).
CUresult cuCtxGetDevice(CUdevice* device) {
  if (t_current == nullptr) {
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  *device = static_cast<CUdevice>(reinterpret_cast<uintptr_t>(t_current) - 0x1000);
  return CUDA_SUCCESS;
}

CUresult cuCtxGetLimit(size_t* value, CUlimit /*limit*/) {
  std::lock_guard<std::mutex> lock(g_mutex);
  *value = g_stack_limit;
  return CUDA_SUCCESS;
}

CUresult cuCtxSetLimit(CUlimit /*limit*/, size_t value) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_stack_limit = value;
  return CUDA_SUCCESS;
}

CUresult cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* /*prop*/,
                                       CUmemAllocationGranularity_flags /*option*/) {
  *granularity = kGranularity;
  return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr* address, size_t size, size_t alignment,
                             CUdeviceptr wanted, unsigned long long /*flags*/) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (failing("cuMemAddressReserve")) {
    return g_fail_status;
  }
  if (size == 0 || size % kGranularity != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  alignment = alignment == 0 ? kGranularity : alignment;
  uint64_t base = wanted;
  if (base == 0 || base % alignment != 0 || overlaps_reservation(base, size)) {
    base = align_up(g_next_address, alignment);
    while (overlaps_reservation(base, size)) {
      base = align_up(base + kGranularity, alignment);
    }
    g_next_address = base + size;
  }
  g_reservations[base] = size;
  *address = base;
  return CUDA_SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr address, size_t size) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (failing("cuMemAddressFree")) {
    return g_fail_status;
  }
  auto it = g_reservations.find(address);
  if (it == g_reservations.end() || it->second != size || overlaps_mapping(address, size)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  g_reservations.erase(it);
  return CUDA_SUCCESS;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size,
                     const CUmemAllocationProp* /*prop*/, unsigned long long /*flags*/) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (failing("cuMemCreate")) {
    return g_fail_status;
  }
  if (size == 0 || size % kGranularity != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (size > g_capacity - g_used) {
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  g_used += size;
  *handle = g_next_handle++;
  g_physical[*handle] = Physical{size, 0, false};
  return CUDA_SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (failing("cuMemRelease")) {
    return g_fail_status;
  }
  auto it = g_physical.find(handle);
  if (it == g_physical.end() || it->second.released) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  it->second.released = true;
  drop_if_done(handle);
  return CUDA_SUCCESS;
}

CUresult cuMemMap(CUdeviceptr address, size_t size, size_t offset,
                  CUmemGenericAllocationHandle handle, unsigned long long /*flags*/) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (failing("cuMemMap")) {
    return g_fail_status;
  }
  auto it = g_physical.find(handle);
  if (offset != 0) {
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  if (it == g_physical.end() || it->second.released || size != it->second.size ||
      !reserved(address, size) || overlaps_mapping(address, size)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  ++it->second.mappings;
  g_mappings[address] = Mapping{size, handle};
  return CUDA_SUCCESS;
}

CUresult cuMemUnmap(CUdeviceptr address, size_t size) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (failing("cuMemUnmap")) {
    return g_fail_status;
  }
  // Whole mappings only, one after another from `address`.
  uint64_t at = address;
  while (at < address + size) {
    auto it = g_mappings.find(at);
    if (it == g_mappings.end() || at + it->second.size > address + size) {
      return CUDA_ERROR_INVALID_VALUE;
    }
    at += it->second.size;
  }
  at = address;
  while (at < address + size) {
    auto it = g_mappings.find(at);
    const CUmemGenericAllocationHandle handle = it->second.handle;
    at += it->second.size;
    g_mappings.erase(it);
    --g_physical[handle].mappings;
    drop_if_done(handle);
  }
  return CUDA_SUCCESS;
}

CUresult cuMemSetAccess(CUdeviceptr address, size_t size, const CUmemAccessDesc* /*desc*/,
                        size_t /*count*/) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (failing("cuMemSetAccess")) {
    return g_fail_status;
  }
  auto it = g_mappings.find(address);
  return it != g_mappings.end() && it->second.size >= size ? CUDA_SUCCESS
                                                           : CUDA_ERROR_INVALID_VALUE;
}

// -- for the tests ----------------------------------------------------------

void fake_cuda_set_capacity(size_t bytes) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_capacity = bytes;
}

// The `skip`+1-th next call of `call` fails with `status`.
void fake_cuda_fail(const char* call, int status, long skip) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_fail_call = call;
  g_fail_status = static_cast<CUresult>(status);
  g_fail_skip = skip;
}

long fake_cuda_calls(const char* call) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_calls.find(call);
  return it == g_calls.end() ? 0 : it->second;
}

size_t fake_cuda_physical_bytes() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_used;
}

size_t fake_cuda_mapped_bytes() {
  std::lock_guard<std::mutex> lock(g_mutex);
  size_t total = 0;
  for (const auto& entry : g_mappings) {
    total += entry.second.size;
  }
  return total;
}

size_t fake_cuda_reservations() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_reservations.size();
}

int fake_cuda_is_reserved(uint64_t address) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return reserved(address, kGranularity) ? 1 : 0;
}

}  // extern "C"
