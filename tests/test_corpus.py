"""The silent-bug corpus of issue 31 (bench/corpus/): the split is the one committed before
detection code was written, every case is well formed, every bug manifests and every fixed
twin trains, all without graddbg. Nothing here asserts what graddbg finds."""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import corpus
import corpus_run
from corpus import mechanisms
from corpus import split as split_mod
from corpus._common import KINDS


@pytest.fixture
def one_thread():
    """Tiny models: one thread is faster; the process's setting is put back."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_split_is_the_committed_one():
    assert split_mod.make_split() == split_mod.SPLIT
    assert {n: s for n, s in corpus.SPLIT.items() if n in corpus.FIRST} == split_mod.SPLIT


def test_second_corpus_is_where_the_deal_put_it():
    """Each case of the second corpus (issue 39) lies in the file of the side that
    ``mechanisms.deal`` gives it, and in the module of its mechanism."""
    from corpus import mech_dev, mech_heldout

    by_mechanism = {}
    for side, pkg in (("dev", mech_dev), ("heldout", mech_heldout)):
        for module, cases in pkg.MODULES.items():
            assert module in mechanisms.MECHANISMS, module
            for case in cases:
                assert case.family == module, (case.name, case.family, module)
                by_mechanism.setdefault(module, []).append(case.name)
    dealt = mechanisms.deal_all(by_mechanism)
    assert dealt == {n: corpus.SPLIT[n] for n in corpus.SECOND}
    assert not corpus.FIRST & corpus.SECOND
    dev_text = "".join((BENCH / "corpus").joinpath(p).read_text() for p in
                       ["dev.py", *(f"mech_dev/{m}.py" for m in mech_dev.MODULES)])
    for name in (n for n in corpus.SECOND if corpus.SPLIT[n] == "heldout"):
        assert f'"{name}"' not in dev_text, name  # (a held-out case is not read while writing detection code)


def test_corpus_sizes_of_issue_39():
    """At least 90 cases; the second corpus's held-out half at least 40, every mechanism in it."""
    assert len(corpus.CASES) >= 90
    held = [n for n in corpus.SECOND if corpus.SPLIT[n] == "heldout"]
    assert len(held) >= 40
    assert {corpus.CASES[n].family for n in held} == set(mechanisms.MECHANISMS)


def test_third_corpus_is_a_fresh_held_out_half():
    """The third corpus (issue 39, point 5): at least 40 cases, all held out (``heldout3``),
    each in the module of its mechanism, every mechanism in it, no name shared with the
    other corpora, and none of its names in a file detection code was written against."""
    from corpus import mech3, mech_dev

    assert len(corpus.THIRD) >= 40
    assert {corpus.SPLIT[n] for n in corpus.THIRD} == {"heldout3"}
    for module, cases in mech3.MODULES.items():
        assert module in mechanisms.MECHANISMS, module
        assert all(c.family == module for c in cases), module
    assert set(mech3.MODULES) == set(mechanisms.MECHANISMS)
    assert not corpus.THIRD & (corpus.FIRST | corpus.SECOND)
    assert len(corpus.THIRD) == len(mech3.CASES)  # (no name given twice inside it)
    dev_text = "".join((BENCH / "corpus").joinpath(p).read_text() for p in
                       ["dev.py", *(f"mech_dev/{m}.py" for m in mech_dev.MODULES)])
    assert not [n for n in corpus.THIRD if f'"{n}"' in dev_text]


def test_fourth_corpus_is_a_fresh_held_out_half():
    """The fourth corpus: the same as the third, mined after the third was run and spent."""
    from corpus import mech4, mech_dev

    assert len(corpus.FOURTH) >= 40
    assert {corpus.SPLIT[n] for n in corpus.FOURTH} == {"heldout4"}
    for module, cases in mech4.MODULES.items():
        assert module in mechanisms.MECHANISMS, module
        assert all(c.family == module for c in cases), module
    assert set(mech4.MODULES) == set(mechanisms.MECHANISMS)
    assert not corpus.FOURTH & (corpus.FIRST | corpus.SECOND | corpus.THIRD)
    assert len(corpus.FOURTH) == len(mech4.CASES)
    dev_text = "".join((BENCH / "corpus").joinpath(p).read_text() for p in
                       ["dev.py", *(f"mech_dev/{m}.py" for m in mech_dev.MODULES)])
    assert not [n for n in corpus.FOURTH if f'"{n}"' in dev_text]


def test_no_corpus_file_imports_graddbg():
    for path in (BENCH / "corpus").rglob("*.py"):
        text = path.read_text()
        assert "import graddbg" not in text and "from graddbg" not in text, path


def test_split_covers_exactly_the_registry():
    assert set(corpus.SPLIT) == set(corpus.CASES)
    assert len(corpus.CASES) >= 34


def test_split_halves_mix_every_family():
    for family, members in split_mod.FAMILIES.items():
        sides = {corpus.SPLIT[n] for n in members}
        if len(members) >= 2:
            assert sides == {"dev", "heldout"}, family
    counts = [sum(s == side for s in split_mod.SPLIT.values()) for side in ("dev", "heldout")]
    assert abs(counts[0] - counts[1]) <= 1


