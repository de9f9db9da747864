"""Rebuild the plots and the HTML page of a saved report (a cron job's JSON, looked at later):

    python report.py runs/digits/report.json

The report itself (sections, summary, JSON, plots, page, and the runner every CLI writes it
with) lives in ttc/reporting/run.py.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from ttc.reporting.run import read_report, write_visuals
from ttc.reporting.sections import PLOT_NAMES
from utils import EXIT_OK, ConfigError, check_paths, exit_cli, run_cli, setup_logging


def main(argv: Sequence[str] | None = None) -> int:
    from config import (LOG_LEVELS, OneLineParser, page_beside, refuse_linked_plots_folder,
                        visuals_beside)

    parser = OneLineParser(
        prog="report.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Rebuild the plots and the HTML page of a saved report "
        "JSON (pipeline.py or inference.py --report_json).",
        epilog="example:\n  python report.py runs/digits/report.json   # writes "
               "runs/digits/plots/*.png and runs/digits/report.html")
    parser.add_argument("report_json", metavar="REPORT.json", help="the report to draw")
    parser.add_argument("--plots", metavar="DIR", help="where the PNGs go, or 'none' (default: "
                        "plots/ beside the report, NAME_plots/ for a report not called "
                        "report.json)")
    parser.add_argument("--html", metavar="PATH", help="where the page goes, or 'none' "
                        "(default: the report's name with .html)")
    parser.add_argument("--log_level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                        help="log verbosity on stderr (default: INFO)")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    source = Path(args.report_json)
    plots = (None if (args.plots or "").lower() == "none"
             else Path(args.plots) if args.plots else visuals_beside(source))
    page = (None if (args.html or "").lower() == "none"
            else Path(args.html) if args.html else page_beside(source))
    if plots is None and page is None:
        raise ConfigError("--plots none and --html none leave nothing to write",
                          "drop one of them")
    refuse_linked_plots_folder(plots, named=bool(args.plots))
    if plots is not None and plots.exists() and not plots.is_dir():
        raise ConfigError(f"--plots {plots} is a file", "give a folder, or 'none'")
    writes = ({f"--plots ({name}.png)": plots / f"{name}.png" for name in PLOT_NAMES}
              if plots else {})
    if page is not None:
        writes["--html"] = page
    check_paths({"REPORT.json": source}, writes)
    report = read_report(source)
    write_visuals(report, plots, page, strict=True)
    if report.get("html"):
        print(f"page: {report['html']}")
    for name, path in (report.get("plots") or {}).items():
        print(f"{name}: {path}")
    return EXIT_OK


if __name__ == "__main__":
    exit_cli(run_cli(main))
