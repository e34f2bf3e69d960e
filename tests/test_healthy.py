"""No false alarms on healthy training (issue 23, point 3): every script of tests/healthy/,
run unchanged under `graddbg run`, exits 0, prints the same losses as the unwatched run
(exactly), records 0 anomalies and says nothing on stderr about graddbg.

All runs (each script unwatched and watched) are made once per session, three processes at
a time, by the module fixture; each test reads its part. The suite runs the scripts of
``_healthy.CI_SCRIPTS`` (nine of the eighteen, to keep the suite short);
bench/healthy_suite.py runs all eighteen and prints the same comparison as one table.
"""
from __future__ import annotations

import re

import pytest

import _healthy
from _healthy import CI_SCRIPTS, SCRIPTS

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return _healthy.run_suite(CI_SCRIPTS, tmp_path_factory.mktemp("healthy"))


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
