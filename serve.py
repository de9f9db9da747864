"""Serve a model bundle over HTTP: predictions of rows as JSON, with dynamic batching. Every
model type: a classifier answers its classes, a detector boxes, a segmenter a mask, the values
`inference.py --input` writes for the same image.

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

import signal
from typing import Sequence

HELD_HANGUPS: list[int] = []  # SIGHUPs that came before the server took them over


def hold_hangups() -> None:
    """SIGHUP (a reload) before the server is up would end the process (exit 129): until the
    server takes it over, one is held, and reloads the bundle once the server is up."""
    try:
        signal.signal(signal.SIGHUP, lambda signum, frame: HELD_HANGUPS.append(signum))
    except (AttributeError, ValueError):  # no SIGHUP (Windows), or not the main thread
        pass


if __name__ == "__main__":
    hold_hangups()  # before the imports below (0.2 s), which a SIGHUP would otherwise end

from config import build_parser, start_cli  # noqa: E402 - after the SIGHUP hold
from utils import exit_cli, run_cli  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    hold_hangups()
    parser = build_parser(
        "serve", "Serve a model bundle over HTTP (FastAPI on uvicorn, or Ray Serve with "
        "--engine ray): POST /predict, POST /predict/image, the Open Inference Protocol (/v2), "
        "GET /metrics; requests are joined into batches for ONNX Runtime.",
        required=["output_model"], aliases={"output_model": ["--model"]},
        epilog="example:\n  python serve.py --model runs/sms/model.onnx --port 8000\n"
               "  curl -s localhost:8000/predict -d '{\"instances\": [{\"text\": \"hi\"}]}'")
    config = start_cli(parser, argv)
    from ttc.options.stages import ServeOptions, view_of

    options = view_of(config, ServeOptions)  # the flags against the bundle's type: validate_tta
    if config.engine == "ray":
        from ttc.online.ray_serve import serve_on_ray

        return serve_on_ray(options, config.validate_tta)
    from ttc.online.app import serve

    return serve(options, config.validate_tta, HELD_HANGUPS)


if __name__ == "__main__":
    exit_cli(run_cli(main))
