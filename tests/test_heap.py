"""Start-up ends by freezing the heap (runtime/heap.py): a full collection afterwards walks only what
was allocated since, and the collections are counted for the summary."""
import gc

from specdp_cli.runtime.heap import collections_since_startup, freeze_startup_heap, thaw_heap


class Node:
    def __init__(self):
        self.me = self              # a reference cycle: only the cyclic collector frees it


def test_freeze_hides_startup_objects_and_counts_later_collections():
    before = [Node() for _ in range(1000)]      # long-lived objects of "start-up"
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(before)
        assert collections_since_startup() == {"gc_collections": 0, "gc_pause_s": 0.0}
        garbage = [Node() for _ in range(10)]
        del garbage
        assert gc.collect() >= 10                # the cycles made after start-up are still collected
        counted = collections_since_startup()
        assert counted["gc_collections"] >= 1 and counted["gc_pause_s"] > 0
    finally:
        thaw_heap()
    assert gc.get_freeze_count() == 0
    del before
