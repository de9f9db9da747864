"""Property-based tests (hypothesis): whatever the input, the parsers and loaders either succeed
or raise this tool's own error type (one clear line, a documented exit code), never anything
else."""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from utils import PipelineError

FAST = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)


@FAST
@given(text)
def test_booleans(value):
    from config import parse_bool

    try:
        assert parse_bool(value) in (True, False)
    except argparse.ArgumentTypeError as err:
        assert str(value) in str(err) or repr(value) in str(err)


@FAST
@given(st.one_of(text, st.lists(st.sampled_from(
    ["hflip", "rot90", "rotate:10", "shift:1", "crop:0.9", "crop:2", "rotate", "jitter:0.1",
     "token_dropout:0.5", "window:4", "flip", "identity", "shift:1.5", ":", ""])).map(",".join)),
    st.sampled_from(["image", "text", "tabular"]))
def test_transform_specs(spec, kind):
    from ttc.testtime.tta import REGISTRY, parse_transform_specs

    try:
        parsed = parse_transform_specs(spec, kind)
    except PipelineError as err:
        assert err.exit_code == 2
        return
    assert all(name in REGISTRY[kind] and name != "identity" for name, _ in parsed)


@FAST
@given(st.one_of(text, st.lists(st.sampled_from(
    ["cpu", "cuda", "tensorrt", "CUDAExecutionProvider", "gpu", "dml", " ", ""])).map(",".join)))
def test_provider_lists(value):
    from ttc.serving.runtime import parse_ep_options, parse_providers

    try:
        providers = parse_providers(value)
        parse_ep_options(value if "=" in value else None, providers)
    except PipelineError as err:
        assert err.exit_code == 2
        return
    assert providers[-1] == "CPUExecutionProvider" and len(set(providers)) == len(providers)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12)
manifest_keys = st.sampled_from(["format", "format_version", "model_type", "labels", "input",
                                 "preprocessing", "architecture", "files", "extra", "dataset"])


@FAST
@given(st.dictionaries(manifest_keys, json_values, max_size=10), st.booleans())
def test_manifests(fields, real_format):
    from ttc.serving.bundle import BundlePaths, read_manifest

    if real_format:
        fields.update(format="ttc-model-bundle", format_version=1)
    with tempfile.TemporaryDirectory() as folder:
        paths = BundlePaths.from_model_path(Path(folder) / "model.onnx")
        paths.manifest.write_text(json.dumps(fields))
        try:
            read_manifest(paths)
        except PipelineError as err:
            assert err.exit_code == 4


@FAST
@given(st.binary(max_size=300), st.sampled_from(["csv", "tsv", "json", "jsonl"]))
def test_tables_from_random_bytes(data, fmt):
    from ttc.inputs.tables import read_table

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"data.{fmt}"
        path.write_bytes(data)
        try:
            frame = read_table(path)
        except PipelineError as err:
            assert err.exit_code == 3
            return
        assert len(frame) > 0


cell = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(str),
                 st.sampled_from(["", "NA", "?", "red", "x,y", '"q"', "1e400", "-0"]), text)


@FAST
@given(st.lists(st.lists(cell, min_size=3, max_size=3), min_size=1, max_size=30))
def test_random_csvs_through_the_batch_reader(rows):
    from ttc.serving.batch import BatchOptions, TableReader

    manifest = {"model_type": "tabular_classifier", "labels": ["a", "b"], "dataset": {},
                "preprocessing": {"kind": "tabular", "columns": [
                    {"name": "h", "type": "numeric"}, {"name": "w", "type": "numeric"},
                    {"name": "c", "type": "categorical", "categories": ["red", "blue"]}]}}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "new.csv"
        with open(path, "w", newline="", encoding="utf-8") as handle:
            import csv

            writer = csv.writer(handle)
            writer.writerow(["h", "w", "c"])
            writer.writerows(rows)
        try:
            chunks = list(TableReader(path, manifest, BatchOptions(str(path), "out.csv", 7)))
        except PipelineError as err:
            assert err.exit_code in (2, 3)
            return
        for chunk in chunks:
            assert len(chunk.ids) + len(chunk.errors) <= 7
            if chunk.x is not None:
                assert chunk.x.dtype == np.float32 and chunk.x.shape == (len(chunk.ids), 4)
