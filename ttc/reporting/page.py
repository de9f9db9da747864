"""The run's report as one self-contained HTML page (report.html beside the report JSON): the
sections of the text summary as tables, plus the plots embedded as data URIs. No script, no
external font, stylesheet or image: the page opens offline, from an artifact or a mail.

Every string taken from the report (labels, paths, file names, verdicts, error messages, config
values, dict keys) goes through `_esc`; markup built here is an `_Html` string, the only kind
inserted as is. stdlib + utils only; which sections, in what order, under which title, with which
plots: the table of ttc/reporting/sections.py. report.py passes its label lists (`summary_keys`,
`prediction_keys`); without them each section shows its plain keys under their own names.
The model type that made the report (its report part, ttc/reporting/kinds.py) adds its own rows,
renderers and headline; its renderers build on the helpers named at the end of this module.
"""
from __future__ import annotations

import base64
import html
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from ttc.reporting.classifier_report import ClassifierReport
from ttc.reporting.kinds import report_part
from ttc.reporting.sections import PLOT_CAPTIONS, SECTION, SECTIONS, KeyLabels, Section
from utils import atomic_write_text

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_MATRIX_CLASSES = 20  # a bigger confusion matrix is left to its plot
LONG_VALUE = 48  # characters: a longer value gets a row of its own
CONFIG_TITLE = "Configuration"  # the run's settings, last on the page
TITLES = {**{section.key: section.title for section in SECTIONS}, "config": CONFIG_TITLE}
EVALUATION_KEYS = [("split", "split"), ("samples", "samples"), ("accuracy", "accuracy"),
                   ("macro_f1", "macro-F1"), ("balanced_accuracy", "balanced accuracy"),
                   ("ece", "ECE (15 bins)"), ("baseline_accuracy", "baseline accuracy"),
                   ("baseline_class", "baseline class (always answered)"),
                   ("baseline_source", "baseline counted on")]
EXAMPLE_SIDE = 96  # CSS pixels: the longer side of an example picture on the page
# an example's picture as the report holds it; anything else is not put in an <img>
PNG_DATA_URL = re.compile(r"data:image/png;base64,[A-Za-z0-9+/]+={0,2}")
# the calibration section's before/after rows: (key prefix of `_before` and `_after`, label)
CALIBRATION_METRICS = [("accuracy", "accuracy"), ("mean_confidence", "mean confidence"),
                       ("ece", "ECE"), ("nll", "NLL")]

CSS = """
:root { color-scheme: light; }
body { margin: 0; background: #f4f5f7; color: #1d2330;
  font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial,
  sans-serif; }
main { max-width: 1100px; margin: 0 auto; padding: 20px 20px 48px; }
h1 { font-size: 26px; margin: 0 0 2px; }
h2 { font-size: 19px; margin: 0 0 10px; }
h3 { font-size: 15px; margin: 16px 0 6px; }
section, header.headline { background: #fff; border: 1px solid #dde1e7; border-radius: 8px;
  padding: 16px 20px; margin: 14px 0; }
nav { font-size: 13px; margin: 6px 0 0; display: flex; flex-wrap: wrap; gap: 4px 14px; }
nav a { color: #2f5bb7; text-decoration: none; white-space: nowrap; }
.sub { color: #4a5568; margin: 0; overflow-wrap: anywhere; }
.wrap { overflow-x: auto; }
table { border-collapse: collapse; margin: 6px 0 12px; font-size: 14px; }
th, td { padding: 4px 10px; border-bottom: 1px solid #e6e9ee; text-align: left;
  vertical-align: top; overflow-wrap: break-word; }
thead th { background: #eef1f5; font-weight: 600; white-space: nowrap; }
tbody tr:nth-child(even) { background: #fafbfc; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap;
  overflow-wrap: normal; }
table.kv th { font-weight: normal; color: #4a5568; min-width: 10em; max-width: 18em; }
table.kv th.second { padding-left: 32px; }
table.kv td { max-width: 60em; font-variant-numeric: tabular-nums; }
tr.kept td { font-weight: 600; }
table.cm td.num { min-width: 2.2em; }
table.cm td.diag { font-weight: 700; }
table.cm th { font-size: 13px; }
.banner { border-radius: 8px; padding: 10px 16px; margin: 0 0 6px; font-weight: 600;
  overflow-wrap: anywhere; }
.banner.ok { background: #e6f4ea; border: 1px solid #9fd3ae; }
.banner.error { background: #fdecea; border: 1px solid #f1a9a0; color: #8a1c12; }
.banner.other { background: #fff6db; border: 1px solid #e8c55a; }
.stats { display: flex; flex-wrap: wrap; gap: 10px; margin: 12px 0; }
.stat { border: 1px solid #dde1e7; border-radius: 6px; padding: 6px 14px; min-width: 110px; }
.stat .v { display: block; font-size: 22px; font-weight: 600;
  font-variant-numeric: tabular-nums; }
.stat .k { font-size: 12px; color: #5a6475; }
.verdict { font-size: 17px; font-weight: 600; border-left: 6px solid #2f9e58;
  background: #e9f6ee; padding: 10px 14px; margin: 12px 0; overflow-wrap: anywhere; }
.verdict.bad { border-left-color: #c92a1a; background: #fdecea; }
.warnings, .note { background: #fff6db; border: 1px solid #e8c55a; border-left: 6px solid #d9a400;
  padding: 8px 14px; margin: 10px 0; overflow-wrap: anywhere; }
.warnings ul { margin: 4px 0; padding-left: 20px; }
p.line { margin: 4px 0 8px; overflow-wrap: anywhere; }
.row { display: flex; flex-wrap: wrap; gap: 0 40px; align-items: flex-start; }
.plots { display: grid; grid-template-columns: repeat(auto-fit, minmax(440px, 1fr)); gap: 12px; }
figure { margin: 10px 0; }
figure img { display: block; max-width: 100%; height: auto; border: 1px solid #e6e9ee; }
img { max-width: 100%; height: auto; }
figcaption { font-size: 13px; color: #5a6475; margin-top: 4px; }
.examples { display: flex; flex-wrap: wrap; gap: 10px 28px; margin: 8px 0 12px; }
.example h4 { font-size: 13px; font-weight: 600; margin: 0 0 2px; }
.example .trio { display: flex; gap: 8px; }
.example figure { margin: 0; text-align: center; }
.example figure img { image-rendering: pixelated; border: 1px solid #c9ced6;
  background: #000; }
.example figcaption { margin-top: 2px; font-size: 12px; }
details summary { cursor: pointer; font-weight: 600; }
footer { color: #5a6475; font-size: 13px; margin: 14px 2px; }
"""


