"""kvfs._budget.ByteBudget: bytes shared by trio tasks, taken in line and given back from
any thread (the mount's write-behind and the control channel's pages hold it)."""

from __future__ import annotations

import threading

import pytest
import trio
import trio.testing

from kvfs._budget import ByteBudget


async def _taker(budget: ByteBudget, n: int, done: list[int]) -> None:
    await budget.take(n)
    done.append(n)


async def _line_up(
    nursery: trio.Nursery, budget: ByteBudget, sizes: tuple[int, ...], done: list[int]
) -> None:
    """Tasks taking ``sizes``, started in that order, each waiting before the next starts."""
    for k in sizes:
        nursery.start_soon(_taker, budget, k, done)
        await trio.testing.wait_all_tasks_blocked()


async def test_a_large_take_is_not_passed_by_smaller_ones_that_fit() -> None:
    """A take of 8 waits (6 of 10 held); a take of 3 that would fit waits behind it, and
    goes only once the 8 went. Before, each take that fitted went ahead, so a large page
    waited as long as small ones kept the budget more than half full."""
    budget, done = ByteBudget(10), []
    await budget.take(6)
    async with trio.open_nursery() as n:
        await _line_up(n, budget, (8, 3), done)
        assert done == [] and budget.held == 6 and budget.in_line == 2
        budget.give(6)
        await trio.testing.wait_all_tasks_blocked()
        assert done == [8] and budget.held == 8  # (8 + 3 is past the limit: 3 waits)
        budget.give(8)
    assert done == [8, 3] and budget.held == 3 and budget.in_line == 0


async def test_an_unfair_budget_lets_a_take_that_fits_go_ahead() -> None:
    """The mount's write-behind (fair=False): a write that fits goes at once, past a
    larger one waiting; the larger one goes once it fits."""
    budget, done = ByteBudget(10, fair=False), []
    await budget.take(6)
    async with trio.open_nursery() as n:
        await _line_up(n, budget, (8, 3, 2), done)
        assert done == [3] and budget.held == 9 and budget.in_line == 2
        budget.give(3)  # (the 2 fits beside 6 now; the 8 does not)
        await trio.testing.wait_all_tasks_blocked()
        assert done == [3, 2] and budget.held == 8
        budget.give(8)
    assert done == [3, 2, 8] and budget.held == 8 and budget.in_line == 0


async def test_takes_in_line_go_together_once_they_fit() -> None:
    """One give grants every take at the head of the line that fits, in order, and stops at
    the first that does not (the ones behind it wait, even if they would fit)."""
    budget, done = ByteBudget(10), []
    await budget.take(10)
    async with trio.open_nursery() as n:
        await _line_up(n, budget, (2, 3, 9, 1), done)
        budget.give(10)
        await trio.testing.wait_all_tasks_blocked()
        # (granted in order; woken together, in whatever order trio runs them)
        assert sorted(done) == [2, 3] and budget.held == 5
        budget.give(5)  # (9, then 1 beside it: 10 fits the limit)
    assert sorted(done[2:]) == [1, 9] and budget.held == 10


async def test_a_take_over_the_limit_goes_alone_and_is_not_starved() -> None:
    """A take larger than the limit goes once nothing else is held, and takes after it
    wait for it instead of keeping something held for ever."""
    budget, done = ByteBudget(10), []
    await budget.take(4)
    async with trio.open_nursery() as n:
        await _line_up(n, budget, (25, 1), done)
        assert done == []
        budget.give(4)
        await trio.testing.wait_all_tasks_blocked()
        assert done == [25] and budget.held == 25
        budget.give(25)
    assert done == [25, 1] and budget.held == 1


@pytest.mark.parametrize("granted", [False, True], ids=["in line", "granted"])
async def test_a_take_cancelled_holds_nothing_and_lets_the_next_go(granted: bool) -> None:
    """A take of 8 in line behind 6 of 10 held, a take of 3 behind it, and the 8 is
    cancelled: still in line, or granted by a give whose wake-up has not run yet. Either
    way it holds nothing, and the 3 goes (its bytes never leaked)."""
    budget, done = ByteBudget(10), []
    await budget.take(6)
    async with trio.open_nursery() as n:
        scope = trio.CancelScope()

        async def cancelled_taker() -> None:
            with scope:
                await budget.take(8)
                done.append(8)

        n.start_soon(cancelled_taker)
        await trio.testing.wait_all_tasks_blocked()
        await _line_up(n, budget, (3,), done)
        assert done == []
        if granted:
            budget.give(6)  # grants the 8 (its wake-up not run yet) ...
            assert budget.held == 8
        scope.cancel()  # ... and it is cancelled first
    assert done == [3] and budget.held == (3 if granted else 9) and budget.in_line == 0


async def test_bytes_given_back_from_another_thread_wake_the_line() -> None:
    budget, done = ByteBudget(4), []
    await budget.take(4)
    async with trio.open_nursery() as n:
        n.start_soon(_taker, budget, 3, done)
        await trio.testing.wait_all_tasks_blocked()
        t = threading.Thread(target=budget.give, args=(4,))
        t.start()
        t.join()
    assert done == [3] and budget.held == 3


@pytest.mark.parametrize("limit", [1, 10])
async def test_many_tasks_never_hold_more_than_the_limit(limit: int) -> None:
    """Tasks of every size taking and giving back at random: the budget never holds more
    than its limit, but for one take larger than it held alone, and ends at 0."""
    import random

    rng = random.Random(limit)
    most = [0]

    async def worker(sizes: list[int]) -> None:
        for k in sizes:
            await budget.take(k)
            assert budget.held <= limit or budget.held == k
            most[0] = max(most[0], budget.held)
            await trio.sleep(0)
            budget.give(k)

    budget = ByteBudget(limit)
    async with trio.open_nursery() as n:
        for _ in range(20):
            n.start_soon(worker, [rng.randint(1, 2 * limit) for _ in range(30)])
    assert budget.held == 0 and budget.in_line == 0 and most[0] > 0
