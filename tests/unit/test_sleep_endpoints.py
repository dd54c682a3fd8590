"""The dev sleep endpoints reject what stock vLLM 0.26 mishandles (400, engine not
called) and serve everything else exactly as stock (CPU, no server process)."""

from __future__ import annotations

import inspect
import time

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from vllm.engine.protocol import EngineClient
from vllm.entrypoints.serve.dev.sleep import api_router

from vllm_graph_sleep.patches import entrypoints_serve_dev_sleep_api_router as patch
from vllm_graph_sleep.patches._wrap import original_of


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
    layers = [m for m in app.user_middleware if m.cls is patch.SleepRequestValidation]
    assert len(layers) == 1
    response = client.post("/sleep?level=3")
    assert response.status_code == 400
    assert set(response.json()) == {"error"}
    assert engine.calls == []


# -- requests while asleep (AsleepGate) ------------------------------------


class StagedEngine(FakeEngineClient):
    """Sleeps with both tags; a wake with tags wakes only those (a staged wake)."""

    def __init__(self) -> None:
        super().__init__()
        self.asleep: set[str] = set()

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        await super().sleep(level, mode)
        self.asleep = {"weights", "kv_cache"}

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await super().wake_up(tags)
        self.asleep -= set(tags or self.asleep)

    async def is_sleeping(self) -> bool:
        self.calls.append(("is_sleeping",))
        return bool(self.asleep)


def gated_app(engine: FakeEngineClient, root_path: str = "") -> FastAPI:
    """The sleep router plus a stand-in for vLLM's completion route."""
    app = FastAPI(root_path=root_path)
    api_router.attach_router(app)
    app.state.engine_client = engine

    @app.post("/v1/completions")
    async def completions() -> dict:
        engine.calls.append(("completion",))
        return {"served": True}

    return app


def run(app: FastAPI, *steps) -> list:
    """Runs each step (a coroutine function taking an httpx client) concurrently."""
    import asyncio

    import httpx

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await asyncio.gather(*(step(client) for step in steps))

    return asyncio.run(main())


def post(path: str, delay: float = 0.0):
    async def step(client):
        import asyncio

        await asyncio.sleep(delay)
        return await client.post(path)

    return step


@pytest.fixture
def gate(monkeypatch):
    monkeypatch.setenv(patch.ASLEEP_WAIT_ENV, "5")
    patch.apply()


def test_awake_engine_costs_no_round_trip(gate):
    engine = StagedEngine()
    (answer,) = run(gated_app(engine), post("/v1/completions"))
    assert answer.status_code == 200 and engine.calls == [("completion",)]


def test_request_while_asleep_is_held_and_served_after_a_staged_wake(gate):
    engine = StagedEngine()
    app = gated_app(engine)
    run(app, post("/sleep?level=2"))
    held, *_ = run(
        app,
        post("/v1/completions"),
        post("/wake_up?tags=weights", delay=0.3),
        post("/wake_up?tags=kv_cache", delay=0.6),
    )
    assert held.status_code == 200 and held.json() == {"served": True}
    served = engine.calls.index(("completion",))
    assert engine.calls.index(("wake_up", ["kv_cache"])) < served
    # Awake again: the next request goes straight through.
    before = len(engine.calls)
    run(app, post("/v1/completions"))
    assert engine.calls[before:] == [("completion",)]


def test_request_while_asleep_gets_503_after_the_bound(monkeypatch):
    monkeypatch.setenv(patch.ASLEEP_WAIT_ENV, "0.4")
    patch.apply()
    engine = StagedEngine()
    app = gated_app(engine)
    run(app, post("/sleep?level=1"))
    started = time.monotonic()
    (answer,) = run(app, post("/v1/completions"))
    assert 0.4 <= time.monotonic() - started < 3
    assert answer.status_code == 503
    assert answer.headers["retry-after"] == "1"
    assert "asleep" in answer.json()["error"] and "/wake_up" in answer.json()["error"]
    assert ("completion",) not in engine.calls  # the engine never saw it


def test_zero_wait_refuses_at_once_and_pause_counts_as_asleep(monkeypatch):
    monkeypatch.setenv(patch.ASLEEP_WAIT_ENV, "0")
    patch.apply()
    engine = StagedEngine()
    app = gated_app(engine)

    @app.post("/pause")
    async def pause() -> dict:  # vLLM's dev/rlhf route pauses the scheduler
        engine.asleep = {"scheduling"}
        return {"status": "paused"}

    run(app, post("/pause"))
    started = time.monotonic()
    (answer,) = run(app, post("/v1/completions"))
    assert answer.status_code == 503 and time.monotonic() - started < 1


def test_root_path_is_honoured_by_the_gate(monkeypatch):
    monkeypatch.setenv(patch.ASLEEP_WAIT_ENV, "0")
    patch.apply()
    engine = StagedEngine()
    app = gated_app(engine, root_path="/api")
    run(app, post("/api/sleep?level=1"))
    (answer,) = run(app, post("/api/v1/completions"))
    assert answer.status_code == 503


@pytest.mark.parametrize("value", ["-1", "soon", "inf", "nan"])
def test_bad_wait_bound_fails_at_start_up(monkeypatch, value):
    monkeypatch.setenv(patch.ASLEEP_WAIT_ENV, value)
    with pytest.raises(ValueError, match=patch.ASLEEP_WAIT_ENV):
        patch.apply()


def test_a_failing_engine_check_lets_the_request_through_to_vllm(gate):
    class DeadEngine(StagedEngine):
        async def is_sleeping(self) -> bool:
            raise RuntimeError("engine core died")

    engine = DeadEngine()
    app = gated_app(engine)
    run(app, post("/sleep?level=1"))
    (answer,) = run(app, post("/v1/completions"))
    assert answer.status_code == 200 and ("completion",) in engine.calls


def test_a_request_overtaken_by_a_sleep_is_bounded_too(monkeypatch):
    """It found the engine awake, then a /sleep reached the engine first: vLLM
    would queue it until a wake that may never come (seen in the H200 fuzz)."""
    import asyncio

    monkeypatch.setenv(patch.ASLEEP_WAIT_ENV, "0.4")
    patch.apply()
    engine = StagedEngine()
    app = FastAPI()
    api_router.attach_router(app)
    app.state.engine_client = engine
    cancelled = []

    @app.post("/v1/completions")
    async def completions() -> dict:
        engine.calls.append(("completion",))
        try:
            while engine.asleep or len(engine.calls) < 3:  # queued in the engine
                await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            cancelled.append(True)  # vLLM aborts the request here
            raise
        return {"served": True}

    started = time.monotonic()
    answer, _ = run(app, post("/v1/completions"), post("/sleep?level=1", delay=0.1))
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    assert cancelled == [True]
    assert 0.4 <= time.monotonic() - started < 3


def test_a_request_overtaken_by_a_short_sleep_is_served(gate):
    import asyncio

    engine = StagedEngine()
    app = FastAPI()
    api_router.attach_router(app)
    app.state.engine_client = engine

    @app.post("/v1/completions")
    async def completions() -> dict:
        await asyncio.sleep(0.2)
        while engine.asleep:
            await asyncio.sleep(0.05)
        return {"served": True}

    answer, *_ = run(
        app,
        post("/v1/completions"),
        post("/sleep?level=1", delay=0.05),
        post("/wake_up", delay=0.5),
    )
    assert answer.status_code == 200 and answer.json() == {"served": True}
