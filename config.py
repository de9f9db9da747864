"""Every setting of the tool: the per-stage flag dataclasses of ttc/options composed into one
`Config`, and the argument parsers, summary and docs/cli.md reference built from their fields.

All entry points (pipeline.py, train.py, export.py, quantize.py, inference.py) build their
argument parsers from these fields, so a flag means the same thing everywhere. Each stage's
flags, checks and helpers live in its own module of ttc/options; this module holds the
composition (the order of the fields and of the checks, the checks that span stages) and the
parser.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ttc.options.batch import BatchFlags
from ttc.options.compress import CompressFlags
from ttc.options.data import DataFlags
from ttc.options.distributed import DistributedFlags
from ttc.options.export import VALIDATE_ATOL, VALIDATE_ATOL_FOR_ARCH, ExportFlags
from ttc.options.fields import GROUPS, SCRIPTS, bad, parse_bool
from ttc.options.fitting import FittingFlags
from ttc.options.iterative import IterativeFlags
from ttc.options.output import (LOG_LEVELS, PLOT_NAMES, OutputFlags, page_beside,
                                refuse_linked_plots_folder, visuals_beside)
from ttc.options.quantize import QuantizeFlags
from ttc.options.serve import ServeFlags
from ttc.options.sessions import RuntimeFlags
from ttc.options.shift import ShiftFlags
from ttc.options.stages import ModelTypeChecks, TestTimeOptions
from ttc.options.spelling import first_unknown_flag, unknown_flag_message, with_underscores
from ttc.options.teacher import TeacherFlags
from ttc.options.training import (ARCHS, HF_LEARNING_RATE, LEARNING_RATE, TYPE_FLAGS,
                                  TrainingFlags, is_hf_arch)
from ttc.options.tta import TTAFlags
from ttc.options.ttt import TTTFlags, no_batchnorm_error, norm_without_batchnorm
from utils import DataError, check_output_folders, check_paths, refuse_linked_folder

if TYPE_CHECKING:
    from ttc.reporting.run import ReportOptions

# The names other modules import from here (config.X), wherever they now live.
__all__ = ["ARCHS", "HF_LEARNING_RATE", "LEARNING_RATE", "LOG_LEVELS", "SCRIPTS", "VALIDATE_ATOL",
           "VALIDATE_ATOL_FOR_ARCH", "FIELDS", "Config", "OneLineParser", "build_parser",
           "flags_for", "is_hf_arch", "markdown_reference", "no_batchnorm_error",
           "norm_without_batchnorm", "page_beside", "parse_bool", "refuse_linked_plots_folder",
           "start_cli", "visuals_beside"]

# The stages in the order their flags appear in --help, the summary and the report (the model
# types' own flag groups after the training flags).
STAGES = (DataFlags, TrainingFlags, *TYPE_FLAGS, FittingFlags, TeacherFlags, CompressFlags, ExportFlags,
          QuantizeFlags, TTAFlags, TTTFlags, ShiftFlags, IterativeFlags, RuntimeFlags, BatchFlags,
          DistributedFlags, ServeFlags, OutputFlags)


@dataclass
class Config(ModelTypeChecks, TestTimeOptions, *STAGES[::-1]):
    """Every stage's flags in one dataclass, for the CLIs. A dataclass collects its bases'
    fields from the last base to the first, so the bases are STAGES reversed: the fields' order
    is the flags' order in --help, the summary and the report."""

    # ------------------------------------------------------------------ checks

    def validate(self) -> "Config":
        """Check every value, stage by stage; raise ConfigError (exit 2) naming the flag and
        the fix. The order is the order the checks have always fired in (a run with several
        bad flags reports the same one first), which interleaves a few stages' checks. A flag
        the named --model_type does not take is refused first (a bundle's script refuses them
        once its manifest names the type: validate_tta)."""
        if "model_type" in self.names():
            self.refuse_flags_for(self.model_type)
        self.check_data()
        self.check_memory()  # the three allocation bounds are checked together
        self.check_text_length()
        self.check_rates()
        self.check_ensemble_size()  # a count of models to train
        self.check_training(self.model_type)
        for group in TYPE_FLAGS:
            group.check_own_flags(self)
        self.check_fitting(self.model_type, self.arch, self.model_def)
        self.check_dropout(self.arch, self.dropout)
        self.check_teacher(self.model_type)
        self.check_compress(self.arch)
        self.check_export()
        self.check_quantize()
        self.check_test_time_compute()
        serving = getattr(self, "script", None) == "serve"
        self.check_batch(self.ray_threads, self.profile, self.adapts_online(), serving)
        self.check_distributed()
        if serving:
            self.check_serve(self.adapts_online())
        self.check_runtime()
        self._validate_paths()
        return self

    def _validate_paths(self) -> None:
        """The files: builtin data sets, the outputs' forms, the plots folder, that every
        input exists and that no output overwrites an input or another output."""
        names_model_type = "model_type" in self.names()  # a bundle's script: its manifest says
        self.check_builtin(names_model_type)
        self.check_outputs()
        folder = self.plots_folder()
        refuse_linked_plots_folder(folder, named=bool(self.plots))
        if folder is not None and folder.exists() and not folder.is_dir():
            bad("plots", str(folder), "it is a file; give a folder, or 'none'")
        reads, writes = self.files_read_and_written()
        for flag in self.READ_FLAGS:
            path = reads.get(f"--{flag}")
            if path is not None and not path.exists():
                raise DataError(f"--{flag} {path} does not exist", "check the path")
        self.check_image_splits(names_model_type)
        check_paths(reads, writes)
        self.check_input_folders()
        self.check_checkpoint_folder(reads, writes)

    # ------------------------------------------------------------------ files

    def plots_folder(self) -> Path | None:
        """Where the plots go (OutputFlags.plots_destination); None for a script without
        --plots."""
        if "plots" not in self.names():
            return None
        return self.plots_destination(getattr(self, "script", None))

    def page_path(self) -> Path | None:
        """The HTML page: beside the report file, with its name (report.json → report.html),
        else pipeline.py's beside the model (OutputFlags.page_destination); None for a script
        without --plots."""
        if "plots" not in self.names():
            return None
        return self.page_destination(getattr(self, "script", None))

    def profile_path(self) -> Path | None:
        """Where --profile's raw trace goes: beside the report file (report.json →
        report.profile.json), else beside the model (model.profile.json); None without
        --profile."""
        if ("profile" not in self.names() or not self.profile
                or getattr(self, "script", None) == "quantize"):  # quantize.py writes no trace
            return None
        return self.trace_destination()

    def visual_outputs(self) -> dict[str, Path]:
        """Every plot and page path this run may write, for the path checks."""
        folder, page = self.plots_folder(), self.page_path()
        outputs = {f"--plots ({name}.png)": folder / f"{name}.png" for name in PLOT_NAMES
                   } if folder else {}
        if page and self.report_json and self.report_json != "-":
            outputs["the report page (--report_json's .html)"] = page
        elif page:
            outputs["--output_model (the report page beside it)"] = page
        return outputs

    def check_input_folders(self, segmenter: bool = False) -> None:
        """--input's folders (BatchFlags.input_outputs): a real folder where the tool chose it
        beside --output (refuse_linked_folder), none an input or another output, nor holding
        an output its PNGs would replace (check_output_folders). Before any work: from the
        flags, and again once a bundle names a segmenter (its default mask folder)."""
        folders = self.input_outputs(segmenter)[1]
        for name, folder in folders.items():
            if name.startswith("--output "):  # chosen beside --output, not named by a flag
                refuse_linked_folder(folder, name, "outputs",
                                     "remove the link, or give --output another name")
        if folders:
            reads, writes = self.files_read_and_written()
            reads.pop("--input", None)  # its overlaps are the writer's to say (check_options)
            check_output_folders(folders, reads, writes)

    READ_FLAGS = ("dataset_path", "val_path", "test_path", "unlabeled_path", "input",
                  "init_weights", "model_def", "annotations")
    WRITE_FLAGS = ("output", "errors", "report_json")

    def files_read_and_written(self) -> tuple[dict[str, Path], dict[str, Path]]:
        """Every file this script reads and every file it writes, keyed by the flag that names
        it: pipeline.py and train.py write the --output_model bundle, export.py and quantize.py
        add to it, inference.py reads it (and the --ensemble bundles)."""
        from ttc.serving.bundle import BundlePaths

        reads = {f"--{flag}": Path(value) for flag in self.READ_FLAGS
                 if (value := getattr(self, flag)) and value != "-"
                 and not value.startswith("builtin:")}
        if self.model_def:
            reads["--model_def"] = self.model_def_parts()[0]
        writes = {f"--{flag}": Path(value) for flag in self.WRITE_FLAGS
                  if (value := getattr(self, flag)) and value != "-"}
        if self.output_model:
            bundle = {f"--output_model (the bundle's {what})": path for what, path in
                      BundlePaths.from_model_path(self.output_model).files().items()}
            reads_bundle = getattr(self, "script", None) in ("inference", "serve")
            (reads if reads_bundle else writes).update(bundle)
        writes.update(self.visual_outputs())
        writes.update(self.input_outputs()[0])  # beside --output: a COCO images file
        if self.profile_path() is not None:
            writes["--profile (the ONNX Runtime trace)"] = self.profile_path()
        for i, member in enumerate(self.ensemble_members()):
            reads[f"--ensemble (bundle {i + 1})"] = Path(member)
        return reads, writes

    # ------------------------------------------------------------------ summary

    def names(self) -> list[str]:
        """The flags of the script that parsed this Config (every field when none did)."""
        script = getattr(self, "script", None)
        return flags_for(script) if script else [f.name for f in fields(self)]

    def as_dict(self) -> dict:
        """The resolved settings of this script's flags (the report's config section)."""
        data = asdict(self)
        if self.image_size is not None:
            data["image_size"] = list(self.image_size)
        return {name: data[name] for name in self.names()}

    def report_options(self) -> "ReportOptions":
        """What the run's report takes of these flags (ttc/reporting/run.py's run_with_report):
        the config section, resolved now, before the stages run, as it always was."""
        from ttc.reporting.run import ReportOptions

        return ReportOptions(self.as_dict(), self.report_json, self.json, self.quiet,
                             "plots" in self.names(), self.plots_folder(), self.page_path(),
                             getattr(self, "script", None), self.output_model)

    def summary_lines(self, changed_only: bool = False) -> list[str]:
        """One line per setting, `*` marking those not at their defaults (only those when
        `changed_only`)."""
        from_network = getattr(self, "network_defaults", {})  # the network's own defaults
        data = self.as_dict()
        marked = {name: value != _default(name) and name not in from_network
                  for name, value in data.items()}
        data = {name: value for name, value in data.items() if marked[name] or not changed_only}
        width = max((len(n) for n in data), default=0)
        return [f"  {'*' if marked[name] else ' '} {name:<{width}} = {value!r}"
                for name, value in data.items()]

    def summary_block(self, every: bool) -> str:
        """The configuration summary a run logs: every setting (--log_level DEBUG), or only
        those not at their defaults (the report's config keeps them all)."""
        if every:
            return "configuration (* = not the default):\n" + "\n".join(self.summary_lines())
        lines = self.summary_lines(changed_only=True)
        return (f"configuration ({len(lines)} not at their defaults; all of them at "
                f"--log_level DEBUG and in the report's config){':' if lines else ''}" +
                "".join(f"\n{line}" for line in lines))


