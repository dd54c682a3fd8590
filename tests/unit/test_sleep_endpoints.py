"""The dev sleep endpoints reject what stock vLLM 0.26 mishandles (400, engine not
called) and serve everything else exactly as stock (CPU, no server process)."""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from vllm.engine.protocol import EngineClient
from vllm.entrypoints.serve.dev.sleep import api_router

from tests.unit.force_cpu_platform import force_cpu_platform
from vllm_graph_sleep import request_gate
from vllm_graph_sleep.bench.client import greedy_completion_body
from vllm_graph_sleep.patches import entrypoints_serve_dev_sleep_api_router as patch
from vllm_graph_sleep.patches._wrap import original_of
from vllm_graph_sleep.units import MiB

force_cpu_platform()  # vLLM's app below builds a config (a no-op on a GPU machine)


class FakeEngineClient:
    """The sleep part of vLLM's EngineClient protocol; records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.sleeping = False

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(("sleep", level, mode))
        self.sleeping = True

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))
        self.sleeping = False

    async def is_sleeping(self) -> bool:
        self.calls.append(("is_sleeping",))
        return self.sleeping


def serve(attach_router, engine: FakeEngineClient, **client_kwargs) -> tuple[FastAPI, TestClient]:
    app = FastAPI()
    attach_router(app)
    app.state.engine_client = engine
    return app, TestClient(app, **client_kwargs)


@pytest.fixture(autouse=True)
def dev_mode(monkeypatch):
    # The dev routes, and so our patch, exist only with VLLM_SERVER_DEV_MODE=1.
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")


def test_nothing_is_patched_outside_dev_mode(monkeypatch):
    monkeypatch.setattr(api_router, "attach_router", original_of(api_router.attach_router))
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE")
    patch.apply()
    assert api_router.attach_router is original_of(api_router.attach_router)


@pytest.fixture
def engine() -> FakeEngineClient:
    return FakeEngineClient()


@pytest.fixture
def client(engine) -> TestClient:
    patch.apply()
    return serve(api_router.attach_router, engine)[1]


def test_fake_engine_client_matches_vllm_protocol():
    for name in ("sleep", "wake_up", "is_sleeping"):
        ours = inspect.signature(getattr(FakeEngineClient, name)).parameters
        theirs = inspect.signature(getattr(EngineClient, name)).parameters
        assert list(ours) == list(theirs), name
        assert [p.default for p in ours.values()] == [p.default for p in theirs.values()]
        assert inspect.iscoroutinefunction(getattr(EngineClient, name))


@pytest.mark.parametrize(
    ("query", "level", "mode"),
    [
        ("", 1, "abort"),
        ("?level=0", 0, "abort"),
        ("?level=1", 1, "abort"),
        ("?level=2", 2, "abort"),
        ("?level=2&mode=keep", 2, "keep"),
        ("?mode=wait", 1, "wait"),
        ("?level=1&mode=abort", 1, "abort"),
    ],
)
def test_valid_sleep_reaches_engine(client, engine, query, level, mode):
    response = client.post(f"/sleep{query}")
    assert response.status_code == 200
    assert response.content == b""
    assert engine.calls == [("sleep", level, mode)]


@pytest.mark.parametrize("level", ["3", "-1", "abc", "1.5", ""])
def test_bad_level_is_rejected_before_the_engine(client, engine, level):
    response = client.post("/sleep", params={"level": level})
    assert response.status_code == 400
    error = response.json()["error"]
    assert repr(level) in error and "0, 1, 2" in error
    assert engine.calls == []


@pytest.mark.parametrize("query", ["level=1&level=2", "level=1&level=1", "mode=keep&mode=wait"])
def test_repeated_sleep_parameter_is_rejected(client, engine, query):
    response = client.post(f"/sleep?{query}")
    assert response.status_code == 400
    assert "times: give it once" in response.json()["error"]
    assert engine.calls == []


@pytest.mark.parametrize("mode", ["drain", "ABORT", ""])
def test_bad_mode_is_rejected_before_the_engine(client, engine, mode):
    response = client.post("/sleep", params={"level": "1", "mode": mode})
    assert response.status_code == 400
    error = response.json()["error"]
    assert repr(mode) in error and "'abort', 'keep', 'wait'" in error
    assert engine.calls == []


@pytest.mark.parametrize(
    ("tags", "seen"),
    [
        ([], None),
        (["weights"], ["weights"]),
        (["kv_cache"], ["kv_cache"]),
        (["weights", "kv_cache"], ["weights", "kv_cache"]),
        (["scheduling"], ["scheduling"]),  # ends a level-0 pause
    ],
)
def test_valid_wake_up_reaches_engine(client, engine, tags, seen):
    response = client.post("/wake_up", params={"tags": tags})
    assert response.status_code == 200
    assert response.content == b""
    assert engine.calls == [("wake_up", seen)]


@pytest.mark.parametrize(
    ("tags", "bad"),
    [(["unknown"], "unknown"), (["cudagraph"], "cudagraph"), ([""], ""), (["weights", "x"], "x")],
)
def test_bad_tag_is_rejected_before_the_engine(client, engine, tags, bad):
    response = client.post("/wake_up", params={"tags": tags})
    assert response.status_code == 400
    error = response.json()["error"]
    assert repr(bad) in error and "'weights', 'kv_cache', 'scheduling'" in error
    assert engine.calls == []


def test_is_sleeping_is_unaffected(client, engine):
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    client.post("/sleep?level=3")  # rejected, so still awake
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    client.post("/sleep?level=2")
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}
    assert engine.calls == [
        ("is_sleeping",),
        ("is_sleeping",),
        ("sleep", 2, "abort"),
        ("is_sleeping",),
    ]


def test_other_methods_on_guarded_paths_are_stock(client, engine):
    assert client.get("/sleep?level=3").status_code == 405
    assert engine.calls == []


def test_valid_requests_answer_exactly_as_stock():
    patch.apply()
    requests = [
        ("post", "/sleep?level=0&mode=keep"),
        ("post", "/sleep"),
        ("post", "/wake_up?tags=weights&tags=kv_cache"),
        ("post", "/wake_up"),
        ("get", "/is_sleeping"),
    ]
    answers = []
    for attach_router in (original_of(api_router.attach_router), api_router.attach_router):
        engine = FakeEngineClient()
        _, client = serve(attach_router, engine)
        responses = [getattr(client, method)(url) for method, url in requests]
        seen = [(r.status_code, r.headers.get("content-type"), r.content) for r in responses]
        answers.append((seen, engine.calls))
    assert answers[0] == answers[1]


def test_root_path_is_honoured(engine):
    patch.apply()
    _, client = serve(api_router.attach_router, engine, root_path="/api")
    assert client.post("/api/sleep?level=3").status_code == 400
    assert client.post("/api/sleep?level=2").status_code == 200
    assert engine.calls == [("sleep", 2, "abort")]


def test_apply_and_attach_are_idempotent(engine):
    patch.apply()
    wrapped = api_router.attach_router
    patch.apply()
    assert api_router.attach_router is wrapped
    assert original_of(original_of(wrapped)) is original_of(wrapped)  # wrapped once

    app, client = serve(api_router.attach_router, engine)
    api_router.attach_router(app)  # a second attach adds no second layer
    layers = [m for m in app.user_middleware if m.cls is request_gate.SleepRequestValidation]
    assert len(layers) == 1
    response = client.post("/sleep?level=3")
    assert response.status_code == 400
    assert set(response.json()) == {"error"}
    assert engine.calls == []


# -- requests while asleep (AsleepGate) ------------------------------------
#
# vLLM's real app (build_app, init_app_state) on a real AsyncLLM, so requests
# go through vLLM's handlers, renderer and input processor; only the engine
# core process is replaced (FakeCore). A tiny random Llama gives the config and
# the tokenizer.

MAX_MODEL_LEN = 512


class FakeCore:
    """The engine core client as AsyncLLM uses it, with no engine behind it.
    A request is answered with max_tokens tokens after busy_s seconds; while
    the core sleeps or is paused it queues requests, as EngineCore does
    (requests in flight are kept, as with mode=keep, except that mode=wait
    lets them finish before the sleep or pause returns), and answers them
    once fully awake: the scheduler resumes when no tag sleeps any more, as
    EngineCore.wake_up does. is_sleeping answers after answer_s seconds (never
    when it is None), like an engine core busy with something else. Records
    the calls the tests look at."""

    def __init__(self) -> None:
        self.resources = SimpleNamespace(engine_dead=False)
        self.calls: list[tuple] = []
        self.asleep: set[str] = set()
        self.busy_s = 0.0
        self.answer_s: float | None = 0.0
        self.check_fails = False
        self._queued: list = []
        self._in_flight: set[str] = set()
        self._draining: set[str] = set()
        self._aborted: set[str] = set()
        self._outputs: asyncio.Queue = asyncio.Queue()

    def added(self) -> list[str]:
        return [call[1] for call in self.calls if call[0] == "add"]

    def count(self, name: str) -> int:
        return sum(call[0] == name for call in self.calls)

    async def get_supported_tasks_async(self) -> tuple[str, ...]:
        return ("generate",)

    async def add_request_async(self, request) -> None:
        self.calls.append(("add", request.request_id))
        self._in_flight.add(request.request_id)
        asyncio.get_running_loop().call_later(self.busy_s, self._step, request)

    def _step(self, request) -> None:
        if request.request_id in self._aborted:
            self._in_flight.discard(request.request_id)
            return
        if self.asleep and request.request_id not in self._draining:
            self._queued.append(request)
            return
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

        tokens = list(range(100, 100 + request.sampling_params.max_tokens))
        output = EngineCoreOutput(request.request_id, tokens, finish_reason=FinishReason.LENGTH)
        self._outputs.put_nowait(EngineCoreOutputs(outputs=[output]))
        self._in_flight.discard(request.request_id)

    async def get_output_async(self):
        return await self._outputs.get()

    async def abort_requests_async(self, request_ids) -> None:
        self.calls.append(("abort", list(request_ids)))
        self._aborted.update(request_ids)

    async def _pause(self, mode: str) -> None:
        if mode == "wait":
            self._draining = set(self._in_flight)
        self.asleep.add("scheduling")
        while self._draining & self._in_flight:
            await asyncio.sleep(0.01)
        self._draining = set()

    async def sleep_async(self, level: int, mode: str) -> None:
        self.calls.append(("sleep", level, mode))
        await self._pause(mode)
        if level:
            self.asleep |= {"weights", "kv_cache"}

    async def wake_up_async(self, tags: list[str] | None) -> None:
        self.calls.append(("wake_up", tags))
        self.asleep -= set(tags or self.asleep)
        if not self.asleep & {"weights", "kv_cache"}:
            self.asleep.discard("scheduling")
        self._answer_queued()

    async def pause_scheduler_async(self, mode: str, clear_cache: bool) -> None:
        self.calls.append(("pause", mode))
        await self._pause(mode)

    async def resume_scheduler_async(self) -> None:
        self.asleep.discard("scheduling")
        self._answer_queued()

    async def collective_rpc_async(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("rpc", method))
        return [None]

    async def is_sleeping_async(self) -> bool:
        self.calls.append(("is_sleeping",))
        if self.check_fails:
            raise RuntimeError("engine core died")
        if self.answer_s is None:
            await asyncio.Event().wait()  # wedged: never answers
        await asyncio.sleep(self.answer_s)
        return bool(self.asleep)

    def _answer_queued(self) -> None:
        if not self.asleep:
            queued, self._queued = self._queued, []
            for request in queued:
                self._step(request)

    def shutdown(self, timeout: float | None = None) -> None:
        pass


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    from vllm_graph_sleep.testing.models import make_model

    return make_model("llama", tmp_path_factory.mktemp("model") / "llama")


@pytest.fixture
def wait_s(monkeypatch):
    """Sets the wait bound and applies the patch (AsleepGate reads the bound)."""

    def set_bound(seconds: float) -> None:
        monkeypatch.setenv(request_gate.ASLEEP_WAIT_ENV, str(seconds))
        patch.apply()

    return set_bound


def serve_vllm(llama: Path, scenario, *cli: str):
    """Runs `await scenario(client, core)` against vLLM's app, in one event
    loop (AsyncLLM's output handler lives in it)."""
    import httpx
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.api_server import build_app, init_app_state
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core_client import EngineCoreClient

    options = ["--model", str(llama), "--max-model-len", str(MAX_MODEL_LEN), *cli]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(options)
    config = AsyncEngineArgs.from_cli_args(args).create_engine_config()

    async def main():
        core = FakeCore()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(EngineCoreClient, "make_async_mp_client", lambda **_: core)
            engine = AsyncLLM.from_vllm_config(config, disable_log_stats=True)
        try:
            app = build_app(args, supported_tasks=("generate",))
            await init_app_state(engine, app.state, args, supported_tasks=("generate",))
            transport = httpx.ASGITransport(app=app, root_path=args.root_path or "")
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                return await scenario(client, core)
        finally:
            engine.shutdown()

    return asyncio.run(main())


def completion(llama: Path, prompts=("The quick brown fox",), **fields) -> bytes:
    body = greedy_completion_body(str(llama), list(prompts), fields.pop("max_tokens", 4))
    return json.dumps({**body, **fields}).encode()


async def timed_post(client, path: str, body: bytes = b"", delay: float = 0.0):
    await asyncio.sleep(delay)
    started = time.monotonic()
    response = await client.post(path, content=body, headers={"content-type": "application/json"})
    response.seconds = time.monotonic() - started
    return response


def malformed(llama: Path) -> dict[str, tuple[str, bytes]]:
    """Requests vLLM rejects with a 4xx without the engine (the HTTP fuzz's
    kinds first), by kind: (path, body)."""
    chat = {"model": str(llama), "messages": "not a list"}
    return {
        "not_json": ("/v1/completions", b"[1, 2"),
        "invalid_utf8": ("/v1/completions", b'{"prompt": "\xc3\x28"}'),
        "oversized_not_json": ("/v1/completions", b"{" + b"x" * (8 * MiB)),
        # The fuzz's long_prompt: 2 MiB, far past max_model_len.
        "oversized_prompt": ("/v1/completions", completion(llama, ["word " * (400 * 1024)])),
        # Past max_model_len only once tokenized.
        "long_prompt": ("/v1/completions", completion(llama, [" ".join(["go"] * 600)])),
        "long_prompt_streamed": (
            "/v1/completions",
            completion(llama, [" ".join(["go"] * 600)], stream=True),
        ),
        "unknown_model": ("/v1/completions", completion(llama, model="no-such-model")),
        "bad_max_tokens": ("/v1/completions", completion(llama, max_tokens=-1)),
        # Rejected inside AsyncLLM.add_request (InputProcessor), just before
        # the point where the gate holds requests.
        "token_out_of_vocab": ("/v1/completions", completion(llama, prompts=[[99999999]])),
        "bad_chat": ("/v1/chat/completions", json.dumps(chat).encode()),
    }


MALFORMED_KINDS = (
    "not_json",
    "invalid_utf8",
    "oversized_not_json",
    "oversized_prompt",
    "long_prompt",
    "long_prompt_streamed",
    "unknown_model",
    "bad_max_tokens",
    "token_out_of_vocab",
    "bad_chat",
)


@pytest.mark.parametrize("kind", MALFORMED_KINDS)
def test_malformed_request_while_asleep_gets_vllms_4xx_at_once(llama, wait_s, kind):
    """What the H200 fuzz found: these waited out the bound and got 503."""
    wait_s(10)
    path, body = malformed(llama)[kind]

    async def scenario(client, core):
        awake = await timed_post(client, path, body)
        await timed_post(client, "/sleep?level=1")
        asleep = await timed_post(client, path, body)
        return awake, asleep, core

    awake, asleep, core = serve_vllm(llama, scenario)
    assert 400 <= awake.status_code < 500, awake.text[:300]
    assert (asleep.status_code, asleep.content) == (awake.status_code, awake.content)
    assert asleep.seconds < 2  # the bound is 10 s
    assert core.added() == []  # the engine saw neither


def test_awake_engine_costs_no_round_trip(llama, wait_s):
    wait_s(5)

    async def scenario(client, core):
        return await timed_post(client, "/v1/completions", completion(llama)), core

    answer, core = serve_vllm(llama, scenario)
    assert answer.status_code == 200
    assert [call[0] for call in core.calls] == ["add"]


def test_request_while_asleep_is_held_and_served_after_a_staged_wake(llama, wait_s):
    wait_s(5)
    several = completion(llama, ["The quick brown fox", "Sleep mode"], n=2, temperature=1.0)

    async def scenario(client, core):
        await timed_post(client, "/sleep?level=2")
        reload = json.dumps({"method": "reload_weights"}).encode()
        held, *_ = await asyncio.gather(
            timed_post(client, "/v1/completions", several),
            timed_post(client, "/wake_up?tags=weights", delay=0.3),
            # Level 2 discarded the weights: the RL loop reloads or updates them.
            timed_post(client, "/collective_rpc", reload, delay=0.45),
            timed_post(client, "/wake_up?tags=kv_cache", delay=0.6),
        )
        return held, core

    held, core = serve_vllm(llama, scenario)
    assert held.status_code == 200, held.text[:300]
    choices = held.json()["choices"]
    assert len(choices) == 4 and all(c["token_ids"] == [100, 101, 102, 103] for c in choices)
    # Both prompts, both children of each, reach the engine only after the wake.
    woken = core.calls.index(("wake_up", ["kv_cache"]))
    added = [i for i, call in enumerate(core.calls) if call[0] == "add"]
    assert len(added) == 4 and min(added) > woken


def test_streamed_request_while_asleep_is_held_and_served_after_the_wake(llama, wait_s):
    wait_s(5)

    async def scenario(client, core):
        await timed_post(client, "/sleep?level=1")
        held, _ = await asyncio.gather(
            timed_post(client, "/v1/completions", completion(llama, stream=True)),
            timed_post(client, "/wake_up", delay=0.3),
        )
        return held, core

    held, core = serve_vllm(llama, scenario)
    assert held.status_code == 200 and held.seconds >= 0.3
    assert held.text.rstrip().endswith("data: [DONE]")
    assert core.calls.index(("wake_up", None)) < core.calls.index(("add", core.added()[0]))


@pytest.mark.parametrize("stream", [False, True])
def test_request_while_asleep_gets_503_after_the_bound(llama, wait_s, stream):
    wait_s(0.4)

    async def scenario(client, core):
        await timed_post(client, "/sleep?level=1")
        answer = await timed_post(client, "/v1/completions", completion(llama, stream=stream))
        # vLLM dropped the request: a wake does not send it to the engine.
        await timed_post(client, "/wake_up")
        await asyncio.sleep(0.3)
        return answer, core.added()

    answer, added = serve_vllm(llama, scenario)
    assert 0.4 <= answer.seconds < 3
    assert answer.status_code == 503  # a stream, too: its 200 was held back
    assert answer.headers["retry-after"] == "1"
    assert "asleep" in answer.json()["error"] and "/wake_up" in answer.json()["error"]
    assert added == []  # the engine never saw it


def test_zero_wait_refuses_at_once_and_pause_counts_as_asleep(llama, wait_s):
    wait_s(0)

    async def scenario(client, core):
        await timed_post(client, "/pause")  # vLLM's dev/rlhf route
        return await timed_post(client, "/v1/completions", completion(llama)), core

    answer, core = serve_vllm(llama, scenario)
    assert answer.status_code == 503 and answer.seconds < 1
    assert core.added() == []


def test_root_path_is_honoured_by_the_gate(llama, wait_s):
    wait_s(0)

    async def scenario(client, core):
        await timed_post(client, "/api/sleep?level=1")
        return await timed_post(client, "/api/v1/completions", completion(llama))

    assert serve_vllm(llama, scenario, "--root-path", "/api").status_code == 503


@pytest.mark.parametrize("value", ["-1", "soon", "inf", "nan"])
def test_bad_wait_bound_fails_at_start_up(monkeypatch, value):
    monkeypatch.setenv(request_gate.ASLEEP_WAIT_ENV, value)
    with pytest.raises(ValueError, match=request_gate.ASLEEP_WAIT_ENV):
        patch.apply()


def test_a_failing_engine_check_lets_the_request_through_to_vllm(llama, wait_s):
    wait_s(5)

    async def scenario(client, core):
        await timed_post(client, "/sleep?level=1")
        core.asleep.clear()
        core.check_fails = True
        return await timed_post(client, "/v1/completions", completion(llama)), core

    answer, core = serve_vllm(llama, scenario)
    assert answer.status_code == 200 and len(core.added()) == 1


def test_a_request_overtaken_by_a_sleep_is_bounded_too(llama, wait_s):
    """It found the engine awake, then a /sleep reached the engine first: vLLM
    would queue it until a wake that may never come (seen in the H200 fuzz)."""
    wait_s(0.4)

    async def scenario(client, core):
        core.busy_s = 0.3
        answer, _ = await asyncio.gather(
            timed_post(client, "/v1/completions", completion(llama)),
            timed_post(client, "/sleep?level=1&mode=keep", delay=0.1),
        )
        return answer, list(core.calls), core.added()

    answer, calls, added = serve_vllm(llama, scenario)
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    assert 0.4 <= answer.seconds < 3
    assert ("abort", added) in calls  # vLLM aborted it in the engine before the 503


def test_a_request_overtaken_by_a_short_sleep_is_served(llama, wait_s):
    wait_s(5)

    async def scenario(client, core):
        core.busy_s = 0.2
        answer, *_ = await asyncio.gather(
            timed_post(client, "/v1/completions", completion(llama)),
            timed_post(client, "/sleep?level=1&mode=keep", delay=0.05),
            timed_post(client, "/wake_up", delay=0.5),
        )
        return answer

    answer = serve_vllm(llama, scenario)
    assert answer.status_code == 200 and answer.json()["choices"][0]["token_ids"] == [
        100,
        101,
        102,
        103,
    ]


def test_a_request_overtaken_by_another_api_servers_drain_is_not_cut_off(llama, wait_s):
    """With --api-server-count 2, a /sleep with mode=wait sent to the other
    process drains the engine: this process cannot tell that from a sleep, so
    its request in flight is left to finish, past the bound."""
    wait_s(0.3)

    async def scenario(client, core):
        client._transport.app.state.args.api_server_count = 2
        core.busy_s = 1.0

        async def other_servers_drain():
            await asyncio.sleep(0.1)
            await core.sleep_async(1, "wait")

        answer, _ = await asyncio.gather(
            timed_post(client, "/v1/completions", completion(llama)), other_servers_drain()
        )
        return answer

    answer = serve_vllm(llama, scenario)
    assert answer.status_code == 200, answer.text[:300]
    assert answer.json()["choices"][0]["token_ids"] == [100, 101, 102, 103]


def test_a_handler_that_ignores_the_cut_off_is_cancelled(wait_s):
    """vLLM's handlers stop when AsleepGate cuts a refused request off (they
    see the client go); one that does not listen for that (a streaming response
    under ASGI spec 2.4, say) is cancelled after a grace."""
    import httpx
    from vllm.v1.engine.async_llm import AsyncLLM

    wait_s(0.2)
    engine = FakeEngineClient()
    app = FastAPI()
    api_router.attach_router(app)
    app.state.engine_client = engine
    cancelled = []

    @app.post("/v1/completions")
    async def completions() -> dict:
        try:
            # Where vLLM hands a request to the engine; held while asleep.
            await AsyncLLM._add_request(engine, None, None, None, 0, None)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return {"served": True}

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            await timed_post(client, "/sleep?level=1")
            return await timed_post(client, "/v1/completions")

    answer = asyncio.run(scenario())
    assert answer.status_code == 503 and cancelled == [True]
    assert 0.2 + request_gate.DISCONNECT_GRACE_S <= answer.seconds < 3


# -- issue 34, items 5-9 ---------------------------------------------------


@pytest.mark.parametrize("tags", [["weights", "weights"], ["scheduling", "scheduling"]])
def test_repeated_wake_up_tag_is_rejected_before_the_engine(client, engine, tags):
    """vLLM's executor would wake the workers, then raise KeyError removing
    the tag a second time: a 500 for a wake that worked, scheduling left paused."""
    response = client.post("/wake_up", params={"tags": tags})
    assert response.status_code == 400
    assert f"tag {tags[0]!r} given 2 times: give it once" in response.json()["error"]
    assert engine.calls == []


@pytest.mark.parametrize(
    "route",
    [
        "/sleep?level=1&mode=wait",
        "/pause?mode=wait",
        # The deprecated flag, in spellings FastAPI reads as true.
        "/pause?wait_for_inflight_requests=true",
        "/pause?wait_for_inflight_requests=y",
        "/pause?wait_for_inflight_requests=T",
        "/pause?wait_for_inflight_requests=on",
    ],
)
def test_a_wait_drain_finishes_requests_in_flight_past_the_bound(llama, wait_s, route):
    """mode=wait promises to let requests in flight finish; the engine counts as
    asleep (paused) while it drains, which the in-flight bound must not count.
    The gate reads /pause's flag as vLLM does, or it would cut off a request
    the engine drains."""
    wait_s(0.3)

    async def scenario(client, core):
        core.busy_s = 1.0
        return await asyncio.gather(
            timed_post(client, "/v1/completions", completion(llama)),
            timed_post(client, route, delay=0.1),
        )

    answer, drain = serve_vllm(llama, scenario)
    assert answer.status_code == 200, answer.text[:300]
    assert answer.json()["choices"][0]["token_ids"] == [100, 101, 102, 103]
    assert drain.status_code == 200 and drain.seconds >= 0.5  # it waited for the request


@pytest.mark.parametrize("answer_s", [3.0, None], ids=["busy", "wedged"])
def test_the_bound_holds_while_the_engine_does_not_answer(llama, wait_s, answer_s):
    """is_sleeping queues behind whatever the engine core does; the held
    request's bound must not wait for its answer."""
    wait_s(0.4)

    async def scenario(client, core):
        await timed_post(client, "/sleep?level=1")
        core.answer_s = answer_s
        post = timed_post(client, "/v1/completions", completion(llama))
        return await asyncio.wait_for(post, 6)  # a wedged engine held it for good

    answer = serve_vllm(llama, scenario)
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    assert 0.4 <= answer.seconds < 2


def test_a_request_in_flight_is_bounded_while_the_engine_does_not_answer(llama, wait_s):
    wait_s(0.4)

    async def scenario(client, core):
        core.busy_s = 0.3
        answer, _ = await asyncio.gather(
            asyncio.wait_for(timed_post(client, "/v1/completions", completion(llama)), 6),
            timed_post(client, "/sleep?level=1&mode=keep", delay=0.1),
        )
        return answer

    async def wedge_after_sleep(client, core):
        real_sleep = core.sleep_async

        async def sleep_then_wedge(level, mode):
            await real_sleep(level, mode)
            core.answer_s = None

        core.sleep_async = sleep_then_wedge
        return await scenario(client, core)

    answer = serve_vllm(llama, wedge_after_sleep)
    assert answer.status_code == 503 and 0.4 <= answer.seconds < 2


def test_held_requests_share_one_engine_watcher(llama, wait_s):
    """40 requests held for a second cost the engine about ten is_sleeping
    calls, not ten each."""
    wait_s(5)
    held = 40

    async def scenario(client, core):
        await timed_post(client, "/sleep?level=1")
        before = core.count("is_sleeping")
        answers = await asyncio.gather(
            *(timed_post(client, "/v1/completions", completion(llama)) for _ in range(held)),
            timed_post(client, "/wake_up", delay=1.0),
        )
        return answers[:held], core.count("is_sleeping") - before

    answers, asked = serve_vllm(llama, scenario)
    assert [a.status_code for a in answers] == [200] * held
    assert asked <= 20, asked


def test_requests_beyond_the_held_bound_get_503_at_once(llama, wait_s, monkeypatch):
    monkeypatch.setenv(request_gate.MAX_HELD_ENV, "2")
    wait_s(5)

    async def scenario(client, core):
        await timed_post(client, "/sleep?level=1")
        answers = await asyncio.gather(
            *(timed_post(client, "/v1/completions", completion(llama)) for _ in range(4)),
            timed_post(client, "/wake_up", delay=1.5),
        )
        return answers[:4], core.added()

    answers, added = serve_vllm(llama, scenario)
    served = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 503]
    assert len(served) == 2 and len(refused) == 2 and len(added) == 2
    assert all(a.seconds >= 1.5 for a in served)
    for answer in refused:
        assert answer.seconds < 1.2 and answer.headers["retry-after"] == "1"
        assert request_gate.MAX_HELD_ENV in answer.json()["error"]


