"""Wall-clock timing of named phases, logged as `timing/<name>` seconds."""
from __future__ import annotations

import time
from contextlib import contextmanager


class Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        """Count `seconds` measured elsewhere (another thread) under `name`."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def pop_metrics(self) -> dict[str, float]:
        out = {f"timing/{k}": v for k, v in self.seconds.items()}
        self.seconds.clear()
        return out
