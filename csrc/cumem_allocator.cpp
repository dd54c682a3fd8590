// Virtual-memory allocator behind vllm-graph-sleep's sleep mode.
//
// Torch uses my_malloc/my_free as a pluggable allocator; Python drives sleep
// and wake through create_and_map/unmap_and_release. Each allocation reserves
// its virtual range once. Sleep unmaps and releases the physical memory but
// (on CUDA) keeps the range, so pointers baked into CUDA graphs stay valid and
// wake maps fresh physical memory at the same address. On ROCm the range is
// released too and re-reserved at the same address on wake (see
// cumem_compat.h).
//
// ABI rules: nothing here throws or exits. Driver failures are recorded in a
// per-thread message "<call> failed: <driver message>" that the Python entry
// points raise as RuntimeError; my_malloc returns nullptr (torch reports the
// OOM) and my_free logs. The mapping path enqueues no stream work: it runs
// during graph capture.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cinttypes>
#include <cstdio>
#include <new>
#include <string>
#include <sys/types.h>

#include "cumem_compat.h"

#define GRAPH_SLEEP_EXPORT extern "C" __attribute__((visibility("default")))

namespace graph_sleep {
namespace {

// Strong references, owned by this module (set by register_callbacks).
PyObject* g_on_malloc = nullptr;
PyObject* g_on_free = nullptr;

thread_local std::string t_last_error;

bool succeeded(DriverResult result) {
  if (result.ok()) {
    return true;
  }
  t_last_error = std::string(result.call) + " failed: " + driver_message(result.status);
  return false;
}

// Holds the GIL for the lifetime of the object, whatever path leaves the scope.
class GilHold {
 public:
  GilHold() : state_(PyGILState_Ensure()) {}
  ~GilHold() { PyGILState_Release(state_); }
  GilHold(const GilHold&) = delete;
  GilHold& operator=(const GilHold&) = delete;

 private:
  PyGILState_STATE state_;
};

// Owns a new Python reference and drops it on every path.
class PyRef {
 public:
  explicit PyRef(PyObject* object) : object_(object) {}
  ~PyRef() { Py_XDECREF(object_); }
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  PyObject* get() const { return object_; }

