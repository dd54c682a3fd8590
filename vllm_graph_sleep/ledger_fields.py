"""The memory ledger's vocabulary: what each field means, which fields add up,
and the arithmetic (`balance`). Standard library only, so the bench report can
use it without torch; vllm_graph_sleep.ledger fills the fields in the worker.

A ledger describes one GPU of one worker, in bytes unless a field says
otherwise; a field is None where its figure cannot be had, with the reason in
"unavailable", and an estimated field says how in "estimated".

field                         summed  what it is; how it is obtained
nvml_used                     -       this process's GPU memory: NVML's per-process figure, else
                                      NVML's device used, else the driver's total - free (those
                                      two include other processes); nvml_used_source says which
stack_reservation             yes     the context's stack reservation, derived (CUDA only):
                                      stack_limit_per_thread (cuCtxGetLimit CU_LIMIT_STACK_SIZE)
                                      x resident_threads (multiprocessors x max threads each)
printf_fifo                   yes     the printf FIFO limit (cuCtxGetLimit / hipDeviceGetLimit);
                                      reserved for kernels that print, so an upper bound
malloc_heap                   yes     the device malloc heap limit, read the same way; an upper
                                      bound too
our_pools_mapped              yes     bytes our allocator has mapped (its bookkeeping, leftovers
                                      of earlier engines and what refused frees left
                                      included); 0 in stock
vllm_cumem_mapped             yes     bytes stock vLLM's CuMemAllocator has mapped (its
                                      bookkeeping); 0 without its instance
torch_reserved_outside_pools  yes     torch's reserved segments (memory_snapshot) that no
                                      sleep-mode allocator made: torch's own pool, stock graph
                                      pools
nccl_buffers                  yes     ESTIMATE, TP>1 only: NCCL_BUFFSIZE x channels x peers
                                      (see "estimated"); None at TP=1
cublas_workspaces             no      ESTIMATE: one cuBLAS workspace of torch's size (cuBLASLt
                                      shares it on CUDA); torch takes one per (handle, stream)
                                      from its caching allocator, so it is already inside
                                      torch_reserved_outside_pools or a sleep pool
vllm_workspace                no      bytes of vLLM's WorkspaceManager buffers (one per ubatch,
                                      grown on demand, shared by fused-MoE kernels and
                                      attention backends), read from
                                      vllm.v1.worker.workspace._manager; 0 before it is made;
                                      torch's memory, so inside torch_reserved_outside_pools or a
                                      sleep pool
vllm_workspace_outside_pools  no      the part of vllm_workspace in torch's segments that no
                                      sleep-mode allocator made: what a sleep leaves of it
vllm_sampler_scratch          no      bytes of the tensors vLLM's Triton top-k/top-p sampler keeps
                                      on this GPU for the life of the process (a per-program
                                      scratch of up to one float32 row of the vocabulary per SM,
                                      and two lookup tables), read from _TRITON_BUFFER_CACHE and
                                      _TRITON_TABLE_CACHE of vllm.v1.sample.ops.topk_topp_triton,
                                      each storage once; 0 before the first sampling, after our
                                      sleep (it drops them), and where vLLM has not imported that
                                      module (it does wherever Triton works; the ledger never
                                      imports it); torch's memory, so inside
                                      torch_reserved_outside_pools or a sleep pool
instantiated_graphs           no      a count: graphs vLLM captured (its compilation counter);
                                      the driver's memory for them is in unattributed
cuda_modules                  no      a count, None: no driver call counts a context's modules
torch_outside_pools_by_stream no      torch_reserved_outside_pools split by the stream each segment
                                      was made for ("0x0": default), with bytes in use and the
                                      segment count; JSON only (a capture stream's cuBLAS
                                      workspace shows up here)
torch_outside_pools_largest_blocks
                              no      the 8 largest allocated blocks (live tensors) of those
                                      segments, largest first: size, stream (as above) and a
                                      "what" where recognised: a vLLM workspace buffer or its
                                      sampler's scratch by address, "a cuBLAS workspace's size"
                                      by size only (torch does not expose their addresses), the
                                      current or vLLM's aux stream; JSON only
current_stream                no      the probe thread's current stream, keyed as above: vLLM
                                      makes its own stream current on the thread that runs the
                                      model, which is the one its collective_rpc runs the probe on
vllm_aux_stream               no      vLLM's aux stream (vllm.utils.torch_utils._aux_stream,
                                      made for MoE shared-expert overlap), keyed as above; None
                                      where it was not made
host_backup_copied            no      host memory, not this GPU's: bytes the last sleep copied to
                                      its host backups (our allocator's bookkeeping); 0 in stock
host_backup_kept              no      host memory too: bytes of backups the last sleep kept from the
                                      sleep before, their fingerprints unchanged since (issue 38)
attributed                    -       the sum of the summed fields that are known
unattributed                  -       nvml_used - attributed: the context, loaded modules, graph
                                      executables and whatever else no field names
"""

from __future__ import annotations

from typing import Any

#: Fields added up into `attributed`, in the order the report shows them.
SUMMED = (
    "stack_reservation",
    "printf_fifo",
    "malloc_heap",
    "our_pools_mapped",
    "vllm_cumem_mapped",
    "torch_reserved_outside_pools",
    "nccl_buffers",
)
#: Shown beside them, never added: counts, and bytes already inside a summed field.
INFORMATIVE = (
    "cublas_workspaces",
    "vllm_workspace",
    "vllm_workspace_outside_pools",
    "vllm_sampler_scratch",
    "instantiated_graphs",
    "cuda_modules",
    "host_backup_copied",
    "host_backup_kept",
)
#: Fields that count things rather than bytes.
COUNTS = ("instantiated_graphs", "cuda_modules")


def balance(fields: dict[str, Any]) -> tuple[int, int | None]:
    """(attributed, unattributed): the summed fields that are known, and what
    nvml_used leaves beyond them (None without nvml_used; negative when an
    estimate or an upper bound overshoots)."""
    attributed = sum(fields[name] for name in SUMMED if fields.get(name) is not None)
    used = fields.get("nvml_used")
    return attributed, None if used is None else used - attributed
