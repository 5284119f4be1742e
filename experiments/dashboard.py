"""The MLflow dashboard on this project's tracking store (docs/design.md section 9).

Starts ``mlflow ui`` on the SQLite store (``results/mlflow.db`` unless told otherwise),
bound to the loopback interface, with one worker and MLflow's job runner off (the light
setting for a 2-core machine: two processes, ~0.5 GB), waits until it answers ``/health``,
prints the URL and runs until Ctrl-C (or SIGTERM), then stops the server and its workers.

Usage:
  .venv/bin/python experiments/dashboard.py [--port 5000] [--tracking-uri sqlite:///...]
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from xengine.records.tracking import (  # noqa: E402
    artifact_location_for,
    create_store,
    resolve_tracking_uri,
)

log = logging.getLogger("dashboard")

HOST = "127.0.0.1"


def server_command(uri: str, port: int, host: str = HOST, workers: int = 1) -> list[str]:
    """The ``mlflow ui`` command line for ``uri`` (artifacts beside a SQLite file)."""
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "ui",
        "--backend-store-uri",
        uri,
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        str(workers),
    ]
    artifacts = artifact_location_for(uri)
    if artifacts is not None:
        cmd += ["--default-artifact-root", artifacts]
    return cmd


def server_env() -> dict[str, str]:
    """The environment: MLflow's background job runner off (it would start 7 consumers)."""
    return {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def start(uri: str, port: int, host: str = HOST) -> subprocess.Popen:
    """Start the server in its own process group (so that stopping it stops its workers)."""
    create_store(uri)  # whole before the server opens it: a run may be starting too
    cmd = server_command(uri, port, host)
    log.info("starting: %s", " ".join(cmd))
    # the server's own output goes to stderr: stdout carries only the URL line
    return subprocess.Popen(cmd, env=server_env(), start_new_session=True, stdout=sys.stderr)


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 60.0) -> bool:
    """Poll ``<url>/health`` until it answers OK, the server exits, or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    return False


def stop(proc: subprocess.Popen, timeout_s: float = 10.0) -> int | None:
    """SIGTERM to the server's process group, SIGKILL after ``timeout_s``; its exit code."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("server did not stop within %.0f s; killing it", timeout_s)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=timeout_s)
    try:  # workers left behind in the group (the server normally takes them down)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return proc.returncode


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=5000)
    ap.add_argument(
        "--tracking-uri",
        default=None,
        help="store to show (default: $MLFLOW_TRACKING_URI, else sqlite:///results/mlflow.db)",
    )
    ap.add_argument("--timeout-s", type=float, default=60.0, help="how long to wait for /health")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s", stream=sys.stderr)

    uri = resolve_tracking_uri(args.tracking_uri, ROOT / "results")
    if not uri.startswith("sqlite:///"):
        log.error("%s is not a SQLite store: a tracking server is already a dashboard", uri)
        return 2
    url = f"http://{HOST}:{args.port}"
    proc = start(uri, args.port)
    for sig in (signal.SIGINT, signal.SIGTERM):  # SIGINT too: a background job ignores it
        signal.signal(sig, _interrupt)
    try:
        if not wait_healthy(proc, url, args.timeout_s):
            log.error(
                "the server did not answer %s/health within %.0f s (exit code %s); "
                "is port %d taken?",
                url,
                args.timeout_s,
                proc.poll(),
                args.port,
            )
            return 1
        print(f"MLflow dashboard: {url}  (store {uri}; Ctrl-C stops it)", flush=True)
        proc.wait()
        log.error("the server exited on its own with code %s", proc.returncode)
        return 1
    except KeyboardInterrupt:
        log.info("stopping the server")
        return 0
    finally:
        stop(proc)


if __name__ == "__main__":
    sys.exit(main())