 private:
  PyObject* object_;
};

bool interpreter_alive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

// Creates physical memory and maps it read-write at an already reserved range.
// All or nothing: on failure nothing stays created or mapped.
bool map_fresh_memory(int device, uint64_t address, size_t size, PhysicalHandle* handle) {
  if (!succeeded(create_physical(handle, size, device))) {
    return false;
  }
  if (!succeeded(map_physical(address, size, *handle))) {
    release_physical(*handle);
    return false;
  }
  if (!succeeded(grant_read_write(address, size, device))) {
    unmap_physical(address, size);
    release_physical(*handle);
    return false;
  }
  return true;
}

bool reclaim_address(int device, uint64_t address, size_t size) {
  size_t granularity = 0;
  if (!succeeded(allocation_granularity(device, &granularity))) {
    return false;
  }
  uint64_t got = 0;
  if (!succeeded(reserve_address(&got, size, granularity, address))) {
    return false;
  }
  if (got != address) {
    free_address(got, size);
    char message[160];
    std::snprintf(message, sizeof(message),
                  "address re-reservation failed: 0x%" PRIx64
                  " is taken by another mapping (driver offered 0x%" PRIx64 ")",
                  address, got);
    t_last_error = message;
    return false;
  }
  return true;
}

bool create_and_map(int device, size_t size, uint64_t address, PhysicalHandle* handle) {
  if (!succeeded(bind_device(device))) {
    return false;
  }
  if (kReleaseAddressOnSleep && !reclaim_address(device, address, size)) {
    return false;
  }
  if (!map_fresh_memory(device, address, size, handle)) {
    if (kReleaseAddressOnSleep) {
      free_address(address, size);
    }
    return false;
  }
  return true;
}

bool unmap_and_release(int device, size_t size, uint64_t address, PhysicalHandle* handle) {
  if (!succeeded(bind_device(device))) {
    return false;
  }
  if (!succeeded(unmap_physical(address, size))) {
    return false;
  }
  if (!succeeded(release_physical(*handle))) {
    return false;
  }
  return !kReleaseAddressOnSleep || succeeded(free_address(address, size));
}

// Tells Python about a new allocation; false (with the error recorded) if the
// callback is missing or raised.
bool announce_allocation(int device, size_t size, uint64_t address, PhysicalHandle* handle) {
  GilHold gil;
  if (g_on_malloc == nullptr) {
    t_last_error = "my_malloc failed: register_callbacks() was never called";
    return false;
  }
  PyRef result(PyObject_CallFunction(g_on_malloc, "iKKK", device,
                                     static_cast<unsigned long long>(size),
                                     static_cast<unsigned long long>(address),
                                     static_cast<unsigned long long>(
                                         reinterpret_cast<uintptr_t>(handle))));
  if (result.get() == nullptr) {
    t_last_error = "my_malloc failed: the Python malloc callback raised";
    PyErr_WriteUnraisable(g_on_malloc);
    return false;
  }
  return true;
}

struct ReleaseOrder {
  size_t size = 0;
  PhysicalHandle* handle = nullptr;
  bool mapped = false;
};

// Asks Python to forget an allocation. Python answers (size, handle, mapped).
bool withdraw_allocation(uint64_t address, ReleaseOrder* order) {
  if (!interpreter_alive()) {
    t_last_error = "my_free skipped: the Python interpreter is shutting down";
    return false;
  }
  GilHold gil;
  if (g_on_free == nullptr) {
    t_last_error = "my_free failed: register_callbacks() was never called";
    return false;
  }
  PyRef result(PyObject_CallFunction(g_on_free, "K", static_cast<unsigned long long>(address)));
  unsigned long long size = 0;
  unsigned long long handle = 0;
  int mapped = 0;
  if (result.get() == nullptr ||
      !PyArg_ParseTuple(result.get(), "KKp", &size, &handle, &mapped)) {
    t_last_error = "my_free failed: the Python free callback raised or answered badly";
    PyErr_WriteUnraisable(g_on_free);
    return false;
  }
  order->size = static_cast<size_t>(size);
  order->handle = reinterpret_cast<PhysicalHandle*>(static_cast<uintptr_t>(handle));
  order->mapped = mapped != 0;
  return true;
}

void report_free_failure() {
  std::fprintf(stderr, "[vllm_graph_sleep] %s\n", t_last_error.c_str());
}

}  // namespace
}  // namespace graph_sleep

using namespace graph_sleep;

// ---------------------------------------------------------------------------
// Pluggable-allocator entry points called by torch (C ABI).
// ---------------------------------------------------------------------------

GRAPH_SLEEP_EXPORT void* my_malloc(ssize_t size, int device, StreamHandle /*stream*/) {
  if (size <= 0) {
    t_last_error = "my_malloc failed: size must be positive";
    return nullptr;
  }
  size_t granularity = 0;
  if (!succeeded(bind_device(device)) ||
      !succeeded(allocation_granularity(device, &granularity))) {
    return nullptr;
  }
  const size_t aligned = (static_cast<size_t>(size) + granularity - 1) / granularity * granularity;
  uint64_t address = 0;
  if (!succeeded(reserve_address(&address, aligned, granularity, 0))) {
    return nullptr;
  }
  auto* handle = new (std::nothrow) PhysicalHandle{};
  if (handle == nullptr) {
    t_last_error = "my_malloc failed: out of host memory for the handle";
    free_address(address, aligned);
    return nullptr;
  }
  if (!map_fresh_memory(device, address, aligned, handle)) {
    delete handle;
    free_address(address, aligned);
    return nullptr;
  }
  if (!announce_allocation(device, aligned, address, handle)) {
    unmap_physical(address, aligned);
    release_physical(*handle);
    delete handle;
    free_address(address, aligned);
    return nullptr;
  }
  return reinterpret_cast<void*>(address);
}

