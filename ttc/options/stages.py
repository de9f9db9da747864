"""What each stage reads of the flags. A stage's options are a dataclass composed of the flag
groups (ttc/options) it takes; the CLI copies them out of the whole `Config` with `view_of` and
hands the stage only those. Below the CLIs no function takes the whole Config (docs/design.md):
a stage that reads another stage's flag fails at once with an AttributeError in the tests,
instead of coupling two stages silently.

The views are flat (`options.epochs`, as on Config), so a function written for a view also
accepts any larger one, the whole Config included (tests may pass either)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ttc.options.batch import BatchFlags
from ttc.options.compress import CompressFlags
from ttc.options.data import DataFlags
from ttc.options.distributed import DistributedFlags
from ttc.options.export import ExportFlags
from ttc.options.fitting import FittingFlags
from ttc.options.iterative import IterativeFlags
from ttc.options.output import OutputFlags
from ttc.options.quantize import QuantizeFlags
from ttc.options.serve import ServeFlags
from ttc.options.sessions import RuntimeFlags
from ttc.options.shift import ShiftFlags
from ttc.options.teacher import TeacherFlags
from ttc.options.training import TYPE_FLAGS, TrainingFlags
from ttc.options.tta import TTAFlags
from ttc.options.ttt import TTTFlags

if TYPE_CHECKING:
    from ttc.testtime.tta import TTAOptions
    from ttc.testtime.ttt import TTTSettings

T = TypeVar("T")

# What a parse records beside the flags (config.parse_config): the script that parsed them and
# the flags given on its command line. A view keeps them: the summary and the manifest use them.
PARSE_RECORDS = ("script", "given")


def view_of(flags: Any, cls: type[T]) -> T:
    """The fields of `cls` (a stage's options) copied out of `flags` (the whole Config, or any
    larger view)."""
    view = cls(**{f.name: getattr(flags, f.name) for f in fields(cls)})  # type: ignore[arg-type]
    for name in PARSE_RECORDS:
        if hasattr(flags, name):
            setattr(view, name, getattr(flags, name))
    return view


class TestTimeOptions:
    """What the test-time methods take from the flags, for a view (or Config) holding the TTA,
    TTT, shift, runtime and batch groups."""

    def tta_options(self: Any) -> "TTAOptions":
        """What test-time augmentation takes from the flags."""
        from ttc.testtime.tta import TTAOptions

        return TTAOptions(self.tta_transforms, self.tta_merge, self.tta_threshold,
                          self.batch_size, self.seed, self.tta_plan)

    def ttt_settings(self: Any, kind: str) -> "TTTSettings":
        """What test-time training takes from the flags, for a model of preprocessing `kind`."""
        from ttc.testtime.ttt import TTTSettings

        return TTTSettings(self.ttt_method, self.ttt_mode, self.ttt_iterations,
                           self.ttt_learning_rate, self.ttt_bn_prior, self.ttt_reset_every,
                           self.batch_size, self.shift_names(kind),
                           self.shift_severity, self.seed, self.num_threads,
                           self.trust_model_code, self.ttt_guard, self.ttt_predict,
                           self.eval_stream, self.stream_passes)

    def check_test_time_compute(self: Any) -> None:
        """The test-time methods' flags, in the order Config.validate and ServeOptions.validate
        check them."""
        self.check_steps()
        self.check_passes()
        self.check_tta()
        self.check_ttt()
        self.check_stream(self.ttt)
        self.check_network(self.arch, self.batch_size)
        self.check_iterative()

    def ray_workers(self: Any) -> int:
        """--num_workers; by default 2, or 1 where a local cluster cannot hold two."""
        return self.workers(self.ray_threads())


class ModelTypeChecks:
    """The flags against the model type (known from the flags, or from a bundle's manifest),
    for Config (every script) and ServeOptions (the Python API, which has no Config): one copy."""

    def validate_tta(self: Any, model_type: str) -> None:
        """--tta_transforms and --eval_shift against the model type, after the flags that model
        type does not take (Task.refused_flags) and its own checks (Parts.flag_checks, given the
        flags they read), and --input's mask folder for a type that writes masks (Task.masks)."""
        from ttc.tasks.registry import task_for

        self.refuse_flags_for(model_type)
        task = task_for(model_type)
        task.part("flag_checks")(flag_check_view(self))
        if task.masks:
            self.check_input_folders(segmenter=True)
        if self.tta or self.tta_transforms:  # the one vocabulary: the transforms its kind takes
            from ttc.testtime.transforms import parse_transform_specs

            parse_transform_specs(self.tta_transforms, task.kind, task.default_tta)
        if self.eval_shift:
            self.shift_names(task.kind)

    def refuse_flags_for(self: Any, model_type: str) -> None:
        """A flag given (on the command line, else any of the script's flags) with a value other
        than its default that `model_type` does not take (its entry's refused_flags), or that is
        another type's own: one line naming it, exit 2, before any work."""
        from ttc.tasks.registry import TASKS, task_for
        from utils import ConfigError, with_article

        task = task_for(model_type)
        defaults = {f.name: f.default for f in fields(self)}
        script = getattr(self, "script", None)
        named = getattr(self, "given", None)
        if named is None:
            named = {f.name for f in fields(self)
                     if script is None or script in f.metadata["scripts"]}
        owner: dict = {}  # a flag several types own is each one's; another type's names the first
        for other in TASKS:
            for name in other.own_flags if other is not task else ():
                if name not in task.own_flags:
                    owner.setdefault(name, other)
        given = [name for name in (*task.refused_flags, *owner)
                 if name in named and getattr(self, name) != defaults[name]]
        if given and given[0] in owner:  # a flag of one other type: name it
            other = owner[given[0]]
            raise ConfigError(f"--{given[0]} is for {with_article(other.name)}, not "
                              f"{with_article(model_type)}",
                              f"drop it, or use --model_type {other.name} (docs/{other.guide})")
        if given:
            flags = ", ".join(f"--{name}" for name in given[:4])
            verb, them = ("does", "it") if len(given) == 1 else ("do", "them")
            article = "an" if model_type[0] in "aeiou" else "a"
            raise ConfigError(f"{flags} {verb} not apply to {article} {model_type}",
                              f"drop {them} (docs/{task.guide} lists what {article} "
                              f"{model_type} takes)")


def flag_check_view(flags: Any) -> "FlagCheckOptions":
    """What a type's flag checks read; a script without a group's flags (serve.py takes no
    --opset) is checked at that group's defaults, which it runs with."""
    return FlagCheckOptions(**{f.name: getattr(flags, f.name, f.default)
                               for f in fields(FlagCheckOptions)})


# ---------------------------------------------------------------- the training stage (train.py)


@dataclass
class TrainingOptions(OutputFlags, DistributedFlags, BatchFlags, RuntimeFlags, IterativeFlags,
                      TTAFlags, ExportFlags, CompressFlags, TeacherFlags, FittingFlags,
                      *TYPE_FLAGS[::-1], TrainingFlags, DataFlags):
    """What training reads (ttc/training, ttc/nets, ttc/distributed, a type's trainer): the
    network, the flags a model type declares itself (Task.flags), its fitting, the teacher, --prune/--qat, the TTA transforms it trains on and the
    manifest records, a detector's NMS (its validation runs the graph's), --ensemble_size,
    --engine ray's workers and checkpoints (beside --output_model), threads and progress bars."""


# ---------------------------------------------------------------- export and quantization


@dataclass
class ExportOptions(OutputFlags, RuntimeFlags, IterativeFlags, TTAFlags, QuantizeFlags,
                    ExportFlags, TrainingFlags, DataFlags):
    """What export reads (ttc/convert, a type's exporter): the bundle and its data, the opset,
    the tolerance and a detector's NMS, the TTA graph's transforms, the MC-dropout passes, the
    numeric check's batch and threads; and every flag export.py takes, which a failed export's
    hint repeats (ttc/convert/failure.py: --max_accuracy_drop, the compressed variants' gate)."""


@dataclass
class QuantizeOptions(RuntimeFlags, QuantizeFlags, TrainingFlags, DataFlags):
    """What quantization reads (ttc/compress/quantization.py): the int8 and fp16 flags, the
    runtime it times on (--profile, --ep), the batch size and the calibration sample's seed."""


@dataclass
class FlagCheckOptions(BatchFlags, ShiftFlags, TTTFlags, TTAFlags, ExportFlags):
    """What a model type's own flag checks read (its Parts.flag_checks, from
    config.Config.validate_tta): its test-time compute, --input, and a detector's --opset."""


# ---------------------------------------------------------------- inference, serving, report


@dataclass
class InferenceOptions(TestTimeOptions, OutputFlags, BatchFlags, RuntimeFlags, IterativeFlags,
                       ShiftFlags, TTTFlags, TTAFlags, TrainingFlags, DataFlags):
    """What the inference stage reads (ttc/online/evaluate.py, predict.py, the test-time methods,
    a type's Parts.test_split and Parts.new_input): the sessions, --input and --engine ray, the
    test-time methods and --eval_shift, --batch_size, the seed, a --model_def bundle's trust,
    the bundle and the report file (--profile's trace beside it). The graph (--variant,
    --quantized, --fp16) and the flags' checks against the bundle's model type are the CLI's."""

    def profile_path(self) -> Path | None:
        """Where --profile's raw trace goes (config.Config.profile_path, for the scripts that
        run this stage, inference.py and pipeline.py, which both take --profile)."""
        return self.trace_destination() if self.profile else None


@dataclass
class ServeOptions(ModelTypeChecks, TestTimeOptions, OutputFlags, ServeFlags, BatchFlags,
                   RuntimeFlags, IterativeFlags, ShiftFlags, TTTFlags, TTAFlags, TrainingFlags,
                   DataFlags):
    """What serving reads (ttc/online/app.py, ray_serve.py, the Predictor and its served part):
    the server, the graph (--variant), the test-time method it predicts with, the sessions,
    --top_k and a detector's --min_score, the batch a test-time method adapts on, the input
    bounds a replica takes, the bundle."""

    def validate(self) -> "ServeOptions":
        """serve.py's checks of these flags, in config.Config.validate's order, for the Python
        API (Predictor.load), which has no Config; the other stages' flags keep their defaults."""
        self.check_data()
        self.check_memory()
        self.check_text_length()
        self.check_rates()
        self.check_ensemble_size()
        self.check_test_time_compute()
        self.check_batch(self.ray_threads, self.profile, self.adapts_online(), True)
        self.check_serve(self.adapts_online())
        self.check_runtime()
        self.check_outputs()
        return self

    def check_input_folders(self, segmenter: bool = False) -> None:
        """Serving writes no files: no --input folders to check (a type's flag checks ask)."""
