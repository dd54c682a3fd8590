// Virtual-memory allocator behind vllm-graph-sleep's sleep mode.
//
// Torch uses my_malloc/my_free as a pluggable allocator; Python drives sleep
// and wake through create_and_map/unmap_and_release. Each allocation gets its
// virtual range once: on CUDA one after another from a large reservation (an
// arena chunk), on ROCm a reservation of its own. Sleep unmaps and releases the
// physical memory but keeps the address, so pointers baked into CUDA/HIP graphs
// stay valid and wake maps fresh physical memory at the same address. On CUDA
// the chunk keeps it; on ROCm that reservation must go for the VRAM to come
// back, so an empty placeholder reservation of the same range holds the
// address while asleep (kPlaceholderWhileAsleep in cumem_compat.h). A wake may
// map neighbouring ranges with one physical allocation (map_run), which a
// sleep then gives back at once.
//
// ABI rules: nothing here throws or exits. Driver failures are recorded in a
// per-thread message "<call> failed: <driver message>" that the Python entry
// points raise as RuntimeError. my_malloc and my_free have no Python caller to
// raise to: they write one line per failure to stderr (the worker's log), and
// my_malloc returns nullptr, which torch turns into its generic out-of-memory
// error. The mapping path enqueues no stream work: it runs during graph capture.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cinttypes>
#include <cstdio>
#include <memory>
#include <new>
#include <pthread.h>
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

struct Run;
struct ArenaChunk;

// What this module keeps per allocation. Python holds its address as the
// allocation's "handle" and hands it back on every call.
struct Allocation {
  PhysicalHandle physical{};
  // Whether a reservation of ours covers the allocation's range. False only
  // for a ROCm allocation asleep whose placeholder could not be had; wake then
  // reserves the range again.
  bool range_held = true;
  // Whether that reservation is an empty placeholder (kPlaceholderWhileAsleep):
  // it holds no VRAM, where one that had memory mapped under it may on ROCm.
  bool placeholder = false;
  // The run whose mapping backs this range while the run lives (map_run), and
  // this range's place in it; its own `physical` is then unused.
  Run* run = nullptr;
  size_t slot = 0;
  // The arena chunk the range was taken from (CUDA), or nullptr: a
  // reservation of its own (ROCm).
  ArenaChunk* chunk = nullptr;
};

// A range of a run: its record (nullptr once torch freed it: its reservation
// goes with the run) and whether it is in use (mapped, for its record).
struct RunSlot {
  Allocation* allocation = nullptr;
  uint64_t address = 0;
  size_t size = 0;
  ArenaChunk* chunk = nullptr;
  bool in_use = true;
};

// Neighbouring ranges mapped at once, by one mapping of one physical
// allocation (map_run): a sleep then gives the run back with one unmap and
// one release, where each allocation of its own costs a release (issue 38;
// docs/results/sleep-speed-h100.md). A mapping can only be unmapped whole, so
// a range that is unmapped or freed only leaves the run; the last one to
// leave unmaps and releases it all. A range unmapped while others are still
// in use keeps its memory and contents: mapped again (a failed sleep's
// rollback), it rejoins the run.
struct Run {
  int device = 0;
  uint64_t base = 0;
  size_t size = 0;
  PhysicalHandle physical{};
  RunSlot* slots = nullptr;
  size_t count = 0;
  size_t in_use = 0;
  // In the list of what refused frees left (g_held_runs) until it ends.
  bool held = false;
  Run* next_held = nullptr;
};

// A range whose free (my_free) the driver refused after Python had forgotten
// it, with what is left to give back: its mapping (the unmap failed), its
// physical memory (the release failed) and its range (taken until unmapped).
struct HeldRange {
  int device = 0;
  uint64_t address = 0;
  size_t size = 0;
  PhysicalHandle physical{};
  ArenaChunk* chunk = nullptr;
  bool range_held = true;
  bool placeholder = false;  // as Allocation::placeholder
  bool mapped = true;
  bool physical_held = true;
  HeldRange* next = nullptr;
};

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

