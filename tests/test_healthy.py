"""No false alarms on healthy training (issue 23, point 3): every script of tests/healthy/,
run unchanged under `graddbg run`, exits 0, prints the same losses as the unwatched run
(exactly), records 0 anomalies and says nothing on stderr about graddbg.

All runs (each script unwatched and watched) are made once per session, three processes at
a time, by the module fixture; each test reads its part. The single-process scripts' runs
are forked from two processes that imported torch (and graddbg's command line) once
(tests/_preloaded.py): each run is still its own process, run as python runs it, as
test_a_forked_run_ends_as_python_ends checks. The suite runs the scripts of
``_healthy.CI_SCRIPTS`` (ten of the twenty-one, to keep the suite short);
bench/healthy_suite.py runs all twenty-one and prints the same comparison as one table.
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

import _healthy
from _healthy import CI_SCRIPTS, SCRIPTS
from _preloaded import Zygote

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return _healthy.run_suite(CI_SCRIPTS, tmp_path_factory.mktemp("healthy"), preload=True)


def _show(res) -> str:
    return f"exit {res.returncode}\nstdout (end):\n{res.stdout[-1500:]}\nstderr (end):\n{res.stderr[-3000:]}"


def test_the_suite_is_what_the_readme_lists():
    readme = (_healthy.HEALTHY / "README.md").read_text(encoding="utf-8")
    assert len(SCRIPTS) >= 14 and set(CI_SCRIPTS) <= set(SCRIPTS)
    for s in SCRIPTS:
        assert f"`{s}.py`" in readme, f"tests/healthy/README.md does not list {s}.py"


@pytest.mark.parametrize("script", CI_SCRIPTS)
def test_unwatched_run_is_a_real_training_run(suite, script):
    plain, _ = suite[script]
    assert plain.returncode == 0, _show(plain)
    assert len(plain.losses) >= 3, _show(plain)
    values = [float(line.split()[2]) for line in plain.losses]
    assert all(v == v and abs(v) < 1e30 for v in values), plain.losses  # finite losses


@pytest.mark.parametrize("script", CI_SCRIPTS)
def test_graddbg_run_exits_0(suite, script):
    _, watched = suite[script]
    assert watched.returncode == 0, _show(watched)


@pytest.mark.parametrize("script", CI_SCRIPTS)
def test_graddbg_run_gives_the_same_losses(suite, script):
    plain, watched = suite[script]
    assert watched.losses == plain.losses, _show(watched)


@pytest.mark.parametrize("script", CI_SCRIPTS)
def test_graddbg_run_records_no_anomaly(suite, script):
    _, watched = suite[script]
    assert watched.load_error is None, watched.load_error
    assert watched.saved >= 1, "graddbg run saved no run (stats*.parquet)\n" + _show(watched)
    found = [f"step {a.step} {a.kind} {a.name}: {a.message}" for a in watched.anomalies]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("script", CI_SCRIPTS)
def test_graddbg_run_says_nothing_on_stderr(suite, script):
    plain, watched = suite[script]
    lines = _healthy.graddbg_lines(watched, plain)
    assert lines == [], "\n".join(lines)


@pytest.mark.parametrize("script", sorted(_healthy.DISTRIBUTED))
def test_ranks_do_not_write_the_same_files(suite, script):
    """Under torchrun every rank runs graddbg: one file per rank or rank 0 only, never two
    writers of one stats.parquet / report.html (issue 23, point 6)."""
    _, watched = suite[script]
    reports = re.findall(r"report: (\S+)", watched.stdout)
    assert reports, _show(watched)
    assert len(reports) == len(set(reports)), "\n".join(reports)


_ENDINGS = """\
import atexit, os, sys, threading, time
atexit.register(lambda: print("atexit ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.05), print("thread ran", flush=True))).start()
print("argv", sys.argv[1:], __name__, sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
print("on stderr", file=sys.stderr)
if sys.argv[1] == "raise":
    raise ValueError("boom")
sys.exit(sys.argv[1] if sys.argv[1] == "text" else int(sys.argv[1]))
"""


def test_a_forked_run_ends_as_python_ends(tmp_path):
    """A run forked from a zygote (tests/_preloaded.py) gives what ``python script.py`` (and
    ``python -m module``) gives: the exit status (0, sys.exit's code or text, 1 and the script's own traceback on
    an uncaught exception), stdout and stderr, after non-daemon threads and atexit."""
    script = tmp_path / "endings.py"
    script.write_text(_ENDINGS)
    zygote = Zygote.start(["json"], dict(_healthy._env()))
    assert zygote is not None
    try:
        for module, arg in [(False, "0"), (False, "3"), (False, "text"), (False, "raise"), (True, "raise"),
                            (True, "4")]:
            argv = ["endings" if module else str(script), arg]
            want = subprocess.run([sys.executable, *(["-m"] if module else []), *argv], cwd=tmp_path,
                                  capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                                  env=_healthy._env())
            rc, out, err, late = zygote.run(argv, tmp_path, 60, module=module)
            assert (rc, out, err, late) == (want.returncode, want.stdout, want.stderr, False), argv
            assert "atexit ran" in out and "thread ran" in out and "main__ True" in out
    finally:
        zygote.close()