@pytest.mark.parametrize("value", ["-1", "many", "1.5"])
def test_bad_held_bound_fails_at_start_up(monkeypatch, value):
    monkeypatch.setenv(request_gate.MAX_HELD_ENV, value)
    with pytest.raises(ValueError, match=request_gate.MAX_HELD_ENV):
        patch.apply()


@pytest.mark.parametrize(
    ("path", "body", "worker_call"),
    [
        ("/collective_rpc", {"method": "reload_weights"}, "reload_weights"),
        # The dev/rlhf weight transfer route.
        ("/update_weights", {"update_info": {}}, "update_weights"),
        # A worker extension's loader (RL frameworks name their own).
        ("/collective_rpc", {"method": "update_weights_from_ipc"}, "update_weights_from_ipc"),
    ],
)
def test_after_level_2_and_a_full_wake_requests_wait_for_the_weights(
    llama, wait_s, path, body, worker_call
):
    """The wake maps the weights back without a backup: a request must not
    run on them before they are reloaded or updated."""
    wait_s(5)

    async def scenario(client, core):
        await timed_post(client, "/sleep?level=2")
        answer, *_ = await asyncio.gather(
            timed_post(client, "/v1/completions", completion(llama)),
            timed_post(client, "/wake_up", delay=0.2),
            timed_post(client, path, json.dumps(body).encode(), delay=0.6),
        )
        return answer, core.calls

    answer, calls = serve_vllm(llama, scenario)
    assert answer.status_code == 200 and answer.seconds >= 0.6, answer.text[:300]
    added = [i for i, call in enumerate(calls) if call[0] == "add"]
    assert added and min(added) > calls.index(("rpc", worker_call))


