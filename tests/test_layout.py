"""The shape of the code base: the root holds the CLIs and the card, everything else the ttc
package; no import cycle among all modules (function-level imports included), the leaves stay
leaves, each CLI runs alone, and nothing points outside the repository."""
from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "ttc"
CLIS = {"pipeline", "train", "export", "quantize", "inference", "report", "serve"}
ROOT_MODULES = CLIS | {"config", "utils"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in [*REPO.glob("*.py"), *REPO.glob(f"{PACKAGE}/**/*.py")]}


def imported_modules(node: ast.AST) -> set[str]:
    """The repository modules one import statement names (`from ttc.x import y` names ttc.x.y
    where y is a module, else ttc.x)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        inner = {f"{node.module}.{alias.name}" for alias in node.names}
        return {name for name in inner if name in MODULES} or {node.module}
    return set()


def import_graph() -> dict[str, set[str]]:
    """module → the repository modules it imports anywhere in its code."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            imported |= imported_modules(node)
        graph[name] = {m for m in imported if m in MODULES and m != name}
    return graph


def short(graph: dict[str, set[str]], name: str) -> set[str]:
    """What the layer module `name` (its last part; a model type's own code of the same name,
    e.g. ttc.tasks.segment.metrics, is not it) imports, by last parts."""
    [full] = [m for m in graph if m.rpartition(".")[2] == name and m != PACKAGE
              and not is_type_code(m)]
    return {m.rpartition(".")[2] for m in graph[full]}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_root_holds_only_the_command_line_tools_and_the_card():
    assert {p.stem for p in REPO.glob("*.py")} == ROOT_MODULES


def test_every_package_folder_is_a_package_that_says_what_lives_there():
    for folder in [REPO / PACKAGE, *(p for p in (REPO / PACKAGE).iterdir() if p.is_dir()
                                     and p.name != "__pycache__")]:
        init = folder / "__init__.py"
        assert init.is_file(), folder
        assert ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))), init


def test_the_package_imports_no_command_line_tool():
    """The package may use the card (config, utils); the CLIs chain the package, never the
    reverse."""
    graph = import_graph()
    offenders = {name: graph[name] & CLIS for name in graph
                 if name.startswith(PACKAGE + ".") and graph[name] & CLIS}
    assert offenders == {}


# What each folder of the package may import from outside itself (docs/design.md's module map).
ALLOWED = {
    "tasks": set(),
    "inputs": {"utils", "ttc.nets.hf", "ttc.tasks.*"},
    "nets": {"utils", "ttc.options.stages", "ttc.inputs.*", "ttc.serving.bundle",
             "ttc.testtime.tta",
             "ttc.reporting.metrics", "ttc.tasks.*", "ttc.options.fitting"},
    # the training stage: the type's trainer here or on Ray Train, compressed, calibrated
    "training": {"utils", "ttc.options.stages", "ttc.inputs.*", "ttc.nets.*",
                 "ttc.serving.bundle", "ttc.tasks.*", "ttc.options.training",
                 "ttc.distributed.driver", "ttc.compress.variants", "ttc.testtime.calibrate",
                 "ttc.testtime.transforms", "ttc.reporting.metrics", "ttc.serving.stages"},
    "serving": {"utils", "ttc.inputs.*", "ttc.reporting.evaluation", "ttc.tasks.*"},
    "testtime": {"utils", "ttc.inputs.*", "ttc.serving.*", "ttc.nets.*", "ttc.reporting.*",
                 "ttc.tasks.*"},
    # the registry, to ask the model type that made a report for its report part (never a
    # type's code: ttc/reporting/kinds.py resolves it through the entry's Parts)
    "reporting": {"utils", "ttc.tasks.registry", "ttc.tasks.base"},
    # the export stage: tracing, checks, extra graphs and the bundle (the classifiers' exporter;
    # a type's own through its Parts.exporter, found in the registry), compressed variants
    "convert": {"utils", "ttc.options.stages", "ttc.inputs.*", "ttc.serving.*", "ttc.nets.*",
                "ttc.testtime.*", "ttc.compress.*", "ttc.reporting.metrics", "ttc.options.export",
                "ttc.tasks.registry"},
    # quantization: the per-layer diagnosis of int8 (convert) and the classifier's scorer (metrics)
    "compress": {"utils", "ttc.options.stages", "ttc.inputs.*", "ttc.nets.*", "ttc.serving.*",
                 "ttc.options.compress", "ttc.tasks.*", "ttc.convert.diagnosis",
                 "ttc.reporting.metrics"},
    # (stages.py's TestTimeOptions builds the test-time methods' options, imported lazily)
    "options": {"utils", "ttc.inputs.*", "ttc.serving.runtime", "ttc.reporting.sections",
                "ttc.tasks.*", "ttc.testtime.tta", "ttc.testtime.ttt", "ttc.testtime.transforms"},
    # --engine ray training: the classifier's loop (nets) on Ray Train, through serving's cluster
    "distributed": {"utils", "ttc.options.stages", "ttc.inputs.*", "ttc.nets.*",
                    "ttc.serving.cluster",
                    "ttc.tasks.*"},
    "online": {"utils", "ttc.inputs.*", "ttc.serving.*", "ttc.testtime.*", "ttc.tasks.*",
               "ttc.options.*", "ttc.reporting.*"},
}


