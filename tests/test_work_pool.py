"""The pool a machine's ranks take their inputs from: every input taken exactly once, in order."""
import multiprocessing as mp

import pytest

from specdp_cli.jobs.work_pool import WorkPool

pytestmark = pytest.mark.timeout(60)


def test_private_pool_hands_out_in_order():
    pool = WorkPool(list(range(5)))
    assert pool.take(0) == [] and pool.take(2) == [0, 1] and not pool.empty
    assert pool.take(10) == [2, 3, 4] and pool.empty and pool.take(1) == []
    assert pool.taken == 5
    assert WorkPool([]).take(3) == []


def test_a_rank_takes_at_most_its_share_of_what_is_left():
    pool = WorkPool(list(range(5)), sharers=2)
    assert pool.take(4) == [0, 1, 2]          # ceil(5 / 2)
    assert pool.take(4) == [3]                # ceil(2 / 2)
    assert pool.take(4) == [4] and pool.empty


def _drain(path: str, n_items: int, q) -> None:
    pool = WorkPool(list(range(n_items)), path, sharers=3)
    got = []
    while not pool.empty:
        got += pool.take(3)
    pool.close()
    q.put(got)


def test_shared_pool_gives_every_item_to_exactly_one_process(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    path = str(tmp_path / "claims")
    procs = [ctx.Process(target=_drain, args=(path, 600, q)) for _ in range(3)]
    for p in procs:
        p.start()
    parts = [q.get(timeout=50) for _ in procs]
    for p in procs:
        p.join(timeout=10)
    everything = sorted(x for part in parts for x in part)
    assert everything == list(range(600))                 # none lost, none twice
    assert all(part == sorted(part) for part in parts)    # each process takes in list order
