"""The silent-bug corpus of issue 31 (point 5): public reports of training that goes wrong
without an error, each reproduced as a small CPU loop with a fixed twin.

``CASES`` maps a case's name to its ``Case``; ``SPLIT`` (split.py, fixed before detection
code was written) says which half, ``dev`` or ``heldout``, it belongs to. The halves live in
separate files: dev.py holds the dev cases and the code only they use, heldout.py the
held-out ones (do not read it while writing detection code); _common.py and _shared.py hold
data, models and loops with no bug in them. Nothing in this package imports graddbg:
``bench/corpus_run.py`` runs the cases under ``graddbg.watch``.

The second corpus (issue 39: mined one mechanism of a step at a time, mechanisms.py) lives in
``mech_dev/`` and ``mech_heldout/``, one module per mechanism; its split is dealt by
``mechanisms.deal``. ``FIRST`` holds the first corpus's names, ``SECOND`` the second's.

The third (``mech3/``, ``THIRD``) is a fresh held-out half, split ``heldout3``: mined by
mechanism after the second corpus's held-out half had been run, by people who neither read
nor ran graddbg's detection code, and committed before it was run under graddbg, once.
The fourth (``mech4/``, ``FOURTH``, split ``heldout4``) is the same again, mined after the
third was run and spent, by people whose reports gave counts only.
"""
from __future__ import annotations

from typing import Dict, List

from . import dev, heldout, mech3, mech4, mech_dev, mech_heldout
from ._common import Case
from .split import SEED
from .split import SPLIT as _FIRST_SPLIT

_ALL: List[Case] = [*dev.CASES, *heldout.CASES, *mech_dev.CASES, *mech_heldout.CASES,
                    *mech3.CASES, *mech4.CASES]

CASES: Dict[str, Case] = {c.name: c for c in _ALL}
FIRST = frozenset(c.name for c in (*dev.CASES, *heldout.CASES))
SECOND = frozenset(c.name for c in (*mech_dev.CASES, *mech_heldout.CASES))
THIRD = frozenset(c.name for c in mech3.CASES)
FOURTH = frozenset(c.name for c in mech4.CASES)
#: every case's side: the first corpus's frozen split, and the second's by where its file is
SPLIT: Dict[str, str] = {**_FIRST_SPLIT, **{c.name: "dev" for c in mech_dev.CASES},
                         **{c.name: "heldout" for c in mech_heldout.CASES},
                         **{c.name: "heldout3" for c in mech3.CASES},
                         **{c.name: "heldout4" for c in mech4.CASES}}


#: the splits ``names`` accepts
SPLITS = ("dev", "heldout", "heldout3", "heldout4", "all")


def split_of(name: str) -> str:
    """``"dev"``, ``"heldout"`` or ``"heldout3"``."""
    return SPLIT[name]


def names(split: str = "all") -> List[str]:
    """Case names of one split (``dev``, ``heldout``, ``heldout3`` or ``all``), in registry
    order."""
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {', '.join(map(repr, SPLITS))}, got {split!r}")
    return [n for n in CASES if split == "all" or SPLIT[n] == split]


__all__ = ["CASES", "FIRST", "SECOND", "SEED", "SPLIT", "SPLITS", "THIRD", "FOURTH", "Case", "names",
           "split_of"]
