"""The simulator's shortcuts (whole-matrix checks, memoised stages) agree with its per-stage
replay."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import random_graph
from xengine.checkpoints import solve_r_opt
from xengine.problem import UNLIMITED_BYTES, Instance
from xengine.schedule import Schedule, keep_all_schedule
from xengine.simulate import (
    ScheduleError,
    StageMemo,
    _check_kept,
    _keep_breaks,
    _row_bytes,
    _row_lists,
    simulate,
)
from xengine.strategies.distribute import place, units


@pytest.mark.parametrize("seed", range(20))
def test_the_stages_flagged_at_once_are_those_the_per_stage_check_refuses(seed):
    rng = np.random.default_rng(seed)
    D, n = int(rng.integers(1, 3)), int(rng.integers(2, 9))
    R, S, A = (rng.random((D, n, n)) < p for p in (0.3, 0.3, 0.1))
    names, dev = [f"n{i}" for i in range(n)], [f"d{d}" for d in range(D)]
    flagged = _keep_breaks(R, S, A)
    for t in range(n):
        try:
            _check_kept(R, S, A, t, names, dev)
            refused = False
        except ScheduleError:
            refused = True
        assert refused == bool(flagged[t]), (seed, t)


def test_rows_as_lists_and_their_bytes():
    M = np.array([[[0, 1, 1], [0, 0, 0], [1, 0, 1]]], dtype=bool)
    assert _row_lists(M[0]) == [[1, 2], [], [0, 2]]
    nbytes = np.array([2**52, 3, 5], dtype=np.int64)  # sums stay exact in float64
    assert _row_bytes(M, nbytes).tolist() == [[8, 0, 2**52 + 5]]


# ----------------------------------------------------------------------------- StageMemo
def _fields(sim):
    return (
        sim.time_s,
        sim.compute_time_s,
        sim.copy_time_s,
        sim.n_computes,
        sim.n_recomputes,
        sim.n_copies,
        sim.copied_bytes,
        sim.peak_bytes.tolist(),
        sim.mem_bytes.tolist(),
        sim.steps,
        sim.ops,
        sim.violations,
        sim.loss_releases,
    )


def _neighbours(g, rng, count):
    """One-device schedules whose checkpoint matrices differ from the last by a few bits, as
    a greedy's moves do."""
    n = g.size
    S = np.tril(rng.random((n, n)) < 0.3, k=-1)
    out = []
    for _ in range(count):
        flips = rng.integers(0, n, (int(rng.integers(1, 4)), 2))
        for t, i in flips:
            if i < t:
                S[t, i] = ~S[t, i]
        out.append(solve_r_opt(g, S, 0, drop_unused=bool(rng.integers(2))))
    return out


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("n_devices", [1, 2])
def test_a_memoised_replay_is_the_plain_replay_to_the_bit(seed, n_devices):
    g = random_graph(seed, states=True)
    devices = ("a", "b")[:n_devices]
    rng = np.random.default_rng(seed)
    single = Instance.single(g, "a", None)
    free = Instance(g, devices, (UNLIMITED_BYTES,) * n_devices)
    placement = rng.integers(0, 2, g.size)[units(free)]  # (forward, backward) pairs together
    scheds = []
    for sched in _neighbours(g, rng, 40):
        simulate(single, sched)  # valid on one device
        if n_devices == 2:  # the same computations spread over two devices
            sched = place(sched, devices, placement)
        scheds.append(sched)
    peaks = [int(simulate(free, s).peak_bytes.max()) for s in scheds]
    inst = Instance(g, devices, (int(np.median(peaks)),) * n_devices)  # about half are above
    memo = StageMemo(inst)
    over = 0
    for sched in scheds:
        plain = simulate(inst, sched, check_budget=False)
        assert _fields(simulate(inst, sched, check_budget=False, memo=memo)) == _fields(plain)
        over += not plain.within_budget
        if not plain.within_budget:  # the error a plain replay raises, and no other
            with pytest.raises(ScheduleError) as raised:
                simulate(inst, sched, memo=memo)
            assert str(raised.value) == plain.violations[0]
    assert memo.hits > memo.misses > 0  # stages were reused, and some were new
    assert 0 < over < 40  # schedules within the budgets and above them


def test_a_memo_replays_its_own_instance_only():
    g = random_graph(1, states=True)
    inst = Instance.single(g, "a", None)
    other = Instance.single(g, "a", 10**9)
    with pytest.raises(ValueError, match="instance it was made for"):
        simulate(other, keep_all_schedule(inst), memo=StageMemo(inst))


@pytest.mark.parametrize("seed", range(4))
def test_a_memo_never_lends_a_valid_stage_to_a_schedule_that_breaks_the_rules(seed):
    """A value read in a stage is part of the stage's key even where it stays resident: a
    schedule that lacks it must fail as a plain replay fails, not reuse the stage."""
    g = random_graph(seed, states=True)
    inst = Instance.single(g, "a", None)
    good = keep_all_schedule(inst)
    memo = StageMemo(inst)
    simulate(inst, good, memo=memo)
    S = good.S[0]
    broken = 0
    for t in range(1, g.size - 1):
        for x in g.predecessors[t]:
            if not (S[t, x] and S[t + 1, x]):
                continue
            bad_S = good.S.copy()
            bad_S[0, t:, x] = False  # node t reads x, which is nowhere
            bad = Schedule(good.devices, good.R, bad_S, good.S_state)
            with pytest.raises(ScheduleError) as plain:
                simulate(inst, bad, check_budget=False)
            with pytest.raises(ScheduleError) as memoised:
                simulate(inst, bad, check_budget=False, memo=memo)
            assert str(memoised.value) == str(plain.value)
            broken += 1
    assert broken > 0
