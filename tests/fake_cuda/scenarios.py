"""The allocator extension's arena and runs on the fake driver
(fake_libcuda.cpp), one scenario per process: `python scenarios.py FAKE_SO
EXTENSION_SO NAME`. The extension is the real build; only the driver under it
is faked. Each scenario asserts; the process exits non-zero on failure."""

from __future__ import annotations

import ctypes
import importlib.util
import sys
import threading

MIB = 1 << 20
GIB = 1 << 30


class Fake:
    """The fake driver's test hooks."""

    def __init__(self, path: str) -> None:
        self.lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        self.lib.fake_cuda_calls.restype = ctypes.c_long
        self.lib.fake_cuda_calls.argtypes = [ctypes.c_char_p]
        self.lib.fake_cuda_fail.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_long]
        for name in ("physical_bytes", "mapped_bytes", "reservations"):
            getattr(self.lib, f"fake_cuda_{name}").restype = ctypes.c_size_t
        self.lib.fake_cuda_is_reserved.argtypes = [ctypes.c_uint64]

    def calls(self, call: str) -> int:
        return self.lib.fake_cuda_calls(call.encode())

    def fail(self, call: str, status: int = 2, skip: int = 0) -> None:  # 2: out of memory
        self.lib.fake_cuda_fail(call.encode(), status, skip)

    def physical(self) -> int:
        return self.lib.fake_cuda_physical_bytes()

    def mapped(self) -> int:
        return self.lib.fake_cuda_mapped_bytes()

    def reservations(self) -> int:
        return self.lib.fake_cuda_reservations()

    def is_reserved(self, address: int) -> bool:
        return bool(self.lib.fake_cuda_is_reserved(address))


