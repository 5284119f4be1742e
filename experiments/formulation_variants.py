"""Written forms of the XEngine model that only experiments use, built from the library's row
families (:mod:`xengine.strategies.formulation`) in another composition.

Neither changes the optimum of :func:`~xengine.strategies.formulation.build`'s model; each
exists to be measured against it (``experiments/solver_benchmark.py``, issue 5):

* :func:`build_published`: the model as Checkmate (Jain et al., MLSys 2020) and XEngine
  (Schuler et al., TACO 2022, section 4) publish it: full T x n matrices for R, S, U (and Z),
  FREE over every (t, e), the stage structure (Checkmate eq. 8, XEngine constraints 1 and 3)
  fixed by *rows*, hazard-count FREE rows over every later reader, and none of the default
  model's reductions (the triangular allocation, the frontier fixed by bounds on one device,
  R fixed at zero on devices whose budget cannot hold a node). Slow by design: it is the
  baseline the reductions are measured against.
* :func:`build_symmetry_broken`: when devices are interchangeable (:func:`twin_of_first`:
  same costs, budget and copy costs as the first device), any schedule stays a schedule of
  the same cost when two of them swap roles, so the first device may be the one that
  computes node 0 in stage 0: ``R[0, 0, 0]`` is fixed at 1. It removes the mirror image of
  every schedule in which a twin computes node 0, never an optimum's cost.

Both take the arguments of ``build`` and are passed to
:func:`xengine.strategies.solve.solve_xengine` as its ``builder``; :func:`variant_lp_bound_s`
is :func:`xengine.strategies.bounds.lp_bound_s` for them. The published form has only the
hazard FREE rows, so its callers state ``free_rows="hazard"`` where ``solve_xengine`` would
pick the tight ones.
"""

from __future__ import annotations

import numpy as np

from xengine.problem import Instance
from xengine.strategies import formulation as F
from xengine.strategies.formulation import Draft, Formulation


def build_published(
    inst: Instance, mode: str = "exact", linearize: bool = True, free_rows: str = "hazard"
) -> Formulation:
    """The published, unreduced form of :func:`~xengine.strategies.formulation.build`'s model
    (see the module docstring). ``free_rows`` is there to be refused: the papers' FREE rows
    are the hazard count."""
    if free_rows != "hazard":
        raise ValueError(
            "the published model has Checkmate's hazard FREE rows: free_rows must be 'hazard', "
            f"not {free_rows!r}"
        )
    g = inst.graph
    name = f"xengine-{mode}-reference-{g.name}-D{inst.n_devices}"
    dr = F.start(inst, mode, linearize, free_rows, full_matrices=True, name=name)
    F.add_variables(dr)
    add_stage_rows(dr)
    F.add_frontier_rows(dr)
    F.add_presence_rows(dr)
    F.add_persistence_rows(dr)
    F.add_state_rows(dr)
    F.add_dependency_rows(dr)
    F.add_copy_terms(dr)
    F.add_free_rows(dr, every_later_reader=True)
    F.add_loss_release_rows(dr)
    F.add_memory_rows(dr)
    F.add_compute_objective(dr)
    return F.finish(dr)


def build_symmetry_broken(
    inst: Instance, mode: str = "exact", linearize: bool = True, free_rows: str = "hazard"
) -> Formulation:
    """:func:`~xengine.strategies.formulation.build`'s model with ``R[0, 0, 0]`` fixed at 1
    where another device is the first one's twin (see the module docstring)."""
    dr = F.start(inst, mode, linearize, free_rows)
    F.add_variables(dr)
    F.add_frontier_rows(dr)
    F.fix_by_bounds(dr)
    fix_first_twin(dr)
    F.add_presence_rows(dr)
    F.add_persistence_rows(dr)
    F.add_state_rows(dr)
    F.add_dependency_rows(dr)
    F.add_copy_terms(dr)
    F.add_free_rows(dr)
    F.add_loss_release_rows(dr)
    F.add_memory_rows(dr)
    F.add_compute_objective(dr)
    return F.finish(dr)


def add_stage_rows(dr: Draft) -> None:
    """``R[d,t,i] = 0`` for i > t and ``S[d,t,i] = 0`` for i >= t (``S[0, :] = 0`` included) as
    rows: Checkmate's eq. 8 and XEngine's constraints 1 and 3 as published, where the default
    model never creates these columns at all."""
    T, n = dr.T, dr.inst.graph.size
    stage_le = np.tril(np.ones((T, n), dtype=bool))
    stage_lt = np.tril(np.ones((T, n), dtype=bool), k=-1)
    for name, ix, allowed in (("stage_fix_r", dr.Rix, stage_le), ("stage_fix_s", dr.Six, stage_lt)):
        ft, fi = np.nonzero(~allowed)
        for d in range(dr.D):
            dr.b.add_rows(name, ft.size, np.arange(ft.size), ix[d, ft, fi], 1.0, 0.0, 0.0)


def fix_first_twin(dr: Draft) -> None:
    """``R[0, 0, 0] = 1`` by its bound when the first device has a twin and may run node 0:
    of two mirror-image schedules, only the one in which the first device starts is left."""
    if twin_of_first(dr.inst) and not dr.cannot_run[0, 0]:
        dr.b.fix(dr.Rix[0, :1, 0], 1.0)


def twin_of_first(inst: Instance) -> bool:
    """Whether some other device is interchangeable with the first: the same compute costs
    and budget, and copy costs that do not change when the two swap roles."""
    C, CP, budgets = inst.compute_s, inst.copy_s, inst.budgets
    for d in range(1, inst.n_devices):
        perm = np.arange(inst.n_devices)
        perm[[0, d]] = perm[[d, 0]]
        if (
            np.array_equal(C[0], C[d])
            and budgets[0] == budgets[d]
            and np.array_equal(CP, CP[np.ix_(perm, perm)])
        ):
            return True
    return False