# A model type may keep its code in a folder of its own beside its entry (ttc/tasks/TYPE/, the
# entry in its __init__.py, referenced by its Parts): that code uses the layers as testtime does.
TYPE_CODE = {"utils", "ttc.options.stages", "ttc.options.fields", "ttc.inputs.*", "ttc.serving.*", "ttc.nets.*",
             "ttc.reporting.*",
             "ttc.testtime.*", "ttc.convert.*", "ttc.compress.quantizing"}


def is_type_code(module: str) -> bool:
    """ttc.tasks.TYPE.NAME: a model type's own code, not an entry (entries are leaves)."""
    return module.startswith(f"{PACKAGE}.tasks.") and module.count(".") >= 3


def allowed(rules: set[str], module: str) -> bool:
    return module in rules or any(rule.endswith(".*") and module.startswith(rule[:-1])
                                  for rule in rules)


def test_each_folder_imports_only_what_the_module_map_allows():
    graph = import_graph()
    offenders = {}
    for name, deps in graph.items():
        if not name.startswith(PACKAGE + ".") or name.count(".") < 2:
            continue
        folder = name.split(".")[1]
        outside = {d for d in deps if not d.startswith(f"{PACKAGE}.{folder}.")}
        rules = TYPE_CODE if is_type_code(name) else ALLOWED[folder]
        if bad := {d for d in outside if not allowed(rules, d)}:
            offenders[name] = bad
    assert offenders == {}


def test_the_model_type_entries_import_no_type_s_code():
    """Entries stay plain data every folder may read: no entry imports the code its Parts name."""
    graph = import_graph()
    offenders = {name: {d for d in deps if is_type_code(d)} for name, deps in graph.items()
                 if name.startswith(f"{PACKAGE}.tasks") and not is_type_code(name)
                 and any(is_type_code(d) for d in deps)}
    assert offenders == {}


def test_every_model_type_s_parts_resolve_to_its_code():
    """A moved reader, row encoder, network table or evaluation fails here, not in a user's run."""
    from ttc.tasks.base import Parts
    from ttc.tasks.registry import TASKS

    roles = [f.name for f in dataclasses.fields(Parts)]
    assert roles[:7] == ["reader", "rows", "networks", "modules", "evaluation", "trainer",
                         "served"]
    for task in TASKS:
        for role in ("reader", "rows", "evaluation", "trainer", "served"):
            assert callable(task.part(role)), (task.name, role)
        assert list(task.part("networks")) == list(task.archs), task.name
        assert all(callable(build) for build in task.part("networks").values())
        assert all(isinstance(cls, type) for cls in task.part("modules").values())
    with pytest.raises(ModuleNotFoundError):
        dataclasses.replace(TASKS[0], parts=dataclasses.replace(
            TASKS[0].parts, reader="ttc.inputs.moved_away:load")).part("reader")


def test_the_import_graph_sees_the_package():
    graph = import_graph()
    assert "ttc.online.evaluate" in graph["inference"]
    assert "ttc.inputs.tables" in graph["ttc.inputs.preprocess"]


def test_no_import_cycle_among_all_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_leaf_modules_stay_leaves():
    graph = import_graph()
    assert short(graph, "utils") == set()
    assert short(graph, "metrics") == set()
    assert short(graph, "limits") <= {"utils"}
    assert short(graph, "runtime") <= {"utils", "preprocess", "limits"}
    assert short(graph, "tables") <= {"utils", "limits", "formats"}
    assert short(graph, "formats") == set()  # the flags' choices read it without numpy
    assert short(graph, "profiling") <= {"utils", "runtime"}


# What no CLI's --help may import: it builds the parser from the option tables only (#66: the
# numeric and serving libraries were most of a --help's 0.7-1.1 s).
NOT_AT_HELP = ("numpy", "pandas", "pyarrow", "onnx", "onnxruntime", "torch", "dspy",
               "transformers", "matplotlib", "PIL", "sklearn", "fastapi", "uvicorn", "ray")


