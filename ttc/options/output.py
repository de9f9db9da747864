"""The output flags: the bundle's path, the report (a file, or JSON on stdout), the plots and
page beside it, and what the run prints on stderr (log level, progress bars, quiet)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ttc.options.fields import bad, opt, parse_bool
from ttc.reporting.sections import PLOT_NAMES
from utils import refuse_linked_folder

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")



def visuals_beside(path: Path) -> Path:
    """The plots folder beside a report or model file: `plots/` for report.json or model.onnx,
    `NAME_plots/` for other names."""
    return path.parent / ("plots" if path.stem in ("report", "model") else f"{path.stem}_plots")


def refuse_linked_plots_folder(folder: Path | None, named: bool) -> None:
    """A plots folder the tool chose (beside the report or the model, not named with --plots)
    must be a real folder, never a symbolic link: one placed there (in a shared or downloaded
    folder) would send the PNGs wherever it points. ConfigError (exit 2), before any work."""
    if folder is not None and not named:
        refuse_linked_folder(folder, "the plots folder", "plots",
                             "remove the link, or name the folder with --plots DIR")


def page_beside(report_json: Path) -> Path:
    """The HTML page beside a report file: its name with .html (a report named *.html gets
    .report.html, so the page never replaces it)."""
    if report_json.suffix.lower() in (".html", ".htm"):
        return report_json.with_name(report_json.name + ".report.html")
    return report_json.with_suffix(".html")


def page_beside_model(model: Path) -> Path:
    """pipeline.py's page without a report file: `report.html` beside model.onnx,
    `NAME_report.html` beside NAME.onnx (two bundles in one folder keep their own)."""
    return model.parent / ("report.html" if model.stem == "model" else f"{model.stem}_report.html")


@dataclass
class OutputFlags:
    json: bool = opt(False, "print the run's report as JSON on stdout instead of the summary",
                     "batch", type=parse_bool, metavar="BOOL", scripts="I")
    quiet: bool = opt(False, "print nothing but errors", "batch", type=parse_bool,
                      metavar="BOOL", scripts="I")
    output_model: str | None = opt(None, "where to write the model bundle: PATH.onnx plus "
                                   "PATH.json (manifest) and PATH.pt (weights)", "output",
                                   metavar="PATH.onnx", scripts="PTEQIS", help_for={
        "E": "the bundle to export: reads PATH.json and PATH.pt, writes PATH.onnx and its "
             "extra graphs",
        "Q": "the bundle to quantize: reads PATH.onnx, adds PATH.int8.onnx / PATH.fp16.onnx",
        "I": "the bundle to read: PATH.onnx with its manifest PATH.json beside it",
        "S": "the bundle to serve: PATH.onnx with its manifest PATH.json beside it"})
    report_json: str | None = opt(None, "write the final report as JSON to PATH ('-' prints it "
                                  "on stdout instead of the summary)", "output", metavar="PATH",
                                      scripts="PTEQI")
    plots: str | None = opt(None, "write the run's plots (PNG) to DIR, or 'none' (default: a "
                            "plots/ folder beside --report_json; for pipeline.py without a "
                            "report file, beside the model)", "output", metavar="DIR",
                            scripts="PI")
    log_level: str = opt("INFO", "log verbosity on stderr; DEBUG also shows library logs and "
                         "tracebacks", "output", type=str.upper, choices=LOG_LEVELS,
                             scripts="PTEQIS")
    no_progress: bool = opt(False, "hide progress bars (they only show when stderr is a "
                            "terminal anyway)", "output", type=parse_bool, metavar="BOOL",
                                scripts="PTEQI")

    def check_outputs(self) -> None:
        """--output_model names an .onnx file, --report_json a file."""
        if self.output_model is not None:
            out = Path(self.output_model)
            if out.suffix != ".onnx":
                bad("output_model", self.output_model, "give a path ending in .onnx, e.g. "
                    "runs/digits/model.onnx")
            if out.exists() and out.is_dir():
                bad("output_model", self.output_model, "it is a folder; give a file path "
                    "ending in .onnx")
        if self.report_json and self.report_json != "-" and Path(self.report_json).is_dir():
            bad("report_json", self.report_json, "it is a folder; give a file path")

    def plots_destination(self, script: str | None) -> Path | None:
        """Where the plots go: --plots DIR, else beside the report file, else for pipeline.py
        beside the model (visuals_beside); None for none."""
        if self.plots:
            return None if self.plots.lower() == "none" else Path(self.plots)
        if self.report_json and self.report_json != "-":
            return visuals_beside(Path(self.report_json))
        if script == "pipeline" and self.output_model:
            return visuals_beside(Path(self.output_model))
        return None

    def page_destination(self, script: str | None = None) -> Path | None:
        """The HTML page: beside the report file, with its name (report.json → report.html),
        else for pipeline.py beside the model (page_beside_model) unless --plots none."""
        if self.report_json and self.report_json != "-":
            return page_beside(Path(self.report_json))
        if script == "pipeline" and self.output_model and (self.plots or "").lower() != "none":
            return page_beside_model(Path(self.output_model))
        return None

    def trace_destination(self) -> Path | None:
        """Where a profile trace goes: beside the report file (report.json →
        report.profile.json), else beside the model (model.profile.json)."""
        if self.report_json and self.report_json != "-":
            report = Path(self.report_json)
            return report.with_name(f"{report.stem}.profile.json")
        return Path(self.output_model).with_suffix(".profile.json") if self.output_model else None
