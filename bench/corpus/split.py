"""The dev / heldout split of the silent-bug corpus (issue 31, point 5), fixed before any
detection code was written against the corpus.

Cases are grouped by family (the kind of mistake); inside each family the names are sorted,
shuffled with ``random.Random(SEED)`` and dealt alternately to the two halves, the first card
of a family going to the half that holds fewer cases so far (``dev`` on a tie), so both
halves get a mix of every family. ``SPLIT`` is the frozen result; ``make_split()``
recomputes it (tests/test_corpus.py checks that they agree, and that every case of the
registry has a side).

Develop against ``dev`` only. Report recall on ``heldout`` once, when the code is final.
"""
from __future__ import annotations

import random
from typing import Dict, Tuple

SEED = 20261201

FAMILIES: Dict[str, Tuple[str, ...]] = {
    "stale_grad": ("d_steps_without_zero_grad", "gan_zero_grad_other_optimizer"),
    "empty_step": ("loss_rewrapped_requires_grad",),
    "double_step": ("scaler_step_then_optimizer_step",),
    "scaled_grad": ("clip_before_unscale", "optimizer_step_bypasses_scaler"),
    "orphan_param": ("model_instantiated_twice", "unfrozen_after_optimizer_built",
                     "tied_embedding_reassigned"),
    "no_update": ("warmup_integer_division_lr_zero",),
    "hidden_param": ("layers_in_python_list", "parameters_in_plain_dict",
                     "layer_created_in_forward"),
    "foreign_update": ("adam_recreated_each_batch", "optimizer_recreated_each_epoch"),
    "eval_mode": ("eval_not_undone_after_validation", "pretrained_left_in_eval_mode"),
    "unused_param": ("backbone_under_no_grad", "reentrant_checkpoint_no_input_grad",
                     "numpy_roundtrip_in_forward", "round_quantization_in_forward"),
    "loss_pattern": ("softmax_then_cross_entropy", "softmax_then_nll_loss",
                     "nll_loss_on_raw_logits", "bce_with_logits_on_sigmoid",
                     "log_softmax_over_batch_dim", "mse_target_broadcast",
                     "log_of_softmax_nan"),
    "dead_grad": ("zero_init_weights", "negative_bias_dead_relu"),
    "lr_schedule": ("steplr_stepped_per_batch", "scheduler_stepped_per_micro_batch",
                    "plateau_stepped_per_batch"),
    "explode": ("unnormalised_regression_targets",),
    "data": ("labels_shuffled_separately", "view_instead_of_permute",
             "module_requires_grad_attribute_noop"),
}


def make_split(seed: int = SEED) -> Dict[str, str]:
    """Recompute the stratified split: case name -> "dev" | "heldout"."""
    rng = random.Random(seed)
    out: Dict[str, str] = {}
    count = {"dev": 0, "heldout": 0}
    for family in sorted(FAMILIES):
        names = sorted(FAMILIES[family])
        rng.shuffle(names)
        first = "heldout" if count["heldout"] < count["dev"] else "dev"
        other = "heldout" if first == "dev" else "dev"
        for i, name in enumerate(names):
            side = first if i % 2 == 0 else other
            out[name] = side
            count[side] += 1
    return out


SPLIT: Dict[str, str] = {
    'adam_recreated_each_batch': 'heldout',
    'backbone_under_no_grad': 'dev',
    'bce_with_logits_on_sigmoid': 'heldout',
    'clip_before_unscale': 'heldout',
    'd_steps_without_zero_grad': 'heldout',
    'eval_not_undone_after_validation': 'dev',
    'gan_zero_grad_other_optimizer': 'dev',
    'labels_shuffled_separately': 'dev',
    'layer_created_in_forward': 'dev',
    'layers_in_python_list': 'dev',
    'log_of_softmax_nan': 'dev',
    'log_softmax_over_batch_dim': 'dev',
    'loss_rewrapped_requires_grad': 'dev',
    'model_instantiated_twice': 'heldout',
    'module_requires_grad_attribute_noop': 'dev',
    'mse_target_broadcast': 'heldout',
    'negative_bias_dead_relu': 'dev',
    'nll_loss_on_raw_logits': 'dev',
    'numpy_roundtrip_in_forward': 'heldout',
    'optimizer_recreated_each_epoch': 'dev',
    'optimizer_step_bypasses_scaler': 'dev',
    'parameters_in_plain_dict': 'heldout',
    'plateau_stepped_per_batch': 'dev',
    'pretrained_left_in_eval_mode': 'heldout',
    'reentrant_checkpoint_no_input_grad': 'heldout',
    'round_quantization_in_forward': 'dev',
    'scaler_step_then_optimizer_step': 'heldout',
    'scheduler_stepped_per_micro_batch': 'dev',
    'softmax_then_cross_entropy': 'heldout',
    'softmax_then_nll_loss': 'heldout',
    'steplr_stepped_per_batch': 'heldout',
    'tied_embedding_reassigned': 'dev',
    'unfrozen_after_optimizer_built': 'dev',
    'unnormalised_regression_targets': 'heldout',
    'view_instead_of_permute': 'heldout',
    'warmup_integer_division_lr_zero': 'heldout',
    'zero_init_weights': 'heldout',
}
