"""The DP group: the one door through which every collective of specdp passes.

The stepping collective (`sync_step`, one per step) only exists in lockstep (`dp_sync: always`).
It is a single MAX all-reduce over a vector in which rank r writes its fields at row r (the sizes
of every forward of its step, whether it has work), plus `tag` and `-tag` at the end (tag = hash
of step and phase). One collective returns every rank's fields *and* max(tag), -min(tag): if they
differ the ranks are out of step, and a second collective gathers each rank's phase for the
message. So a divergence is caught at the first collective where ranks disagree, not by a timeout.
When every rank runs on one machine the same exchange goes through Unix datagrams instead of
NCCL/gloo (`local_exchange.py`: a tenth of the cost, no GPU work). Because the step sync carries
every forward's size, every rank knows the padded size (and CUDA graph) of each forward of the
step before the first one runs, with no collective or host sync between forwards. Expert
parallelism adds two collectives inside every MoE forward (`ep_all_gather`, `ep_reduce_scatter`),
the same on every rank because the forwards' sizes were agreed.

Tensor parallelism (`tensor_parallel_size` > 1): a DP rank is a group of processes (`TPGroup`); the DP
collectives above run among the groups' first processes (the leaders) only, and each group has its own: the
all-reduce of the row-parallel layers inside every forward, and the step package its leader sends before each
step's device work (see TPGroup). Expert parallelism under tensor parallelism runs its two collectives among the
processes of one TP rank over the DP ranks (an EP group per TP rank: processes d * tp + t for every DP rank d), each
holding the same columns of its DP rank's experts; the MoE layer then all-reduces over its TP group.

`check_collectives` also compares a full descriptor (op, shape, dtype, step, phase) before every
collective. Stepping collectives use `collective_timeout_s`; start-up and result collectives use
a longer bound (loading a model is slow). A watchdog thread publishes a heartbeat in the rendezvous
store and ends the rank when a peer has stopped beating (a dead machine), or when the parent CLI
process is gone.
"""
from __future__ import annotations

import datetime
import os
import secrets
import threading
import time
import zlib
from typing import Any

import torch

from .local_exchange import LocalExchange
from .status import StatusBoard, where

START_TIMEOUT_S = 1800.0
WAIT_S = 30 * 86400.0        # a TP follower waiting for its leader's next step (a server idles): the watchdog's business


class OutOfStepError(RuntimeError):
    kind = "out-of-step"


class PeerLostError(RuntimeError):
    kind = "peer-lost"


def _tag(step: int, what: str) -> int:
    return (zlib.crc32(f"{step}|{what}".encode()) & 0x3FFFFFFF) + 1


def _guarded(fn, failed: str):
    """fn(), a collective: a lost peer or a timeout (gloo and NCCL raise plain errors) becomes PeerLostError,
    `failed` and the error's first line."""
    try:
        return fn()
    except (OutOfStepError, PeerLostError):
        raise
    except Exception as e:  # noqa: BLE001 - gloo/NCCL report a lost peer or a timeout this way
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PeerLostError(f"{failed}: {first[:300]}") from None