// One line on stderr for a failure that no Python caller will raise.
void report(const char* context) {
  std::fprintf(stderr, "[vllm_graph_sleep] %s: %s\n", context, t_last_error.c_str());
}

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

// Reserves exactly [address, address + size) again. The address is only a
// hint to the driver, which offers another range when that one is taken.
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

// Trades the reservation of a range whose physical memory was just released
// for an empty placeholder of the same range (kPlaceholderWhileAsleep). The
// allocation is asleep whatever happens here, so failures are reported, not
// returned: if the placeholder cannot be had, the range is left free and wake
// reserves it again, failing cleanly if another mapping took it meanwhile.
void hold_with_placeholder(int device, uint64_t address, size_t size, Allocation* allocation) {
  char context[160];
  if (!succeeded(free_address(address, size))) {
    std::snprintf(context, sizeof(context),
                  "sleep of 0x%" PRIx64 " kept its reservation (and maybe its VRAM)", address);
    report(context);
    return;
  }
  allocation->range_held = allocation->placeholder = reclaim_address(device, address, size);
  if (!allocation->range_held) {
    std::snprintf(context, sizeof(context),
                  "sleep of 0x%" PRIx64 " holds no placeholder; wake will reserve it again",
                  address);
    report(context);
  }
}

// One large reservation that hands out the ranges of allocations one after
// another (CUDA), so that those made one after another (the weights of one
// model load) are neighbours within one reservation, which one mapping may
// cover (map_run). A range is not handed out again; the reservation goes
// once every range taken from it is given back and a newer chunk hands them
// out. ROCm reserves each range on its own (kPlaceholderWhileAsleep).
struct ArenaChunk {
  uint64_t base = 0;
  size_t size = 0;
  size_t used = 0;  // bytes from base handed out, alignment gaps included
  size_t live = 0;  // ranges out
};

constexpr size_t kArenaChunkBytes = size_t{256} << 30;
constexpr size_t kGiB = size_t{1} << 30;

// A lock that cannot throw (std::mutex may): nothing throws across the ABI.
class Lock {
 public:
  explicit Lock(pthread_mutex_t* mutex) : mutex_(mutex) { pthread_mutex_lock(mutex_); }
  ~Lock() { pthread_mutex_unlock(mutex_); }
  Lock(const Lock&) = delete;
  Lock& operator=(const Lock&) = delete;

 private:
  pthread_mutex_t* mutex_;
};

// Guards the arena: my_malloc and my_free run on any thread torch allocates
// and frees from (one lock per device in torch).
pthread_mutex_t g_arena_mutex = PTHREAD_MUTEX_INITIALIZER;
ArenaChunk* g_arena = nullptr;  // the chunk handing out ranges now

// Guards every run's bookkeeping and the `run` of every allocation: torch
// may free a member (my_free) on its thread while a sleep or wake on another
// unmaps or maps one of the same run. Taken before the arena's, never after.
pthread_mutex_t g_run_mutex = PTHREAD_MUTEX_INITIALIZER;

// What frees the driver refused left on the device (lock: g_run_mutex).
// Python has forgotten it, so the extension counts it (held_bytes) and tries
// again when asked (retry_held, at every sleep): a passing driver failure
// does not leak the memory for the life of the process.
Run* g_held_runs = nullptr;
HeldRange* g_held_ranges = nullptr;

// Bytes of `runs` (a g_held_runs list) that no range in use accounts for.
size_t run_bytes_out_of_use(const Run* runs) {
  size_t bytes = 0;
  for (const Run* run = runs; run != nullptr; run = run->next_held) {
    bytes += run->size;
    for (size_t i = 0; i < run->count; ++i) {
      if (run->slots[i].in_use) {
        bytes -= run->slots[i].size;
      }
    }
  }
  return bytes;
}

void unlink_held_run(Run* run) {
  for (Run** link = &g_held_runs; *link != nullptr; link = &(*link)->next_held) {
    if (*link == run) {
      *link = run->next_held;
      run->held = false;
      run->next_held = nullptr;
      return;
    }
  }
}

