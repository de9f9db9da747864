"""The table formats the tool reads, by name (--dataset_format, a manifest's record) and by file
extension. Plain data without numpy: the flags' choices read it at --help time, before any
reader is imported; tables.py reads the files."""
from __future__ import annotations

TABLE_FORMATS = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".txt": "tsv", ".json": "json",
                 ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
FORMAT_NAMES = ("csv", "tsv", "json", "jsonl", "parquet")
