"""A segmenter's batch outputs (ttc/tasks/segment/masks.py): mask PNGs that read back as the
class indices (palette mode, VOC colours), overlays, per-class pixel shares, and a write that
fails leaving the previous file as it was."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image


def test_a_mask_png_reads_back_as_its_indices_with_voc_colours(tmp_path):
    from ttc.tasks.segment.data import read_mask
    from ttc.tasks.segment.masks import voc_palette, write_mask

    mask = np.random.default_rng(0).integers(0, 21, (13, 17)).astype(np.int64)
    path = write_mask(tmp_path / "a.png", mask)
    with Image.open(path) as image:
        assert image.mode == "P" and image.size == (17, 13)
        np.testing.assert_array_equal(np.asarray(image), mask)
    np.testing.assert_array_equal(read_mask(path), mask)  # the reader the training data uses
    palette = voc_palette()
    assert palette[:4].tolist() == [[0, 0, 0], [128, 0, 0], [0, 128, 0], [128, 128, 0]]
    assert palette[15].tolist() == [192, 128, 128]  # VOC's "person"
    assert len({tuple(c) for c in palette}) == 256


def test_overlays_blend_class_colours_and_keep_the_background():
    from ttc.tasks.segment.masks import overlay, voc_palette

    image = np.full((1, 2, 3), 0.5, np.float32)
    mask = np.array([[0, 1, 2], [2, 1, 0]])
    shaded = overlay(image, mask, alpha=0.5)
    assert shaded.shape == (2, 3, 3) and shaded.dtype == np.uint8
    np.testing.assert_array_equal(shaded[0, 0], [128, 128, 128])  # background: the image
    expected = np.round(0.5 * 127.5 + 0.5 * voc_palette()[1].astype(float)).astype(np.uint8)
    np.testing.assert_array_equal(shaded[0, 1], expected)
    with pytest.raises(ValueError, match="differ in size"):
        overlay(image, mask[:, :2])


def test_class_shares_and_bad_masks(tmp_path):
    from ttc.tasks.segment.masks import class_shares, write_mask

    shares = class_shares(np.array([[0, 0, 1], [2, 2, 2]]), 4)
    np.testing.assert_allclose(shares, [2 / 6, 1 / 6, 3 / 6, 0])
    previous = tmp_path / "kept.png"
    previous.write_bytes(b"the previous output")
    for bad in (np.array([[0, 300]]), np.zeros((2, 2, 2), int), np.array([[-1, 0]])):
        with pytest.raises(ValueError):
            write_mask(previous, bad)
    assert previous.read_bytes() == b"the previous output"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.png"]  # no temporary left