@pytest.mark.parametrize("script", ["pipeline.py", "train.py", "export.py", "quantize.py",
                                    "inference.py", "report.py", "serve.py"])
def test_each_stage_runs_alone_and_its_help_stays_light(script):
    """`python X.py --help` from the root works, and imports none of NOT_AT_HELP, not even
    numpy (the package's moves must not pull a heavy module into a CLI's start)."""
    code = ("import runpy, sys\n"
            f"sys.argv = [{script!r}, '--help']\n"
            f"try:\n    runpy.run_path({script!r}, run_name='__main__')\n"
            "except SystemExit as exit:\n    assert exit.code in (0, None), exit.code\n"
            "print('imported:' + ','.join(sorted({m.partition('.')[0] for m in sys.modules} & "
            f"{set(NOT_AT_HELP)!r})))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout
    assert result.stdout.rstrip().splitlines()[-1] == "imported:", result.stdout[-300:]


def test_nothing_refers_outside_the_repository():
    texts = [*REPO.glob("*.py"), *REPO.glob(f"{PACKAGE}/**/*.py"), *REPO.glob("tests/*.py"), *REPO.glob("bench/*.py"),
             *REPO.glob("docs/*.md"), REPO / "README.md"]
    offenders = [str(p.relative_to(REPO)) for p in texts
                 if any(word in p.read_text(encoding="utf-8")
                        for word in ("../" "shared", "DESIGN" ".md", '/ "shared"'))
                 and p.name != "test_layout.py"]
    assert offenders == []


def test_readme_is_short_and_its_doc_links_resolve():
    import re

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    assert readme.count("```bash") >= 2 and ".venv/bin/python -m pytest -q" in readme
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert links and all((REPO / link).is_file() for link in links), links


# The keys only a model type's report holds (a segmenter's pixel figures, a detector's mAPs):
# ttc/reporting asks the type that made a report (its Parts.report) instead of looking for them.
TYPE_REPORT_KEYS = ("mean_iou", "pixel_acc", "val_map", "train_map", '"map', "map50")


def test_reporting_sniffs_no_model_type_s_keys():
    """Not one report key-sniff in ttc/reporting: the summary, the page and the plots get a
    type's rows, labels, renderers and plots from its report part (ttc/tasks/TYPE/report.py)."""
    offenders = {str(path.relative_to(REPO)): [key for key in TYPE_REPORT_KEYS if key in text]
                 for path in sorted((REPO / PACKAGE / "reporting").glob("*.py"))
                 if any(key in (text := path.read_text(encoding="utf-8"))
                        for key in TYPE_REPORT_KEYS)}
    assert offenders == {}


def test_every_model_type_s_report_part_answers_the_reporting_layer():
    """Each type's report part (Parts.report) is a ClassifierReport, the interface ttc/reporting
    asks; it draws only plots the sections' table names, and every plot of the table is drawn by
    plots.py or by a type; a report names its type, or a type recognises it, or it is a
    classifier's."""
    from ttc.reporting import plots
    from ttc.reporting.classifier_report import REPORT, ClassifierReport
    from ttc.reporting.kinds import report_part
    from ttc.reporting.sections import PLOT_NAMES
    from ttc.tasks.base import Parts
    from ttc.tasks.registry import TASKS

    assert "report" in [f.name for f in dataclasses.fields(Parts)]
    parts = {task.name: task.part("report") for task in TASKS}
    assert all(isinstance(part, ClassifierReport) for part in parts.values())
    own = {name for part in parts.values() for name in part.plots()}
    assert own <= set(PLOT_NAMES)
    assert {name for name in PLOT_NAMES if name not in own} <= set(vars(plots))
    for name, part in parts.items():
        assert report_part({"dataset": {"model_type": name}}) is part
        assert report_part({"config": {"model_type": name}}) is part
    assert report_part({}) is REPORT and report_part({"dataset": {"model_type": 3}}) is REPORT
    assert report_part({"evaluation": {"mean_iou": 0.5}}) is parts["image_segmenter"]
    assert report_part({"predictions": {"boxes_per_class": {}}}) is parts["object_detector"]



# ----------------------------------------------------------------------------- issue 63's goals

CLI_MAX_LINES = 400


def test_no_module_outside_the_model_types_imports_a_type_s_code():
    """A CLI or shared layer reaches a model type's code only through its entry's Parts."""
    graph = import_graph()
    offenders = {name: {d for d in deps if is_type_code(d)} for name, deps in graph.items()
                 if not name.startswith(f"{PACKAGE}.tasks") and any(is_type_code(d) for d in deps)}
    assert offenders == {}


def type_branches(path: Path, words: set[str]) -> list[str]:
    """Comparisons with a model type's name or preprocessing kind, and reads of `.dense`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            constants = [n.value for n in sides if isinstance(n, ast.Constant)]
            constants += [e.value for n in sides if isinstance(n, (ast.Tuple, ast.List, ast.Set))
                          for e in n.elts if isinstance(e, ast.Constant)]
            found += [f"{path.name}:{node.lineno} compares with {c!r}" for c in constants
                      if c in words]
        elif isinstance(node, ast.Attribute) and node.attr == "dense" and \
                isinstance(node.ctx, ast.Load) and isinstance(node.value, ast.Name) and \
                node.value.id in ("task", "self"):
            found.append(f"{path.name}:{node.lineno} reads .dense")
    return found


def test_no_command_line_tool_or_shared_layer_branches_on_a_model_type():
    """The stages ask the type (its Task's attributes and Parts) instead of testing which one it
    is. The input roles ("image", "text", "feature") are a type's attribute, not its name; the
    manifest's schema checks each kind's records by kind, by design."""
    from ttc.tasks.registry import TASKS

    roles = {task.input_role for task in TASKS}
    words = {task.name for task in TASKS} | {task.kind for task in TASKS} - roles - {"tabular"}
    files = [*REPO.glob("*.py"), *(p for p in (REPO / PACKAGE).rglob("*.py")
                                   if "tasks" not in p.relative_to(REPO / PACKAGE).parts
                                   and p.name != "manifest_schema.py")]
    offenders = [hit for path in sorted(files) for hit in type_branches(path, words)]
    assert offenders == []


def test_the_branch_finder_finds_a_branch(tmp_path):
    path = tmp_path / "cli.py"
    path.write_text('if kind == "detection" or task.dense:\n    pass\n')
    assert len(type_branches(path, {"detection"})) == 2


@pytest.mark.parametrize("script", sorted(CLIS))
def test_each_command_line_tool_parses_calls_and_prints(script):
    lines = len((REPO / f"{script}.py").read_text(encoding="utf-8").splitlines())
    assert lines <= CLI_MAX_LINES, f"{script}.py has {lines} lines: move its machinery to ttc/"


def test_tests_and_benchmarks_import_the_package_not_the_command_line_tools():
    offenders = {}
    for path in [*REPO.glob("tests/*.py"), *REPO.glob("bench/*.py")]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if bad := {m for node in ast.walk(tree) for m in imported_modules(node)} & CLIS:
            offenders[str(path.relative_to(REPO))] = bad
    assert offenders == {}


def config_annotations(path: Path) -> list[str]:
    """Parameters annotated with the whole Config (`Config`, `"Config"`, `config.Config`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            for arg in args:
                text = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if text.strip("'\"") in {"Config", "config.Config"}:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}({arg.arg})")
    return found


def test_no_layer_below_the_command_line_tools_takes_the_whole_config():
    """docs/design.md: a stage takes its own options (ttc/options/stages.py), copied out of the
    Config by the CLI; the package neither imports config.py nor names Config in a signature."""
    graph = import_graph()
    importers = sorted(name for name, deps in graph.items()
                       if name.startswith(PACKAGE + ".") and "config" in deps)
    assert importers == []
    signatures = [hit for path in (REPO / PACKAGE).rglob("*.py")
                  for hit in config_annotations(path)]
    assert signatures == []


def test_the_signature_finder_finds_a_config_parameter(tmp_path):
    path = REPO / "ttc" / "__config_probe__.py"
    try:
        path.write_text("def f(config: 'Config', x: int) -> None:\n    pass\n", encoding="utf-8")
        assert config_annotations(path) == ["ttc/__config_probe__.py:1 f(config)"]
    finally:
        path.unlink()


def test_a_stage_s_view_holds_its_own_flags_and_not_another_stage_s():
    """Reading another stage's flag from a stage's options fails at once."""
    import config
    from ttc.options import stages

    whole = config.Config(epochs=3, port=9001)
    whole.script = "pipeline"
    views = [getattr(stages, name) for name in dir(stages) if name.endswith("Options")
             and dataclasses.is_dataclass(getattr(stages, name))]
    assert len(views) >= 4, "a view per stage: training, export, quantization, inference, serving"
    for view_class in views:
        view = stages.view_of(whole, view_class)
        assert view.script == "pipeline"
        names = {f.name for f in dataclasses.fields(view)}
        assert names < {f.name for f in dataclasses.fields(whole)}
        for f in dataclasses.fields(view):
            assert getattr(view, f.name) == getattr(whole, f.name)
    training = stages.view_of(whole, stages.TrainingOptions)
    assert training.epochs == 3
    with pytest.raises(AttributeError):
        training.port  # noqa: B018  (serve.py's flag)
