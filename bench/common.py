"""What the bench scripts share: set up quiet logging and one torch thread, and train + export a
bundle in-process, exactly as pipeline.py does."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from config import Config  # noqa: E402
from bundle import BundlePaths
from utils import quiet_library_loggers, setup_logging  # noqa: E402


def quiet_single_thread() -> None:
    setup_logging("ERROR")
    import torch

    import program  # noqa: F401 - imports dspy, which resets its loggers: quiet them after

    quiet_library_loggers()
    torch.set_num_threads(1)


def train_bundle(config: Config):
    """Train and export; returns (dataset, trained model, bundle paths, export result)."""
    from data import DataOptions, load_dataset
    from export import export_bundle
    from program import train_classifier
    from train import build_manifest

    dataset = load_dataset(DataOptions.from_config(config))
    trained = train_classifier(config, dataset)
    paths = BundlePaths.from_model_path(config.output_model)
    exported = export_bundle(config, trained.net, build_manifest(config, trained, dataset),
                             dataset.test.x, dataset.train.x, paths)
    return dataset, trained, paths, exported


def run_cases(cases, measure, *args) -> None:
    """measure(*case, *args) for each case; a case whose data file is missing is skipped."""
    for case in cases:
        if case[2].endswith(".tsv") and not Path(case[2]).exists():
            print(f"\n{case[0]}: skipped, {case[2]} not found")
            continue
        measure(*case, *args)
