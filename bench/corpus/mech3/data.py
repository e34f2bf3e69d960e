"""The third corpus's cases of the mechanism 'data' (bench/corpus/mechanisms.py): the data
path (normalisation, labels, augmentation, targets) of real reports, mined by worker e."""
from __future__ import annotations

import numpy as np
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from .._common import (
    Case,
    batch,
    classification,
    mlp,
    trains,
    worse,
)
from .._m3_e import (
    TinyCausalLM,
    eval_ce_acc,
    markov_tokens,
    noisy_sine_series,
    shift,
    windows,
)


# --------------------------------------------------------------------------------------------
# ---- per-channel normalisation done in place on a view of the loaded array (pycls PR #21)

_MEAN = [120.0 + 3 * i for i in range(10)]
_SD = [40.0 + i for i in range(10)]


def color_norm(im, mean, std):
    """Performs per-channel normalization."""
    for i in range(im.shape[0]):
        im[i] = im[i] - mean[i]
        im[i] = im[i] / std[i]
    return im


class _RawFeatures(Dataset):
    def __init__(self, inputs, labels, copy):
        self._inputs, self._labels, self._copy = inputs, labels, copy

    def __getitem__(self, index):
        if self._copy:
            im, label = self._inputs[index, ...].copy(), self._labels[index]
        else:
            im, label = self._inputs[index, ...], self._labels[index]
        im = color_norm(im, _MEAN, _SD)
        return im, label

    def __len__(self):
        return len(self._labels)


def _inplace_build(copy: bool):
    def build(seed):
        model = mlp(seed)
        x, y = classification(seed)
        raw = (x.numpy() * np.array(_SD, dtype=np.float32)
               + np.array(_MEAN, dtype=np.float32)).astype(np.float32)  # stored unnormalised
        ds = _RawFeatures(raw, y.numpy(), copy)
        loader = DataLoader(ds, batch_size=32, shuffle=True,
                            generator=torch.Generator().manual_seed(seed), num_workers=0)
        return model, torch.optim.SGD(model.parameters(), lr=0.1), {"loader": loader}
    return build


def _epochs_loop(model, opt, ex, steps):
    losses = []
    while len(losses) < steps:
        for x, y in ex["loader"]:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if len(losses) == steps:
                break
    return {"losses": losses}


INPLACE_NORM = Case(
    name="getitem_normalises_stored_array_in_place",
    family="data",
    source="facebookresearch/pycls pull request #21 ('Fixed Cifar10 dataset __getitem__ "
           "transformations modifying loaded data permanently': 'performing data augmentation "
           "in place ... Telling the data loader to only use a single process by setting "
           "DATA_LOADER.NUM_WORKERS=0 causes the model to fail to train after ~3 epochs'; the "
           "fix adds .copy() to self._inputs[index, ...])",
    description="My dataset's __getitem__ normalises self._inputs[index] channel by channel; "
                "with num_workers=0 the model trains for an epoch and then the loss goes back "
                "up to chance and stays there.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and worse(b, f, 1.5),
    build_buggy=_inplace_build(False), loop_buggy=_epochs_loop,
    build_fixed=_inplace_build(True), loop_fixed=_epochs_loop,
    steps=64,
)


# --------------------------------------------------------------------------------------------
# ---- the images divided by 255 in the dataset, then again by Normalize (max_pixel_value=255)

def normalize(img, mean, std, max_pixel_value=255.0):
    mean = torch.tensor(mean) * max_pixel_value
    std = torch.tensor(std) * max_pixel_value
    return (img - mean) * (1.0 / std)


def _pixels(seed):
    x, y = classification(seed)
    return (x * 50 + 128).clamp(0, 255).to(torch.uint8), y


def _double_build(seed):
    model = mlp(seed)
    pixels, y = _pixels(seed)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), {"x": pixels, "y": y}


_PIX_MEAN, _PIX_STD = [0.5] * 10, [0.2] * 10


