"""The simulator's whole-matrix shortcuts agree with its per-stage rules."""

from __future__ import annotations

import numpy as np
import pytest

from xengine.simulate import ScheduleError, _check_kept, _keep_breaks, _row_bytes, _row_lists


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