def _default(name: str) -> Any:
    default = FIELDS[name].default
    return list(default) if isinstance(default, tuple) else default




# ----------------------------------------------------------------------------- argument parsing


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2; a flag is taken only
    whole (no abbreviations: a flag added later must not change what a script's `--epoch`
    meant), in its dashed spelling too (`--dataset-path`), and a flag the script does not have
    is refused naming the flags probably meant (ttc/options/spelling.py)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None):
        known = self._option_string_actions
        argv = with_underscores(sys.argv[1:] if args is None else args, known)
        unknown = first_unknown_flag(argv, known)
        if unknown is not None:
            self.error(unknown_flag_message(unknown, known))
        return super().parse_known_args(argv, namespace)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


FIELDS = {f.name: f for f in fields(Config)}


def flags_for(script: str) -> list[str]:
    """The Config fields a script takes ("pipeline", "train", ...), in declaration order."""
    return [f.name for f in fields(Config) if script in f.metadata["scripts"]]


def build_parser(script: str, description: str, *, required: Sequence[str] = (),
                 epilog: str = "", aliases: dict[str, Sequence[str]] | None = None
                 ) -> OneLineParser:
    """An argparse parser for `script` ("pipeline", ...) exposing its Config fields, grouped as
    in GROUPS."""
    names = flags_for(script)
    parser = OneLineParser(prog=f"{script}.py", description=description, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for key, title in GROUPS.items():
        if any(FIELDS[n].metadata["group"] == key for n in names):
            groups[key] = parser.add_argument_group(title)
    for name in names:
        meta = FIELDS[name].metadata
        default = FIELDS[name].default
        flags = [f"--{name}", *((aliases or {}).get(name, ()))]
        text = meta["help_for"].get(script, meta["help"])
        kwargs: dict[str, Any] = {"dest": name, "help": _help_with_default(text, default),
                                  "required": name in required}
        if meta["type"] is not None:
            kwargs["type"] = meta["type"]
        if meta["type"] is parse_bool:  # --tta alone means --tta true
            kwargs.update(nargs="?", const=True)
        if meta["choices"] is not None:
            kwargs["choices"] = meta["choices"]
        if meta["metavar"] is not None:
            kwargs["metavar"] = meta["metavar"]
        if not kwargs["required"]:
            kwargs["default"] = argparse.SUPPRESS
        groups[meta["group"]].add_argument(*flags, **kwargs)
    return parser


def _help_with_default(text: str, default: Any) -> str:
    if default is None or default == "":
        return text
    shown = str(default).lower() if isinstance(default, bool) else default
    return f"{text} (default: {shown})"


def parse_config(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> Config:
    """Parse argv into a Config; flags not given keep the dataclass defaults. The Config
    remembers which script's flags it holds (its summary and report list only those)."""
    namespace = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    config = Config(**vars(namespace))
    config.script = parser.prog.removesuffix(".py")
    config.given = frozenset(vars(namespace))  # the flags on the command line
    return config


def start_cli(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> Config:
    """Parse, set up logging, validate, and log the configuration summary (stderr)."""
    from utils import LOG, setup_logging, stop_after

    config = parse_config(parser, argv)
    if config.quiet:  # nothing but errors
        config.log_level, config.no_progress = "ERROR", True
    setup_logging(config.log_level)
    config.validate()
    stop_after(config.timeout_s)  # the run's clock starts once its flags are read
    from ttc.inputs.limits import configure

    configure(config)
    LOG.info("%s", config.summary_block(every=config.log_level.upper() == "DEBUG"))
    return config


def markdown_reference() -> str:
    """docs/cli.md's flag tables, one per group, from the same metadata argparse uses (a test
    keeps docs/cli.md in step: python -c "import config; print(config.markdown_reference())")."""
    out = []
    letters = {name: letter for letter, name in SCRIPTS.items()}
    for group, title in GROUPS.items():
        out += [f"**{title}**", "", "| flag | default | scripts | meaning |", "|---|---|---|---|"]
        for f in fields(Config):
            meta = f.metadata
            if meta.get("group") != group:
                continue
            default = "—" if f.default in (None, "") else (
                str(f.default).lower() if isinstance(f.default, bool) else f.default)
            if isinstance(default, tuple):
                default = ",".join(map(str, default))
            meaning = meta["help"] + (f"; one of: {', '.join(map(str, meta['choices']))}"
                                      if meta.get("choices") else "")
            scripts = "".join(letters[s] for s in meta["scripts"])
            out.append(f"| `--{f.name}` | `{default}` | {scripts} | {meaning} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"
