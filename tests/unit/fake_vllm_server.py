"""A stand-in for `vllm serve` in dev mode, for the bench's CPU tests (stdlib only).

    python fake_vllm_server.py --port P --config NAME --used-file PATH [--pressure-file PATH]

It answers what the bench calls: /health, /v1/models, /v1/completions (greedy,
with token ids), /reset_prefix_cache, /sleep, /wake_up, /is_sleeping, /collective_rpc
(graph_sleep_memory_report, reload_weights), and keeps a simulated "GPU used
bytes" figure in --used-file, which the tests' fake NVML reads. The figures
follow the memory layout of each configuration: stock keeps its graphs while
asleep, ours and eager do not.

Level 2 discards the weights: until reload_weights runs, completions come out
wrong, as they would on a real server. Environment switches for failure tests:
FAKE_CORRUPT=1 (tokens differ after every wake), FAKE_NONDETERMINISTIC=1 (every
completion differs from the one before, sleep or not: the last token of each
prompt counts the completions, like a server that is not deterministic on its
model), FAKE_RESETS_REFUSED=N (the first N /reset_prefix_cache answer success
false, as vLLM does while blocks are held), FAKE_DIE_ON_SLEEP=1 (the process
exits on the first /sleep), FAKE_START_DELAY=S (seconds before /health
answers), FAKE_ENGINE_FAILS=1 (logs vLLM's engine start-up failure, then hangs).

With --pressure-file, the bytes written in that file are held by another process
(tests/unit/fake_gpu_hog.py) on a GPU of TOTAL bytes: a wake whose memory does
not fit in what is left answers 500 and changes nothing, as vLLM 0.26 answers a
wake whose worker raised (the reason is only in the log) and as our allocator
rolls a failed wake back; FAKE_NO_ROLLBACK=1 leaves the first tag of such a wake
mapped instead (a half-done wake, what the allocator must never do).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from vllm_graph_sleep.units import MiB

TOTAL = 140 * 1024 * MiB  # the fake GPU's memory
IDLE = 500 * MiB  # what the fake NVML reports with no server (tests read the same)
CONTEXT = 400 * MiB
SIZES = {"weights": 200 * MiB, "kv_cache": 2000 * MiB, "cudagraph": 500 * MiB}
STACK = 264 * MiB  # the context's stack reservation (ours gives it back while asleep)
PINNED_AT_START = 4 * MiB  # pinned host memory vLLM takes at start-up (input staging)
PINNING_S = 0.05  # the time torch takes to pin a sleep's host buffers
GRAPHS = 67


class State:
    def __init__(self, config: str, used_file: Path, pressure_file: Path | None = None):
        self.config = config
        # ours_coded and ours_raw are ours with the coding switch set one way,
        # ours_deep ours with its sleeps checkpointed.
        self.ours = config in ("ours", "ours_coded", "ours_raw", "ours_deep")
        # Checkpointed by the CUDA driver (/sleep?checkpoint=1): the process holds
        # nothing on the GPU, the context included, until its wake restores it.
        self.checkpointed = False
        self.used_file = used_file
        self.pressure_file = pressure_file
        self.graphs = 0 if config == "stock_eager" else SIZES["cudagraph"]
        self.mapped = {"weights": True, "kv_cache": True}
        self.weights_valid = True
        self.level = 0
        self.corrupt = os.environ.get("FAKE_CORRUPT") == "1"
        self.nondeterministic = os.environ.get("FAKE_NONDETERMINISTIC") == "1"
        self.completions = 0
        self.resets_to_refuse = int(os.environ.get("FAKE_RESETS_REFUSED", "0"))
        self.reset_requests = 0
        self.woken_once = False
        # torch's pinned host allocator: blocks rounded up to powers of two, kept
        # for reuse, and the time spent pinning them.
        self.pinned = PINNED_AT_START
        self.pinning_s = 0.001
        self.write()

    def graph_resident(self) -> bool:
        # Stock keeps graphs on the GPU at every level; ours backs them up while
        # everything sleeps and restores them with the first tag that wakes.
        return not self.ours or any(self.mapped.values())

    def used(self) -> int:
        if self.checkpointed:
            return IDLE
        total = IDLE + CONTEXT
        total += sum(SIZES[t] for t, on in self.mapped.items() if on)
        if self.graph_resident():
            total += self.graphs
        return total

    def held_by_others(self) -> int:
        if self.pressure_file is None:
            return 0
        try:
            return int(self.pressure_file.read_text())
        except (OSError, ValueError):
            return 0

    def wake_need(self, tags: list[str]) -> int:
        """Bytes a wake of `tags` maps: the tags still asleep, and our graph pool
        when it is offloaded (any wake restores it)."""
        need = sum(SIZES[tag] for tag in tags if not self.mapped.get(tag, True))
        return need if self.graph_resident() else need + self.graphs

    def pin_backup(self, level: int) -> None:
        """What a sleep at `level` copies to host, pinned as torch would."""
        backup = self.graphs if self.ours else 0
        backup += SIZES["weights"] if level == 1 else 0
        if backup:
            needed = PINNED_AT_START + (1 << (backup - 1).bit_length())
            if needed > self.pinned:
                self.pinned = needed
                self.pinning_s += PINNING_S

    def write(self) -> None:
        tmp = self.used_file.with_suffix(".tmp")
        tmp.write_text(str(self.used()))
        tmp.replace(self.used_file)

    def report(self) -> dict:
        tags = {}
        for tag, on in self.mapped.items():
            size = SIZES[tag]
            if self.ours:
                kept = tag == "weights" and self.level == 1
                tags[tag] = {
                    "mapped": size if on else 0,
                    "backed_up": 0 if on or not kept else size,
                    "dropped": 0 if on or kept else size,
                }
            else:
                tags[tag] = {"mapped": size if on else 0, "asleep": 0 if on else size}
        report = {
            "graph_offload_active": self.ours,
            "driver_free_bytes": TOTAL - self.used() - self.held_by_others(),
            "driver_total_bytes": TOTAL,
            "tags": tags,
            "allocator": "vllm",
        }
        if self.ours:
            resident = self.graph_resident()
            tags["cudagraph"] = {
                "mapped": self.graphs if resident else 0,
                "backed_up": 0 if resident else self.graphs,
                "dropped": 0,
            }
            report["allocator"] = "vllm_graph_sleep"
            report["host_bytes"] = sum(t["backed_up"] for t in tags.values())
        report["ledger"] = self.ledger(tags)
        report["pinned_host"] = {"bytes": self.pinned, "pinning_s": self.pinning_s}
        return report

    def ledger(self, tags: dict) -> dict:
        """The worker's ledger as vllm_graph_sleep.ledger shapes it: the context
        and what the sleep-mode allocator and torch's graph pools hold."""
        mapped = sum(t["mapped"] for t in tags.values())
        ours = self.ours
        asleep = not any(self.mapped.values())
        fields = {
            "device": 0,
            "nvml_used": self.used() - IDLE,
            "nvml_used_source": "nvml process",
            "stack_reservation": 0 if ours and asleep else STACK,
            "our_pools_mapped": mapped if ours else 0,
            "vllm_cumem_mapped": 0 if ours else mapped,
            "torch_reserved_outside_pools": self.graphs if self.config == "stock_graphs" else 0,
            "nccl_buffers": None,
            "cublas_workspaces": 32 * MiB,
            "instantiated_graphs": 0 if self.config == "stock_eager" else GRAPHS,
            "cuda_modules": None,
            "estimated": {"cublas_workspaces": "one workspace of torch's default"},
            "unavailable": {"cuda_modules": "not countable", "nccl_buffers": "TP=1"},
        }
        summed = ("stack_reservation", "our_pools_mapped", "vllm_cumem_mapped")
        summed += ("torch_reserved_outside_pools",)
        fields["attributed"] = sum(fields[name] for name in summed)
        fields["unattributed"] = fields["nvml_used"] - fields["attributed"]
        return fields

    def tokens(self, prompt: str, count: int) -> list[int]:
        seed = hashlib.sha256(prompt.encode()).digest()
        ids = [(seed[i % 32] * 31 + i * 7) % 4096 for i in range(count)]
        if not self.weights_valid or (self.corrupt and self.woken_once):
            ids = [(i + 1) % 4096 for i in ids]
        if self.nondeterministic:
            ids[-1] = (ids[-1] + self.completions) % 4096
        return ids