def test_after_level_2_a_started_weight_update_releases_requests_when_it_ends(llama, wait_s):
    wait_s(5)

    async def scenario(client, core):
        await timed_post(client, "/sleep?level=2")
        answer, *_ = await asyncio.gather(
            timed_post(client, "/v1/completions", completion(llama)),
            timed_post(client, "/wake_up", delay=0.2),
            timed_post(client, "/start_weight_update", delay=0.3),
            timed_post(client, "/update_weights", b'{"update_info": {}}', delay=0.4),
            timed_post(client, "/finish_weight_update", delay=0.8),
        )
        return answer, core.calls

    answer, calls = serve_vllm(llama, scenario)
    assert answer.status_code == 200 and answer.seconds >= 0.8, answer.text[:300]
    added = [i for i, call in enumerate(calls) if call[0] == "add"]
    assert added and min(added) > calls.index(("rpc", "finish_weight_update"))


@pytest.mark.parametrize("through", ["route", "rpc"])
def test_after_level_2_a_draft_model_update_alone_does_not_release_requests(llama, wait_s, through):
    """An update started with start_draft_weight_update loads the draft model
    only: the target model's weights, discarded by the level-2 sleep, are still
    missing when it ends, so requests wait for their reload."""
    wait_s(5)

    def call(client, method, delay, update_info=None):
        if through == "route":
            body = b"" if update_info is None else json.dumps({"update_info": update_info})
            return timed_post(client, f"/{method}", body, delay)
        rpc = {"method": method, "args": [] if update_info is None else [update_info]}
        return timed_post(client, "/collective_rpc", json.dumps(rpc).encode(), delay)

    async def scenario(client, core):
        await timed_post(client, "/sleep?level=2")
        answer, *_ = await asyncio.gather(
            timed_post(client, "/v1/completions", completion(llama)),
            timed_post(client, "/wake_up", delay=0.2),
            call(client, "start_draft_weight_update", 0.3),
            call(client, "update_weights", 0.4, update_info={}),
            call(client, "finish_weight_update", 0.5),
            timed_post(client, "/collective_rpc", b'{"method": "reload_weights"}', delay=1.0),
        )
        return answer, core.calls

    answer, calls = serve_vllm(llama, scenario)
    assert answer.status_code == 200 and answer.seconds >= 1.0, answer.text[:300]
    added = [i for i, call in enumerate(calls) if call[0] == "add"]
    assert added and min(added) > calls.index(("rpc", "reload_weights")), calls


