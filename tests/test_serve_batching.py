"""serve.py's micro-batcher runs what is queued as soon as the model is idle (a lone request
waits for nothing, whatever --max_queue_delay_ms), and batches form from the requests that come
while the model runs; a request's rows are encoded by the one encoder of the batch path, row by
row: one row alone gives the arrays it gives inside a table of thousands.
"""
from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from conftest import feature_rows, topic_texts
from test_serve import serving


def test_a_lone_request_is_answered_without_waiting_the_whole_delay(tabular_bundle, tmp_path):
    """--max_queue_delay_ms is an upper bound: with 5,000 ms a lone request is answered long
    before 5 s (the client gives up after 2.5 s), and so is each of several in a row."""
    row = {k: v for k, v in feature_rows(per_class=1)[0].items() if k != "kind"}
    with serving(tabular_bundle["model"], "--max_queue_delay_ms", 5000, "--timeout_ms", 60000,
                 logs=tmp_path) as server:
        with httpx.Client(base_url=server.url, timeout=httpx.Timeout(2.5)) as client:
            for _ in range(3):
                answer = client.post("/predict", json={"instances": [row]})
                assert answer.status_code == 200, answer.text
                assert answer.json()["predictions"][0]["label"] in {"a", "b", "c"}


def test_requests_that_come_while_the_model_runs_join_one_batch():
    """The first request runs at once; the five that come while the model runs it wait, and
    run together in the next batch, each answered with its own rows."""
    from ttc.online.batcher import MicroBatcher

    busy, release = threading.Event(), threading.Event()
    batches: list[list[int]] = []

    def run(parts):
        batches.append([len(rows) for rows, _ in parts])
        if len(batches) == 1:
            busy.set()
            release.wait(30)
        return [(np.asarray(rows, dtype=np.float32)[:, None], {}) for rows, _ in parts]

    async def scenario():
        batcher = MicroBatcher(run, max_batch_size=32, max_delay_s=60.0, max_queue=16).start()
        deadline = asyncio.get_running_loop().time() + 60
        first = asyncio.create_task(batcher.submit([1.0], deadline + 1e9))
        await asyncio.get_running_loop().run_in_executor(None, busy.wait, 30)
        later = [asyncio.create_task(batcher.submit([float(k), float(k)], deadline + 1e9))
                 for k in range(2, 7)]
        while batcher.depth < len(later):
            await asyncio.sleep(0.001)
        release.set()
        answers = await asyncio.gather(first, *later)
        await batcher.close()
        return answers

    answers = asyncio.run(scenario())
    assert batches == [[1], [2] * 5]
    assert [a[0][:, 0].tolist() for a in answers] == [[1.0]] + [[float(k)] * 2
                                                              for k in range(2, 7)]


def big_rows(rows: list[dict], copies: int) -> list[dict]:
    return [rows[k % len(rows)] for k in range(copies)]


@pytest.mark.parametrize("kind", ["tabular", "text"])
def test_one_row_encodes_as_inside_a_big_table(request, kind, tmp_path):
    """A request of one row, a request of thousands, and the same rows read from a JSONL file
    by the batch path (`inference.py --input`'s reader) give each row the same model input."""
    from ttc.serving.batch import BatchOptions, TableReader
    from ttc.serving.bundle import BundlePaths, read_manifest
    from ttc.serving.records import RecordReader
    from ttc.serving.runtime import batches_of

    bundle = request.getfixturevalue(f"{kind}_bundle")
    manifest = read_manifest(BundlePaths.from_model_path(bundle["model"]))
    if kind == "tabular":
        rows = [{k: v for k, v in row.items() if k != "kind"} for row in feature_rows()]
        rows[3] = dict(rows[3], weight="?", color="NA")  # missing markers
    else:
        rows = [{"text": text} for text, _ in topic_texts()] + [{"text": "  "}]
    many = big_rows(rows, 5000)
    reader = RecordReader(manifest)
    together = reader.encode(many)
    path = Path(tmp_path) / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in many))
    options = BatchOptions(input=str(path), output="", dataset_format="jsonl", chunk_rows=1024)
    from_file = [chunk.x for chunk in TableReader(path, manifest, options)]
    pad = manifest.input.pad_id if kind == "text" else 0
    for k in (0, 3, len(rows) - 1, 4999):
        alone = reader.encode([many[k]])
        in_request = together[k:k + 1]
        in_file = from_file[k // 1024][k % 1024:k % 1024 + 1]
        if kind == "text":  # token ids: the same once the batch's padding is trimmed
            in_request, in_file = (batches_of(x, 1, pad)[0] for x in (in_request, in_file))
            alone = batches_of(alone, 1, pad)[0]
        np.testing.assert_array_equal(alone, in_request)
        np.testing.assert_array_equal(alone, in_file)