class Handler(BaseHTTPRequestHandler):
    state: State
    ready_at: float
    lock = threading.Lock()

    def log_message(self, fmt, *args):  # into the log file, like a server
        sys.stdout.write("fake-vllm: " + (fmt % args) + "\n")
        sys.stdout.flush()

    def _send(self, code: int, body: object = None, headers: dict | None = None) -> None:
        raw = b"" if body is None else json.dumps(body).encode()
        self.send_response(code)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _send_text(self, code: int, text: str) -> None:
        raw = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length) or b"{}")

    def do_GET(self):  # noqa: N802
        path = urllib.parse.urlparse(self.path).path
        if path == "/health":
            self._send(200 if time.monotonic() >= self.ready_at else 503)
        elif path == "/v1/models":
            self._send(200, {"data": [{"id": "fake-model"}]})
        elif path == "/is_sleeping" and self.state.checkpointed:
            self._send(200, {"is_sleeping": True, "checkpointed": True})
        elif path == "/is_sleeping":
            self._send(200, {"is_sleeping": not all(self.state.mapped.values())})
        else:
            self._send(404, {"error": path})

    def do_POST(self):  # noqa: N802
        # One state change at a time (the HTTP server runs a thread per request).
        with Handler.lock:
            self._post()

    def _post(self):
        url = urllib.parse.urlparse(self.path)
        query = urllib.parse.parse_qs(url.query)
        state = self.state
        if state.checkpointed and url.path not in ("/wake_up", "/v1/completions"):
            self._send(409, {"error": "checkpointed: POST /wake_up first"})
            return
        if url.path == "/v1/completions":
            body = self._body()
            if not all(state.mapped.values()):
                self._send(503, {"error": "asleep"}, {"Retry-After": "1"})
                return
            assert body.get("return_token_ids") is True and body.get("temperature") == 0
            prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
            count = body["max_tokens"]
            # The shape of each request, for the tests of how the bench asks.
            sys.stdout.write(f"fake-vllm: completion of {len(prompts)} prompt(s)\n")
            state.completions += 1
            # 2 ms per token: a decode of a few tokens must take measurably longer
            # than one token even on a loaded 2-core CI machine (0.2 ms per token
            # let the HTTP jitter make eight tokens look as fast as one).
            time.sleep(0.002 + 0.002 * count)
            choices = [
                {"index": i, "text": f"<{i}>", "token_ids": state.tokens(p, count)}
                for i, p in enumerate(prompts)
            ]
            usage = {"completion_tokens": count * len(prompts)}
            self._send(200, {"choices": choices, "usage": usage})
        elif url.path == "/reset_prefix_cache":
            state.reset_requests += 1
            self._send(200, {"success": state.reset_requests > state.resets_to_refuse})
        elif url.path == "/sleep":
            if os.environ.get("FAKE_DIE_ON_SLEEP") == "1":
                sys.stdout.write("fake-vllm: dying on /sleep as asked\n")
                sys.stdout.flush()
                state.used_file.unlink(missing_ok=True)  # the driver frees a dead process
                os._exit(7)
            level = int(query.get("level", ["1"])[0])
            state.level = level
            state.pin_backup(level)
            state.mapped = {"weights": False, "kv_cache": False}
            if level == 2:
                state.weights_valid = False
            state.checkpointed = query.get("checkpoint") == ["1"]
            time.sleep(0.01)
            state.write()
            self._send(200)
        elif url.path == "/wake_up":
            if state.checkpointed:  # the restore first, only with room for what it held
                if TOTAL - IDLE - state.held_by_others() < CONTEXT:
                    self._send(503, {"error": "no room to restore"}, {"Retry-After": "5"})
                    return
                state.checkpointed = False
            tags = query.get("tags") or list(state.mapped)
            need = state.wake_need(tags)
            free = TOTAL - state.used() - state.held_by_others()
            if need > free:
                # vLLM logs the worker's exception; the client sees a bare 500.
                sys.stdout.write(
                    f"fake-vllm: ERROR wake_up failed\nRuntimeError: fake out of memory: "
                    f"wake_up(tags={tags}) needs {need} bytes, {free} free\n"
                )
                sys.stdout.flush()
                if os.environ.get("FAKE_NO_ROLLBACK") == "1":
                    state.mapped[tags[0]] = True
                    state.write()
                self._send_text(500, "Internal Server Error")
                return
            for tag in tags:
                if tag in state.mapped:  # "scheduling" ends a level-0 pause: nothing here
                    state.mapped[tag] = True
            state.woken_once = True
            time.sleep(0.01)
            state.write()
            self._send(200)
        elif url.path == "/collective_rpc":
            method = self._body().get("method")
            if method == "graph_sleep_memory_report":
                self._send(200, {"results": [state.report()]})
            elif method == "reload_weights":
                state.weights_valid = True
                self._send(200, {"results": [None]})
            else:
                self._send(500, {"error": f"no method {method}"})
        else:
            self._send(404, {"error": url.path})


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--used-file", type=Path, required=True)
    parser.add_argument("--pressure-file", type=Path)
    args = parser.parse_args()
    print(f"fake-vllm: serving {args.config} on {args.port}", flush=True)
    # What `vllm serve` does when VLLM_WORKER_MULTIPROC_METHOD is unset: spawn.
    method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    print(f"fake-vllm: engine core started by {method}", flush=True)
    coding = os.environ.get("VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS", "1")  # on by default on CUDA
    print(f"fake-vllm: weight backups {'coded' if coding == '1' else 'raw'}", flush=True)
    Handler.state = State(args.config, args.used_file, args.pressure_file)
    if os.environ.get("FAKE_ENGINE_FAILS"):
        # vLLM's engine core dying at start-up while the API server hangs on.
        print("(EngineCore pid=1) ERROR [core.py:1330] EngineCore failed to start.", flush=True)
        print("(EngineCore pid=1) ERROR [core.py:1330] RuntimeError: Worker failed", flush=True)
        try:
            time.sleep(600)
        finally:
            # The driver frees a stopped process's memory, as it would vLLM's.
            args.used_file.unlink(missing_ok=True)
    # The line vLLM 0.26's engine core logs once it is initialized (v1/engine/core.py).
    compile_s = "" if args.config == "stock_eager" else " (compilation: 1.25 s)"
    print(
        "(EngineCore pid=1) INFO 12-01 11:04:48 [core.py:340] init engine (profile, "
        f"create kv cache, warmup model) took 6.50 s{compile_s}",
        flush=True,
    )
    Handler.ready_at = time.monotonic() + float(os.environ.get("FAKE_START_DELAY", "0.3"))
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    try:
        server.serve_forever(poll_interval=0.05)
    finally:
        args.used_file.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    import signal

    # Like vLLM: SIGTERM shuts down cleanly (frees the "GPU" memory).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sys.exit(main())