def test_after_level_2_a_request_gets_503_until_the_weights_are_reloaded(llama, wait_s):
    wait_s(0.4)

    async def scenario(client, core):
        await timed_post(client, "/sleep?level=2")
        await timed_post(client, "/wake_up")
        # Known to leave the weights as they are: no reload.
        await timed_post(client, "/collective_rpc", b'{"method": "check_health"}')
        refused = await timed_post(client, "/v1/completions", completion(llama))
        body = json.dumps({"method": "reload_weights"}).encode()
        await timed_post(client, "/collective_rpc", body)
        served = await timed_post(client, "/v1/completions", completion(llama))
        return refused, served, core.added()

    refused, served, added = serve_vllm(llama, scenario)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert "reload_weights" in refused.json()["error"] and 0.4 <= refused.seconds < 2
    assert served.status_code == 200 and len(added) == 1


# -- a level-2 sleep vLLM turns into nothing (review, 2026-12-06) -------------


@pytest.mark.parametrize(
    "before",
    [
        ["/sleep?level=1"],  # asleep: vLLM's executor ignores the level-2 sleep
        ["/sleep?level=1", "/wake_up?tags=weights"],  # the KV cache still sleeps
    ],
)
def test_a_level_2_sleep_of_an_engine_already_asleep_holds_no_request(llama, wait_s, before):
    """The weights keep their level-1 backup: asking for a reload would make a
    client throw away weights it updated."""
    wait_s(0.4)

    async def scenario(client, core):
        for path in [*before, "/sleep?level=2", "/wake_up"]:
            assert (await timed_post(client, path)).status_code == 200, path
        return await timed_post(client, "/v1/completions", completion(llama))

    answer = serve_vllm(llama, scenario)
    assert answer.status_code == 200 and answer.seconds < 0.4, answer.text[:300]


