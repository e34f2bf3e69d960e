"""examples/fsdp_train.py, launched the way its docstring says: torchrun, 2 processes, gloo
on 127.0.0.1 with a free port, end to end (a few seconds of work, most of it start-up)."""
from __future__ import annotations

import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

from _dist import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "fsdp_train.py"




@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """(completed process, report path) of one torchrun launch of the example."""
    out = tmp_path_factory.mktemp("fsdp") / "report.html"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}",
           str(EXAMPLE), "--steps", "3", "--out", str(out)]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True, timeout=180)
    return proc, out


@pytest.mark.timeout(240)
def test_torchrun_launch_exits_0(launched):
    proc, _ = launched
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"


@pytest.mark.timeout(240)
def test_rank0_writes_one_html_report(launched):
    proc, out = launched
    assert out.exists(), proc.stdout + proc.stderr[-2000:]
    html = out.read_text()
    assert len(html) > 10_000 and html.lstrip().lower().startswith("<!doctype html")
    assert "layers.0.linear1.weight" in html  # the unsharded model's names
    assert f"report: {out}" in proc.stdout


@pytest.mark.timeout(240)
def test_summary_prints_a_finite_global_norm_per_step_once(launched):
    proc, _ = launched
    norms = [float(v) for v in re.findall(r"^step \d+: .*global norm (\S+)$", proc.stdout, re.M)]
    assert len(norms) == 3, proc.stdout  # 3 steps, printed by rank 0 only
    assert all(math.isfinite(v) and v > 0 for v in norms), norms
    assert "anomalies: 0" in proc.stdout