// Frees a chunk that hands out no more ranges and has none out (lock held).
void retire_if_empty(ArenaChunk* chunk) {
  if (chunk != g_arena && chunk->live == 0) {
    if (!succeeded(free_address(chunk->base, chunk->size))) {
      report("freeing an arena chunk");
    }
    delete chunk;
  }
}

// Takes `size` bytes starting at a multiple of `alignment` (at most 1 GiB).
bool arena_take(size_t size, size_t alignment, uint64_t* address, ArenaChunk** taken) {
  Lock lock(&g_arena_mutex);
  ArenaChunk* chunk = g_arena;
  size_t start = chunk == nullptr ? 0 : (chunk->used + alignment - 1) / alignment * alignment;
  if (chunk == nullptr || start + size > chunk->size) {
    auto* fresh = new (std::nothrow) ArenaChunk{};
    if (fresh == nullptr) {
      t_last_error = "out of host memory for an arena chunk";
      return false;
    }
    fresh->size = size > kArenaChunkBytes ? (size + kGiB - 1) / kGiB * kGiB : kArenaChunkBytes;
    if (!succeeded(reserve_address(&fresh->base, fresh->size, kGiB, 0))) {
      delete fresh;
      return false;
    }
    g_arena = fresh;
    if (chunk != nullptr) {
      retire_if_empty(chunk);
    }
    chunk = fresh;
    start = 0;
  }
  chunk->used = start + size;
  ++chunk->live;
  *address = chunk->base + start;
  *taken = chunk;
  return true;
}

void arena_give_back(ArenaChunk* chunk) {
  Lock lock(&g_arena_mutex);
  --chunk->live;
  retire_if_empty(chunk);
}

// Gives a range back where it came from: its arena chunk or its own reservation.
bool give_back_range(ArenaChunk* chunk, uint64_t address, size_t size) {
  if (chunk != nullptr) {
    arena_give_back(chunk);
    return true;
  }
  return succeeded(free_address(address, size));
}

// Unmaps `physical` from [address, address + size) and releases it. All or
// nothing: a failed release maps the same memory back at the same address
// (nothing was lost yet), so the caller can treat a failure as no change.
bool unmap_and_release_physical(int device, uint64_t address, size_t size,
                                PhysicalHandle physical) {
  if (!succeeded(bind_device(device)) || !succeeded(unmap_physical(address, size))) {
    return false;
  }
  if (!succeeded(release_physical(physical))) {
    std::string release_error;  // swapped, not copied: no allocation that could throw
    release_error.swap(t_last_error);
    if (succeeded(map_physical(address, size, physical))) {
      grant_read_write(address, size, device);
    }
    t_last_error.swap(release_error);
    return false;
  }
  return true;
}

// Unmaps and releases a run whose last range leaves it, then frees the
// reservations of the ranges torch freed meanwhile and detaches the others.
// All or nothing: on failure the run is mapped as before.
bool end_run(Run* run) {
  if (!unmap_and_release_physical(run->device, run->base, run->size, run->physical)) {
    return false;
  }
  for (size_t i = 0; i < run->count; ++i) {
    RunSlot& slot = run->slots[i];
    if (slot.allocation == nullptr) {
      if (!give_back_range(slot.chunk, slot.address, slot.size)) {
        report("freeing a freed range of a run");
      }
    } else {
      slot.allocation->run = nullptr;
    }
  }
  if (run->held) {
    unlink_held_run(run);
  }
  delete[] run->slots;
  delete run;
  return true;
}

// Takes `allocation`'s range out of use in its run (`freed`: torch freed it,
// in use or not); the last range out ends the run.
bool leave_run(Allocation* allocation, bool freed) {
  Run* run = allocation->run;
  RunSlot& slot = run->slots[allocation->slot];
  if (!slot.in_use && !freed) {
    t_last_error = "unmap_and_release failed: the range is not mapped";
    return false;
  }
  if (freed) {
    slot.allocation = nullptr;
    allocation->run = nullptr;
  }
  if (!slot.in_use) {
    return true;
  }
  if (run->in_use > 1) {
    slot.in_use = false;
    --run->in_use;
    return true;
  }
  if (end_run(run)) {
    return true;
  }
  if (freed) {
    // Its record goes: the run stays mapped, with no range in use, until
    // another member is mapped again and leaves, or a retry ends it.
    slot.in_use = false;
    run->in_use = 0;
    if (!run->held) {
      run->held = true;
      run->next_held = g_held_runs;
      g_held_runs = run;
    }
  }
  return false;
}