def _double_loop(divide_in_dataset: bool):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            img, y = batch(ex["x"], ex["y"], i)
            img = img.float()
            if divide_in_dataset:
                img = img / 255  # img = img.astype('float32') / 255 in the Dataset
            img = normalize(img, _PIX_MEAN, _PIX_STD)  # the augmentation pipeline's Normalize
            opt.zero_grad()
            loss = F.cross_entropy(model(img), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return {"losses": losses}
    return loop


DOUBLE_255 = Case(
    name="images_divided_by_255_twice",
    family="data",
    source="4uiiurz1/pytorch-nested-unet issue #62 ('BUG: Unexpected Dual Normalizing from "
           "Dataset Class and Alubmentations normalize': img.astype('float32') / 255 in the "
           "dataset and Normalize with max_pixel_value=255.0, 'The image is divided by 255 "
           "twice before input into the network'); pkmital/pycadl pull request #5 ('The input "
           "image batch was being divided by 255 twice before being fed to the model')",
    description="My dataset divides the images by 255 and the augmentation pipeline's Normalize "
                "does it again; the loss hardly moves from chance.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and worse(b, f, 1.5),
    build_buggy=_double_build, loop_buggy=_double_loop(True),
    build_fixed=_double_build, loop_fixed=_double_loop(False),
    steps=80,
)


# --------------------------------------------------------------------------------------------
# ---- mixup: the images and the labels mixed with two different permutations (VMT issue #1)

def _mixup_build(seed):
    model = mlp(seed)
    x, y = classification(seed, n=512)
    xt, yt = x[:256], y[:256]
    return model, torch.optim.Adam(model.parameters(), lr=0.01), {
        "x": xt, "y": yt, "x_val": x[256:], "y_val": y[256:],
        "gen": torch.Generator().manual_seed(seed + 7), "rng": np.random.default_rng(seed + 7)}


def _mixup_loop(separate: bool):
    def loop(model, opt, ex, steps):
        gen, rng, losses = ex["gen"], ex["rng"], []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i, size=64)
            y1 = F.one_hot(y, 4).float()
            lam = float(rng.beta(1.0, 1.0))
            idx_x = torch.randperm(x.shape[0], generator=gen)
            idx_y = torch.randperm(x.shape[0], generator=gen) if separate else idx_x
            x_mix = lam * x + (1 - lam) * x[idx_x]
            y_mix = lam * y1 + (1 - lam) * y1[idx_y]
            opt.zero_grad()
            loss = -(y_mix * F.log_softmax(model(x_mix), 1)).sum(1).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        val_ce, val_acc = eval_ce_acc(model, ex["x_val"], ex["y_val"])
        return {"losses": losses, "val_ce": val_ce, "val_acc": val_acc}
    return loop


MIXUP = Case(
    name="mixup_labels_permuted_separately",
    family="data",
    source="xudonmao/VMT issue #1 ('Mixup returns different combinations for labels and "
           "images': 'the use of 2 separate random_shuffle calls will return a different "
           "combination of images and labels'; after the fix 'the performance of VMT can be "
           "further improved')",
    description="My mixup shuffles the batch once for the images and once more for the "
                "labels; it trains, but on held-out data the loss is about twice and the "
                "accuracy below what a run without the bug gets.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (trains(f, 0.3) and b["val_ce"] >= 1.5 * f["val_ce"]
                           and b["val_acc"] <= f["val_acc"] - 0.03),
    build_buggy=_mixup_build, loop_buggy=_mixup_loop(True),
    build_fixed=_mixup_build, loop_fixed=_mixup_loop(False),
    steps=80,
)


# --------------------------------------------------------------------------------------------
# ---- class ids remapped in place through an alias of the label tensor (PCEDA issue #5)

_ORDERING = torch.tensor([1, 0, 3, 2])


def random_permute(label, ordering, clone):
    label2 = label.clone() if clone else label
    for i in range(len(ordering)):
        label2[label == i] = ordering[i]
    return label2


def _remap_build(seed):
    model = mlp(seed)
    x, y = classification(seed)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), {"x": x, "y": y}


def _remap_loop(clone: bool):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            y = random_permute(y, _ORDERING, clone)  # the head's class order
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        _, acc = eval_ce_acc(model, ex["x"], _ORDERING[ex["y"]])
        return {"losses": losses, "accuracy": acc}
    return loop


REMAP = Case(
    name="label_remap_through_alias",
    family="data",
    source="donglao/PCEDA issue #5 ('bug on random_permute': 'label2 just referencing label, so "
           "by changing label with the following for loop can make unintentional labels'; fix "
           "label2 = label.clone())",
    description="I map the class ids onto another order with label2 = label and a loop of "
                "label2[label == i] = ordering[i]; training runs, but the accuracy against the "
                "remapped classes stays near one half.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and b["accuracy"] <= f["accuracy"] - 0.25,
    build_buggy=_remap_build, loop_buggy=_remap_loop(False),
    build_fixed=_remap_build, loop_fixed=_remap_loop(True),
    steps=60,
)


