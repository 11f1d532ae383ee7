"""The step sync's same-machine transport (Unix datagrams): every rank gets every rank's record of the
same exchange, in rank order, whatever the ranks' timing; a silent peer is a timeout, not a hang."""
import secrets
import threading

import pytest

from specdp_cli.runtime.local_exchange import ExchangeTimeout, LocalExchange

pytestmark = pytest.mark.skipif(not LocalExchange.available(), reason="Linux abstract sockets")


def run_ranks(world: int, rounds: int, delay_of, timeout_s: float = 20.0) -> list[list]:
    """`world` threads as ranks, each doing `rounds` exchanges of [rank, round]; delay_of(rank, round)
    is an Event wait that skews the ranks (a rank can run ahead by one exchange)."""
    name = secrets.token_hex(6)
    exchanges = [LocalExchange(r, world, name, timeout_s) for r in range(world)]
    results: list[list] = [[] for _ in range(world)]
    errors: list[BaseException] = []

    def rank_main(r: int) -> None:
        try:
            for i in range(rounds):
                delay_of(r, i)
                results[r].append(exchanges[r].exchange([r, i, r * 1000 + i]))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for x in exchanges:
        x.close()
    assert not errors, errors
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_every_record_of_the_same_exchange(world):
    slow = threading.Event()

    def delay(r, i):
        if r == 0 and i % 3 == 0:        # rank 0 late now and then: the others send the next record early
            slow.wait(0.005)

    results = run_ranks(world, 50, delay)
    want = [[tuple([r, i, r * 1000 + i]) for r in range(world)] for i in range(50)]
    for r in range(world):
        assert results[r] == want


def test_a_silent_peer_is_a_timeout():
    name = secrets.token_hex(6)
    a, b = LocalExchange(0, 2, name, 0.3), LocalExchange(1, 2, name, 0.3)
    try:
        with pytest.raises(ExchangeTimeout, match="rank 1"):
            a.exchange([1, 2])
    finally:
        a.close()
        b.close()


def test_a_gone_peer_is_an_error():
    name = secrets.token_hex(6)
    a, b = LocalExchange(0, 2, name, 5.0), LocalExchange(1, 2, name, 5.0)
    b.close()
    try:
        with pytest.raises(OSError):
            a.exchange([1])
    finally:
        a.close()
