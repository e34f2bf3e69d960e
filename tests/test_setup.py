"""scripts/setup.sh says what it is doing at each stage (it was silent for two minutes),
run here in a copy with stand-ins for dot, g++ and the virtual environment's python."""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _stand_in(path: pathlib.Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


def test_setup_says_each_stage_before_it_runs(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    shutil.copy(ROOT / "constraints.txt", tmp_path / "constraints.txt")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    _stand_in(tmp_path / ".venv" / "bin" / "python", 'echo "python $*" >&2\n')  # (says where pip would run)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dot", "g++"):
        _stand_in(bin_dir / tool, "exit 0\n")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    for args, what in (([], "graddbg into .venv (about 2 minutes)"),
                       (["--dev"], "graddbg with the test and docs tools into .venv (about 3 minutes)")):
        res = subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh"), *args], capture_output=True,
                             text=True, env=env, timeout=60)
        assert res.returncode == 0, res.stderr
        pin = re.search(r"^torch==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M).group(1)
        lines = res.stderr.splitlines()
        said = [line for line in lines if line.startswith("setup: ")]
        assert said[0].startswith("setup: checking for Graphviz's dot") and said[-1].startswith("setup: done")
        install = lines.index(f"setup: installing torch {pin} and {what}")
        assert lines[install + 1].startswith("python -m pip install -q -c constraints.txt -e"), lines
        assert lines.index("setup: upgrading pip in .venv") < install
