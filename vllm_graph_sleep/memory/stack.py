"""The per-thread stack limit while asleep. Owns the limits a sleep lowered,
per device, until a wake (or shutdown) puts them back."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllm_graph_sleep.settings import RELEASE_STACK

if TYPE_CHECKING:
    from vllm_graph_sleep.memory.driver import DeviceDriver

logger = logging.getLogger("vllm.graph_sleep")

# Per-thread stack limit while asleep. The context reserves limit x every thread
# the GPU can hold resident and keeps it until the limit changes; nothing runs
# a graph while asleep, and wake restores the limit before anything can replay
# one (a replay with too little stack fails).
STACK_WHILE_ASLEEP = 0


class StackLimiter:
    def __init__(self, driver: DeviceDriver, *, enabled: bool) -> None:
        self._driver = driver
        self.enabled = enabled
        # device -> the stack limit a wake puts back (only while it is lowered)
        self._saved: dict[int, int] = {}

    def lowered_devices(self) -> set[int]:
        return set(self._saved)

    def lower(self, devices: set[int]) -> str:
        """Lowers the stack limit of `devices`, remembering what to restore;
        a device that refuses keeps its reservation (less is freed, no harm).
        Returns what it did, for the sleep's log line."""
        if not self.enabled:
            return f"stack reservation kept (switched off: {RELEASE_STACK.name})"
        lowered = []
        for device in sorted(devices - self._saved.keys()):
            try:
                limit = self._driver.stack_limit(device)
                self._driver.set_stack_limit(device, STACK_WHILE_ASLEEP)
            except Exception as error:
                logger.warning(
                    "graph-sleep sleep: device %d keeps its stack reservation: %s", device, error
                )
                continue
            self._saved[device] = limit
            lowered.append(f"device {device} {limit} -> {STACK_WHILE_ASLEEP}")
        if not lowered:
            return "stack limit unchanged"
        return "stack limit per thread " + ", ".join(lowered) + " B"

    def restore(self) -> None:
        """Puts back every lowered stack limit; raises on the first refusal
        (the devices not yet restored stay lowered)."""
        for device, limit in sorted(self._saved.items()):
            self._driver.set_stack_limit(device, limit)
            del self._saved[device]

    def shut_down(self) -> None:
        """Engine shutdown: puts the stack limits back, so that a next engine
        starts with the context's stack; a refusal is logged, not raised."""
        try:
            self.restore()
        except Exception as error:
            logger.warning(
                "graph-sleep: at shutdown, the per-thread stack limit could not be restored (%s); "
                "a next engine in this process starts with it lowered",
                error,
            )