def test_a_level_2_sleep_after_a_level_0_pause_holds_requests_for_the_weights(llama, wait_s):
    """Level 0 only paused the scheduler: the level-2 sleep discarded the weights."""
    wait_s(0.4)

    async def scenario(client, core):
        for path in ["/sleep?level=0", "/sleep?level=2", "/wake_up"]:
            assert (await timed_post(client, path)).status_code == 200, path
        return await timed_post(client, "/v1/completions", completion(llama))

    answer = serve_vllm(llama, scenario)
    assert answer.status_code == 503 and "reload" in answer.json()["error"]


def test_a_request_waiting_for_the_weights_through_a_second_level_2_sleep_is_served(llama, wait_s):
    wait_s(5)
    reload = json.dumps({"method": "reload_weights"}).encode()

    async def scenario(client, core):
        await timed_post(client, "/sleep?level=2")
        await timed_post(client, "/wake_up")
        answer, *_ = await asyncio.gather(
            timed_post(client, "/v1/completions", completion(llama)),
            timed_post(client, "/sleep?level=2", delay=0.2),
            timed_post(client, "/wake_up", delay=0.4),
            timed_post(client, "/collective_rpc", reload, delay=0.6),
        )
        return answer

    answer = serve_vllm(llama, scenario)
    assert answer.status_code == 200 and 0.6 <= answer.seconds < 3, answer.text[:300]


def test_a_level_2_sleep_that_failed_holds_requests_for_the_weights(llama, wait_s):
    """With several ranks, those that slept lost their weights before another
    failed, and all were woken back up (rank_sleep): the safe side."""
    wait_s(0.4)

    async def scenario(client, core):
        async def failing_sleep(level, mode):
            core.calls.append(("sleep", level, mode))
            raise RuntimeError("sleep(level=2) failed on 1 of 2 rank(s)")

        core.sleep_async = failing_sleep
        # Raised through the middlewares (a server answers 500 outside them).
        with pytest.raises(RuntimeError, match="failed on 1 of 2 rank"):
            await timed_post(client, "/sleep?level=2")
        await timed_post(client, "/wake_up")
        return await timed_post(client, "/v1/completions", completion(llama))

    answer = serve_vllm(llama, scenario)
    assert answer.status_code == 503 and "reload" in answer.json()["error"]