def test_each_half_lives_in_its_own_file():
    from corpus import dev, heldout

    assert {c.name for c in dev.CASES} == {n for n, s in split_mod.SPLIT.items() if s == "dev"}
    assert {c.name for c in heldout.CASES} == {n for n, s in split_mod.SPLIT.items() if s == "heldout"}
    dev_text = (BENCH / "corpus" / "dev.py").read_text()
    for case in heldout.CASES:
        assert case.name not in dev_text


@pytest.mark.parametrize("name", list(corpus.CASES))
def test_case_metadata(name):
    case = corpus.CASES[name]
    if name in corpus.FIRST:
        assert case.name in split_mod.FAMILIES[case.family]
    else:
        assert case.family in mechanisms.MECHANISMS
    assert case.source.strip() and case.description.strip()
    assert set(case.expected_kinds) <= set(KINDS), case.expected_kinds
    assert "ddp_mismatch" not in case.expected_kinds
    if case.params:
        model, _, _ = case.build_buggy(0)
        names = {n for n, _ in model.named_parameters()}
        assert set(case.params) <= names, (case.params, names)


@pytest.mark.parametrize("name", list(corpus.CASES))
def test_bug_manifests_and_fix_trains(name, one_thread):
    case = corpus.CASES[name]
    buggy, fixed = case.run("buggy"), case.run("fixed")
    assert len(buggy["losses"]) > 0 and len(fixed["losses"]) > 0
    assert case.manifest(buggy, fixed), (name, buggy["losses"][-3:], fixed["losses"][-3:])


def test_runs_are_deterministic(one_thread):
    case = corpus.CASES["model_instantiated_twice"]
    assert case.run("fixed")["losses"] == case.run("fixed")["losses"]


def _finding(kind, name=None, params=()):
    return corpus_run.Finding(kind=kind, step=0, name=name, params=params, message="")


def test_classify_needs_an_expected_kind_and_a_named_parameter():
    case = corpus.CASES["unfrozen_after_optimizer_built"]  # orphan_param on 0.weight/0.bias
    assert corpus_run.classify(case, []) == "missed"
    assert corpus_run.classify(case, [_finding("orphan_param", "0.weight")]) == "named"
    assert corpus_run.classify(case, [_finding("orphan_param", "2.weight", ("0.bias",))]) == "named"
    assert corpus_run.classify(case, [_finding("orphan_param", "2.weight")]) == "mis-named"
    assert corpus_run.classify(case, [_finding("no_update", "0.weight")]) == "mis-named"


def test_classify_without_params_takes_any_expected_kind():
    case = corpus.CASES["steplr_stepped_per_batch"]
    assert corpus_run.classify(case, [_finding("explode"), _finding("lr_schedule")]) == "named"
    no_kind = corpus.CASES["labels_shuffled_separately"]
    assert corpus_run.classify(no_kind, [_finding("dead_grad")]) == "mis-named"


def test_totals_count_false_alarms_and_recall():
    rows = [
        {"case": "a", "expected_kinds": ["stale_grad"], "outcome": "named", "false_alarm": False,
         "manifest": True},
        {"case": "b", "expected_kinds": ["stale_grad"], "outcome": "missed", "false_alarm": True,
         "manifest": True},
        {"case": "c", "expected_kinds": [], "outcome": "mis-named", "false_alarm": False,
         "manifest": False},
    ]
    t = corpus_run.totals(rows)
    assert (t["named"], t["nameable"], t["recall"], t["missed"]) == (1, 2, 0.5, 1)
    assert (t["false_alarms"], t["no_kind_flagged"], t["manifest_failed"]) == (1, 1, ["c"])


def test_runner_without_graddbg(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rc = corpus_run.main(["--split", "all", "--no-graddbg", "--only",
                          "model_instantiated_twice,labels_shuffled_separately",
                          "--json", str(out)])
    assert rc == 0
    assert "all hold" in capsys.readouterr().out
    assert '"manifest": true' in out.read_text()


def test_runner_rejects_unknown_case():
    with pytest.raises(SystemExit):
        corpus_run.main(["--no-graddbg", "--only", "no_such_case"])


def test_variant_rejects_bad_name():
    with pytest.raises(ValueError, match="'buggy' or 'fixed'"):
        corpus.CASES["zero_init_weights"].variant("both")


# --------------------------------------------------------------------------- graddbg on the dev half
# (the held-out half is measured once, by bench/corpus_run.py --split heldout, never asserted here)
# (the first corpus's dev half; the second corpus's dev cases are measured by corpus_run)
DEV = [n for n, s in corpus.SPLIT.items() if s == "dev" and n in corpus.FIRST]


@pytest.mark.parametrize("name", DEV)
def test_dev_case_is_named_and_its_twin_is_silent(name, one_thread):
    case = corpus.CASES[name]
    row = corpus_run.evaluate(case, watched=True)
    expected = "named" if case.expected_kinds else "missed"  # (no kind can name it: silence)
    assert row["outcome"] == expected, row
    assert not row["false_alarm"], row["fixed_findings"]