bool create_and_map(int device, size_t size, uint64_t address, Allocation* allocation) {
  {
    Lock lock(&g_run_mutex);
    if (allocation->run != nullptr) {
      // The run is still mapped (another range is in use), with this range's
      // memory and contents: it is in use again.
      RunSlot& slot = allocation->run->slots[allocation->slot];
      if (slot.in_use) {
        t_last_error = "create_and_map failed: the range is already mapped";
        return false;
      }
      slot.in_use = true;
      ++allocation->run->in_use;
      return true;
    }
  }
  if (!succeeded(bind_device(device))) {
    return false;
  }
  if (!allocation->range_held) {
    if (!reclaim_address(device, address, size)) {
      return false;
    }
    allocation->range_held = true;
  }
  // On failure the range stays reserved for the next wake, and the record
  // keeps the handle it had (a refused call on a mapped range changes nothing).
  PhysicalHandle physical{};
  if (!map_fresh_memory(device, address, size, &physical)) {
    return false;
  }
  allocation->physical = physical;
  allocation->placeholder = false;  // memory is mapped under it now
  return true;
}

// All or nothing, like map_fresh_memory: on failure the memory is still mapped
// with its contents, so the caller's bookkeeping (and a sleep's rollback) can
// treat a failed call as one that changed nothing.
bool unmap_and_release(int device, size_t size, uint64_t address, Allocation* allocation) {
  {
    Lock lock(&g_run_mutex);
    if (allocation->run != nullptr) {
      return leave_run(allocation, false);
    }
  }
  if (!unmap_and_release_physical(device, address, size, allocation->physical)) {
    return false;
  }
  if (kPlaceholderWhileAsleep) {
    hold_with_placeholder(device, address, size, allocation);
  }
  return true;
}

// Keeps a range whose free the driver refused (see HeldRange); false when
// there is no host memory for the note (the range then leaks, reported).
bool hold_range(const HeldRange& range) {
  auto* held = new (std::nothrow) HeldRange(range);
  if (held == nullptr) {
    return false;
  }
  Lock lock(&g_run_mutex);
  held->next = g_held_ranges;
  g_held_ranges = held;
  return true;
}

// Gives back what a refused free left, step by step as my_free does; false
// while the driver still refuses a step (what is done stays done).
bool give_back_held(HeldRange* range) {
  if (!succeeded(bind_device(range->device))) {
    return false;
  }
  if (range->mapped) {
    if (!unmap_and_release_physical(range->device, range->address, range->size,
                                    range->physical)) {
      return false;
    }
    range->mapped = range->physical_held = false;
  } else if (range->physical_held) {
    if (!succeeded(release_physical(range->physical))) {
      return false;
    }
    range->physical_held = false;
  }
  if (range->range_held) {
    if (!give_back_range(range->chunk, range->address, range->size)) {
      return false;
    }
    range->range_held = false;
  }
  return true;
}

// Whether a held range still costs device memory: its mapping or physical
// memory, or on ROCm a reservation alone that had memory mapped under it
// (kPlaceholderWhileAsleep: ROCm keeps that VRAM charged while the reservation
// lives), not an empty placeholder; on CUDA a range alone is address space.
bool holds_device_memory(const HeldRange& range) {
  return range.mapped || range.physical_held ||
         (kPlaceholderWhileAsleep && range.range_held && !range.placeholder);
}

// Device bytes that refused frees left: of each such run what no range in
// use accounts for (one mapped again rejoined it, and Python counts that
// one), and the ranges.
size_t held_bytes() {
  Lock lock(&g_run_mutex);
  size_t bytes = run_bytes_out_of_use(g_held_runs);
  for (HeldRange* range = g_held_ranges; range != nullptr; range = range->next) {
    if (holds_device_memory(*range)) {
      bytes += range->size;
    }
  }
  return bytes;
}

