"""The Python heap a rank, or an API server, keeps for the whole job.

Start-up leaves hundreds of thousands of long-lived objects (torch, transformers, the models, the
captured graphs' bookkeeping). A full cyclic collection walks all of them: ~0.1 s on a desktop CPU,
the time of a hundred host-bound steps on the H200, started by the interpreter at a step nobody
chooses. That stalls a step at random (a lockstep job waits for it on every rank) and corrupts what
the adaptive k measures. As vLLM does after start-up: collect once, then freeze the survivors out of
the collector's view, so the collections during steps only walk what the steps allocate. The
collections after that, and their time, are counted for the summary (a rank) or /metrics (an API
server: its ~90,000 start-up objects took 40-50 ms a full collection, one every few hundred requests, the
event loop stalled meanwhile). The count is kept in plain Python: a collection can start inside any
allocation, one under a lock included, so its callback takes none."""
from __future__ import annotations

import gc
import time

_since_startup = {"gc_collections": 0, "gc_pause_s": 0.0}
_began = [0.0]


def _on_collection(phase: str, _info: dict) -> None:
    if phase == "start":
        _began[0] = time.perf_counter()
    else:
        _since_startup["gc_collections"] += 1
        _since_startup["gc_pause_s"] += time.perf_counter() - _began[0]


def freeze_startup_heap() -> None:
    gc.collect()
    gc.freeze()
    _since_startup.update(gc_collections=0, gc_pause_s=0.0)
    if _on_collection not in gc.callbacks:
        gc.callbacks.append(_on_collection)


def thaw_heap() -> None:
    gc.unfreeze()


def collections_since_startup() -> dict:
    """Cyclic collections since freeze_startup_heap() and the seconds they took (zeros before it)."""
    return dict(_since_startup)
