"""The flags only the regressors take (the Task entries' `flags`): composed into the Config
after the training flags and read by their training. Plain declarations: no numpy or torch."""
from __future__ import annotations

from dataclasses import dataclass

from ttc.options.fields import bad, opt


@dataclass
class RegressionFlags:
    loss: str = opt("mse", "tabular_regressor, text_regressor: the training loss on the "
                    "standardised target, mse or huber (delta 1, in target standard deviations)",
                    "training", choices=("mse", "huber"), scripts="PT")
    interval: float | None = opt(None, "tabular_regressor, text_regressor: split conformal "
                                 "prediction intervals at this coverage (e.g. 0.9), from the "
                                 "calibration slice (--calibration_fraction); the bundle answers "
                                 "lower and upper beside prediction", "training", type=float,
                                 metavar="LEVEL", scripts="PT")

    def check_own_flags(self) -> None:
        """--interval is a coverage (whether the calibration slice holds enough rows for it is
        the training stage's check, once the data is read)."""
        if self.interval is not None and not 0.5 <= self.interval < 1:
            bad("interval", self.interval, "use a coverage from 0.5 to below 1, e.g. 0.9")