// Tries again to give back everything refused frees left; the device bytes
// given back. What the driver still refuses stays held, its error recorded
// (none recorded: nothing refused); a run a range uses again ends when its
// last range leaves.
size_t retry_held() {
  Lock lock(&g_run_mutex);
  t_last_error.clear();
  size_t freed = 0;
  for (Run* run = g_held_runs; run != nullptr;) {
    Run* next = run->next_held;
    const size_t size = run->size;
    if (run->in_use == 0 && end_run(run)) {  // unlinks it
      freed += size;
    }
    run = next;
  }
  for (HeldRange** link = &g_held_ranges; *link != nullptr;) {
    HeldRange* range = *link;
    const bool had_memory = holds_device_memory(*range);
    const bool done = give_back_held(range);
    if (had_memory && !holds_device_memory(*range)) {
      freed += range->size;
    }
    if (done) {
      *link = range->next;
      delete range;
    } else {
      link = &range->next;
    }
  }
  return freed;
}

struct RunMember {
  size_t size = 0;
  uint64_t address = 0;
  Allocation* allocation = nullptr;
};

// Maps fresh memory at `count` neighbouring ranges, in address order, none
// mapped nor in a run, with one physical allocation and one mapping (Run).
// All or nothing, like map_fresh_memory.
bool map_run(int device, const RunMember* members, size_t count) {
  Lock lock(&g_run_mutex);
  if (kPlaceholderWhileAsleep) {
    // Each range asleep is held by a placeholder of its own.
    t_last_error = "map_run failed: not on this platform";
    return false;
  }
  size_t total = 0;
  for (size_t i = 0; i < count; ++i) {
    // One mapping covers one reservation: one arena chunk.
    if (members[i].allocation->run != nullptr || members[i].allocation->chunk == nullptr ||
        members[i].allocation->chunk != members[0].allocation->chunk ||
        (i > 0 && members[i].address != members[i - 1].address + members[i - 1].size)) {
      t_last_error = "map_run failed: the ranges are not free neighbours";
      return false;
    }
    total += members[i].size;
  }
  const uint64_t base = members[0].address;
  auto* run = new (std::nothrow) Run{};
  auto* slots = new (std::nothrow) RunSlot[count];
  if (run == nullptr || slots == nullptr) {
    delete run;
    delete[] slots;
    t_last_error = "map_run failed: out of host memory";
    return false;
  }
  PhysicalHandle physical{};
  if (!succeeded(bind_device(device)) || !map_fresh_memory(device, base, total, &physical)) {
    delete run;
    delete[] slots;
    return false;
  }
  *run = Run{device, base, total, physical, slots, count, count};
  for (size_t i = 0; i < count; ++i) {
    slots[i] = RunSlot{members[i].allocation, members[i].address, members[i].size,
                       members[i].allocation->chunk, true};
    members[i].allocation->run = run;
    members[i].allocation->slot = i;
  }
  return true;
}

// Tells Python about a new allocation; false (with the error recorded) if the
// callback is missing or raised.
bool announce_allocation(int device, size_t size, uint64_t address, Allocation* allocation) {
  GilHold gil;
  if (g_on_malloc == nullptr) {
    t_last_error = "register_callbacks() was never called";
    return false;
  }
  PyRef result(PyObject_CallFunction(g_on_malloc, "iKKK", device,
                                     static_cast<unsigned long long>(size),
                                     static_cast<unsigned long long>(address),
                                     static_cast<unsigned long long>(
                                         reinterpret_cast<uintptr_t>(allocation))));
  if (result.get() == nullptr) {
    t_last_error = "the Python malloc callback raised";
    PyErr_WriteUnraisable(g_on_malloc);
    return false;
  }
  return true;
}

struct ReleaseOrder {
  size_t size = 0;
  Allocation* allocation = nullptr;
  bool mapped = false;
};