class Allocator:
    """The extension as torch and our Python drive it: my_malloc/my_free, and
    the records its callbacks keep (address -> [size, handle, mapped])."""

    def __init__(self, path: str) -> None:
        spec = importlib.util.spec_from_file_location("vllm_graph_sleep._cumem", path)
        self.ext = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.ext)
        assert self.ext.platform in ("cuda", "rocm"), self.ext.platform
        self.lib = ctypes.CDLL(path)
        self.lib.my_malloc.restype = ctypes.c_void_p
        self.lib.my_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        self.lib.my_free.argtypes = [
            ctypes.c_void_p,
            ctypes.c_ssize_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        self.records: dict[int, list] = {}
        self.lock = threading.Lock()
        self.ext.register_callbacks(self._on_malloc, self._on_free)

    def _on_malloc(self, device: int, size: int, address: int, handle: int) -> None:
        with self.lock:
            self.records[address] = [size, handle, True]

    def _on_free(self, address: int) -> tuple[int, int, bool]:
        with self.lock:
            size, handle, mapped = self.records.pop(address)
        return size, handle, mapped

    def malloc(self, size: int) -> int:
        address = self.lib.my_malloc(size, 0, None)
        assert address, f"my_malloc of {size} failed: {self.ext.last_error()}"
        return address

    def free(self, address: int) -> None:
        self.lib.my_free(address, self.records[address][0], 0, None)

    def args(self, address: int) -> tuple[int, int, int, int]:
        size, handle, _ = self.records[address]
        return 0, size, address, handle

    def sleep(self, address: int) -> None:
        self.ext.unmap_and_release(*self.args(address))
        self.records[address][2] = False

    def wake(self, address: int) -> None:
        self.ext.create_and_map(*self.args(address))
        self.records[address][2] = True

    def wake_run(self, addresses: list[int]) -> None:
        self.ext.create_and_map_run(0, [self.args(a)[1:] for a in addresses])
        for address in addresses:
            self.records[address][2] = True


def retire_chunk_of(fake: Fake, alloc: Allocator, address: int) -> bool:
    """Hands out and frees 64 GiB ranges until the chunk holding `address`
    goes back to the driver (True) or 2 TiB went by (False)."""
    for _ in range(32):
        if not fake.is_reserved(address):
            return True
        alloc.free(alloc.malloc(64 * GIB))
    return not fake.is_reserved(address)


def weights(alloc: Allocator, sizes=(4, 8, 200, 2)) -> list[int]:
    return [alloc.malloc(size * MIB) for size in sizes]


def vmm_driver(alloc: Allocator):
    """The allocator's GPU driver layer over this extension (torch, no GPU)."""
    from vllm_graph_sleep import _native

    _native._load_extension = lambda: alloc.ext
    return _native.VmmDriver(host_buffers="torch")


def a_run_only_its_last_member_uses(alloc: Allocator) -> list[int]:
    """Weights woken as one run, then all but the last put to sleep."""
    members = weights(alloc)
    for address in members:
        alloc.sleep(address)
    alloc.wake_run(members)
    for address in members[:-1]:
        alloc.sleep(address)
    return members


# -- scenarios ------------------------------------------------------------------


def neighbours_in_one_reservation(fake: Fake, alloc: Allocator) -> None:
    first, second = alloc.malloc(8 * MIB), alloc.malloc(16 * MIB)
    large = alloc.malloc(2 * GIB)
    assert second == first + 8 * MIB
    assert large % GIB == 0 and large > second
    assert fake.reservations() == 1
    alloc.free(first)
    assert alloc.malloc(8 * MIB) not in (first, second), "a range was handed out twice"


def a_chunk_goes_back_once_done_and_its_ranges_are_freed(fake: Fake, alloc: Allocator) -> None:
    first = alloc.malloc(8 * MIB)
    kept = alloc.malloc(8 * MIB)
    alloc.free(first)
    assert not retire_chunk_of(fake, alloc, first), "a chunk went back with a range out"
    alloc.free(kept)
    assert not fake.is_reserved(kept) and not fake.is_reserved(first)
    assert fake.physical() == 0


def a_run_maps_once_and_the_last_member_out_gives_it_all_back(fake: Fake, alloc: Allocator) -> None:
    members = weights(alloc)
    for address in members:
        alloc.sleep(address)
    assert fake.physical() == 0
    creates, maps = fake.calls("cuMemCreate"), fake.calls("cuMemMap")
    alloc.wake_run(members)
    assert (fake.calls("cuMemCreate") - creates, fake.calls("cuMemMap") - maps) == (1, 1)
    assert fake.physical() == fake.mapped() == 214 * MIB
    unmaps, releases = fake.calls("cuMemUnmap"), fake.calls("cuMemRelease")
    for address in members[:-1]:
        alloc.sleep(address)
    assert fake.calls("cuMemUnmap") == unmaps and fake.physical() == 214 * MIB
    alloc.sleep(members[-1])
    assert (fake.calls("cuMemUnmap") - unmaps, fake.calls("cuMemRelease") - releases) == (1, 1)
    assert fake.physical() == fake.mapped() == 0
    # Woken one by one after the run: each on its own again.
    for address in members:
        alloc.wake(address)
    assert fake.physical() == 214 * MIB


def a_member_freed_inside_its_run_keeps_its_memory_until_the_run_ends(fake, alloc) -> None:
    members = weights(alloc)
    for address in members:
        alloc.sleep(address)
    alloc.wake_run(members)
    alloc.free(members[1])
    assert fake.physical() == 214 * MIB
    for address in (members[0], members[2], members[3]):
        alloc.sleep(address)
    assert fake.physical() == fake.mapped() == 0
    for address in (members[0], members[2], members[3]):
        alloc.free(address)
    # The freed member's range went back to its chunk with the run.
    assert retire_chunk_of(fake, alloc, members[1])
    assert fake.physical() == 0


def a_run_the_driver_will_not_release_stays_mapped_and_members_rejoin(fake, alloc) -> None:
    members = a_run_only_its_last_member_uses(alloc)
    fake.fail("cuMemRelease")
    try:
        alloc.sleep(members[-1])
    except RuntimeError as error:
        assert "cuMemRelease failed" in str(error), error
    else:
        raise AssertionError("the failed release was not reported")
    assert fake.physical() == fake.mapped() == 214 * MIB
    creates = fake.calls("cuMemCreate")
    alloc.wake(members[0])  # a failed sleep's rollback: back in its run, no new memory
    assert fake.calls("cuMemCreate") == creates and fake.physical() == 214 * MIB
    alloc.sleep(members[0])
    alloc.sleep(members[-1])
    assert fake.physical() == fake.mapped() == 0


def refused_runs_change_nothing(fake: Fake, alloc: Allocator) -> None:
    first, middle, last = weights(alloc, (4, 4, 4))
    for address in (first, last):
        alloc.sleep(address)
    # Apart, or one still mapped (which the driver refuses to map over).
    for members, why in (([first, last], "not free neighbours"), ([first, middle], "cuMemMap")):
        try:
            alloc.ext.create_and_map_run(0, [alloc.args(a)[1:] for a in members])
        except RuntimeError as error:
            assert why in str(error), error
        else:
            raise AssertionError(f"a run of {members} was mapped")
    assert fake.physical() == fake.mapped() == 4 * MIB  # only `middle`
    fake.fail("cuMemCreate")
    alloc.sleep(middle)
    try:
        alloc.wake_run([first, middle, last])
    except RuntimeError as error:
        assert "out of memory" in str(error), error
    assert fake.physical() == fake.mapped() == 0
    alloc.wake_run([first, middle, last])
    assert fake.physical() == 12 * MIB


def a_refused_map_over_a_mapped_range_changes_nothing(fake: Fake, alloc: Allocator) -> None:
    # driver.py's promise: a refusal maps nothing, and the record keeps the
    # handle of what is mapped (a sleep then gives that memory back).
    address = alloc.malloc(4 * MIB)
    try:
        alloc.ext.create_and_map(*alloc.args(address))
    except RuntimeError as error:
        assert "cuMemMap" in str(error), error
    else:
        raise AssertionError("a mapped range was mapped again")
    assert fake.physical() == fake.mapped() == 4 * MIB
    alloc.sleep(address)
    assert fake.physical() == fake.mapped() == 0


def a_range_whose_unmap_failed_is_not_given_back(fake: Fake, alloc: Allocator) -> None:
    address = alloc.malloc(8 * MIB)
    fake.fail("cuMemUnmap")
    alloc.free(address)  # reported on stderr; the range keeps its chunk
    assert fake.mapped() == 8 * MIB
    assert alloc.ext.held_bytes() == 8 * MIB
    assert not retire_chunk_of(fake, alloc, address)


def what_refused_frees_left_is_counted_and_a_retry_gives_it_back(fake, alloc) -> None:
    # The unmap refused: still mapped, its range taken. The driver refuses
    # the first retry too; the second gives it all back.
    mapped = alloc.malloc(8 * MIB)
    fake.fail("cuMemUnmap")
    alloc.free(mapped)
    # The release refused: unmapped (its range went back), memory held.
    unreleased = alloc.malloc(4 * MIB)
    fake.fail("cuMemRelease")
    alloc.free(unreleased)
    # Through the GPU driver's calls (vllm_graph_sleep._native.VmmDriver).
    driver = vmm_driver(alloc)
    assert driver.held_after_refused_frees() == 12 * MIB
    assert fake.mapped() == 8 * MIB and fake.physical() == 12 * MIB
    fake.fail("cuMemUnmap")
    freed, why = driver.retry_refused_frees()
    assert freed == 4 * MIB and "cuMemUnmap failed" in why, why  # the release went through
    assert driver.held_after_refused_frees() == 8 * MIB and fake.physical() == 8 * MIB
    assert driver.retry_refused_frees() == (8 * MIB, "")
    assert alloc.ext.held_bytes() == 0 and fake.physical() == fake.mapped() == 0
    assert driver.retry_refused_frees() == (0, "")
    assert retire_chunk_of(fake, alloc, mapped)


def a_run_its_last_free_could_not_end_is_held_until_a_retry_or_a_member_rejoins(fake, alloc):
    members = a_run_only_its_last_member_uses(alloc)
    fake.fail("cuMemUnmap")
    alloc.free(members[-1])  # reported: the run stays mapped, no range in use
    assert alloc.ext.held_bytes() == fake.mapped() == 214 * MIB
    # A member mapped again rejoins it (counted by Python from then on); a
    # retry leaves a run in use alone; its last member out ends it.
    creates = fake.calls("cuMemCreate")
    alloc.wake(members[0])
    assert fake.calls("cuMemCreate") == creates and alloc.ext.held_bytes() == 210 * MIB
    assert alloc.ext.retry_held() == 0 and fake.mapped() == 214 * MIB
    assert alloc.ext.last_error() == ""  # skipped while in use, not refused
    alloc.sleep(members[0])
    assert alloc.ext.held_bytes() == 0 and fake.physical() == fake.mapped() == 0
    # Again, and this time a retry ends it; the members asleep map afresh.
    alloc.wake_run(members[:-1])
    for address in members[1:-1]:
        alloc.sleep(address)
    fake.fail("cuMemUnmap")
    alloc.free(members[0])
    assert alloc.ext.held_bytes() == fake.mapped() == 212 * MIB
    assert alloc.ext.retry_held() == 212 * MIB
    assert alloc.ext.held_bytes() == 0 and fake.physical() == 0
    alloc.wake(members[1])
    assert fake.physical() == 8 * MIB


def members_freed_on_other_threads_while_a_sleep_unmaps(fake: Fake, alloc: Allocator) -> None:
    for _ in range(50):
        members = weights(alloc, (2,) * 16)
        for address in members:
            alloc.sleep(address)
        alloc.wake_run(members)
        freed, slept = members[::2], members[1::2]
        threads = [threading.Thread(target=alloc.free, args=(a,)) for a in freed]
        for thread in threads:
            thread.start()
        for address in slept:
            alloc.sleep(address)
        for thread in threads:
            thread.join()
        assert fake.physical() == fake.mapped() == 0
        for address in slept:
            alloc.free(address)
    assert fake.physical() == 0


def rocm_a_reservation_whose_free_was_refused_is_tried_again(fake: Fake, alloc: Allocator) -> None:
    # The rocm-on-cuda build. ROCm keeps a reservation's VRAM charged while it
    # lives (csrc/cumem_compat.h), so a free whose hipMemAddressFree was refused
    # holds device memory: counted, and given back by the sleep's retry.
    assert alloc.ext.platform == "rocm"
    address = alloc.malloc(8 * MIB)
    alloc.lib.hip_shim_refuse_next_address_free()
    alloc.free(address)  # reported on stderr; unmapped and released, the range held
    assert fake.physical() == fake.mapped() == 0
    assert alloc.ext.held_bytes() == 8 * MIB
    assert alloc.ext.retry_held() == 8 * MIB
    assert alloc.ext.held_bytes() == 0 and alloc.ext.retry_held() == 0
    # Freed asleep, the range is an empty placeholder: a refused free of it
    # holds no VRAM, and nothing is counted (the retry still gives it back).
    address = alloc.malloc(8 * MIB)
    alloc.sleep(address)
    alloc.lib.hip_shim_refuse_next_address_free()
    alloc.free(address)
    assert alloc.ext.held_bytes() == 0
    assert alloc.ext.retry_held() == 0 and alloc.ext.last_error() == ""


if __name__ == "__main__":
    fake_path, extension_path, name = sys.argv[1:]
    fake = Fake(fake_path)
    globals()[name](fake, Allocator(extension_path))
    print(f"{name}: ok")
