"""Iterative inference's flags: MC-dropout, ensembles (of bundles, or trained by pipeline.py)
and the state loop, their passes, backend and early stopping."""
from __future__ import annotations

from dataclasses import dataclass

from ttc.options.fields import bad, opt, positive
from utils import ConfigError

# Networks without a Dropout layer: MC-dropout has no masks to sample in them.
ARCHS_WITHOUT_DROPOUT = ("resnet18", "resnet34")


@dataclass
class IterativeFlags:
    iterative: str = opt("none", "iterative inference, reported with calibration (NLL, ECE, "
                         "accuracy when abstaining on the 10 percent most uncertain) next to a "
                         "single pass: mc_dropout (K passes "
                         "with dropout on), ensemble (the bundle's ensemble graph, or the "
                         "bundles of --ensemble), state (feed a graph's state_out back into its "
                         "state input K times)", "ttc",
                         choices=("none", "mc_dropout", "ensemble", "state"), scripts="PIS")
    iterations: int = opt(16, "passes K for --iterative mc_dropout and state", "ttc", type=int,
                          metavar="K", scripts="PIS")
    iterative_backend: str = opt("batched", "how the K passes run: python (a loop of "
                                 "session.run; the only one that stops early), batched (K copies "
                                 "stacked in one run), loop (an ONNX Loop, one run)", "ttc",
                                 choices=("python", "batched", "loop"), scripts="PIS")
    iterative_tol: float | None = opt(None, "python backend: stop once the running mean's top-1 "
                                      "is unchanged and its largest change is below this for "
                                      "--iterative_patience passes", "ttc", type=float,
                                      metavar="EPS", scripts="PIS")
    iterative_patience: int = opt(2, "passes the early-stopping test must hold in a row", "ttc",
                                  type=int, metavar="N", scripts="PIS")
    ensemble: str | None = opt(None, "inference.py, serve.py: more bundles (model.onnx paths, "
                               "comma-separated) to average with --model; same labels and "
                               "preprocessing", "ttc", metavar="LIST", scripts="IS")
    ensemble_size: int = opt(1, "pipeline.py: train N models (seeds --seed, --seed+1, ...) and "
                             "write them as one ensemble graph, model.ensemble.onnx", "ttc",
                             type=int, metavar="N", scripts="P")

    def check_passes(self) -> None:
        """The pass count and the early-stopping patience (checked with tent's counts)."""
        for name in ("iterations", "iterative_patience"):
            positive(name, getattr(self, name))

    def check_ensemble_size(self) -> None:
        """--ensemble_size, a count of models to train (checked with training's counts)."""
        positive("ensemble_size", self.ensemble_size)

    def check_dropout(self, arch: str | None, dropout: float | None) -> None:
        """mc_dropout needs Dropout layers in --arch, at a rate above 0."""
        if self.iterative == "mc_dropout" and dropout == 0:
            raise ConfigError("--iterative mc_dropout samples dropout masks, and --dropout 0 "
                              "turns the network's dropout off",
                              "raise --dropout, or use --iterative ensemble --ensemble_size 3")
        if self.iterative == "mc_dropout" and arch in ARCHS_WITHOUT_DROPOUT:
            raise ConfigError(f"--iterative mc_dropout samples dropout masks, and --arch "
                              f"{arch} has no Dropout layer",
                              "use --iterative ensemble --ensemble_size 3, or an arch with "
                              "dropout (small_cnn, mobilenet_v3_small, efficientnet_b0)")

    def check_iterative(self) -> None:
        """A trained ensemble turns on --iterative ensemble; --ensemble names bundles;
        --iterative_tol is positive and needs the python backend."""
        if self.ensemble_size > 1 and self.iterative == "none":
            self.iterative = "ensemble"  # a trained ensemble is measured against one model
        if self.ensemble is not None and not self.ensemble_members():
            bad("ensemble", self.ensemble, "name one or more bundles, e.g. "
                "runs/b/model.onnx,runs/c/model.onnx")
        if self.iterative_tol is not None and self.iterative_tol <= 0:
            bad("iterative_tol", self.iterative_tol, "use a small positive number like 1e-3")
        if self.iterative_tol is not None and self.iterative_backend != "python":
            raise ConfigError("--iterative_tol needs --iterative_backend python (the batched "
                              "and loop backends run all passes at once)",
                              "add --iterative_backend python, or drop --iterative_tol")

    def ensemble_members(self) -> list[str]:
        """--ensemble's bundle paths, blanks dropped."""
        return [item for item in (p.strip() for p in (self.ensemble or "").split(",")) if item]