// Asks Python to forget an allocation. Python answers (size, handle, mapped).
bool withdraw_allocation(uint64_t address, ReleaseOrder* order) {
  if (!interpreter_alive()) {
    t_last_error = "skipped: the Python interpreter is shutting down";
    return false;
  }
  GilHold gil;
  if (g_on_free == nullptr) {
    t_last_error = "register_callbacks() was never called";
    return false;
  }
  PyRef result(PyObject_CallFunction(g_on_free, "K", static_cast<unsigned long long>(address)));
  unsigned long long size = 0;
  unsigned long long handle = 0;
  int mapped = 0;
  if (result.get() == nullptr ||
      !PyArg_ParseTuple(result.get(), "KKp", &size, &handle, &mapped)) {
    t_last_error = "the Python free callback raised or answered badly";
    PyErr_WriteUnraisable(g_on_free);
    return false;
  }
  order->size = static_cast<size_t>(size);
  order->allocation = reinterpret_cast<Allocation*>(static_cast<uintptr_t>(handle));
  order->mapped = mapped != 0;
  return true;
}

// Where a new allocation's range starts: an allocation of 1 GiB or more (a KV
// cache's, mostly) at a multiple of 1 GiB, any other at the granularity. The
// driver released large allocations about 10% faster so aligned (on an H100, 24
// GiB in 3 GiB allocations: 9.8 -> 8.8 ms; beside a device-to-host copy 10.1 ->
// 9.0 ms), and 64-256 MiB ones aligned to their size no faster (issue 38;
// docs/results/sleep-speed-h100.md). Only address space is spent.
size_t range_alignment(size_t size, size_t granularity) {
  constexpr size_t kLargeAllocation = size_t{1} << 30;
  return size >= kLargeAllocation && granularity < kLargeAllocation ? kLargeAllocation
                                                                    : granularity;
}

// Reserves, maps and announces a new allocation; false with the error recorded.
bool allocate(ssize_t size, int device, uint64_t* address) {
  if (size <= 0) {
    t_last_error = "size must be positive";
    return false;
  }
  size_t granularity = 0;
  if (!succeeded(bind_device(device)) ||
      !succeeded(allocation_granularity(device, &granularity))) {
    return false;
  }
  const size_t aligned = (static_cast<size_t>(size) + granularity - 1) / granularity * granularity;
  const size_t alignment = range_alignment(aligned, granularity);
  ArenaChunk* chunk = nullptr;
  if (!(kPlaceholderWhileAsleep ? succeeded(reserve_address(address, aligned, alignment, 0))
                                : arena_take(aligned, alignment, address, &chunk))) {
    return false;
  }
  auto* allocation = new (std::nothrow) Allocation{};
  if (allocation == nullptr) {
    t_last_error = "out of host memory for the allocation record";
    give_back_range(chunk, *address, aligned);
    return false;
  }
  allocation->chunk = chunk;
  if (!map_fresh_memory(device, *address, aligned, &allocation->physical)) {
    delete allocation;
    give_back_range(chunk, *address, aligned);
    return false;
  }
  if (!announce_allocation(device, aligned, *address, allocation)) {
    unmap_physical(*address, aligned);
    release_physical(allocation->physical);
    delete allocation;
    give_back_range(chunk, *address, aligned);
    return false;
  }
  return true;
}

// Maps one granule of fresh memory at a range of its own and gives it all
// back. After a large release the CUDA driver defers work that the next
// mapping call on the device pays, and the longer it waits the more it pays:
// for 40 GiB on an H200, 3-4 ms after 20 ms and 11-25 ms from 100 ms on; 26 ms
// for 80 GiB (docs/results/archive/bench-h200-run11.md, as settle.py says). A sleeping
// allocator calls this from a background thread so that the wake does not pay
// it. All or nothing.
bool probe_mapping(int device) {
  size_t granularity = 0;
  if (!succeeded(bind_device(device)) ||
      !succeeded(allocation_granularity(device, &granularity))) {
    return false;
  }
  uint64_t address = 0;
  if (!succeeded(reserve_address(&address, granularity, granularity, 0))) {
    return false;
  }
  PhysicalHandle physical{};
  bool ok = map_fresh_memory(device, address, granularity, &physical);
  if (ok) {
    ok = succeeded(unmap_physical(address, granularity));
    ok = succeeded(release_physical(physical)) && ok;
  }
  return succeeded(free_address(address, granularity)) && ok;
}

}  // namespace
}  // namespace graph_sleep

