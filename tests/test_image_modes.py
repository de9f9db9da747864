"""Every Pillow image mode decodes to float32 [0, 1] by its real range (docs/data.md, "Pixel
values per image mode"), at 1 or 3 channels, through the one decoder training and serving share."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from PIL import Image

from ttc.inputs.preprocess import decode_image_file

LUMA = np.array([0.299, 0.587, 0.114])  # ITU-R 601-2, what Pillow's convert("L") uses


def _row(values, dtype) -> np.ndarray:
    return np.array([values], dtype=dtype)


def _gray8(mode: str) -> Callable:
    def build(values):
        return Image.fromarray(_row(values, np.uint8)).convert(mode)
    return build


def _rgb8(mode: str) -> Callable:
    def build(colors):
        img = Image.fromarray(_row(colors, np.uint8), "CMYK" if mode == "CMYK" else "RGB")
        return img if mode in ("RGB", "CMYK") else img.convert(mode)
    return build


def _palette(colors):
    img = Image.new("P", (len(colors), 1))
    img.putpalette([c for color in colors for c in color])
    img.putdata(list(range(len(colors))))
    return img


def _gray_alpha(values):
    gray = Image.fromarray(_row(values, np.uint8))
    return Image.merge("LA", (gray, Image.new("L", gray.size, 128)))


def _uint16(values):
    return Image.fromarray(_row(values, np.uint16))  # mode I;16


def _uint16_big_endian(values):
    return Image.frombytes("I;16B", (len(values), 1), _row(values, ">u2").tobytes())


def _int32(values):
    return Image.fromarray(_row(values, np.int32))  # mode I


def _float(values):
    return Image.fromarray(_row(values, np.float32))  # mode F


@dataclass
class Case:
    mode: str          # the mode Pillow must report when it opens the saved file
    suffix: str
    build: Callable    # pixels → a one-row PIL image
    pixels: list
    rgb: list          # expected [0, 1] colour of each pixel at 3 channels

    @property
    def id(self) -> str:
        return f"{self.mode}-{self.suffix}"


def _gray(values: list, full_scale: float) -> list:
    """Expected colours of gray values: value / full scale, clipped to [0, 1], NaN as 0."""
    return [[0.0 if v != v else min(max(v / full_scale, 0.0), 1.0)] * 3 for v in values]


def _can_write(image_format: str) -> bool:
    Image.init()  # Pillow registers its writers lazily
    return image_format in Image.SAVE


COLORS = [(0, 0, 0), (255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255), (40, 90, 200)]
SCALED_COLORS = [[c / 255 for c in color] for color in COLORS]
BYTES = [0, 1, 64, 128, 255]
WORDS = [0, 257, 300, 32768, 65535]
INT32 = [0, 255, 65535, 2**30, 2**31 - 1]
FLOATS = [0.0, 0.25, 0.5, 1.0, 2.0, -1.0, float("nan")]
COLOR_MODES = {"P", "RGB", "RGBA", "CMYK"}
CASES = [
    Case("1", "png", _gray8("1"), [0, 255, 0], _gray([0, 1, 0], 1)),
    Case("L", "png", _gray8("L"), BYTES, _gray(BYTES, 255)),
    Case("LA", "png", _gray_alpha, BYTES, _gray(BYTES, 255)),
    Case("P", "png", _palette, COLORS, SCALED_COLORS),
    Case("RGB", "png", _rgb8("RGB"), COLORS, SCALED_COLORS),
    Case("RGBA", "png", _rgb8("RGBA"), COLORS, SCALED_COLORS),
    # white, cyan, black: where every CMYK → RGB formula agrees
    Case("CMYK", "tif", _rgb8("CMYK"), [(0, 0, 0, 0), (255, 0, 0, 0), (0, 0, 0, 255)],
         [[1, 1, 1], [0, 1, 1], [0, 0, 0]]),
    Case("I;16", "png", _uint16, WORDS, _gray(WORDS, 65535)),
    Case("I;16", "tif", _uint16, WORDS, _gray(WORDS, 65535)),
    Case("I;16B", "tif", _uint16_big_endian, WORDS, _gray(WORDS, 65535)),
    # a 16-bit PGM opens as "I" (Pillow rescales any maxval to 16 bits)
    Case("I", "pgm", _uint16, WORDS, _gray(WORDS, 65535)),
    # the TIFF declares 32 bits, signed (Pillow's "I" is int32): full scale 2**31 - 1
    Case("I", "tif", _int32, INT32, _gray(INT32, 2**31 - 1)),
    # no declared depth (Pillow's own IM format): the smallest of 255, 65535 and 2**31 - 1 that
    # holds the brightest pixel
    *[pytest.param(case, id=f"I-im-{depth}", marks=[
        pytest.mark.filterwarnings("ignore:IM image format"),
        pytest.mark.skipif(not _can_write("IM"), reason="this Pillow cannot write IM")])
      for depth, case in (
          ("8bit", Case("I", "im", _int32, [0, 100, 255], _gray([0, 100, 255], 255))),
          ("16bit", Case("I", "im", _int32, [0, 100, 40000], _gray([0, 100, 40000], 65535))))],
    Case("F", "tif", _float, FLOATS, _gray(FLOATS, 1)),
]


def _save(case: Case, folder: Path) -> Path:
    path = folder / f"image.{case.suffix}"
    case.build(case.pixels).save(path)
    with Image.open(path) as img:
        assert img.mode == case.mode, f"{case.id} reopened as {img.mode}: the case tests nothing"
    return path


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("channels", [1, 3])
def test_each_mode_decodes_by_its_real_range(case: Case, channels: int, tmp_path: Path):
    path = _save(case, tmp_path)
    width = len(case.pixels)
    pixels = decode_image_file(path, {"image_size": [1, width], "channels": channels})
    rgb = np.array(case.rgb, dtype=np.float64)  # (W, 3)
    expected = rgb.T[:, None, :] if channels == 3 else (rgb @ LUMA)[None, None, :]
    # Pillow's 8-bit convert("L") rounds its integer luma to the nearest of 256 levels
    atol = 0.5 / 255 + 1e-6 if channels == 1 and case.mode in COLOR_MODES else 1e-6
    assert pixels.dtype == np.float32 and pixels.shape == (channels, 1, width)
    np.testing.assert_allclose(pixels, expected, rtol=0, atol=atol)


def test_mid_range_16_bit_is_half_not_clipped_to_white(tmp_path: Path):
    path = _save(Case("I;16", "png", _uint16, [32768], []), tmp_path)
    value = decode_image_file(path, {"image_size": [1, 1], "channels": 1}).item()
    assert value == pytest.approx(32768 / 65535, abs=1e-6)


def test_high_bit_depth_resizes_as_floats(tmp_path: Path):
    """A 16-bit level between two 8-bit levels survives resizing (no 8-bit intermediate)."""
    path = tmp_path / "flat.png"
    Image.fromarray(np.full((3, 5), 300, dtype=np.uint16)).save(path)
    pixels = decode_image_file(path, {"image_size": [8, 6], "channels": 3})
    assert pixels.shape == (3, 8, 6)
    np.testing.assert_allclose(pixels, 300 / 65535, rtol=0, atol=1e-7)


@pytest.mark.parametrize("mode", ["L", "RGB", "P", "RGBA"])
@pytest.mark.parametrize("channels", [1, 3])
def test_eight_bit_decoding_is_unchanged(mode: str, channels: int, tmp_path: Path):
    """8-bit images decode bit for bit as before: Pillow's convert, bilinear resize, /255."""
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (7, 5, 3), dtype=np.uint8), "RGB")
    path = tmp_path / "image.png"
    (rgb.quantize(16) if mode == "P" else rgb.convert(mode)).save(path)
    with Image.open(path) as img:
        before = img.convert("L" if channels == 1 else "RGB").resize(
            (6, 4), Image.Resampling.BILINEAR)
        before = np.asarray(before, dtype=np.float32) / 255.0
    before = before[None] if before.ndim == 2 else before.transpose(2, 0, 1)
    after = decode_image_file(path, {"image_size": [4, 6], "channels": channels})
    np.testing.assert_array_equal(after, before)