class DPGroup:
    def __init__(self, rank: int = 0, world: int = 1, lockstep: bool = False, status: StatusBoard | None = None,
                 timeout_s: float = 120.0, check: bool = False, device: torch.device | None = None,
                 proc: int | None = None, procs: int | None = None):
        """rank, world: the DP rank and size; proc, procs: this process's global rank and the processes of the
        job (dp x tp; the same as rank, world without tensor parallelism)."""
        self.rank, self.world = rank, world
        self.proc = rank if proc is None else proc
        self.procs = world if procs is None else procs
        self.object_group = None          # the start-up and result collectives' group (None: every process)
        self.tp: TPGroup | None = None    # this DP rank's TP group (tensor parallelism)
        self.leader = True                # the TP group's first process: the one that runs the DP rank's work
        self.lockstep = lockstep and world > 1
        self.status = status or StatusBoard(None, rank)
        self.timeout_s = timeout_s
        self.check = check and world > 1
        self.comm_device = device or torch.device("cpu")
        self.step_group = None
        self.ep_group = None              # expert parallelism under TP: this TP rank's processes (None: step_group)
        self.local = None                 # LocalExchange: the step sync's transport on one machine
        self.collectives = 0
        self._at: tuple[int, str] = (0, "start-up")          # where the rank is (for collectives inside forwards)
        self._watchdog: threading.Thread | None = None
        self._stop = threading.Event()

    # -- set-up ---------------------------------------------------------------------------------

    @classmethod
    def solo(cls, status: StatusBoard | None = None) -> "DPGroup":
        return cls(status=status)

    @classmethod
    def from_env(cls, backend: str, lockstep: bool, timeout_s: float, check: bool,
                 device: torch.device, status: StatusBoard, tp_size: int = 1,
                 expert_parallel: bool = False) -> "DPGroup":
        """Join the process group that `accelerate launch` describes in RANK / WORLD_SIZE / MASTER_*
        (accelerate's own PartialState misreports the rank on CPU). With tensor parallelism (tp_size > 1)
        process p is TP rank p % tp_size of DP rank p // tp_size; the DP collectives run among the TP groups'
        first processes (the leaders), and each TP group gets its own (`TPGroup`); with `expert_parallel` each
        TP rank's processes an EP group (`ep_group`)."""
        import torch.distributed as dist

        proc, procs = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        kw = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, rank=proc, world_size=procs,
                                timeout=datetime.timedelta(seconds=START_TIMEOUT_S), **kw)
        comm = device if backend == "nccl" else torch.device("cpu")
        rank, world = proc // tp_size, procs // tp_size
        g = cls(rank, world, lockstep, status, timeout_s, check, comm, proc=proc, procs=procs)
        stepping = datetime.timedelta(seconds=timeout_s)
        if tp_size == 1:
            g.step_group = dist.new_group(backend=backend, timeout=stepping)
        else:
            # every process creates every group, in the same order (torch.distributed's rule)
            leaders = list(range(0, procs, tp_size))
            g.step_group = dist.new_group(leaders, backend=backend, timeout=stepping)
            g.object_group = dist.new_group(leaders, backend=backend,
                                            timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
            for d in range(world):
                members = list(range(d * tp_size, (d + 1) * tp_size))
                groups = (dist.new_group(members, backend=backend, timeout=stepping),
                          dist.new_group(members, backend="gloo", timeout=datetime.timedelta(seconds=WAIT_S)),
                          dist.new_group(members, backend="gloo", timeout=stepping))
                if d == rank:
                    g.tp = TPGroup(proc % tp_size, tp_size, rank, members[0], groups, timeout_s, check, comm)
            g.leader = g.tp.rank == 0
            if expert_parallel and world > 1:
                for t in range(tp_size):
                    group = dist.new_group(list(range(t, procs, tp_size)), backend=backend, timeout=stepping)
                    if t == g.tp.rank:
                        g.ep_group = group
        if (g.lockstep and g.leader and int(os.environ.get("LOCAL_WORLD_SIZE", 0)) == procs
                and LocalExchange.available()):
            box = [secrets.token_hex(8) if rank == 0 else None]       # a name no other job shares
            dist.broadcast_object_list(box, src=0, group=g.object_group)
            g.local = LocalExchange(rank, world, box[0], timeout_s)
            dist.barrier(group=g.object_group)                        # every rank bound before the first send
        return g

    @property
    def sync_transport(self) -> str:
        """How the lockstep step sync travels (the ready line says it)."""
        if self.local is not None:
            return "Unix datagrams (one machine)"
        return "the process group" if self.lockstep else "none (dp_sync never)"

    def start_watchdog(self, parent_pid: int | None) -> None:
        """Heartbeat + liveness checks in a daemon thread (see module docstring), over every process."""
        if self.procs == 1 and not parent_pid:
            return
        self._watchdog = threading.Thread(target=self._watch, args=(parent_pid,), daemon=True, name="specdp-watchdog")
        self._watchdog.start()

    def _watch(self, parent_pid: int | None) -> None:
        store = None
        if self.procs > 1:
            import torch.distributed as dist
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=datetime.timedelta(seconds=30))
        seen: dict[int, tuple[int, float]] = {}
        while not self._stop.wait(1.0):
            if parent_pid and not alive(parent_pid):
                self._die("terminated", "the specdp command that started this rank is gone", 1)
            if store is None:
                continue
            try:
                store.add(f"specdp/hb/{self.proc}", 1)
                now = time.monotonic()
                for r in range(self.procs):
                    if r == self.proc or store.check([f"specdp/exited/{r}"]):
                        continue
                    beat = store.add(f"specdp/hb/{r}", 0)
                    last = seen.get(r)
                    if last is None or last[0] != beat:
                        seen[r] = (beat, now)
                    elif now - last[1] > self.timeout_s:
                        self._die("peer-lost", f"rank {r} stopped responding (no heartbeat for "
                                               f"{self.timeout_s:.0f} s) while this rank was at {self.status.where}", 1)
            except Exception:  # noqa: BLE001 - the store lives with rank 0's machine: it is gone
                if self._stop.is_set():
                    return
                self._die("peer-lost", f"lost the rendezvous store (rank 0's machine) at {self.status.where}", 1)

    def _die(self, kind: str, message: str, code: int) -> None:
        self.status.exit(kind, message, code)
        os._exit(code)

    def close(self, ok: bool = True) -> None:
        self._stop.set()
        if self.local is not None:
            self.local.close()
        if self.procs > 1 and ok:
            import torch.distributed as dist
            try:
                store = dist.distributed_c10d._get_default_store()
                store.set(f"specdp/exited/{self.proc}", "1")
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        # No destroy_process_group: the rank process ends right after this (os._exit) with nothing in
        # flight, and NCCL's orderly teardown cost every job half a second of wall time.

    # -- stepping collectives -------------------------------------------------------------------

    def publish(self, step: int, what: str) -> None:
        self._at = (step, what)
        self.status.set(step, what)
        if self.tp is not None:
            self.tp._at = self._at

    # -- expert parallelism: inside a MoE layer's forward (the step group, or under TP this TP rank's EP group;
    #    graph-capturable on NCCL) --

    @property
    def _ep(self):
        return self.step_group if self.ep_group is None else self.ep_group

    def ep_all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[N, h] on every rank -> [world * N, h], rank r's rows at r * N (N is the same on every rank:
        the step's forward sizes were agreed in the step sync)."""
        if self.world == 1:
            return x
        x = x.contiguous()
        self._check(("all_gather", "-", tuple(x.shape), str(x.dtype), *self._at), self._ep)
        return _gather_rows(x, self.world, self._ep, self.comm_device.type == "cuda",
                            lambda fn: self._run(fn, *self._at))

    def ep_reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """[world * N, h] partial sums on every rank -> this rank's N rows of their sum."""
        if self.world == 1:
            return x
        import torch.distributed as dist

        N = x.shape[0] // self.world
        self._check(("reduce_scatter", "sum", tuple(x.shape), str(x.dtype), *self._at), self._ep)
        if self.comm_device.type == "cuda":
            out = torch.empty((N, *x.shape[1:]), dtype=x.dtype, device=x.device)
            self._run(lambda: dist.reduce_scatter_tensor(out, x.contiguous(), op=dist.ReduceOp.SUM,
                                                         group=self._ep), *self._at)
            return out
        # gloo has no reduce-scatter: sum everything, keep this rank's rows
        self._run(lambda: dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self._ep), *self._at)
        return x[self.rank * N:(self.rank + 1) * N]

    def sync_step(self, fields, step: int) -> list:
        """Start of a step: in lockstep, every rank's `fields` (the sizes of its step's forwards) in
        one collective, with the check that all ranks are at the same step; else only this rank's."""
        self.publish(step, "step sync")
        if not self.lockstep:
            return [fields]
        F = len(fields)
        flat = self._sync(fields, step, "step sync")
        return [flat[r * F:(r + 1) * F] for r in range(self.world)]

    def _sync(self, fields: list[int], step: int, what: str) -> list[int]:
        import torch.distributed as dist

        W, F = self.world, len(fields)
        tag = _tag(step, what)
        if self.local is not None:
            self._check(("exchange", "max", (F + 1,), "int64", step, what))
            recs = self._run(lambda: self.local.exchange([tag, *fields]), step, what)
            if len({r[0] for r in recs}) > 1:
                self._out_of_step(step, what)
            return [v for r in recs for v in r[1:]]
        vec = torch.zeros(W * F + 2, dtype=torch.long)
        vec[self.rank * F:(self.rank + 1) * F] = torch.tensor(fields, dtype=torch.long)
        vec[W * F], vec[W * F + 1] = tag, -tag
        vec = vec.to(self.comm_device)
        self._check(("all_reduce", "max", (W * F + 2,), "int64", step, what))
        self._run(lambda: dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=self.step_group), step, what)
        v = vec.tolist()
        if v[W * F] != -v[W * F + 1]:
            self._out_of_step(step, what)
        return v[:W * F]

    def _out_of_step(self, step: int, what: str) -> None:
        import torch.distributed as dist

        phases: list[Any] = [None] * self.world
        self._run(lambda: dist.all_gather_object(phases, (step, what), group=self.step_group), step, what)
        self.out_of_step([where(*p) for p in phases])

    def out_of_step(self, places: list[str]) -> None:
        """Raise the out-of-step error, naming where each rank is (`places[r]`)."""
        listing = "; ".join(f"rank {r} at {p}" for r, p in enumerate(places))
        raise OutOfStepError(f"ranks are out of step (their collective sequences differ): {listing}")

    def _check(self, desc: tuple, group=None) -> None:
        """check_collectives: every rank's descriptor of the collective it is about to run over `group` (the step
        group, or this TP rank's EP group: then the ranks are named with their TP rank) compared."""
        if not self.check or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            return      # (a CUDA graph being captured cannot hold the descriptor exchange; eager runs check)
        import torch.distributed as dist

        descs: list[Any] = [None] * self.world
        step, what = desc[-2], desc[-1]
        self._run(lambda: dist.all_gather_object(descs, desc, group=group or self.step_group), step, what)
        if any(d != descs[0] for d in descs):
            among = (f" among the processes of TP rank {self.tp.rank}"
                     if group is not None and group is self.ep_group else "")
            listing = "; ".join(f"rank {r}: {d[0]} op={d[1]} shape={d[2]} dtype={d[3]} at {where(d[4], d[5])}"
                                for r, d in enumerate(descs))
            raise OutOfStepError(f"collective mismatch{among} (check_collectives): {listing}")

    def _run(self, fn, step: int, what: str):
        self.collectives += 1
        return _guarded(fn, f"a collective failed at {where(step, what)}")

    # -- start-up and result collectives (long timeout, default group) ----------------------------

    def broadcast_object(self, obj: Any, what: str) -> Any:
        if self.world == 1:
            return obj
        import torch.distributed as dist

        self.publish(0, what)
        box = [obj if self.rank == 0 else None]
        self._check(("broadcast_object", "-", (1,), "object", 0, what))
        self._run(lambda: dist.broadcast_object_list(box, src=0, group=self.object_group), 0, what)
        return box[0]

    def gather_objects(self, obj: Any, what: str) -> list[Any] | None:
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        self.publish(0, what)
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        self._check(("gather_object", "-", (1,), "object", 0, what))
        self._run(lambda: dist.gather_object(obj, out, dst=0, group=self.object_group), 0, what)
        return out

    def scatter_objects(self, objs: list[Any] | None, what: str) -> Any:
        """Rank 0 hands objs[r] to rank r."""
        if self.world == 1:
            return objs[0]
        import torch.distributed as dist

        self.publish(0, what)
        box: list[Any] = [None]
        self._check(("scatter_object", "-", (1,), "object", 0, what))
        self._run(lambda: dist.scatter_object_list(box, objs if self.rank == 0 else None, src=0,
                                                   group=self.object_group), 0, what)
        return box[0]

    def wait_for_all(self, what: str) -> None:
        """A barrier without a time limit, for `dp_sync: never`: a slow but alive rank is no fault.
        It polls the store (no busy loop); the watchdog ends this rank if a peer dies meanwhile."""
        if self.world == 1:
            return
        import torch.distributed as dist

        self.publish(0, what)
        store = dist.distributed_c10d._get_default_store()
        key = f"specdp/arrived/{what}"
        store.add(key, 1)
        pause = 0.001
        while store.add(key, 0) < self.world:
            time.sleep(pause)
            pause = min(pause * 2, 0.1)


