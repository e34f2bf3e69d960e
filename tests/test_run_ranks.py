"""`graddbg run` across processes (graddbg/_launch.py): a script that starts its own ranks
with torch.multiprocessing.spawn has every rank watched and every rank's record written,
with its rank; the script's exit code is kept."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

SCRIPTS = pathlib.Path(__file__).parent / "scripts"


@pytest.mark.timeout(240)
def test_every_rank_that_torch_multiprocessing_spawn_starts_is_watched(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "graddbg", "run", "--out", str(out), "--nonfinite", "record",
                          str(SCRIPTS / "spawn_ddp_train.py")], capture_output=True, text=True, timeout=200,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 3, res.stderr[-3000:]  # the script's own exit code
    import graddbg

    for rank in (0, 1):
        run = graddbg.load(out / f"rank-{rank}" / "stats.parquet")
        assert run.meta["rank"] == rank and run.meta["world_size"] == 2
        assert sorted(run.stats["step"].unique()) == [0, 1, 2]
        kinds = [(a.step, a.kind) for a in run.anomalies]
        assert kinds == [(2, "nonfinite")], run.anomalies  # both ranks know, at the same step
        assert (out / f"rank-{rank}" / "report.html").exists()
    assert "rank-1" in res.stdout and "rank-0" in res.stdout, res.stdout


@pytest.mark.timeout(240)
def test_under_torchrun_each_rank_writes_its_own_record(tmp_path):
    from _dist import free_port

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "graddbg", "run", "--out", str(out),
           str(SCRIPTS / "torchrun_ddp_train.py")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=200, stdin=subprocess.DEVNULL)
    assert res.returncode != 0 and "exitcode  : 4" in res.stderr + res.stdout, res.stderr[-3000:]  # kept
    import graddbg

    for rank in (0, 1):
        run = graddbg.load(out / f"rank-{rank}" / "stats.parquet")
        assert run.meta["rank"] == rank and sorted(run.stats["step"].unique()) == [0, 1, 2]


def _env_with_port() -> dict:
    import os

    from _dist import free_port

    return {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}


@pytest.mark.timeout(240)
def test_lightning_ddp_starts_its_second_rank_itself_and_both_are_watched(tmp_path):
    """Lightning's strategy="ddp" runs the script again for rank 1 (unwatched, were it not for
    graddbg run's start-up hook): both ranks are watched, their global norms are torch's own
    in the same run, a NaN written into rank 1's reduced gradient at step 1 is found on both
    ranks at step 1 (rank 0 names rank 1's as the non-finite one), and the parent lists the
    record of the rank it did not wait for."""
    import json

    out, torch_out, trainer = tmp_path / "g", tmp_path / "torch", tmp_path / "trainer"
    torch_out.mkdir()
    env = {**_env_with_port(), "NAN_AT": "1"}
    res = subprocess.run([sys.executable, "-m", "graddbg", "run", "--out", str(out), "--nonfinite", "record",
                          str(SCRIPTS / "lightning_ddp_train.py"), str(torch_out), str(trainer)],
                         capture_output=True, text=True, timeout=200, stdin=subprocess.DEVNULL, env=env)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-3000:]  # (anomalies found: graddbg run's 1)
    import graddbg

    for rank in (0, 1):
        run = graddbg.load(out / f"rank-{rank}" / "stats.parquet")
        assert run.meta["rank"] == rank and run.meta["world_size"] == 2 and run.meta["layout"] == "replicas"
        theirs = json.loads((torch_out / f"torch-{rank}.json").read_text())
        assert run.steps["global_norm"].iloc[0] == pytest.approx(theirs[0], rel=1e-5)
        first = run.anomalies[0]
        assert (first.step, first.kind, first.name) == (1, "nonfinite", "net.0.weight"), run.anomalies
        assert "entered from outside the autograd graph" not in first.message, first.message
    assert "rank(s) 1" in graddbg.load(out / "rank-0" / "stats.parquet").anomalies[0].message
    assert "(rank-1) recorded 3 steps" in res.stdout and "rank 1  nonfinite" in res.stdout, res.stdout


@pytest.mark.timeout(240)
def test_accelerate_launch_runs_graddbg_run_on_every_rank(tmp_path):
    """``accelerate launch -m graddbg run script.py`` (2 CPU processes through torchrun):
    each rank watched once (the AcceleratedOptimizer and the SGD it wraps are one
    optimizer), its own record, a NaN made in rank 1's backward found on both ranks at the
    same step, and the script's exit code (5) kept."""
    import shutil

    from _dist import free_port

    accelerate = shutil.which("accelerate", path=str(pathlib.Path(sys.executable).parent))
    assert accelerate, "accelerate is a dev dependency: its launcher is missing"
    out = tmp_path / "g"
    cmd = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
           "no", "--dynamo_backend", "no", "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()),
           "-m", "graddbg", "run", "--out", str(out), "--nonfinite", "record", str(SCRIPTS / "accelerate_train.py")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=200, stdin=subprocess.DEVNULL)
    assert res.returncode != 0 and "exitcode: 5" in res.stderr + res.stdout, res.stderr[-3000:]
    import graddbg

    for rank in (0, 1):
        folder = out / f"rank-{rank}"
        assert sorted(p.name for p in folder.iterdir()) == ["report.html", "stats.parquet"]  # one watch
        run = graddbg.load(folder / "stats.parquet")
        assert run.meta["rank"] == rank and run.meta["world_size"] == 2
        assert [(a.step, a.kind) for a in run.anomalies] == [(2, "nonfinite")], run.anomalies


@pytest.mark.timeout(240)
def test_graddbg_run_under_torchrun_on_a_pipeline_script(tmp_path):
    """``torchrun -m graddbg run`` on an unchanged pipeline script (2 stages, GPipe): no
    collective inside a stage's backward pass (the first step used to deadlock), each
    rank's record, the global norm of the whole model on both ranks equal to torch's in the
    same run, and the NaN made in stage 1 found by both ranks at the same step."""
    import json

    from _dist import free_port

    out, theirs = tmp_path / "g", tmp_path / "torch"
    theirs.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "graddbg", "run", "--out", str(out), "--nonfinite", "record",
           "--fail-on", "never", str(SCRIPTS / "torchrun_pipeline_train.py"), str(theirs)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=200, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr[-3000:]  # (the script's own: 0)
    import graddbg

    for rank in (0, 1):
        run = graddbg.load(out / f"rank-{rank}" / "stats.parquet")
        assert run.meta["rank"] == rank and run.meta["layout"] == "pipeline" and run.meta["stage"] == rank
        torch_norms = json.loads((theirs / f"torch-{rank}.json").read_text())
        got = list(run.steps["global_norm"])
        assert got[:2] == pytest.approx(torch_norms[:2], rel=1e-6), (got, torch_norms)
        assert [(a.step, a.kind) for a in run.anomalies] == [(2, "nonfinite")], run.anomalies