def _write_digits(root: Path, dtype, classes=(0, 1, 2), per_class: int = 12) -> Path:
    """Real digits (values 0..16) at 16x16 as 8-bit or 16-bit grayscale PNGs, by full scale."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    full = np.iinfo(dtype).max
    for label in classes:
        (root / str(label)).mkdir(parents=True)
        for row in np.flatnonzero(digits.target == label)[:per_class]:
            big = np.kron(digits.images[row], np.ones((2, 2)))
            Image.fromarray((big * full / 16).astype(dtype)).save(root / str(label) / f"{row}.png")
    return root


def test_16_bit_folder_decodes_like_the_8_bit_folder(tmp_path: Path):
    """Issue #17: the same digits as 16-bit PNGs used to clip to 255 and train to 0.83."""
    from ttc.inputs.data import DataOptions, load_dataset

    loaded = {}
    for dtype in (np.uint8, np.uint16):
        root = _write_digits(tmp_path / np.dtype(dtype).name, dtype)
        dataset = load_dataset(DataOptions(path=str(root), show_progress=False))
        assert dataset.preprocessing["channels"] == 1, "16-bit gray counts as gray"
        loaded[dtype] = {name: (split.x, [str(Path(i).relative_to(root)) for i in split.ids])
                         for name, split in dataset.splits.items()}
    for name, (x8, ids8) in loaded[np.uint8].items():
        x16, ids16 = loaded[np.uint16][name]
        assert ids16 == ids8 and x16.shape == x8.shape
        assert not x8.size or np.abs(x16 - x8).max() <= 1 / 255  # (an empty calibration slice)