GRAPH_SLEEP_EXPORT void my_free(void* ptr, ssize_t /*size*/, int device, StreamHandle /*stream*/) {
  const auto address = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(ptr));
  ReleaseOrder order;
  if (!withdraw_allocation(address, &order)) {
    // Leak rather than unmap memory that Python may still account for.
    report_free_failure();
    return;
  }
  if (order.mapped) {
    if (!succeeded(bind_device(device)) || !succeeded(unmap_physical(address, order.size)) ||
        !succeeded(release_physical(*order.handle))) {
      report_free_failure();
    }
  }
  // On ROCm a sleeping allocation already gave its range back.
  if (order.mapped || !kReleaseAddressOnSleep) {
    if (!succeeded(free_address(address, order.size))) {
      report_free_failure();
    }
  }
  delete order.handle;
}

// ---------------------------------------------------------------------------
// Python module.
// ---------------------------------------------------------------------------

namespace {

bool parse_allocation(PyObject* args, int* device, unsigned long long* size,
                      unsigned long long* address, unsigned long long* handle) {
  return PyArg_ParseTuple(args, "iKKK", device, size, address, handle) != 0;
}

PyObject* raise_last_error() {
  PyErr_SetString(PyExc_RuntimeError, t_last_error.c_str());
  return nullptr;
}

PyObject* py_register_callbacks(PyObject* /*self*/, PyObject* args) {
  PyObject* on_malloc = nullptr;
  PyObject* on_free = nullptr;
  if (!PyArg_ParseTuple(args, "OO", &on_malloc, &on_free)) {
    return nullptr;
  }
  if (!PyCallable_Check(on_malloc) || !PyCallable_Check(on_free)) {
    PyErr_SetString(PyExc_TypeError, "register_callbacks(on_malloc, on_free) needs two callables");
    return nullptr;
  }
  Py_INCREF(on_malloc);
  Py_INCREF(on_free);
  Py_XSETREF(g_on_malloc, on_malloc);
  Py_XSETREF(g_on_free, on_free);
  Py_RETURN_NONE;
}

PyObject* py_create_and_map(PyObject* /*self*/, PyObject* args) {
  int device = 0;
  unsigned long long size = 0, address = 0, handle = 0;
  if (!parse_allocation(args, &device, &size, &address, &handle)) {
    return nullptr;
  }
  bool ok = false;
  Py_BEGIN_ALLOW_THREADS
  ok = create_and_map(device, size, address,
                      reinterpret_cast<PhysicalHandle*>(static_cast<uintptr_t>(handle)));
  Py_END_ALLOW_THREADS
  if (!ok) {
    return raise_last_error();
  }
  Py_RETURN_NONE;
}

PyObject* py_unmap_and_release(PyObject* /*self*/, PyObject* args) {
  int device = 0;
  unsigned long long size = 0, address = 0, handle = 0;
  if (!parse_allocation(args, &device, &size, &address, &handle)) {
    return nullptr;
  }
  bool ok = false;
  Py_BEGIN_ALLOW_THREADS
  ok = unmap_and_release(device, size, address,
                         reinterpret_cast<PhysicalHandle*>(static_cast<uintptr_t>(handle)));
  Py_END_ALLOW_THREADS
  if (!ok) {
    return raise_last_error();
  }
  Py_RETURN_NONE;
}

PyObject* py_last_error(PyObject* /*self*/, PyObject* /*args*/) {
  return PyUnicode_FromString(t_last_error.c_str());
}

PyMethodDef kMethods[] = {
    {"register_callbacks", py_register_callbacks, METH_VARARGS,
     "register_callbacks(on_malloc, on_free): on_malloc(device, size, address, handle) "
     "records a new allocation; on_free(address) returns (size, handle, mapped)."},
    {"create_and_map", py_create_and_map, METH_VARARGS,
     "create_and_map(device, size, address, handle): map fresh physical memory at address."},
    {"unmap_and_release", py_unmap_and_release, METH_VARARGS,
     "unmap_and_release(device, size, address, handle): give the physical memory back."},
    {"last_error", py_last_error, METH_NOARGS,
     "The last failure recorded on this thread (my_malloc reports only through here)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_cumem", "vllm-graph-sleep VMM allocator", -1,
                       kMethods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__cumem(void) { return PyModule_Create(&kModule); }