class _Html(str):
    """Markup built by this module (user strings already escaped in it): inserted as is."""


class _NumHtml(_Html):
    """Markup of a number (a cost ratio): right-aligned like the numbers."""


def _esc(value: Any) -> _Html:
    return _Html(html.escape(str(value), quote=True))


def _fmt(value: Any) -> str:
    """Like report._fmt (floats to 4 significant digits, lists joined), but big floats as
    grouped integers (21,044 rather than 2.104e+04) and dicts as JSON."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if 1e4 <= abs(value) < 1e15:
            return f"{value:,.0f}"
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value, default=str)
    return str(value)


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _td(value: Any) -> str:
    if isinstance(value, _Html):
        return f'<td class="num">{value}</td>' if isinstance(value, _NumHtml) else \
            f"<td>{value}</td>"
    if value is None:
        return "<td></td>"
    return f'<td class="num">{_esc(_fmt(value))}</td>' if _is_number(value) else \
        f"<td>{_esc(_fmt(value))}</td>"


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]], cls: str = "",
           row_classes: Sequence[str] | None = None) -> _Html:
    """A table; header and cell values are escaped (unless `_Html`), numbers right-aligned."""
    rows = list(rows)
    head = "".join(f"<th>{_esc(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        mark = f' class="{row_classes[i]}"' if row_classes and row_classes[i] else ""
        body.append(f"<tr{mark}>" + "".join(_td(v) for v in row) + "</tr>")
    klass = f' class="{cls}"' if cls else ""
    return _Html(f'<div class="wrap"><table{klass}><thead><tr>{head}</tr></thead>'
                 f"<tbody>{''.join(body)}</tbody></table></div>")


def _kv_table(pairs: Sequence[tuple[str, Any]]) -> _Html:
    """Label/value rows; six or more short values in two column pairs (read down), long values
    (verdicts, paths) on full-width rows below."""
    if not pairs:
        return _Html("")

    def value(v: Any) -> str:
        return v if isinstance(v, _Html) else _esc(_fmt(v))

    short = [(k, v) for k, v in pairs if len(_fmt(v)) <= LONG_VALUE]
    long = [(k, v) for k, v in pairs if len(_fmt(v)) > LONG_VALUE]
    if len(short) < 6:
        short, long = [], pairs
    half = (len(short) + 1) // 2
    rows = []
    for left, right in zip(short[:half], short[half:] + [("", "")]):
        rows.append(f"<tr><th>{_esc(left[0])}</th><td>{value(left[1])}</td>"
                    f'<th class="second">{_esc(right[0])}</th><td>{value(right[1])}</td></tr>')
    span = ' colspan="3"' if short else ""
    rows += [f"<tr><th>{_esc(k)}</th><td{span}>{value(v)}</td></tr>" for k, v in long]
    return _Html(f'<div class="wrap"><table class="kv"><tbody>{"".join(rows)}</tbody>'
                 "</table></div>")


def _plain(value: Any) -> bool:
    """A value a key/value row can show: a scalar or a non-empty list of scalars."""
    if isinstance(value, (str, int, float, bool)):
        return True
    return isinstance(value, list) and bool(value) and all(
        isinstance(v, (str, int, float, bool)) for v in value)


def _pairs(data: Mapping, keys: KeyLabels | None,
           skip: Iterable[str] = ()) -> list[tuple[str, Any]]:
    """(label, value) for each key of `keys` with a value; without `keys`, each plain key."""
    if keys is None:
        skip = set(skip)
        keys = [(k, str(k).replace("_", " ")) for k, v in data.items()
                if k not in skip and _plain(v)]
    return [(label, data[key]) for key, label in keys if data.get(key) is not None]


def _section(name: str, title: str, parts: Iterable[str]) -> _Html:
    return _Html(f'<section id="{_esc(name)}"><h2>{_esc(title)}</h2>'
                 + "".join(p for p in parts if p) + "</section>")


def _line(text: str) -> _Html:
    return _Html(f'<p class="line">{_esc(text)}</p>')


def _labelled_line(label: str, text: Any) -> _Html:
    return _Html(f'<p class="line"><strong>{_esc(label)}:</strong> {_esc(_fmt(text))}</p>')


def _ratio(value: Any) -> _Html | None:
    return _NumHtml(_esc(f"{value:.2f}x")) if _is_number(value) else None


class _Plots:
    """The plot PNGs as data URIs; each placed once, the ones no section placed at the end."""

    def __init__(self, plots: Mapping[str, Any] | None) -> None:
        self.uris: dict[str, str] = {}
        for name, path in (plots or {}).items():
            if not path:
                continue
            try:
                data = Path(path).read_bytes()
            except OSError:
                continue  # a missing plot is left out
            if data.startswith(PNG_SIGNATURE):
                self.uris[str(name)] = ("data:image/png;base64,"
                                        + base64.b64encode(data).decode("ascii"))
        self.placed: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.uris and name not in self.placed

    def figures(self, *names: str) -> _Html:
        figures = []
        for name in names:
            if not self.has(name):
                continue
            self.placed.add(name)
            caption = PLOT_CAPTIONS.get(name, name.replace("_", " "))
            figures.append(f'<figure><img src="{self.uris[name]}" alt="{_esc(caption)}">'
                           f"<figcaption>{_esc(caption)}</figcaption></figure>")
        if not figures:
            return _Html("")
        return _Html(('<div class="plots">' if len(figures) > 1 else "<div>")
                     + "".join(figures) + "</div>")

    def rest(self) -> list[str]:
        return [name for name in self.uris if name not in self.placed]


@dataclass(frozen=True)
class _View:
    """What a section's renderer gets besides its data: its row of the table, the caller's
    labels for its keys (None: its plain keys), the plots, the section that shows the
    reliability diagram (None: the iterative block), and the report part of the model type
    that made the report."""

    section: Section
    keys: KeyLabels | None
    plots: _Plots
    diagram_in: str | None
    kind: ClassifierReport

    def figures(self) -> _Html:
        """The plots this section owns, the reliability diagram only in its one place."""
        home = self.diagram_in or "iterative"
        return self.plots.figures(*[name for name in self.section.plots
                                    if name != "reliability" or self.section.key == home])


# ----------------------------------------------------------------------------- sections


def _banner(report: dict) -> _Html:
    status = report.get("status")
    error = report.get("error")
    if error:
        if isinstance(error, dict):
            code = error.get("code")
            text = f"error{f' (exit {code})' if code is not None else ''}: {error.get('message')}"
        else:
            text = f"error: {error}"
        return _Html(f'<div class="banner error">status: {_esc(status)} — {_esc(text)}</div>')
    klass = "ok" if status == "ok" else "other"
    return _Html(f'<div class="banner {klass}">status: {_esc(status)}</div>')


def _headline(report: dict, sections: Sequence[str], kind: ClassifierReport) -> _Html:
    dataset = _dict(report.get("dataset"))
    config = _dict(report.get("config"))
    evaluation = _dict(report.get("evaluation"))
    model_type = dataset.get("model_type") or config.get("model_type")
    path = dataset.get("path") or config.get("dataset_path")
    sub = " · ".join(str(v) for v in (model_type, path) if v)
    parts = ["<h1>Run report</h1>", f'<p class="sub">{_esc(sub)}</p>' if sub else ""]
    cells = "".join(f'<div class="stat"><span class="v">{_esc(_fmt(v))}</span>'
                    f'<span class="k">{_esc(k)}</span></div>' for k, v in kind.headline(report)
                    if v is not None)
    if cells:
        parts.append(f'<div class="stats">{cells}</div>')
    warnings = [w for w in evaluation.get("warnings") or [] if w]
    if evaluation.get("verdict"):
        bad = " bad" if warnings or str(evaluation["verdict"]).lower().startswith("not useful") \
            else ""
        parts.append(f'<div class="verdict{bad}">{_esc(evaluation["verdict"])}</div>')
    if warnings:
        items = "".join(f"<li>{_esc(w)}</li>" for w in warnings)
        parts.append(f'<div class="warnings"><strong>Warnings</strong><ul>{items}</ul></div>')
    if sections:
        links = "".join(f'<a href="#{_esc(s)}">{_esc(TITLES.get(s, s))}</a>' for s in sections)
        parts.append(f"<nav>{links}</nav>")
    return _Html('<header class="headline">' + "".join(parts) + "</header>")


def _render_keys(data: dict, view: _View) -> list[str]:
    """The key/value rows (all but those the section shows in tables of their own) and its
    plots."""
    return [_kv_table(_pairs(data, view.keys, view.section.own_tables)), view.figures()]


def _render_dataset(data: dict, view: _View) -> list[str]:
    parts = [_kv_table(_pairs(data, view.keys, view.section.own_tables))]
    dropped = [d for d in data.get("dropped_reasons") or [] if isinstance(d, dict)]
    if dropped:
        rows = [(d.get("count"), d.get("reason"), Path(str(d.get("file", ""))).name,
                 _fmt(d.get("first_rows") or [])
                 + (", ..." if (d.get("count") or 0) > len(d.get("first_rows") or []) else ""))
                for d in dropped]
        parts += ["<h3>Dropped rows</h3>", _table(["rows", "reason", "file", "first rows"], rows)]
    return parts


def _render_train(data: dict, view: _View) -> list[str]:
    parts = [_kv_table(_pairs(data, view.keys, view.section.own_tables))]
    health = _dict(data.get("health"))
    if health:
        if health.get("loss_start") is not None and health.get("loss_end") is not None:
            fall = health.get("loss_fall")
            parts.append(_line(f"training loss {_fmt(health['loss_start'])} → "
                               f"{_fmt(health['loss_end'])}"
                               + (f" (fell {fall:.1%})" if _is_number(fall) else "")))
        if health.get("hint"):
            parts.append(_Html(f'<div class="note"><strong>Training health:</strong> '
                               f'{_esc(health["hint"])}</div>'))
    candidates = [c for c in data.get("candidates") or [] if isinstance(c, dict)]
    if candidates:
        chosen = data.get("chosen_candidate")
        rows = [((c["index"] + 1) if _is_number(c.get("index")) else c.get("index"),
                 c.get("learning_rate"), c.get("seed"), c.get("val_accuracy"), c.get("val_loss"),
                 c.get("best_epoch"), c.get("seconds"),
                 "kept" if c.get("index") == chosen else "") for c in candidates]
        parts += ["<h3>Candidates</h3>",
                  _table(["candidate", "learning rate", "seed", view.kind.names.history[1], "val loss",
                          "best epoch", "seconds", ""], rows,
                         row_classes=["kept" if r[-1] else "" for r in rows])]
    diverged = [d for d in data.get("diverged_candidates") or [] if isinstance(d, dict)]
    if diverged:
        rows = [((d["index"] + 1) if _is_number(d.get("index")) else d.get("index"),
                 d.get("learning_rate"), d.get("reason")) for d in diverged]
        parts += ["<h3>Diverged candidates (skipped)</h3>",
                  _table(["candidate", "learning rate", "reason"], rows)]
    parts.append(view.figures())
    history = [h for h in data.get("history") or [] if isinstance(h, dict)]
    if history:
        rows = [(h.get("epoch"), h.get("loss"), h.get("train_accuracy"), h.get("val_accuracy"),
                 h.get("val_loss"), h.get("seconds")) for h in history]
        parts.append(_Html(f"<details><summary>Per-epoch history ({len(history)} epochs)"
                           "</summary>"
                           + _table(["epoch", "loss", *view.kind.names.history, "val loss",
                                     "seconds"], rows) + "</details>"))
    return parts


def _confusion_table(labels: Sequence[str], matrix: Sequence[Sequence[Any]]) -> _Html:
    def short(label: str) -> str:
        return label if len(label) <= 14 else label[:13] + "…"

    head = "".join(f'<th class="num" title="{_esc(lab)}">{_esc(short(lab))}</th>'
                   for lab in labels)
    body = []
    for i, (label, row) in enumerate(zip(labels, matrix)):
        total = sum(v for v in row if _is_number(v)) or 1
        cells = []
        for j, value in enumerate(row):
            share = value / total if _is_number(value) else 0.0
            colour = "47,91,183" if i == j else "201,42,26"
            style = f' style="background:rgba({colour},{min(share, 1.0) * 0.55:.3f})"' \
                if share > 0 else ""
            klass = "num diag" if i == j else "num"
            cells.append(f'<td class="{klass}"{style}>{_esc(_fmt(value))}</td>')
        body.append(f'<tr><th title="{_esc(label)}">{_esc(short(label))}</th>'
                    + "".join(cells) + "</tr>")
    return _Html('<div class="wrap"><table class="cm"><thead><tr>'
                 '<th>true ↓ / predicted →</th>' + head + "</tr></thead><tbody>"
                 + "".join(body) + "</tbody></table></div>")


def _render_evaluation(data: dict, view: _View) -> list[str]:
    """A classifier's evaluation: its tables and plots (the reliability diagram unless the
    calibration section shows it)."""
    parts = [_kv_table(_pairs(data, view.keys if view.keys is not None else EVALUATION_KEYS))]
    tables = []
    per_class = [r for r in data.get("per_class") or [] if isinstance(r, dict)]
    if per_class:
        tables.append("<div><h3>Per class</h3>"
                      + _table(["class", "precision", "recall", "F1", "support"],
                               [(r.get("label"), r.get("precision"), r.get("recall"),
                                 r.get("f1"), r.get("support")) for r in per_class]) + "</div>")
    confusions = [c for c in data.get("top_confusions") or [] if isinstance(c, dict)]
    if confusions:
        tables.append("<div><h3>Most frequent confusions</h3>"
                      + _table(["true class", "predicted as", "count"],
                               [(c.get("true"), c.get("predicted"), c.get("count"))
                                for c in confusions]) + "</div>")
    if tables:
        parts.append(_Html('<div class="row">' + "".join(tables) + "</div>"))
    labels = [str(label) for label in data.get("labels") or []]
    matrix = data.get("confusion_matrix") or []
    if labels and len(matrix) == len(labels) and len(labels) <= MAX_MATRIX_CLASSES \
            and all(isinstance(r, list) and len(r) == len(labels) for r in matrix):
        parts += ["<h3>Confusion matrix</h3>", _confusion_table(labels, matrix)]
    elif matrix:
        parts.append(_line(f"confusion matrix of {len(matrix)} classes: see its plot"
                           if view.plots.has("confusion_matrix") else
                           f"confusion matrix of {len(matrix)} classes: in the report JSON"))
    elif data.get("confusion_pairs"):
        parts.append(_line(f"no confusion matrix for {len(labels)} classes (too many to keep "
                           "dense): the report JSON lists the most frequent confusions in "
                           "evaluation.confusion_pairs"))
    parts.append(view.figures())
    return parts


def _score(value: Any) -> _Html:
    """An IoU or Dice to 4 decimals; a dash where there is none (a class neither in the truth
    nor predicted)."""
    return _NumHtml(_esc(f"{value:.4f}" if _is_number(value) else "–"))


def _example_img(url: Any, size: Any, caption: str, side: int = EXAMPLE_SIDE) -> str:
    """One picture of an example as an <img> (its longer side `side` CSS pixels, drawn as
    squares), or its caption alone where the report holds no PNG data URL."""
    if not isinstance(url, str) or not PNG_DATA_URL.fullmatch(url):
        return f"<figure><figcaption>{_esc(caption)}: not shown</figcaption></figure>"
    height, width = size if isinstance(size, list) and len(size) == 2 \
        and all(_is_number(v) and v > 0 for v in size) else (1, 1)
    scale = side / max(height, width)
    return (f'<figure><img src="{url}" alt="{_esc(caption)}" '
            f'width="{max(1, round(width * scale))}" height="{max(1, round(height * scale))}">'
            f"<figcaption>{_esc(caption)}</figcaption></figure>")


def _examples_grid(examples: Any, pictures: Sequence[tuple[str, str]],
                   title: Callable[[dict], str], side: int = EXAMPLE_SIDE) -> _Html:
    """Test images, one block each: its `pictures` ((key, caption): a segmenter's image, true
    and predicted mask overlaid; a detector's true and predicted boxes drawn) under its
    `title`. The pictures go in <img> only (their data URLs are never text on the page)."""
    blocks = []
    for example in examples if isinstance(examples, list) else []:
        if not isinstance(example, dict):
            continue
        size = example.get("size")
        shown = "".join(_example_img(example.get(key), size, caption, side)
                        for key, caption in pictures)
        blocks.append(f'<div class="example"><h4>{_esc(title(example))}</h4>'
                      f'<div class="trio">{shown}</div></div>')
    if not blocks:
        return _Html("")
    return _Html(f"<h3>{_esc(f'Examples ({len(blocks)} test images)')}</h3>"
                 '<div class="examples">' + "".join(blocks) + "</div>")


def _warnings(data: dict) -> _Html:
    """A section's warnings as a list, nothing without any."""
    warnings = [w for w in data.get("warnings") or [] if w]
    if not warnings:
        return _Html("")
    items = "".join(f"<li>{_esc(w)}</li>" for w in warnings)
    return _Html(f'<div class="warnings"><strong>Warnings</strong><ul>{items}</ul></div>')


def _fixed(value: Any) -> _Html | None:
    """A number to 4 decimals (the calibration tables': ECE and NLL compare digit by digit)."""
    return _NumHtml(_esc(f"{value:.4f}")) if _is_number(value) else None


def _interval(value: Any) -> str | None:
    """A 90% interval of a change as "[-0.0177, -0.0097]"; None unless two numbers."""
    if isinstance(value, list) and len(value) == 2 and all(_is_number(v) for v in value):
        return f"[{value[0]:+.4f}, {value[1]:+.4f}]"
    return None


def _calibration_head(data: dict) -> _Html:
    """The temperature, how it was found, and on what."""
    temperature = data.get("temperature")
    parts = [f"temperature T = {temperature:.4f}" if _is_number(temperature) else "",
             f"method {data['method']}" if data.get("method") else ""]
    if data.get("fit_samples") is not None:
        errors = f", {data['fit_errors']} errors" if data.get("fit_errors") is not None else ""
        parts.append(f"fitted on {data['fit_samples']} {data.get('fitted_on') or 'validation'} "
                     f"samples{errors}")
    text = ", ".join(p for p in parts if p)
    return _line(text) if text else _Html("")


def _before_after(data: dict) -> _Html:
    """Accuracy, mean confidence, ECE and NLL without and with the temperature on the test
    split, with the 90% interval of the ECE and NLL changes."""
    temperature = data.get("temperature")
    with_t = f"with T = {temperature:.4f}" if _is_number(temperature) else "with T"
    rows = [(label, _fixed(data.get(f"{key}_before")), _fixed(data.get(f"{key}_after")),
             _NumHtml(_esc(_interval(data.get(f"{key}_change_interval_90")) or "")))
            for key, label in CALIBRATION_METRICS]
    rows = [row for row in rows if row[1] is not None or row[2] is not None]
    if not rows:
        return _Html("")
    split = data.get("split") or "test"
    samples = f", {_fmt(data['samples'])} samples" if data.get("samples") is not None else ""
    return _Html(f"<h3>{_esc(f'Before and after, {split} split{samples}')}</h3>"
                 + _table(["", "without T (T = 1)", with_t, "90% interval of the change"],
                          rows))


def _ece_accuracy(row: Any) -> _Html | None:
    """A shift table's cell: "ECE / accuracy" (a dash for a missing number)."""
    if not isinstance(row, dict):
        return None
    ece, accuracy = (f"{row[k]:.4f}" if _is_number(row.get(k)) else "–"
                     for k in ("ece", "accuracy"))
    return _NumHtml(_esc(f"{ece} / {accuracy}"))


def _under_shift(data: dict) -> list[str]:
    """ECE and accuracy of each variant on each corruption, its mean ECE and the variant
    best calibrated under shift (its row in bold)."""
    shifts = [s for s in data.get("shifts") or [] if isinstance(s, dict)]
    cells = {(i, str(r.get("variant"))): r for i, s in enumerate(shifts)
             for r in s.get("rows") or [] if isinstance(r, dict)}
    variants = list(dict.fromkeys(variant for _, variant in cells))
    if not variants:
        return []
    under = _dict(data.get("under_shift"))
    means, best = _dict(under.get("mean_ece")), under.get("best")
    severities = {s.get("severity") for s in shifts if s.get("severity") is not None}
    names = [f"{s.get('name')} ({_fmt(s.get('severity'))})" if len(severities) > 1
             else str(s.get("name")) for s in shifts]
    rows = [(v, *[_ece_accuracy(cells.get((i, v))) for i in range(len(shifts))],
             _fixed(means.get(v))) for v in variants]
    title = "Under shift, ECE / accuracy" + (f" (severity {_fmt(next(iter(severities)))})"
                                             if len(severities) == 1 else "")
    parts = [_Html(f"<h3>{_esc(title)}</h3>"),
             _table(["variant", *names, "mean ECE"], rows,
                    row_classes=["kept" if v == best else "" for v in variants])]
    if best is not None:
        parts.append(_labelled_line("best calibrated under shift (lowest mean ECE)", best))
    return parts


def _render_calibration(data: dict, view: _View) -> list[str]:
    """The temperature and its fit, what it changes on the test split, the variants under
    shift, and the reliability and shift plots."""
    parts: list[str] = [_calibration_head(data)]
    if data.get("fit_note"):
        parts.append(_labelled_line("fit", data["fit_note"]))
    parts.append(_before_after(data))
    if data.get("verdict"):
        parts.append(_labelled_line("verdict", data["verdict"]))
    parts += _under_shift(data)
    parts.append(view.figures())
    return parts


def _render_ttt(data: dict, view: _View) -> list[str]:
    clean = data.get("clean") if isinstance(data.get("clean"), dict) else None
    shifts = [s for s in data.get("shifts") or [] if isinstance(s, dict)]
    rows: list[tuple[str, dict]] = [("clean", clean)] if clean else []
    rows += [(f"{s.get('name')} (severity {s.get('severity')})", s) for s in shifts]
    if isinstance(data.get("mean_shifted"), dict):
        rows.append(("mean of the shifts", data["mean_shifted"]))
    methods = [m for m in ("bn", "tent")
               if any(r.get(f"accuracy_{m}") is not None for _, r in rows)]
    head = [f"{k.replace('_', ' ')} {_fmt(data[k])}"
            for k in ("method", "mode", "batch_size", "bn_prior", "iterations", "learning_rate",
                      "guard", "predict", "metric")
            if data.get(k) is not None]
    parts = [_line(", ".join(head))] if head else []
    if rows:
        headers = ["data", "source"] + [h for m in methods for h in (m, f"cost {m}")]
        parts.append(_table(headers, [
            (name, row.get("accuracy_source"),
             *[v for m in methods for v in (row.get(f"accuracy_{m}"),
                                            _ratio(row.get(f"cost_ratio_{m}")))])
            for name, row in rows]))
    not_applicable = data.get("not_applicable")
    if isinstance(not_applicable, dict) and not_applicable:
        parts.append(_table(["method", "not applicable because"],
                            [(k, v) for k, v in not_applicable.items()]))
    parts += _stream_table(data.get("stream"))
    if data.get("verdict"):
        parts.append(_labelled_line("verdict", data["verdict"]))
    parts.append(view.figures())
    return parts


def _stream_table(stream: object) -> list[str]:
    """--eval_stream: each run's accuracy per pass next to the source model's."""
    if not isinstance(stream, dict):
        return []
    runs = [r for r in stream.get("runs") or [] if isinstance(r, dict)]
    head = _line(f"stream {_fmt(stream.get('order'))}, {_fmt(stream.get('passes'))} passes, "
                 f"{_fmt(stream.get('mode'))}")
    rows = [(r.get("shift"), r.get("method"), r.get("guard"),
             (r.get("source_accuracy_per_pass") or [None])[0],
             " ".join(_fmt(a) for a in r.get("accuracy_per_pass") or []),
             r.get("resets"), r.get("skipped")) for r in runs]
    return [head, _table(["data", "method", "guard", "source", "accuracy per pass", "resets",
                          "skipped"], rows)]


def _render_iterative(data: dict, view: _View) -> list[str]:
    """The variants' table (a temperature column when a "+T" row has one); the reliability
    diagram here, or a link to the section that shows it."""
    if data.get("mode") == "ensemble":
        head = f"mode ensemble, {_fmt(data.get('passes_used'))} members"
    else:
        head = ", ".join(f"{label} {_fmt(data[k])}" for k, label in
                         (("mode", "mode"), ("backend", "backend"),
                          ("iterations", "passes asked"), ("passes_used", "passes used"))
                         if data.get(k) is not None)
    parts = [_line(head)] if head else []
    rows = [r for r in data.get("rows") or [] if isinstance(r, dict)]
    if rows:
        scaled = any(_is_number(r.get("temperature")) for r in rows)
        parts.append(_table(["variant", *["T"] * scaled, "accuracy", "NLL", "ECE",
                             "mean confidence", "accuracy at 90% coverage", "passes", "cost"],
                            [(r.get("variant"), *[r.get("temperature")] * scaled,
                              r.get("accuracy"), r.get("nll"), r.get("ece"),
                              r.get("mean_confidence"), r.get("accuracy_at_90_coverage"),
                              r.get("passes_used"), _ratio(r.get("cost_ratio"))) for r in rows]))
    if data.get("verdict"):
        parts.append(_labelled_line("verdict", data["verdict"]))
    diagram_in, plots = view.diagram_in, view.plots
    if diagram_in is None:
        parts.append(view.figures())
    elif (plots.has("reliability") or "reliability" in plots.placed) \
            and any(isinstance(r.get("reliability"), dict) for r in rows):
        parts.append(_Html('<p class="line">Reliability per variant: see the diagram under '
                           f'<a href="#{_esc(diagram_in)}">{_esc(TITLES[diagram_in])}</a>.</p>'))
    return parts


def _render_benchmark(rows: list | dict, view: _View) -> list[str]:
    """The variants' table and plot; a dict where the rows belong: its key/value rows."""
    if isinstance(rows, dict):
        return [_kv_table(_pairs(rows, view.keys))]
    rows = [r for r in rows if isinstance(r, dict)]
    batch = next((r.get("batch_size") for r in rows if r.get("batch_size") is not None), None)
    table = _table(["variant", "provider", "size (MB)", "accuracy", "p50 ms (batch 1)",
                    "p95 ms (batch 1)",
                    f"samples/s (batch {_fmt(batch)})" if batch is not None else "samples/s"],
                   [(r.get("variant"), r.get("provider"), r.get("size_mb"), r.get("accuracy"),
                     r.get("latency_ms_p50_batch1"), r.get("latency_ms_p95_batch1"),
                     r.get("throughput_per_s")) for r in rows])
    return [table, view.figures()]


def _render_compression(data: dict, view: _View) -> list[str]:
    """The variants' table (fp32 first, the served one marked), each verdict, and the plot."""
    rows = [r for r in data.get("variants") or [] if isinstance(r, dict)]
    batch = data.get("batch_size")
    table = _table(["variant", "recipe", "parameters", "MACs", "size (bytes)", "val accuracy",
                    "test accuracy", f"p50 ms (batch {_fmt(batch)})", "speed-up", "served"],
                   [(r.get("name"), _recipe_text(r.get("recipe")), r.get("params"),
                     r.get("macs"), r.get("size_bytes"), r.get("val_accuracy"),
                     r.get("test_accuracy"), r.get("latency_ms"), r.get("speedup"),
                     "yes" if r.get("served") else "") for r in rows])
    verdicts = [_labelled_line(str(r.get("name")), r.get("verdict")) for r in rows[1:]
                if r.get("verdict")]
    return [table, *verdicts, view.figures()]


def _recipe_text(recipe: Any) -> str:
    if not isinstance(recipe, dict):
        return ""
    return ", ".join(f"{key} {value}" for key, value in recipe.items())


def _render_quantize(data: dict, view: _View) -> list[str]:
    """The variant's figures, then what int8 may quantize (each op set tried), the automatic
    exclusion's steps, where a slower variant's time grew, and the diagnosis's worst layers."""
    parts = [_kv_table(_pairs(data, view.keys, view.section.own_tables))]
    if _dict(data.get("cpu")).get("description"):
        parts.append(_labelled_line("timed on", _dict(data.get("cpu")).get("description")))
    if isinstance(data.get("op_types"), list):
        parts.append(_labelled_line("op types quantized", ", ".join(map(str, data["op_types"]))
                                    or "none"))
    op_sets = [s for s in data.get("op_sets") or [] if isinstance(s, dict)]
    if op_sets:
        rows = [(", ".join(map(str, s.get("op_types") or [])), s.get("accuracy_val"),
                 s.get("accuracy_val_fp32"), s.get("latency_ms_p50"), s.get("latency_ms_p50_fp32"),
                 "kept" if s.get("kept") else "") for s in op_sets]
        parts += ["<h3>Op sets tried (--quantize_ops auto)</h3>",
                  _table(["op types", "val accuracy int8", "val accuracy fp32", "p50 int8 (ms)",
                          "p50 fp32 (ms)", ""], rows,
                         row_classes=["kept" if r[-1] else "" for r in rows])]
    exclusion = _dict(data.get("exclusion"))
    steps = [s for s in exclusion.get("steps") or [] if isinstance(s, dict)]
    if steps:
        kept = exclusion.get("kept_step")
        rows = [(k, s.get("accuracy_val"), s.get("accuracy_val_fp32"), s.get("latency_ms_p50"),
                 s.get("latency_ms_p50_fp32"), ", ".join(map(str, s.get("excluded") or [])),
                 "kept" if k == kept else "") for k, s in enumerate(steps)]
        parts += [_labelled_line("automatic exclusion", exclusion.get("outcome")),
                  _table(["step", "val accuracy int8", "val accuracy fp32", "p50 int8 (ms)",
                          "p50 fp32 (ms)", "kept in fp32", ""], rows,
                         row_classes=["kept" if r[-1] else "" for r in rows])]
    elif exclusion.get("excluded"):
        parts.append(_labelled_line("kept in fp32", ", ".join(map(str, exclusion["excluded"]))))
    grown = [g for g in data.get("slower_op_types") or [] if isinstance(g, dict)]
    if grown:
        parts += ["<h3>Where the time grew (profile, ms per run)</h3>",
                  _table(["op type", "fp32", "int8", "grew"],
                         [(g.get("op_type"), g.get("ms_per_run_fp32"), g.get("ms_per_run"),
                           g.get("grew_ms")) for g in grown])]
    layers = [r for r in data.get("layers") or [] if isinstance(r, dict)]
    if layers:
        parts += ["<h3>Worst layers (noise each node adds, against fp32)</h3>",
                  _table(["node", "op type", "output", "SQNR (dB)", "noise added"],
                         [(r.get("node"), r.get("op_type"), r.get("output"), r.get("sqnr_db"),
                           r.get("noise_added")) for r in layers])]
    return parts


def _render_profile(data: dict, view: _View) -> list[str]:
    """--profile: runs and time per run, the most expensive nodes, the time per op type."""
    pairs = [(label, data.get(key)) for key, label in (
        ("runs", "profiled runs"), ("batch_size", "batch size"), ("ms_per_run", "ms per run"),
        ("node_ms_per_run", "ms in kernels per run"), ("trace", "trace (Chrome tracing JSON)"))
        if data.get(key) is not None]
    top = [r for r in data.get("top") or [] if isinstance(r, dict)]
    by_op = [r for r in data.get("by_op_type") or [] if isinstance(r, dict)]
    return [_kv_table(pairs),
            "<h3>Most expensive nodes</h3>",
            _table(["node", "op type", "total ms", "ms per run", "share", "calls"],
                   [(r.get("node"), r.get("op_type"), r.get("total_ms"), r.get("ms_per_run"),
                     r.get("share"), r.get("calls")) for r in top]),
            "<h3>Time per op type</h3>",
            _table(["op type", "ms per run", "share"],
                   [(r.get("op_type"), r.get("ms_per_run"), r.get("share")) for r in by_op])]


def _config(config: dict) -> list[str]:
    pairs = [(k, _Html("") if v is None else v if _plain(v) else json.dumps(v, default=str))
             for k, v in config.items()]
    return [_Html(f"<details><summary>All {len(config)} settings</summary>"
                  + _kv_table(pairs) + "</details>")]


# ----------------------------------------------------------------------------- the page


Renderer = Callable[[Any, _View], list[str]]
# each section's renderer, `_render_<page>` of its row (a row naming none fails at import)
RENDERERS: dict[str, Renderer] = {s.page: globals()[f"_render_{s.page}"] for s in SECTIONS}


def _page_order(report: dict, labels: Mapping[str, Any]) -> list[Section]:
    """The table's order, with any section only the caller's `labels` name (shown by its key/value
    rows) before the predictions block; in a run that predicted an --input, the sections that
    describe those predictions (`of_input`) after all others."""
    extra = [Section(key, key.replace("_", " ").capitalize()) for key in labels
             if key not in SECTION]
    at = SECTIONS.index(SECTION["predictions"])
    order = [*SECTIONS[:at], *extra, *SECTIONS[at:]]
    if report.get("predictions"):
        order = [s for s in order if not s.of_input] + [s for s in order if s.of_input]
    return order


def _heading(section: Section, data: Any) -> str:
    if section.key == "evaluation" and data.get("split"):
        return f"Evaluation ({data['split']} split)"
    return section.title


def render_page(report: dict, plots: Mapping[str, Any] | None = None,
                summary_keys: Mapping[str, KeyLabels] | None = None,
                prediction_keys: KeyLabels | None = None) -> str:
    """The report as one HTML page. `plots` maps a plot's name to its PNG (a missing or
    unreadable file is left out; None: the report's own "plots"). `summary_keys` (section →
    [(key, label)], sections.SUMMARY_KEYS) and `prediction_keys` (sections.PREDICTION_KEYS)
    choose and name each section's key/value rows; a section they do not list shows its plain
    keys. A section absent or null is left out."""
    labels = {**(summary_keys or {}), "predictions": prediction_keys}
    images = _Plots(report.get("plots") if plots is None else plots)
    # the section that shows the reliability diagram, wherever the iterative block comes
    diagram_in = next((name for name in ("calibration", "evaluation")
                       if isinstance(report.get(name), dict) and report[name]), None)
    kind = report_part(report)
    body: list[str] = []
    present: list[str] = []
    for section in _page_order(report, labels):
        data = report.get(section.key)
        if not data or not isinstance(data, (dict, list) if section.rows else dict):
            continue
        view = _View(section, kind.keys(section.key, labels.get(section.key), data), images,
                     diagram_in, kind)
        parts = kind.renderers().get(section.key, RENDERERS[section.page])(data, view)
        body.append(_section(section.key, _heading(section, data), parts))
        present.append(section.key)
    if isinstance(report.get("config"), dict) and report["config"]:
        body.append(_section("config", CONFIG_TITLE, _config(report["config"])))
        present.append("config")
    rest = images.rest()
    if rest:
        body.append(_section("plots", "Other plots", [images.figures(*rest)]))
    return _document(report, present, body, kind)


def _document(report: dict, present: Sequence[str], body: Sequence[str],
              kind: ClassifierReport) -> str:
    """The page around its sections: head and style, the banner and headline, the footer."""
    footer = ""
    if _is_number(report.get("seconds_total")):
        footer = f"<footer>total seconds: {report['seconds_total']:.1f}</footer>"
    dataset = _dict(report.get("dataset"))
    title = "Run report" + (f" — {dataset['path']}" if dataset.get("path") else "")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{_esc(title)}</title><style>{CSS}</style></head><body><main>"
            + _banner(report) + _headline(report, present, kind) + "".join(body) + footer
            + "</main></body></html>\n")


def write_page(report: dict, plots: Mapping[str, Any] | None, path: str | Path,
               summary_keys: Mapping[str, KeyLabels] | None = None,
               prediction_keys: KeyLabels | None = None) -> None:
    """Write render_page's page to `path` atomically."""
    atomic_write_text(path, render_page(report, plots, summary_keys, prediction_keys))


# What a model type's own renderers (ttc/tasks/TYPE/report.py, its report part's `renderers`)
# build their parts from: the markup, escaping and formatting every section of the page shares.
Html, NumHtml, View = _Html, _NumHtml, _View
esc, fmt, is_number, as_dict = _esc, _fmt, _is_number, _dict
table, kv_table, pairs, line, labelled_line = _table, _kv_table, _pairs, _line, _labelled_line
score, warnings_list, confusion_table = _score, _warnings, _confusion_table
examples_grid, render_keys = _examples_grid, _render_keys