def _gather_rows(x: torch.Tensor, world: int, group, on_device: bool, run) -> torch.Tensor:
    """[N, ...] on every member of `group` -> [world * N, ...], member r's rows at r * N: into one tensor on the
    device (NCCL: a CUDA graph captures it), else as a list joined (gloo). `run(fn)` runs the collective guarded."""
    import torch.distributed as dist

    if on_device:
        out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        run(lambda: dist.all_gather_into_tensor(out, x, group=group))
        return out
    parts = [torch.empty_like(x) for _ in range(world)]
    run(lambda: dist.all_gather(parts, x, group=group))
    return torch.cat(parts)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class TPGroup:
    """The processes of one DP rank under tensor parallelism (consecutive global ranks on one machine): the door
    for their collectives. `rank` is the TP rank (0: the leader, which alone schedules, syncs with the other DP
    ranks and keeps the books), `world` the TP size.

    Three process groups: the device group (NCCL on GPUs, gloo on CPU) carries the all-reduces of the row-parallel
    layers inside every forward (`all_reduce`: a plain collective, so it is captured in the CUDA graphs); the
    package group (gloo, host memory) carries each step's package from the leader to the followers (`share_header`,
    `share_tensor`: what the step's device work reads, see engine.Engine.follow); the check group (gloo) the
    descriptors `check_collectives` compares. A follower waits for its leader's next package without a time
    limit (a server idles; a dead peer is the watchdog's business); the leader, whose followers are waiting for it,
    sends with `collective_timeout_s`. The header carries `tag` and `-tag` of the package count, so a process that
    missed or repeated a package is named at once (as the DP step sync does)."""

    def __init__(self, rank: int, world: int, dp_rank: int, leader_proc: int, groups: tuple, timeout_s: float,
                 check: bool, device: torch.device):
        self.rank, self.world, self.dp_rank, self.leader_proc = rank, world, dp_rank, leader_proc
        self.device_group, self.package_group, self.check_group = groups
        self.timeout_s = timeout_s
        self.check = check
        self.comm_device = device
        self.packages = 0                      # packages shared so far (the next one's tag)
        self.collectives = 0
        self._at: tuple[int, str] = (0, "start-up")

    def name(self, rank: int | None = None) -> str:
        return f"TP rank {self.rank if rank is None else rank} of DP rank {self.dp_rank}"

    # -- inside a forward --------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the TP group, in place (the row-parallel layers' partial sums)."""
        if self.world == 1:
            return x
        import torch.distributed as dist

        self._check(("all_reduce", "sum", tuple(x.shape), str(x.dtype)), *self._at)
        self._run(lambda: dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.device_group), *self._at)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] on every process -> [world * N, ...], process r's rows at r * N (the vocab-parallel LM head's
        slices of the logits; a plain collective on NCCL, captured in the CUDA graphs)."""
        if self.world == 1:
            return x
        x = x.contiguous()
        self._check(("all_gather", "-", tuple(x.shape), str(x.dtype)), *self._at)
        return _gather_rows(x, self.world, self.device_group, self.comm_device.type == "cuda",
                            lambda fn: self._run(fn, *self._at))

    # -- start-up ------------------------------------------------------------------------------------

    def agree_min(self, n: int, what: str) -> int:
        """The smallest of every process's n (e.g. KV blocks: each process measured its own memory)."""
        import torch.distributed as dist

        v = torch.tensor([n], dtype=torch.long)
        self._run(lambda: dist.all_reduce(v, op=dist.ReduceOp.MIN, group=self.package_group), 0, what)
        return int(v.item())

    # -- step packages: leader -> followers (host memory) -----------------------------------------------

    def share_header(self, fields: list[int] | None, width: int, step: int = 0) -> list[int] | None:
        """The leader's `fields` (width integers >= 0) reach every process (followers pass None) in one MAX
        all-reduce that also checks every process is at the same package."""
        import torch.distributed as dist

        self.packages += 1
        what = "step package"
        tag = _tag(self.packages, what)
        vec = torch.zeros(width + 2, dtype=torch.long)
        if fields is not None:
            vec[:width] = torch.tensor(fields, dtype=torch.long)
        vec[width], vec[width + 1] = tag, -tag
        self._run(lambda: self._wait(dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=self.package_group,
                                                     async_op=True)), step, what)
        v = vec.tolist()
        if v[width] != -v[width + 1]:
            self._out_of_step(step, what)
        return v[:width]

    def share_tensor(self, t: torch.Tensor, step: int, what: str = "step package") -> torch.Tensor:
        """The leader's host tensor t into every follower's t (of the same shape and dtype)."""
        import torch.distributed as dist

        self._run(lambda: self._wait(dist.broadcast(t, src=self.leader_proc, group=self.package_group,
                                                    async_op=True)), step, what)
        return t

    def verify(self, fields: tuple, step: int, what: str) -> None:
        """check_collectives: every process of the group applies the same step package (its sizes and flags)."""
        self._check(("package",) + tuple(fields), step, what)

    def _wait(self, work) -> None:
        """A follower waits as long as its leader takes (the group's own limit); the leader, for whom the
        followers are waiting, `collective_timeout_s`."""
        if self.rank == 0:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        else:
            work.wait()

    def _out_of_step(self, step: int, what: str) -> None:
        import torch.distributed as dist

        places: list[Any] = [None] * self.world
        self._run(lambda: dist.all_gather_object(places, (step, what, self.packages), group=self.package_group),
                  step, what)
        listing = "; ".join(f"{self.name(r)} at {where(s, w)} (package {n})" for r, (s, w, n) in enumerate(places))
        raise OutOfStepError(f"the TP processes of DP rank {self.dp_rank} are out of step (they are at different "
                             f"step packages): {listing}")

    def _check(self, desc: tuple, step: int, what: str) -> None:
        if not self.check or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            return
        import torch.distributed as dist

        descs: list[Any] = [None] * self.world
        self._run(lambda: dist.all_gather_object(descs, (desc, step, what), group=self.check_group), step, what)
        if any(d != descs[0] for d in descs):
            listing = "; ".join(f"{self.name(r)}: {' '.join(map(str, d))} at {where(s, w)}"
                                for r, (d, s, w) in enumerate(descs))
            raise OutOfStepError(f"collective mismatch in the TP group of DP rank {self.dp_rank} "
                                 f"(check_collectives): {listing}")

    def _run(self, fn, step: int, what: str):
        self.collectives += 1
        return _guarded(fn, f"{self.name()}: a collective of its TP group failed at {where(step, what)}")
