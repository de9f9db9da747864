"""Serve a model bundle over HTTP: predictions of rows as JSON, with dynamic batching.

    python serve.py --model runs/sms/model.onnx --port 8000
    curl -s localhost:8000/predict -d '{"instances": [{"text": "WINNER! Claim your prize"}]}'

loads the bundle with inference.py's checks (a bundle it would refuse is refused here, before
the port opens), then answers POST /predict (rows of the trained columns, as one line of an
inference.py --input JSONL file), POST /predict/image, the Open Inference Protocol's /v2
endpoints (KServe, Triton clients), GET /metrics (Prometheus) and /docs (OpenAPI), until
SIGTERM (it answers what it accepted, then exits 0). POST /v2/repository/models/NAME/load or
SIGHUP reloads the bundle from disk. --engine ray serves the same application on Ray Serve.
docs/serve.md has the rest.
"""
from __future__ import annotations

from typing import Sequence

from config import build_parser, start_cli
from utils import exit_cli, run_cli


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(
        "serve", "Serve a model bundle over HTTP (FastAPI on uvicorn, or Ray Serve with "
        "--engine ray): POST /predict, POST /predict/image, the Open Inference Protocol (/v2), "
        "GET /metrics; requests are joined into batches for ONNX Runtime.",
        required=["output_model"], aliases={"output_model": ["--model"]},
        epilog="example:\n  python serve.py --model runs/sms/model.onnx --port 8000\n"
               "  curl -s localhost:8000/predict -d '{\"instances\": [{\"text\": \"hi\"}]}'")
    config = start_cli(parser, argv)
    refuse_unserved_model_types(config)
    if config.engine == "ray":
        from ttc.online.ray_serve import serve_on_ray

        return serve_on_ray(config)
    from ttc.online.app import serve

    return serve(config)


def refuse_unserved_model_types(config) -> None:
    """The server's endpoints answer a classifier's classes; a segmenter's masks and a
    detector's boxes have no endpoint yet: one line and exit 2, before the port opens."""
    from ttc.serving.bundle import BundlePaths, read_manifest
    from utils import ConfigError

    manifest = read_manifest(BundlePaths.from_model_path(config.output_model))
    if manifest.preprocessing.kind in ("segmentation", "detection"):
        raise ConfigError(f"serve.py serves classifiers, and this bundle is an "
                          f"{manifest.model_type} (no endpoint returns masks or boxes yet)",
                          "run inference.py --input on its images instead")


if __name__ == "__main__":
    exit_cli(run_cli(main))