using namespace graph_sleep;

// ---------------------------------------------------------------------------
// Pluggable-allocator entry points called by torch (C ABI).
// ---------------------------------------------------------------------------

GRAPH_SLEEP_EXPORT void* my_malloc(ssize_t size, int device, StreamHandle /*stream*/) {
  uint64_t address = 0;
  if (!allocate(size, device, &address)) {
    // Torch reports only a generic "out of memory" for nullptr: the driver's
    // reason reaches the log here, once per failed call.
    char context[96];
    std::snprintf(context, sizeof(context), "my_malloc of %zd bytes on device %d failed", size,
                  device);
    report(context);
    return nullptr;
  }
  return reinterpret_cast<void*>(address);
}

GRAPH_SLEEP_EXPORT void my_free(void* ptr, ssize_t /*size*/, int device, StreamHandle /*stream*/) {
  const auto address = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(ptr));
  ReleaseOrder order;
  if (!withdraw_allocation(address, &order)) {
    // Leak rather than unmap memory that Python may still account for.
    report("my_free");
    return;
  }
  {
    Lock lock(&g_run_mutex);
    if (order.allocation->run != nullptr) {
      // The run's mapping covers the range until the run ends, which frees
      // its reservation then (end_run binds the device itself).
      if (!leave_run(order.allocation, true)) {
        report("my_free");
      }
      delete order.allocation;
      return;
    }
  }
  // What the driver refuses is kept and tried again at the next sleep
  // (retry_held), not given back while it may still be mapped, nor leaked.
  HeldRange refused;
  refused.device = device;
  refused.address = address;
  refused.size = order.size;
  refused.physical = order.allocation->physical;
  refused.chunk = order.allocation->chunk;
  refused.range_held = order.allocation->range_held;
  refused.placeholder = order.allocation->placeholder;
  refused.mapped = refused.physical_held = order.mapped;
  if (succeeded(bind_device(device))) {
    if (refused.mapped && succeeded(unmap_physical(address, order.size))) {
      refused.mapped = false;
    }
    if (!refused.mapped && refused.physical_held &&
        succeeded(release_physical(refused.physical))) {
      refused.physical_held = false;
    }
    // Asleep, the range is held by its placeholder on ROCm, or by nothing if
    // the placeholder was lost.
    if (!refused.mapped && refused.range_held &&
        give_back_range(refused.chunk, address, order.size)) {
      refused.range_held = false;
    }
  }
  if (refused.mapped || refused.physical_held || refused.range_held) {
    report("my_free");
    if (!hold_range(refused)) {
      report("my_free, with no host memory to note it for a retry: it leaks");
    }
  }
  delete order.allocation;
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
                      reinterpret_cast<Allocation*>(static_cast<uintptr_t>(handle)));
  Py_END_ALLOW_THREADS
  if (!ok) {
    return raise_last_error();
  }
  Py_RETURN_NONE;
}

PyObject* py_create_and_map_run(PyObject* /*self*/, PyObject* args) {
  int device = 0;
  PyObject* list = nullptr;
  if (!PyArg_ParseTuple(args, "iO!", &device, &PyList_Type, &list)) {
    return nullptr;
  }
  const Py_ssize_t count = PyList_Size(list);
  if (count < 1) {
    PyErr_SetString(PyExc_ValueError, "create_and_map_run needs at least one range");
    return nullptr;
  }
  std::unique_ptr<RunMember[]> members(new (std::nothrow) RunMember[count]);
  if (!members) {
    return PyErr_NoMemory();
  }
  for (Py_ssize_t i = 0; i < count; ++i) {
    unsigned long long size = 0, address = 0, handle = 0;
    if (!PyArg_ParseTuple(PyList_GetItem(list, i), "KKK", &size, &address, &handle)) {
      return nullptr;
    }
    members[i] = {static_cast<size_t>(size), static_cast<uint64_t>(address),
                  reinterpret_cast<Allocation*>(static_cast<uintptr_t>(handle))};
  }
  bool ok = false;
  Py_BEGIN_ALLOW_THREADS
  ok = map_run(device, members.get(), static_cast<size_t>(count));
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
                         reinterpret_cast<Allocation*>(static_cast<uintptr_t>(handle)));
  Py_END_ALLOW_THREADS
  if (!ok) {
    return raise_last_error();
  }
  Py_RETURN_NONE;
}

