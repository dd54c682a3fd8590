"""The HTTP calls the bench makes to one `vllm serve` (dev mode on).

Completions ask for `return_token_ids` (vLLM 0.26's CompletionRequest extra
field): each choice then carries the generated token ids, which is what the
bit-exactness check compares. Every failure becomes a one-line ServerError that
names the call and the server log.
"""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from vllm_graph_sleep.bench.server import TRANSPORT_ERRORS, ServerError, transport_reason

REPORT_METHOD = "graph_sleep_memory_report"


def greedy_completion_body(model_id: str, prompts: Sequence[str], max_tokens: int) -> dict:
    """A /v1/completions request: greedy, exactly `max_tokens` tokens, token ids back."""
    return {
        "model": model_id,
        "prompt": list(prompts),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


@dataclasses.dataclass
class Completion:
    token_ids: list[list[int]]
    texts: list[str]
    completion_tokens: int
    seconds: float


class Client:
    def __init__(
        self,
        base_url: str,
        name: str,
        where: Callable[[], str],
        timeout: float = 300.0,
        api_key: str | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.name = name
        self._where = where
        self.timeout = timeout
        self.model_id: str | None = None

    def _request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: Sequence[tuple[str, str]] = (),
    ) -> Any:
        url = self.base_url + path
        if query:
            url += "?" + urllib.parse.urlencode(list(query))
        data = None
        headers = {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        elif method == "POST":
            data = b""
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        call = f"{method} {path}" + (f"?{urllib.parse.urlencode(list(query))}" if query else "")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as error:
            detail = error.read()[:300].decode(errors="replace").replace("\n", " ")
            raise ServerError(
                f"[{self.name}] {call} answered {error.code}: {detail}; {self._where()}",
                status=error.code,
            ) from None
        except TRANSPORT_ERRORS as error:
            raise ServerError(
                f"[{self.name}] {call} failed: {transport_reason(error)}; {self._where()}"
            ) from None
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode(errors="replace")

    # -- serving ----------------------------------------------------------

    def served_model(self) -> str:
        models = self._request("GET", "/v1/models")
        try:
            self.model_id = models["data"][0]["id"]
        except (TypeError, KeyError, IndexError):
            raise ServerError(
                f"[{self.name}] GET /v1/models listed no model; {self._where()}"
            ) from None
        return self.model_id

    def complete(self, prompts: Sequence[str], max_tokens: int) -> Completion:
        """Greedy completion of every prompt, exactly `max_tokens` tokens each."""
        body = greedy_completion_body(self.model_id, prompts, max_tokens)
        started = time.perf_counter()
        answer = self._request("POST", "/v1/completions", body)
        seconds = time.perf_counter() - started
        try:
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            token_ids = [list(c["token_ids"]) for c in choices]
            texts = [c["text"] for c in choices]
        except (TypeError, KeyError) as error:
            raise ServerError(
                f"[{self.name}] /v1/completions answer lacks {error} (token ids need vLLM's "
                f"return_token_ids); {self._where()}"
            ) from None
        counts = [len(ids) for ids in token_ids]
        if counts != [max_tokens] * len(prompts):
            # Tokens are compared after every wake: too few would compare as equal.
            raise ServerError(
                f"[{self.name}] /v1/completions gave {counts} tokens for {len(prompts)} "
                f"prompt(s), {max_tokens} each asked (ignore_eos); {self._where()}"
            )
        usage = answer.get("usage") or {}
        return Completion(token_ids, texts, int(usage.get("completion_tokens", 0)), seconds)

    def complete_one_at_a_time(self, prompts: Sequence[str], max_tokens: int) -> Completion:
        """`complete`, one request per prompt, each after the last one finished.

        The prompts of one request reach vLLM's engine core as separate requests,
        and how many of them the next step takes depends on when they arrive: so
        the shapes of the batches, the kernels picked for them and, on a model
        with near-ties between its top logits, the tokens can change from run to
        run (stock vLLM too differed after wakes on an 8B-class random Llama in
        H200 run 7, when a check sent every prompt in one request; with one
        request per prompt, run 8 was exact in both configurations). One prompt
        at a time, every step has the same shape in every run."""
        parts = [self.complete([prompt], max_tokens) for prompt in prompts]
        return Completion(
            token_ids=[ids for part in parts for ids in part.token_ids],
            texts=[text for part in parts for text in part.texts],
            completion_tokens=sum(part.completion_tokens for part in parts),
            seconds=sum(part.seconds for part in parts),
        )

    def reset_prefix_cache(self) -> bool:
        """Empties vLLM's prefix cache (a dev-mode route); False when vLLM could
        not, because blocks were still held."""
        answer = self._request("POST", "/reset_prefix_cache")
        try:
            return bool(answer["success"])
        except (TypeError, KeyError):
            raise ServerError(
                f"[{self.name}] POST /reset_prefix_cache answered {answer!r}, not "
                f'{{"success": ...}}; {self._where()}'
            ) from None

    # -- sleep mode -------------------------------------------------------

    def sleep(self, level: int, checkpoint: bool = False) -> float:
        started = time.perf_counter()
        query = [("level", str(level))] + ([("checkpoint", "1")] if checkpoint else [])
        self._request("POST", "/sleep", query=query)
        return time.perf_counter() - started

    def wake_up(self, tags: Sequence[str] = ()) -> float:
        started = time.perf_counter()
        self._request("POST", "/wake_up", query=[("tags", t) for t in tags])
        return time.perf_counter() - started

    def is_sleeping(self) -> bool:
        answer = self._request("GET", "/is_sleeping")
        return bool(answer["is_sleeping"])

    def checkpointed(self) -> bool:
        """Whether the engine is asleep and checkpointed (deep sleep)."""
        return self._request("GET", "/is_sleeping").get("checkpointed") is True

    def collective_rpc(self, method: str, timeout: float | None = None) -> list[Any]:
        body: dict[str, Any] = {"method": method}
        if timeout is not None:
            body["timeout"] = timeout
        answer = self._request("POST", "/collective_rpc", body)
        return [] if answer is None else list(answer.get("results", []))

    def reload_weights(self) -> float:
        started = time.perf_counter()
        self.collective_rpc("reload_weights")
        return time.perf_counter() - started

    def memory_report(self) -> list[dict[str, Any]]:
        """One report per worker (per GPU), from vllm_graph_sleep.probe."""
        return self.collective_rpc(REPORT_METHOD, timeout=120)
