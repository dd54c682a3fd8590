"""The dev sleep endpoints reject what stock vLLM 0.26 mishandles (400, engine not
called) and serve everything else exactly as stock (CPU, no server process)."""

from __future__ import annotations

import inspect

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
