"""A rank's device and engine, set up the same way in a launched rank and in the CLI's own process (dp 1)."""
from __future__ import annotations

import torch

from ..config import Config
from ..plan import Plan
from .engine import Engine
from .faults import Faults
from .heap import freeze_startup_heap


def rank_device(plan: Plan, local_rank: int, threads: int) -> torch.device:
    """The rank's device (its GPU, made current, or the CPU) and its intra-op threads; before the process
    group is joined (NCCL binds to the device)."""
    torch.set_num_threads(threads)
    if plan.device != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def build_engine(cfg: Config, plan: Plan, dp, device: torch.device, faults: Faults | None = None,
                 on_fault_exit=None, started_at: float | None = None, launch: dict[str, float] | None = None) -> Engine:
    """The rank's engine; then start-up's objects are frozen out of the cyclic collector's view (`heap.py`:
    a full collection over them stalled a step ~0.1 s)."""
    engine = Engine(cfg, plan, dp, device, faults, on_fault_exit=on_fault_exit, started_at=started_at, launch=launch)
    freeze_startup_heap()
    return engine
