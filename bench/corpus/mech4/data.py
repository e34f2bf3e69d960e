"""The fourth corpus's cases of the mechanism 'data' (bench/corpus/mechanisms.py): the data
path (augmentation, labels, class maps, normalisation, input layout) of real reports, mined
by worker e."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn
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
from .._m4_e import (
    accuracy_of,
    epoch_loop,
    local_sum,
    sgd_step,
    strips,
    to_pixels,
)


def _loader(ds, seed, size=32):
    return DataLoader(ds, batch_size=size, shuffle=True,
                      generator=torch.Generator().manual_seed(seed), num_workers=0)


# --------------------------------------------------------------------------------------------
# ---- segmentation: the same random flip object applied to the image and to the mask
#      separately, each call drawing its own coin (MONAI issue #1102)

class RandFlip:
    """Flip along the strip with probability ``prob`` (draws its coin at each call)."""

    def __init__(self, prob, gen):
        self.prob, self.gen = prob, gen

    def __call__(self, t):
        if torch.rand(1, generator=self.gen).item() < self.prob:
            return t.flip(-1)
        return t


class _SegDataset(Dataset):
    def __init__(self, img, seg, img_transform, seg_transform, joint_transform=None):
        self.img, self.seg = img, seg
        self.img_transform, self.seg_transform = img_transform, seg_transform
        self.joint_transform = joint_transform

    def __len__(self):
        return self.img.shape[0]

    def __getitem__(self, index):
        img, seg = self.img[index], self.seg[index]
        if self.joint_transform is not None:
            both = self.joint_transform(torch.stack([img, seg]))  # one coin for the pair
            return both[0], both[1]
        return self.img_transform(img), self.seg_transform(seg)


def _flip_build(joint: bool):
    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
        img = strips(seed)
        seg = (local_sum(img) > 0).float()
        gen = torch.Generator().manual_seed(seed + 11)
        transforms_train = RandFlip(prob=0.5, gen=gen)
        if joint:
            ds = _SegDataset(img, seg, None, None, joint_transform=transforms_train)
        else:
            ds = _SegDataset(img, seg, img_transform=transforms_train,
                             seg_transform=transforms_train)
        test = strips(seed + 50)
        return model, torch.optim.Adam(model.parameters(), lr=0.01), {
            "loader": _loader(ds, seed), "x_test": test,
            "y_test": (local_sum(test) > 0).float()}
    return build


def _flip_loop(model, opt, ex, steps):
    step = sgd_step(model, opt, lambda m, b: F.binary_cross_entropy_with_logits(m(b[0]), b[1]))
    losses = epoch_loop(step, ex["loader"], steps)
    with torch.no_grad():
        pix_acc = ((model(ex["x_test"]) > 0).float() == ex["y_test"]).float().mean().item()
    return {"losses": losses, "pix_acc": pix_acc}


SEG_FLIP = Case(
    name="segmentation_flip_drawn_separately_for_mask",
    family="data",
    source="Project-MONAI/MONAI issue #1102 ('Different randomized transforms applied to image "
           "and segmentation in ArrayDataset': the same RandRotate Compose passed as "
           "img_transform and seg_transform, 'The image will be rotated at a different angle "
           "when compared to the segmentation'); albumentations-team/albumentations issue "
           "#1056 ('Applying the same random transformation on the images and on the masks "
           "for segmentation task': 'the images and masks don't match')",
    description="I pass my random flip transform both as the image transform and as the mask "
                "transform; the segmentation loss plateaus high and the predicted masks are "
                "blurry mirror images of the truth.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (trains(f, 0.4) and f["pix_acc"] >= 0.85
                           and b["pix_acc"] <= f["pix_acc"] - 0.1),
    build_buggy=_flip_build(False), loop_buggy=_flip_loop,
    build_fixed=_flip_build(True), loop_fixed=_flip_loop,
    steps=60,
)


# --------------------------------------------------------------------------------------------
# ---- class folders listed with os.listdir, whose order differs between the train and the
#      test directory (rpg_event_representation_learning issue #2)

_CLASSES = ("cat", "dog", "fox", "owl")
# the order each directory returns its entries in (os.listdir: arbitrary, e.g. creation order)
_DIR_ORDER = {"train": ("cat", "dog", "fox", "owl"), "test": ("dog", "owl", "cat", "fox")}


# note: os.listdir's order is simulated by a fixed per-directory order (no files are written);
# the test folder's order has no class at its sorted place, so the buggy test accuracy is ~0.
def _listdir(root):
    return list(_DIR_ORDER[root])


class _FolderDataset(Dataset):
    def __init__(self, root, files, sort):
        self.classes = sorted(_listdir(root)) if sort else _listdir(root)
        self.samples = [(x, self.classes.index(name)) for name in self.classes
                        for x in files[root][name]]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.samples[index]


def _folders(seed):
    """The files of each split, stored by class folder name."""
    x, y = classification(seed, n=512)
    files = {}
    for split, part in (("train", slice(0, 256)), ("test", slice(256, 512))):
        xs, ys = x[part], y[part]
        files[split] = {name: list(xs[ys == k]) for k, name in enumerate(_CLASSES)}
    return files


def _folder_build(sort: bool):
    def build(seed):
        model = mlp(seed)
        files = _folders(seed)
        train, test = _FolderDataset("train", files, sort), _FolderDataset("test", files, sort)
        xt = torch.stack([s[0] for s in test.samples])
        yt = torch.tensor([s[1] for s in test.samples])
        return model, torch.optim.Adam(model.parameters(), lr=0.01), {
            "loader": _loader(train, seed), "x_test": xt, "y_test": yt}
    return build


def _folder_loop(model, opt, ex, steps):
    step = sgd_step(model, opt, lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    losses = epoch_loop(step, ex["loader"], steps)
    return {"losses": losses, "test_acc": accuracy_of(model, ex["x_test"], ex["y_test"])}


FOLDER_ORDER = Case(
    name="class_folders_listed_unsorted_per_split",
    family="data",
    source="uzh-rpg/rpg_event_representation_learning issue #2 ('Validation accuracy lower "
           "than expected.': 'the train/test label mapping are inconsistent', fixed with "
           "self.classes = sorted(listdir(root))); ultralytics/ultralytics issue #13936 "
           "('Matching tag on classify validation': 'the classes weren't managed by the name "
           "of the folders containing the images, but by their order')",
    description="My dataset takes its class list from listdir(root) for the train and the test "
                "folder; training converges but test accuracy stays near zero.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (trains(f, 0.4) and f["test_acc"] >= 0.8
                           and b["test_acc"] <= f["test_acc"] - 0.5),
    build_buggy=_folder_build(False), loop_buggy=_folder_loop,
    build_fixed=_folder_build(True), loop_fixed=_folder_loop,
    steps=60,
)


# --------------------------------------------------------------------------------------------
# ---- the dataset's preprocess divides every array whose max is over 1 by 255, the masks
#      included; the class-index masks then become all zero as long (Pytorch-UNet issue #228)

_N_CLASSES = 3


class _BasicDataset(Dataset):
    def __init__(self, imgs, masks, mask_aware):
        self.imgs, self.masks, self.mask_aware = imgs, masks, mask_aware

    @classmethod
    def preprocess(cls, arr, is_mask=False, mask_aware=False):
        arr = arr.astype(np.float64)
        if mask_aware and is_mask:
            return arr
        if arr.max() > 1:
            arr = arr / 255
        return arr

    def __len__(self):
        return len(self.imgs)

    def __getitem__(self, i):
        img = self.preprocess(self.imgs[i], mask_aware=self.mask_aware)
        mask = self.preprocess(self.masks[i], is_mask=True, mask_aware=self.mask_aware)
        return {"image": torch.from_numpy(img).float(), "mask": torch.from_numpy(mask)}


def _mask_classes(x):
    s = local_sum(x)
    return (s > -0.8).long() + (s > 0.8).long()  # 0, 1, 2: about a third each


def _mask_build(mask_aware: bool):
    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16 * _N_CLASSES))
        x = strips(seed)
        imgs = to_pixels(x, 80.0)
        masks = _mask_classes(x).numpy().astype(np.uint8)  # the label PNGs: 0..2 per pixel
        ds = _BasicDataset(imgs, masks, mask_aware)
        xt = strips(seed + 50)
        return model, torch.optim.Adam(model.parameters(), lr=0.02), {
            "loader": _loader(ds, seed),
            "x_test": torch.from_numpy(to_pixels(xt, 80.0).astype(np.float32) / 255),
            "y_test": _mask_classes(xt)}
    return build


def _mask_loss(model, b):
    imgs = b["image"].to(dtype=torch.float32)
    true_masks = b["mask"].to(dtype=torch.long)  # mask_type = torch.long for n_classes > 1
    masks_pred = model(imgs).view(imgs.shape[0], _N_CLASSES, -1)
    return F.cross_entropy(masks_pred, true_masks)


def _mask_loop(model, opt, ex, steps):
    losses = epoch_loop(sgd_step(model, opt, _mask_loss), ex["loader"], steps)
    acc = accuracy_of(model, ex["x_test"], ex["y_test"], shape=(_N_CLASSES, 16))
    return {"losses": losses, "pix_acc": acc}


MASK_255 = Case(
    name="class_index_masks_scaled_by_255",
    family="data",
    source="milesial/Pytorch-UNet issue #228 ('My imput mask is 0': 'If your masks include "
           "values over 1, which they do, the masks also get normalized and rounded to "
           "zero'); HasnainRaz/FC-DenseNet-TensorFlow issue #17 ('my mask's each pixel is an "
           "index in [0,classnumber] if mask/255 they will all be 0 (class:background)')",
    description="My masks hold class indices 0..2; the training loss drops to almost zero at "
                "once, yet the model predicts background everywhere.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (trains(f, 0.3) and f["pix_acc"] >= 0.6
                           and b["pix_acc"] <= f["pix_acc"] - 0.25),
    build_buggy=_mask_build(False), loop_buggy=_mask_loop,
    build_fixed=_mask_build(True), loop_fixed=_mask_loop,
    steps=80,
)


# --------------------------------------------------------------------------------------------
# ---- (batch, seq, feature) batches fed to an nn.LSTM built without batch_first=True
#      (yunjey/pytorch-tutorial issue #196)

# note: filed under 'data' as an input-layout mistake (the loader's batch-major tensors meet a
# seq-major module), like the corpus's view-instead-of-permute case; it could be read as 'graph'.
class Rnn(nn.Module):
    def __init__(self, in_dim, hidden_dim, n_layer, n_class, batch_first):
        super().__init__()
        self.lstm = nn.LSTM(in_dim, hidden_dim, n_layer, batch_first=batch_first)
        self.classifier = nn.Linear(hidden_dim, n_class)

    def forward(self, x):
        out, _ = self.lstm(x)
        out = out[:, -1, :]
        return self.classifier(out)


def _seq_data(seed, n=256, steps=8, feat=4, n_class=4):
    gen = torch.Generator().manual_seed(seed + 9000)
    x = torch.randn(n, steps, feat, generator=gen)
    w = torch.randn(feat, n_class, generator=gen)
    return x, (x.sum(1) @ w).argmax(1)


def _lstm_build(batch_first: bool):
    def build(seed):
        torch.manual_seed(seed)
        model = Rnn(4, 32, 1, 4, batch_first)
        x, y = _seq_data(seed)
        return model, torch.optim.Adam(model.parameters(), lr=0.01), {"x": x, "y": y}
    return build


def _lstm_loop(model, opt, ex, steps):
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)  # x: [batch, seq, feature]
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses}


LSTM_LAYOUT = Case(
    name="lstm_batch_major_input_without_batch_first",
    family="data",
    source="yunjey/pytorch-tutorial issue #196 ('LSTM question': with batch_first=True changed "
           "to False 'both loss(about 2) and accuracy(about 11.35%) is not good'); "
           "pytorch/pytorch issue #1538 ('different result on LSTM whether using "
           "batch_first'); Cadene/vqa.pytorch issue #40 ('it seems to me that we are feeding "
           "inputs with shape (batch, seq_len, input_size)')",
    description="My loader yields (batch, seq, feature) tensors and my nn.LSTM is built "
                "without batch_first; nothing complains, but the loss stays near chance.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: trains(f, 0.4) and worse(b, f, 1.5),
    build_buggy=_lstm_build(False), loop_buggy=_lstm_loop,
    build_fixed=_lstm_build(True), loop_fixed=_lstm_loop,
    steps=60,
)


# --------------------------------------------------------------------------------------------
# ---- Gaussian-noise augmentation added to the uint8 pixels in uint8: the sum wraps around at
#      0 and 255, and the np.clip after it cannot undo that (tree-ring-watermark issue #11)

class _NoisyPixels(Dataset):
    def __init__(self, pixels, labels, std, in_uint8, seed):
        self.pixels, self.labels, self.std, self.in_uint8 = pixels, labels, std, in_uint8
        self.rng = np.random.default_rng(seed + 13)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        img = self.pixels[i]
        g_noise = self.rng.normal(0, self.std, img.shape) * 255
        if self.in_uint8:
            # g_noise.astype(np.uint8) in the report (its float cast wraps the same way)
            # note: cast through int64 so the wrap is defined; a float->uint8 cast of a
            # negative value is platform-dependent in numpy
            g_noise = g_noise.astype(np.int64).astype(np.uint8)
            img = np.clip(img + g_noise, 0, 255)
        else:
            img = np.clip(img.astype(np.float32) + g_noise, 0, 255)
        x = (img.astype(np.float32) - 128.0) / 64.0
        return torch.from_numpy(x), self.labels[i]


def _noise_build(in_uint8: bool):
    def build(seed):
        model = mlp(seed)
        x, y = classification(seed, n=512)
        pixels = to_pixels(x[:256], 64.0)
        ds = _NoisyPixels(pixels, y[:256], 0.1, in_uint8, seed)
        xt = (torch.from_numpy(to_pixels(x[256:], 64.0).astype(np.float32)) - 128.0) / 64.0
        return model, torch.optim.Adam(model.parameters(), lr=0.01), {
            "loader": _loader(ds, seed), "x_test": xt, "y_test": y[256:]}
    return build


def _noise_loop(model, opt, ex, steps):
    step = sgd_step(model, opt, lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    losses = epoch_loop(step, ex["loader"], steps)
    with torch.no_grad():
        test_ce = F.cross_entropy(model(ex["x_test"]), ex["y_test"]).item()
    return {"losses": losses, "test_ce": test_ce,
            "test_acc": accuracy_of(model, ex["x_test"], ex["y_test"])}


UINT8_NOISE = Case(
    name="noise_augmentation_wraps_in_uint8",
    family="data",
    source="YuxinWenRick/tree-ring-watermark issue #11 ('errors in image_distortion?': 'type of "
           "g_noise and np.array(img1) is already np.uint8, so np.clip won't have any "
           "effect ... it might cause overflow/underflow when adding noise'); "
           "tensorpack/tensorpack issue #614 ('imgaug.Saturation': 'I think it's a uint8 "
           "overflow'); keras-team/keras-preprocessing issue #170 ('Channel shift "
           "transformation commits overflow if images are uint8')",
    description="I add Gaussian noise to my uint8 images as augmentation and clip to [0, 255]; "
                "some training images come out with bright pixels turned black, and the "
                "model does worse than without the augmentation.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (trains(f, 0.4) and b["test_ce"] >= 1.3 * f["test_ce"]),
    build_buggy=_noise_build(True), loop_buggy=_noise_loop,
    build_fixed=_noise_build(False), loop_fixed=_noise_loop,
    steps=80,
)


# --------------------------------------------------------------------------------------------
# ---- z-scoring multichannel readings along axis=1 (each sample across its channels) instead
#      of per channel: the common level of a sample, which carries the label, is erased
#      (thedatumorg/TSB-AD pull request #79)

def zscore(a, axis=0, ddof=0):
    mn = a.mean(axis=axis, keepdims=True)
    sd = a.std(axis=axis, ddof=ddof, keepdims=True)
    return (a - mn) / sd


def _readings(seed, n):
    gen = np.random.default_rng(seed + 9500)
    level = gen.normal(0.0, 1.5, (n, 1))
    pattern = gen.normal(0.0, 1.0, (n, 10))
    raw = 20.0 + 5.0 * (level + pattern)  # sensor units
    y = 2 * (level[:, 0] > 0) + (pattern[:, 0] > pattern[:, 1])
    return raw.astype(np.float32), torch.from_numpy(y.astype(np.int64))


def _zscore_build(axis: int):
    def build(seed):
        model = mlp(seed)
        raw, y = _readings(seed, 512)
        train, test = raw[:256], raw[256:]
        if axis == 1:
            x_tr, x_te = zscore(train, axis=1), zscore(test, axis=1)
        else:  # per channel, with the training set's statistics
            mn, sd = train.mean(0, keepdims=True), train.std(0, keepdims=True)
            x_tr, x_te = (train - mn) / sd, (test - mn) / sd
        return model, torch.optim.Adam(model.parameters(), lr=0.01), {
            "x": torch.from_numpy(x_tr), "y": y[:256],
            "x_test": torch.from_numpy(x_te), "y_test": y[256:]}
    return build


def _zscore_loop(model, opt, ex, steps):
    losses = []
    for i in range(steps):
        x, y = batch(ex["x"], ex["y"], i)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "test_acc": accuracy_of(model, ex["x_test"], ex["y_test"])}


ZSCORE_AXIS = Case(
    name="zscore_per_sample_across_channels",
    family="data",
    source="thedatumorg/TSB-AD pull request #79 ('Fix multivariate normalization in ML "
           "detectors': 'zscore(X, axis=1) standardized each timestep across channels "
           "(erasing amplitude)'; fixed with per-channel normalization, axis=0)",
    description="I standardise my multichannel readings with zscore(X, axis=1); the model "
                "trains but tops out near half accuracy, as if the overall level of a reading "
                "did not exist.",
    expected_kinds=(),
    params=(),
    manifest=lambda b, f: (trains(f, 0.4) and f["test_acc"] >= 0.8
                           and b["test_acc"] <= f["test_acc"] - 0.2),
    build_buggy=_zscore_build(1), loop_buggy=_zscore_loop,
    build_fixed=_zscore_build(0), loop_fixed=_zscore_loop,
    steps=80,
)


CASES = [SEG_FLIP, FOLDER_ORDER, MASK_255, LSTM_LAYOUT, UINT8_NOISE, ZSCORE_AXIS]
