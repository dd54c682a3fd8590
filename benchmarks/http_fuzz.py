"""Concurrency and malformed-request fuzz of the sleep/wake HTTP surface.

Several clients, for --duration seconds, send random requests to one `vllm serve`
with graph offload (dev mode, --api-key): /sleep and /wake_up with random levels,
modes and tags (valid and invalid), completions, /is_sleeping, bad
/collective_rpc calls, requests without the key and malformed requests
(repeated or empty parameters, wrong methods, huge or non-numeric levels,
invalid UTF-8, oversized bodies). Every answer is judged against what
docs/user-guide.md documents; a request without an answer in --hung-s seconds
counts as a hang. At the end the server is woken (and its weights reloaded,
since a level-2 sleep discards them): it must say it is awake and give the
same greedy tokens as before the first request.

    python benchmarks/http_fuzz.py --out docs/results/http-h200.json

starts its own server (needs a GPU; exits 2 without one). --base-url drives a
server that is already running instead (tests/unit/fake_vllm_server.py in the
CPU test). Exit code 0 when nothing failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import random
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from vllm_graph_sleep.bench.client import greedy_completion_body
from vllm_graph_sleep.bench.server import TRANSPORT_ERRORS, transport_reason
from vllm_graph_sleep.units import MiB

PROMPTS = ["The quick brown fox", "Sleep mode lets a server"]
LEVELS = ("0", "1", "2")
MODES = ("abort", "keep", "wait")
TAGS = ("weights", "kv_cache", "scheduling")
BAD_LEVELS = ("3", "-1", "1.5", "abc", "", "99999999999999999999999", "1e9", "%FF", "%00")
#: The server's VLLM_GRAPH_SLEEP_ASLEEP_WAIT_S when this script starts it.
ASLEEP_WAIT_S = 5


@dataclass
class Request:
    action: str
    method: str
    path: str  # with its query, already encoded
    body: bytes | None = None
    content_type: str | None = "application/json"
    key: bool = True  # send the API key (when there is one)


@dataclass
class Answer:
    status: int | None  # None: no answer (the reason is in error)
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    error: str = ""
    seconds: float = 0.0


def expected(request: Request, answer: Answer) -> str | None:
    """None if the answer is what the user guide documents, else why not."""
    status = answer.status
    if status is None:
        return answer.error
    action = request.action
    if action == "no_key":
        return None if status == 401 else f"{status} without the API key (expected 401)"
    if action == "completion":
        if status == 200:
            return None
        if status == 503 and answer.headers.get("retry-after"):
            return None  # documented: still asleep after the wait bound
        return f"completion answered {status}: {answer.body[:200]!r}"
    if action == "bad_rpc":
        # Documented: an error answer with a JSON message (a 4xx or a 500).
        if 400 <= status < 500 or status == 500:
            try:
                json.loads(answer.body)
            except ValueError:
                return f"bad collective_rpc answered {status} without JSON"
            return None
        return f"bad collective_rpc answered {status}"
    if action in ("sleep", "wake_up"):
        return None if status == 200 else f"{action} answered {status}: {answer.body[:200]!r}"
    if action == "is_sleeping":
        if status != 200:
            return f"is_sleeping answered {status}"
        try:
            state = json.loads(answer.body)["is_sleeping"]
        except (ValueError, KeyError, TypeError):
            return f"is_sleeping answered {answer.body[:100]!r}"
        return None if isinstance(state, bool) else f"is_sleeping said {state!r}"
    # Every other action is a malformed or invalid request: a 4xx, nothing else.
    return None if 400 <= status < 500 else f"{action} answered {status} (expected 4xx)"


class Fuzzer:
    def __init__(self, base_url: str, api_key: str | None, model_id: str, seed: int, hung_s: float):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.model_id = model_id
        self.seed = seed
        self.hung_s = hung_s
        self.lock = threading.Lock()
        self.by_action: dict[str, collections.Counter] = collections.defaultdict(
            collections.Counter
        )
        self.failures: list[dict] = []
        self.requests = 0

    # -- sending ---------------------------------------------------------

    def send(self, request: Request, timeout: float | None = None) -> Answer:
        headers = {}
        if request.content_type and request.body is not None:
            headers["Content-Type"] = request.content_type
        if request.key and self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = (
            request.body if request.body is not None else (b"" if request.method != "GET" else None)
        )
        http = urllib.request.Request(
            self.base_url + request.path, data=data, headers=headers, method=request.method
        )
        started = time.monotonic()
        try:
            with urllib.request.urlopen(http, timeout=timeout or self.hung_s) as response:
                answer = Answer(response.status, dict(response.headers), response.read())
        except urllib.error.HTTPError as error:
            answer = Answer(error.code, dict(error.headers), error.read())
        except TimeoutError:
            answer = Answer(None, error=f"no answer in {timeout or self.hung_s:g} s (hang)")
        except TRANSPORT_ERRORS as error:
            reason = transport_reason(error)
            if isinstance(reason, TimeoutError):
                answer = Answer(None, error=f"no answer in {timeout or self.hung_s:g} s (hang)")
            else:
                answer = Answer(None, error=f"connection failed: {reason!r}")
        answer.headers = {k.lower(): v for k, v in answer.headers.items()}
        answer.seconds = time.monotonic() - started
        return answer

    def record(self, request: Request, answer: Answer) -> None:
        problem = expected(request, answer)
        with self.lock:
            self.requests += 1
            self.by_action[request.action][str(answer.status or "no answer")] += 1
            if problem is not None:
                self.failures.append(
                    {
                        "action": request.action,
                        "request": f"{request.method} {request.path}",
                        "problem": problem,
                        "seconds": round(answer.seconds, 3),
                    }
                )

    def completion_body(self, max_tokens: int = 8, prompts=PROMPTS) -> bytes:
        return json.dumps(greedy_completion_body(self.model_id, prompts, max_tokens)).encode()

    # -- what a client sends ---------------------------------------------

    def random_request(self, rng: random.Random) -> Request:
        kinds = ["completion"] * 30 + ["is_sleeping"] * 12 + ["sleep"] * 10
        kinds += ["wake_up"] * 16 + ["bad_sleep"] * 6 + ["bad_wake_up"] * 5
        kinds += ["malformed"] * 14 + ["bad_rpc"] * 4 + (["no_key"] * 3 if self.api_key else [])
        kind = rng.choice(kinds)
        if kind == "completion":
            return Request("completion", "POST", "/v1/completions", self.completion_body())
        if kind == "is_sleeping":
            return Request("is_sleeping", "GET", "/is_sleeping", content_type=None)
        if kind == "sleep":
            query = {"level": rng.choice(LEVELS)}
            if rng.random() < 0.5:
                query["mode"] = rng.choice(MODES)
            return Request("sleep", "POST", "/sleep?" + urllib.parse.urlencode(query))
        if kind == "wake_up":
            tags = rng.sample(TAGS, rng.randint(0, len(TAGS)))
            query = urllib.parse.urlencode([("tags", t) for t in tags])
            return Request("wake_up", "POST", "/wake_up" + (f"?{query}" if query else ""))
        if kind == "bad_sleep":
            choice = rng.randrange(3)
            if choice == 0:
                query = f"level={rng.choice(BAD_LEVELS)}"
            elif choice == 1:
                query = f"level=1&mode={rng.choice(('drain', 'ABORT', '', '%FF'))}"
            else:
                query = f"level={rng.choice(LEVELS)}&level={rng.choice(LEVELS)}"
            return Request("bad_sleep", "POST", f"/sleep?{query}")
        if kind == "bad_wake_up":
            # "weights" repeats the tag: vLLM 0.26 woke, then answered 500.
            bad = rng.choice(("cudagraph", "", "graphs", "%FF%FE", "weights,kv_cache", "weights"))
            return Request("bad_wake_up", "POST", f"/wake_up?tags=weights&tags={bad}")
        if kind == "bad_rpc":
            method = rng.choice(("get_model", "no_such_worker_method"))
            return Request(
                "bad_rpc", "POST", "/collective_rpc", json.dumps({"method": method}).encode()
            )
        if kind == "no_key":
            path = rng.choice(("/sleep?level=1", "/wake_up", "/collective_rpc"))
            return Request("no_key", "POST", path, key=False)
        return rng.choice(self.malformed)

    @functools.cached_property
    def malformed(self) -> list[Request]:
        big = b"{" + b"x" * (8 * MiB)  # oversized and not JSON
        long_prompt = self.completion_body(prompts=["word " * (400 * 1024)])  # 2 MiB prompt
        return [
            Request("wrong_method", "GET", "/sleep", content_type=None),
            Request("wrong_method", "GET", "/wake_up", content_type=None),
            Request("wrong_method", "POST", "/is_sleeping"),
            Request("wrong_method", "PUT", "/collective_rpc", b"{}"),
            Request("invalid_utf8", "POST", "/collective_rpc", b'{"method": "\xff\xfe"}'),
            Request("invalid_utf8", "POST", "/v1/completions", b'{"prompt": "\xc3\x28"}'),
            Request("not_json", "POST", "/collective_rpc", b"{method: check_health"),
            Request("no_method", "POST", "/collective_rpc", b"{}"),
            Request("rpc_shape", "POST", "/collective_rpc", b"[1, 2]"),
            Request("rpc_shape", "POST", "/collective_rpc", b'{"method": 5}'),
            Request("rpc_shape", "POST", "/collective_rpc", b'{"method": "m", "args": "ab"}'),
            Request("not_json", "POST", "/v1/completions", b"[1, 2"),
            Request("oversized", "POST", "/collective_rpc", big),
            Request("oversized", "POST", "/v1/completions", long_prompt),
        ]

    def client(self, index: int, deadline: float) -> None:
        rng = random.Random(self.seed * 1000 + index)
        try:
            while time.monotonic() < deadline:
                request = self.random_request(rng)
                self.record(request, self.send(request))
        except Exception as error:  # a client that dies is a failure, not silence
            self.failures.append({"action": f"client {index}", "problem": repr(error)})

    # -- the run -----------------------------------------------------------

    def tokens(self) -> list[list[int]] | str:
        answer = self.send(Request("final", "POST", "/v1/completions", self.completion_body(16)))
        if answer.status != 200:
            return f"completion answered {answer.status}: {answer.body[:200]!r} {answer.error}"
        choices = sorted(json.loads(answer.body)["choices"], key=lambda c: c["index"])
        return [c["token_ids"] for c in choices]

    def run(self, duration: float, clients: int) -> dict:
        reference = self.tokens()
        if isinstance(reference, str):
            raise SystemExit(f"the server does not serve before the fuzz: {reference}")
        deadline = time.monotonic() + duration
        threads = [
            threading.Thread(target=self.client, args=(i, deadline), daemon=True)
            for i in range(clients)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()) + self.hung_s + 30)
        stuck = sum(thread.is_alive() for thread in threads)
        final = self.settle(reference)
        if stuck:
            self.failures.append(
                {"action": "clients", "problem": f"{stuck} client(s) never returned"}
            )
        if self.requests == 0:
            self.failures.append({"action": "clients", "problem": "no request was made"})
        failures = self.failures + [{"action": "final", "problem": p} for p in final["problems"]]
        by_status = collections.Counter()
        for counts in self.by_action.values():
            by_status.update(counts)
        return {
            "duration_s": duration,
            "clients": clients,
            "seed": self.seed,
            "hung_after_s": self.hung_s,
            "requests": self.requests,
            "answers_by_status": dict(sorted(by_status.items())),
            "answers_by_action": {
                a: dict(sorted(c.items())) for a, c in sorted(self.by_action.items())
            },
            "failure_count": len(failures),
            "failures": failures[:100],
            "final": {k: v for k, v in final.items() if k != "problems"},
            "passed": not failures,
        }

    def settle(self, reference: list[list[int]]) -> dict:
        """Wakes everything, reloads the weights (a level-2 sleep dropped them),
        and checks the state and the tokens."""
        problems = []
        steps = [
            Request("final", "POST", "/wake_up"),
            Request(
                "final",
                "POST",
                "/collective_rpc",
                json.dumps({"method": "reload_weights"}).encode(),
            ),
        ]
        for step in steps:
            answer = self.send(step)
            if answer.status != 200:
                problems.append(
                    f"{step.method} {step.path} answered {answer.status} {answer.error}"
                )
        answer = self.send(Request("final", "GET", "/is_sleeping", content_type=None))
        awake = answer.status == 200 and json.loads(answer.body) == {"is_sleeping": False}
        if not awake:
            problems.append(
                f"not awake after the final wake: {answer.status} {answer.body[:100]!r}"
            )
        tokens = self.tokens()
        exact = tokens == reference
        if not exact:
            problems.append(f"tokens after the final wake differ from before: {str(tokens)[:200]}")
        return {"awake": awake, "tokens_exact": exact, "problems": problems}


def start_server(args) -> tuple[object, str, str]:
    import torch

    if not torch.cuda.is_available():
        print("http_fuzz: needs a GPU to start vllm serve (or give --base-url)", file=sys.stderr)
        raise SystemExit(2)
    from vllm_graph_sleep.bench.server import Server, free_port, serve_command, server_env
    from vllm_graph_sleep.testing import model_dir

    model = args.model or model_dir("llama")
    port = free_port()
    extra = ("--api-key", args.api_key)
    command = serve_command(
        "ours", model, port, tp=1, gpu_memory_utilization=0.25, max_model_len=512, extra=extra
    )
    env = server_env()
    env["VLLM_GRAPH_SLEEP_ASLEEP_WAIT_S"] = str(ASLEEP_WAIT_S)
    log = Path(tempfile.mkdtemp(prefix="http-fuzz-")) / "server.log"
    print(f"http_fuzz: starting vllm serve; its log: {log}", flush=True)
    server = Server("fuzz", command, env, log)
    server.start(f"http://127.0.0.1:{port}")
    try:
        server.wait_healthy(timeout=900)
    except BaseException:  # a failed start, or Ctrl-C during the wait
        server.stop()
        raise
    return server, server.base_url, " ".join(command[2:])


def _interrupt(signum, frame):
    raise KeyboardInterrupt("SIGTERM")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where the JSON summary goes")
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hung-s", type=float, default=120.0, help="no answer in this = a hang")
    parser.add_argument("--model", help="a local model directory (default: the small llama)")
    parser.add_argument("--base-url", help="drive this running server instead of starting one")
    parser.add_argument("--api-key", default="graph-sleep-fuzz-key")
    parser.add_argument("--no-api-key", action="store_true", help="the server has no key")
    parser.add_argument("--model-id", help="the served model name (default: from /v1/models)")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.clients < 1 or args.hung_s <= 0:
        parser.error("--duration and --hung-s must be > 0 and --clients >= 1")
    api_key = None if args.no_api_key else args.api_key

    server, base_url, command = None, args.base_url, None
    # SIGTERM (a job runner's limit) unwinds like Ctrl-C, so the server is stopped.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        if base_url is None:
            server, base_url, command = start_server(args)
        fuzzer = Fuzzer(base_url, api_key, args.model_id or "", args.seed, args.hung_s)
        if not fuzzer.model_id:
            answer = fuzzer.send(Request("setup", "GET", "/v1/models", content_type=None))
            fuzzer.model_id = json.loads(answer.body)["data"][0]["id"]
        result = fuzzer.run(args.duration, args.clients)
    finally:
        try:
            if server is not None:
                server.stop()
        finally:
            signal.signal(signal.SIGTERM, previous)
    result["server"] = command or base_url
    if command is not None:
        result["asleep_wait_s"] = ASLEEP_WAIT_S
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"http_fuzz: {result['requests']} requests, answers {result['answers_by_status']}, "
        f"{result['failure_count']} failure(s); final awake={result['final']['awake']} "
        f"tokens_exact={result['final']['tokens_exact']} -> {args.out}"
    )
    for failure in result["failures"][:10]:
        print(f"  {failure}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
