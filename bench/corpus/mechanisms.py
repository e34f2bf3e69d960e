"""The second corpus (issue 39, point 5): public reports mined one mechanism of a training step
at a time, and their split, dealt before any detection code was written for them.

The first corpus (dev.py / heldout.py, split.py) was mined around graddbg's finding families,
and its held-out half has been measured; it stays as it is. The cases added here were found
by searching issue trackers and forums mechanism by mechanism (below), never for what graddbg
can already name. Each case's ``family`` is its mechanism.

The split: inside each mechanism the case names are sorted, shuffled with
``random.Random(f"{SEED}:{mechanism}")``, and the first ``ceil(2 n / 3)`` go to the held-out
half (``HELDOUT_SHARE``), the rest to dev. Two thirds, not a half, because the first corpus's
cases all count on the dev side: the held-out half of the whole corpus is these cases. The
cases live in the file of their side (``mech_heldout/<mechanism>.py``,
``mech_dev/<mechanism>.py``); tests/test_corpus.py re-deals them and checks each is where the
deal put it. Develop against ``mech_dev`` only; run ``mech_heldout`` once, at the end.
"""
from __future__ import annotations

import math
import random
from typing import Dict, Iterable, Tuple

SEED = 20261202
HELDOUT_SHARE = 2 / 3

#: the mechanisms of a training step (issue 39, point 5), each a stratum of the split
MECHANISMS: Dict[str, str] = {
    "arithmetic": "the step's arithmetic: accumulation, averaging, zero_grad placement, clipping",
    "optimizer": "the optimizer and its state: param groups, state dicts, moments, weight decay, lr",
    "graph": "the autograd graph: detach, .data, in-place ops, no_grad regions, retain_graph, hooks",
    "loss": "the loss: reduction, weighting, targets, masks, terms that cancel or vanish",
    "params": "the model's parameters and their initial state: init, freezing, tying, buffers, copies",
    "precision": "precision and scaling: autocast, fp16/bf16, GradScaler, casts of weights",
    "data": "the data path: shuffling, normalisation, labels, samplers, augmentation",
    "manual": "hand-written update loops without a torch.optim optimizer (watched as watch(model))",
    "distributed": "distribution: DDP, no_sync, samplers, rank-dependent code (runnable in one process)",
}


def deal(mechanism: str, names: Iterable[str]) -> Dict[str, str]:
    """The side ("dev" or "heldout") of each case of one mechanism."""
    if mechanism not in MECHANISMS:
        raise ValueError(f"mechanism: expected one of {sorted(MECHANISMS)}, got {mechanism!r}")
    order = sorted(names)
    random.Random(f"{SEED}:{mechanism}").shuffle(order)
    k = math.ceil(HELDOUT_SHARE * len(order))
    return {n: ("heldout" if i < k else "dev") for i, n in enumerate(order)}


def deal_all(by_mechanism: Dict[str, Iterable[str]]) -> Dict[str, str]:
    """`deal` over every mechanism: case name -> side."""
    out: Dict[str, str] = {}
    for mechanism, names in by_mechanism.items():
        out.update(deal(mechanism, names))
    return out


def counts(split: Dict[str, str]) -> Tuple[int, int]:
    """(dev, heldout) case counts of a split."""
    return (sum(s == "dev" for s in split.values()), sum(s == "heldout" for s in split.values()))
