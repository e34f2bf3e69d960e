"""The second corpus, held-out half, mechanism 'loss': do not read while writing detection code."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .._common import (
    Case,
    batch,
    classification,
    mlp,
    tail,
    trains,
)


# --- CosineEmbeddingLoss with 0 instead of -1 for dissimilar pairs
def _pairs(seed):
    x, y = classification(seed)
    gen = torch.Generator().manual_seed(seed + 5000)
    j = torch.randperm(x.shape[0], generator=gen)
    same = (y == y[j]).float()
    return torch.cat([x, x[j]], 1), same


class _Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 8))

    def forward(self, pair):
        return self.enc(pair[:, :10]), self.enc(pair[:, 10:])


def _siam_build(seed):
    torch.manual_seed(seed)
    model = _Siamese()
    x, y = _pairs(seed)
    return model, torch.optim.SGD(model.parameters(), lr=0.2), {"x": x, "y": y}


def _siam_loop(negative_label: float):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, same = batch(ex["x"], ex["y"], i)
            target = torch.where(same > 0, torch.ones_like(same), torch.full_like(same, negative_label))
            opt.zero_grad()
            a, b = model(x)
            loss = F.cosine_embedding_loss(a, b, target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            a, b = model(ex["x"])
            cos = F.cosine_similarity(a, b)
        same = ex["y"] > 0
        acc = ((cos > 0.5) == same).float().mean().item()
        return {"losses": losses, "neg_cos": cos[~same].mean().item(), "pair_acc": acc}
    return loop


COSINE_ZERO = Case(
    name="cosine_embedding_loss_zero_negative_label",
    family="loss",
    source="pytorch/pytorch issue #49917 (CosineEmbeddingLoss 'doesn't check the range of "
           "target at all': only target == 1 and target == -1 contribute); huggingface/setfit "
           "issue #254 (negative pairs labelled 0 where the cosine loss expects -1)",
    description="My siamese encoder maps every input to nearly the same direction; my pair "
                "labels are 1 (same) and 0 (different), passed to CosineEmbeddingLoss.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: b["neg_cos"] >= f["neg_cos"] + 0.3 and b["pair_acc"] <= f["pair_acc"] - 0.1,
    build_buggy=_siam_build, loop_buggy=_siam_loop(0.0),
    build_fixed=_siam_build, loop_fixed=_siam_loop(-1.0),
    steps=60,
)


# --- kl_div given probabilities instead of log-probabilities (distillation)
def _distill_build(seed):
    model = mlp(seed)
    x, _ = classification(seed)
    gen = torch.Generator().manual_seed(seed + 6000)
    w = torch.randn(10, 4, generator=gen)
    teacher = F.softmax(x @ w * 0.5, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.2), {"x": x, "y": teacher}


def _distill_loop(log_input: bool):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, t = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            out = model(x)
            inp = F.log_softmax(out, 1) if log_input else F.softmax(out, 1)
            loss = F.kl_div(inp, t, reduction="batchmean")
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            true_kl = F.kl_div(F.log_softmax(model(ex["x"]), 1), ex["y"], reduction="batchmean").item()
        return {"losses": losses, "true_kl": true_kl}
    return loop


KL_PROBS = Case(
    name="kl_div_student_probabilities",
    family="loss",
    source="microsoft/ProDA issues #43, #20 (F.kl_div(student, teacher) with student = "
           "F.softmax(...): 'should be log_softmax', acknowledged as a bug); AberHu/"
           "Knowledge-Distillation-Zoo issue #12 (with softmax instead of log_softmax 'the KD "
           "output is negative')",
    description="My distillation loss is negative and keeps falling, but the student does not "
                "match the teacher's soft labels; I pass softmax outputs to F.kl_div as input.",
    expected_kinds=("loss_pattern",),
    params=(),
    manifest=lambda b, f: b["true_kl"] >= 1.5 * f["true_kl"] and trains(f, 0.3) and tail(b["losses"]) < 0,
    build_buggy=_distill_build, loop_buggy=_distill_loop(False),
    build_fixed=_distill_build, loop_fixed=_distill_loop(True),
    steps=60,
)


# --- BCE targets in [-1, 1] after a mask augmentation
def _binary(seed):
    x, y = classification(seed, c=2)
    return x, y.float()[:, None]


def _bce_build(seed):
    model = mlp(seed, d_out=1)
    x, y = _binary(seed)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), {"x": x, "y": y}


def _bce_loop(signed: bool):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            if signed:
                y = y * 2 - 1  # the mask normalised like the images, to [-1, 1]
            opt.zero_grad()
            loss = F.binary_cross_entropy_with_logits(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            acc = ((model(ex["x"]) > 0).float() == ex["y"]).float().mean().item()
        return {"losses": losses, "accuracy": acc}
    return loop


BCE_SIGNED = Case(
    name="bce_targets_minus_one_to_one",
    family="loss",
    source="bigmb/Unet-Segmentation-Pytorch-Nest-of-Unets issue #18 ('negative number occur in "
           "Loss': the augmentation turned the mask's values to [-1, 1], 'bce's target should "
           "be [0, 1]'); milesial/Pytorch-UNet issue #65 (negative loss; the targets must be "
           "between 0 and 1)",
    description="My BCEWithLogitsLoss becomes negative and keeps decreasing while the masks "
                "get worse; my target masks went through the same normalisation as the images "
                "and lie in [-1, 1].",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (tail(b["losses"]) < 0 and b["accuracy"] <= f["accuracy"] - 0.1
                           and trains(f, 0.3)),
    build_buggy=_bce_build, loop_buggy=_bce_loop(True),
    build_fixed=_bce_build, loop_fixed=_bce_loop(False),
    steps=60,
)


# --- focal loss with alpha applied to both classes
def _rare(seed):
    x, y = classification(seed, c=2, prior=(4.0, 0.0))
    return x, y.float()[:, None]


def _focal_build(seed):
    model = mlp(seed, d_out=1)
    x, y = _rare(seed)
    return model, torch.optim.SGD(model.parameters(), lr=0.3), {"x": x, "y": y}


def _focal(logits, y, alpha, gamma, both):
    p = torch.sigmoid(logits)
    ce = F.binary_cross_entropy_with_logits(logits, y, reduction="none")
    pt = torch.where(y > 0, p, 1 - p)
    w = alpha if both else torch.where(y > 0, torch.full_like(y, alpha), torch.full_like(y, 1 - alpha))
    return (w * (1 - pt) ** gamma * ce).mean()


def _focal_loop(both: bool):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = _focal(model(x), y, 0.9, 2.0, both)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            pred = (model(ex["x"]) > 0).float()
        pos = ex["y"] > 0
        recall = (pred[pos] == 1).float().mean().item()
        return {"losses": losses, "recall": recall, "pos_rate": pos.float().mean().item()}
    return loop


FOCAL_ALPHA = Case(
    name="focal_loss_alpha_on_both_classes",
    family="loss",
    source="mkocabas/focal-loss-keras issue #6 ('alpha is the same for both classes; so "
           "effectively does nothing'); qubvel/segmentation_models issue #187 / pull request "
           "#259; kornia/kornia issue #875; liuyuisanai/Focal-Loss issue #4",
    description="On my imbalanced data the rare class is still mostly missed although my focal "
                "loss has alpha=0.9; the alpha factor multiplies the positive and the negative "
                "terms alike.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: b["recall"] <= f["recall"] - 0.1 and f["recall"] >= 0.8,
    build_buggy=_focal_build, loop_buggy=_focal_loop(True),
    build_fixed=_focal_build, loop_fixed=_focal_loop(False),
    steps=60,
)


# --- ignore_index set to an id that is also a real class
def _ign_build(seed):
    model = mlp(seed)
    x, y = classification(seed)
    return model, torch.optim.SGD(model.parameters(), lr=0.2), {"x": x, "y": y}


def _ign_loop(ignore_index: int):
    def loop(model, opt, ex, steps):
        losses = []
        for i in range(steps):
            x, y = batch(ex["x"], ex["y"], i)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y, ignore_index=ignore_index)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            pred = model(ex["x"]).argmax(1)
        zero = ex["y"] == 0
        return {"losses": losses, "recall0": (pred[zero] == 0).float().mean().item()}
    return loop


IGNORE_REAL = Case(
    name="ignore_index_equals_real_class",
    family="loss",
    source="lucidrains/DALLE-pytorch issue #57 (ignore_index set to the pad id 0: 'We would "
           "ignore also the VQVAE codebook with id of 0'); pytorch/pytorch issue #63004 "
           "(ignore_index given a valid class index)",
    description="My classifier never predicts class 0; I set ignore_index=0 to skip padding, "
                "but 0 is also a real label in my data.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: b["recall0"] <= 0.2 and f["recall0"] >= 0.5,
    build_buggy=_ign_build, loop_buggy=_ign_loop(0),
    build_fixed=_ign_build, loop_fixed=_ign_loop(-100),
    steps=60,
)


# --- InfoNCE with all-zero labels while the positives sit on the diagonal
def _views_build(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 8))
    x, _ = classification(seed)
    g = torch.Generator().manual_seed(seed + 16)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), {"x": x, "y": x, "g": g}


def _nce_loop(diagonal_labels: bool):
    def loop(model, opt, ex, steps):
        g, losses = ex["g"], []
        for i in range(steps):
            x, _ = batch(ex["x"], ex["y"], i)
            v1 = x + 0.5 * torch.randn(x.shape, generator=g)
            v2 = x + 0.5 * torch.randn(x.shape, generator=g)
            a, b = F.normalize(model(v1), dim=1), F.normalize(model(v2), dim=1)
            logits = a @ b.t() / 0.2  # the positive of row i is column i
            n = logits.shape[0]
            labels = torch.arange(n) if diagonal_labels else torch.zeros(n, dtype=torch.long)
            opt.zero_grad()
            loss = F.cross_entropy(logits, labels)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            x = ex["x"][:64]
            a = F.normalize(model(x + 0.5 * torch.randn(x.shape, generator=g)), dim=1)
            b = F.normalize(model(x + 0.5 * torch.randn(x.shape, generator=g)), dim=1)
            top1 = ((a @ b.t()).argmax(1) == torch.arange(x.shape[0])).float().mean().item()
            sim = a @ b.t()
            off = (sim.sum() - sim.diag().sum()) / (64 * 63)
        return {"losses": losses, "top1": top1, "off_cos": off.item()}
    return loop


NCE_ZEROS = Case(
    name="info_nce_zero_labels_diagonal_positives",
    family="loss",
    source="YihengZhang-CV/SeCo-Sequence-Contrastive-Learning issue #3 ('InfoNCE implementation "
           "bug': with all-zero ground truth the loss 'is simply learning that everything is a "
           "negative sample'); wangyuxinwhy/uniem issue #99 and amazon-science/"
           "video-contrastive-learning issue #5 (zeros are right only when the positive sits in "
           "column 0, otherwise torch.arange)",
    description="My contrastive encoder cannot retrieve the other view of an image; my "
                "similarity matrix has the positives on the diagonal but I copied labels = "
                "torch.zeros(N) from a MoCo-style loss.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: b["off_cos"] >= f["off_cos"] + 0.4 and b["top1"] <= f["top1"] - 0.1,
    build_buggy=_views_build, loop_buggy=_nce_loop(False),
    build_fixed=_views_build, loop_fixed=_nce_loop(True),
    steps=60,
)


CASES = [COSINE_ZERO, KL_PROBS, BCE_SIGNED, FOCAL_ALPHA, IGNORE_REAL, NCE_ZEROS]
