"""Sweeps through ``hydra/launcher=slurm`` on the one-node cluster that
``experiments/local_slurm.sh start`` runs on this machine (``.ci/run`` starts it): every point
a SLURM job writing to the same MLflow store as a local run; a job cancelled with ``scancel``
is recorded KILLED, and running the sweep again runs only that point. Without a cluster (the
packages could not be installed, not root) the tests are skipped and say why."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
from mlflow import MlflowClient

from tests.helpers import cli_command


def _cluster() -> str | None:
    """Why there is no usable cluster, or None."""
    if shutil.which("sinfo") is None or shutil.which("scancel") is None:
        return "no SLURM here: bash experiments/local_slurm.sh start (as root) installs one"
    proc = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    if proc.returncode != 0 or not any(s in proc.stdout for s in ("idle", "mix", "alloc")):
        return f"the SLURM cluster does not answer: {proc.stderr.strip() or proc.stdout.strip()}"
    return None


pytestmark = pytest.mark.skipif(_cluster() is not None, reason=str(_cluster()))

SLURM = [
    "hydra/launcher=slurm",
    "hydra.launcher.partition=debug",
    "hydra.launcher.additional_parameters={}",  # not exclusive: two points share the node
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.timeout_min=15",
    "execute=false",
]


def _runs(tmp_path):
    if not (tmp_path / "mlflow.db").exists():  # opening it would make it, racing the sweep
        return None, []
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("xengine")
    runs = client.search_runs([exp.experiment_id]) if exp else []
    return client, [r for r in runs if r.data.tags.get("xe.task") == "run"]


def _why(tmp_path, parents, runs) -> str:
    """What a failed check of the sweep's parent needs: its tags, each point's parent and
    status, the sweep's log and the jobs' warnings."""
    lines = [f"parent {p.info.run_id} {p.info.status}: {p.data.tags}" for p in parents]
    lines += [
        f"point {r.data.params.get('mem.all')} {r.info.status} {r.data.tags.get('xe.status')}"
        f" parent={r.data.tags.get('mlflow.parentRunId')}"
        for r in runs
    ]
    lines.append((tmp_path / "sweep.log").read_text()[-2000:])
    for err in sorted((tmp_path / "sweep").rglob("*_log.err")):
        lines += [
            f"{err.name}: {x}" for x in err.read_text().splitlines() if "WARN" in x or "ERROR" in x
        ]
    return "\n".join(lines)


def _sweep(tmp_path, *args):
    cmd, env = cli_command(tmp_path, *SLURM, f"hydra.sweep.dir={tmp_path / 'sweep'}", *args)
    return [*cmd[:2], "-m", *cmd[2:]], env  # python run.py -m <overrides>


def test_a_sweep_runs_each_point_as_a_slurm_job_into_one_store(tmp_path):
    cmd, env = _sweep(
        tmp_path, "net=tiny", "mem.all=90%,80%,70%,60%", "strategy=[checkpoint_all,chen_sqrtn]"
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, runs = _runs(tmp_path)
    assert sorted(r.data.params["mem.all"] for r in runs) == ["60%", "70%", "80%", "90%"]
    assert all(r.info.status == "FINISHED" for r in runs)
    jobs = {r.data.tags.get("xe.slurm_job_id") for r in runs}
    assert None not in jobs and len(jobs) == 4  # four SLURM jobs (array tasks), one per point


def test_a_cancelled_point_is_killed_and_the_rerun_runs_only_it(tmp_path):
    """Two points that solve for up to a minute; the first job running is cancelled once
    its MLflow run exists, and is recorded KILLED; the sweep ends by itself, its parent run
    counting one killed point; the sweep run again skips the finished point and runs the
    cancelled one to the end."""
    args = (
        "net=resnet18",
        "net.batch_size=2",
        "net.image_size=96",  # at 64 px one op alone needs 96 % on an AMD EPYC
        "strategy=[checkmate]",
        "solver.time_limit_s=40",
        "profile.context_rounds=0",
        "mem.all=80%,81%",  # above the smallest budget (71 % on that AMD)
    )
    cmd, env = _sweep(tmp_path, *args)
    log = (tmp_path / "sweep.log").open("w")  # not a pipe: submitit's warnings would fill it
    sweep = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env=env)
    try:
        cancelled = None
        deadline = time.monotonic() + 300
        while cancelled is None and time.monotonic() < deadline:
            time.sleep(2)
            _, runs = _runs(tmp_path)
            running = [
                r for r in runs if r.info.status == "RUNNING" and r.data.tags.get("xe.slurm_job_id")
            ]
            if running:
                cancelled = running[0]
                subprocess.run(["scancel", cancelled.data.tags["xe.slurm_job_id"]], check=True)
        assert cancelled is not None, "no point started within 5 minutes"
        # the cancelled job records KILLED and returns, so the sweep's own process learns
        # that it ended (without waiting for sacct) and ends once the other point has run
        code = sweep.wait(timeout=max(deadline + 300 - time.monotonic(), 60))
    finally:
        if sweep.poll() is None:
            sweep.kill()
        subprocess.run(["scancel", "--name=run"], check=False)  # nothing left in the queue
    assert code == 0, (tmp_path / "sweep.log").read_text()[-3000:]
    client, runs = _runs(tmp_path)
    status = {r.data.params["mem.all"]: r.info.status for r in runs}
    mem = cancelled.data.params["mem.all"]
    assert status[mem] == "KILLED", status
    assert client.get_run(cancelled.info.run_id).data.tags["xe.status"] == "killed"
    other = next(m for m in status if m != mem)
    assert status[other] == "FINISHED", status
    parents = client.search_runs(
        [cancelled.info.experiment_id], filter_string="tags.`xe.role` = 'sweep'"
    )
    assert [p.data.tags.get("xe.n_killed") for p in parents] == ["1"], _why(tmp_path, parents, runs)

    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    _, after = _runs(tmp_path)
    new = [r for r in after if r.info.run_id not in {x.info.run_id for x in runs}]
    assert [r.data.params["mem.all"] for r in new] == [mem], [r.data.params for r in new]
    assert new[0].info.status == "FINISHED"