PyObject* py_stack_limit(PyObject* /*self*/, PyObject* args) {
  int device = 0;
  if (!PyArg_ParseTuple(args, "i", &device)) {
    return nullptr;
  }
  size_t bytes = 0;
  if (!succeeded(bind_device(device)) || !succeeded(get_stack_limit(&bytes))) {
    return raise_last_error();
  }
  return PyLong_FromSize_t(bytes);
}

PyObject* py_set_stack_limit(PyObject* /*self*/, PyObject* args) {
  int device = 0;
  unsigned long long bytes = 0;
  if (!PyArg_ParseTuple(args, "iK", &device, &bytes)) {
    return nullptr;
  }
  bool ok = false;
  Py_BEGIN_ALLOW_THREADS
  ok = succeeded(bind_device(device)) && succeeded(set_stack_limit(static_cast<size_t>(bytes)));
  Py_END_ALLOW_THREADS
  if (!ok) {
    return raise_last_error();
  }
  Py_RETURN_NONE;
}

PyObject* py_probe_mapping(PyObject* /*self*/, PyObject* args) {
  int device = 0;
  if (!PyArg_ParseTuple(args, "i", &device)) {
    return nullptr;
  }
  bool ok = false;
  Py_BEGIN_ALLOW_THREADS
  ok = probe_mapping(device);
  Py_END_ALLOW_THREADS
  if (!ok) {
    return raise_last_error();
  }
  Py_RETURN_NONE;
}

PyObject* py_held_bytes(PyObject* /*self*/, PyObject* /*args*/) {
  return PyLong_FromSize_t(held_bytes());
}

PyObject* py_retry_held(PyObject* /*self*/, PyObject* /*args*/) {
  size_t freed = 0;
  Py_BEGIN_ALLOW_THREADS
  freed = retry_held();
  Py_END_ALLOW_THREADS
  return PyLong_FromSize_t(freed);
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
    {"create_and_map_run", py_create_and_map_run, METH_VARARGS,
     "create_and_map_run(device, [(size, address, handle), ...]): map fresh memory at "
     "neighbouring ranges with one allocation and one mapping, given back with the last range."},
    {"unmap_and_release", py_unmap_and_release, METH_VARARGS,
     "unmap_and_release(device, size, address, handle): give the physical memory back."},
    {"stack_limit", py_stack_limit, METH_VARARGS,
     "stack_limit(device): the per-thread stack limit of the device's context, in bytes."},
    {"set_stack_limit", py_set_stack_limit, METH_VARARGS,
     "set_stack_limit(device, bytes): sets it; the context's reservation follows."},
    {"probe_mapping", py_probe_mapping, METH_VARARGS,
     "probe_mapping(device): maps and unmaps one granule of fresh memory; pays the "
     "driver's work deferred from earlier releases."},
    {"held_bytes", py_held_bytes, METH_NOARGS,
     "held_bytes(): device bytes that frees the driver refused left held (tried again "
     "by retry_held)."},
    {"retry_held", py_retry_held, METH_NOARGS,
     "retry_held(): gives back what refused frees left, as far as the driver lets; the "
     "device bytes given back (last_error() says what the driver refused, or is empty)."},
    {"last_error", py_last_error, METH_NOARGS,
     "The last failure recorded on this thread (my_malloc's too, which also goes to stderr)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_cumem", "vllm-graph-sleep VMM allocator", -1,
                       kMethods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

// `platform` names the API this binary was built for ("cuda" or "rocm"): the
// allocator's ROCm behaviour follows the build, which a test build can choose
// apart from torch's (CMakeLists.txt, GRAPH_SLEEP_TARGET=rocm-on-cuda).
PyMODINIT_FUNC PyInit__cumem(void) {
  PyObject* module = PyModule_Create(&kModule);
  if (module != nullptr && PyModule_AddStringConstant(module, "platform", kPlatform) != 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