# --------------------------------------------------------------------------------------------
# ---- a forecasting target shifted the wrong way: the model 'predicts' a value it is shown

_K = 6


def _forecast_build(periods: int):
    def build(seed):
        torch.manual_seed(seed)
        series = noisy_sine_series(seed)
        x, y = windows(series, shift(series, periods), _K)          # what it trains on
        x_true, y_true = windows(series, shift(series, -1), _K)     # the next value
        model = torch.nn.Sequential(torch.nn.Linear(_K, 32), torch.nn.Tanh(),
                                    torch.nn.Linear(32, 1))
        return model, torch.optim.Adam(model.parameters(), lr=0.01), {
            "x": x, "y": y, "x_true": x_true, "y_true": y_true}
    return build


def _forecast_loop(model, opt, ex, steps):
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        forecast = F.mse_loss(model(ex["x_true"]), ex["y_true"]).item()
    return {"losses": losses, "forecast_mse": forecast}


FORECAST = Case(
    name="forecast_target_shifted_into_past",
    family="data",
    source="KIC/pandas-ml-quant issue #25 ('Target variable is shifted in the wrong direction "
           "(example notebook)': 'you shift a target variable forward. That means you predict "
           "previous, not future, values ... making prediction as simple as just repeating "
           "one of the inputs')",
    description="I build the target with shift(1) over windows of past values; the training "
                "loss gets very low, but the forecasts of the next value are poor.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (trains(f, 0.4) and trains(b, 0.4)
                           and b["forecast_mse"] >= 3.0 * f["forecast_mse"]),
    build_buggy=_forecast_build(1), loop_buggy=_forecast_loop,
    build_fixed=_forecast_build(-1), loop_fixed=_forecast_loop,
    steps=80,
)


# --------------------------------------------------------------------------------------------
# ---- causal LM labels shifted in the collator, then again inside the model

def _lm_build(seed):
    torch.manual_seed(seed)
    model = TinyCausalLM()
    seqs = markov_tokens(seed)
    held = markov_tokens(seed, draw=1)
    return model, torch.optim.Adam(model.parameters(), lr=0.02), {"seqs": seqs, "held": held}


def _collate(seqs, pre_shift):
    if pre_shift:
        return {"input_ids": seqs[:, :-1], "labels": seqs[:, 1:]}
    return {"input_ids": seqs, "labels": seqs.clone()}


def _lm_loop(pre_shift: bool):
    def loop(model, opt, ex, steps):
        losses = []
        n = ex["seqs"].shape[0]
        for i in range(steps):
            idx = torch.arange(i * 16, i * 16 + 16) % n
            b = _collate(ex["seqs"][idx], pre_shift)
            opt.zero_grad()
            _, loss = model(**b)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            logits, _ = model(ex["held"])
            pred, nxt = logits[:, :-1].argmax(-1), ex["held"][:, 1:]
            acc = (pred == nxt).float().mean().item()
        return {"losses": losses, "next_token_acc": acc}
    return loop


LM_SHIFT = Case(
    name="causal_lm_labels_shifted_twice",
    family="data",
    source="huggingface/transformers pull request #562 ('remove the one shifting of lm labels "
           "since this shift happens internally during the model's forward pass') and pull "
           "request #44642 ('users who pre-shift their labels and end up training "
           "next-next-token prediction by accident'); GanjinZero/RRHF issue #49 ('you manually "
           "shifted the labels in the data collator')",
    description="My collator passes labels = input_ids shifted by one, and the model shifts "
                "them again; the loss goes down, but the model predicts the token after next.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (trains(f, 0.3) and trains(b, 0.2)
                           and b["next_token_acc"] <= f["next_token_acc"] - 0.4),
    build_buggy=_lm_build, loop_buggy=_lm_loop(True),
    build_fixed=_lm_build, loop_fixed=_lm_loop(False),
    steps=60,
)


CASES = [INPLACE_NORM, DOUBLE_255, MIXUP, REMAP, FORECAST, LM_SHIFT]
