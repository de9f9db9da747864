"""serve.py's /docs: the OpenAPI description (`app.openapi()`) as one self-contained HTML page,
rendered on the server. FastAPI's own /docs loads Swagger UI from a CDN and is blank without
internet; this page has no script and no external asset (inline CSS, links within the page and
to /openapi.json only), so it reads the same on an air-gapped machine."""
from __future__ import annotations

import html
import re
from typing import Any

METHODS = ("get", "post", "put", "patch", "delete")
STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 980px; padding: 1em 2em;
       color: #1d232a; }
h1 { margin-bottom: .2em; } h2 { margin-top: 2em; border-bottom: 1px solid #d5dae0; }
h3 { margin: 1.6em 0 .3em; } h4 { margin: 1em 0 .3em; font-size: 1em; }
code { background: #f1f3f5; padding: 0 .25em; border-radius: 3px; }
table { border-collapse: collapse; margin: .3em 0 .8em; }
th, td { border: 1px solid #d5dae0; padding: .25em .6em; text-align: left; vertical-align: top; }
th { background: #f6f8fa; }
.method { display: inline-block; min-width: 3.6em; text-align: center; color: #fff;
          border-radius: 3px; padding: 0 .4em; font: bold 13px monospace; }
.get { background: #2f7d32; } .post { background: #1f5fbf; } .put, .patch { background: #a4660a; }
.delete { background: #b3261e; }
.muted { color: #5b6570; }
ul.toc { list-style: none; padding-left: 0; } ul.toc li { margin: .15em 0; }
"""


def docs_page(spec: dict) -> str:
    """The whole page: the API's description, an index of its endpoints, each endpoint
    (parameters, request body, responses) and the schemas they name."""
    info = spec.get("info", {})
    operations = [(path, method, item[method]) for path, item in spec.get("paths", {}).items()
                  for method in METHODS if method in item]
    schemas = spec.get("components", {}).get("schemas", {})
    # openapi.json relative to /docs: the prefix the app may be mounted under stays in the link
    parts = [f"<h1>{_text(info.get('title', 'API'))}</h1>",
             f"<p class=muted>version {_text(info.get('version', ''))} · the machine-readable "
             "description: <a href=\"openapi.json\">/openapi.json</a></p>",
             _paragraphs(info.get("description", "")),
             "<h2>Endpoints</h2>", _index(operations),
             *(_operation(path, method, op) for path, method, op in operations)]
    if schemas:
        parts += ["<h2>Schemas</h2>", *(_schema(name, schema) for name, schema in schemas.items())]
    return ("<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
            "<meta name=viewport content=\"width=device-width, initial-scale=1\">"
            f"<title>{_text(info.get('title', 'API'))} · docs</title><style>{STYLE}</style>"
            "</head><body>\n" + "\n".join(p for p in parts if p) + "\n</body></html>\n")


def _index(operations: list[tuple[str, str, dict]]) -> str:
    rows = [f"<li><a href=\"#{_anchor(method, path)}\">{_badge(method)} <code>{_text(path)}"
            f"</code></a> <span class=muted>{_text(op.get('summary', ''))}</span></li>"
            for path, method, op in operations]
    return "<ul class=toc>" + "".join(rows) + "</ul>"


def _operation(path: str, method: str, op: dict) -> str:
    parts = [f"<h3 id=\"{_anchor(method, path)}\">{_badge(method)} <code>{_text(path)}</code>"
             f" <span class=muted>{_text(op.get('summary', ''))}</span></h3>",
             _paragraphs(op.get("description", ""))]
    parameters = op.get("parameters", [])
    if parameters:
        parts += ["<h4>Parameters</h4>", _table(
            ("name", "in", "required", "type", "meaning"),
            [(f"<code>{_text(p['name'])}</code>", _text(p.get("in", "")),
              "yes" if p.get("required") else "no", _type(p.get("schema", {})),
              _text(p.get("description", p.get("schema", {}).get("description", ""))))
             for p in parameters])]
    body = op.get("requestBody")
    if body:
        parts.append("<h4>Request body" + (" (required)" if body.get("required") else "")
                     + "</h4>")
        for media, content in body.get("content", {}).items():
            schema = content.get("schema", {})
            parts.append(f"<p><code>{_text(media)}</code>: {_type(schema)}</p>")
            if "properties" in schema:  # an inline object: its fields here
                parts.append(_properties(schema))
    responses = op.get("responses", {})
    if responses:
        parts += ["<h4>Responses</h4>", _table(
            ("status", "meaning", "body"),
            [(f"<code>{_text(status)}</code>", _text(answer.get("description", "")),
              "; ".join(f"<code>{_text(media)}</code> {_type(c.get('schema', {}))}"
                        for media, c in answer.get("content", {}).items()) or "—")
             for status, answer in responses.items()])]
    return "<section>" + "\n".join(p for p in parts if p) + "</section>"


def _schema(name: str, schema: dict) -> str:
    return (f"<h3 id=\"{_schema_anchor(name)}\"><code>{_text(name)}</code></h3>"
            + _paragraphs(schema.get("description", ""))
            + (_properties(schema) if "properties" in schema else f"<p>{_type(schema)}</p>"))


def _properties(schema: dict) -> str:
    required = set(schema.get("required", []))
    rows = [(f"<code>{_text(name)}</code>", _type(field), "yes" if name in required else "no",
             _text(field.get("description", "")))
            for name, field in schema.get("properties", {}).items()]
    if schema.get("additionalProperties") is True:
        rows.append(("<i>any other key</i>", "any", "no", "kept as given"))
    return _table(("field", "type", "required", "meaning"), rows)


def _type(schema: Any) -> str:
    """A schema in a few words: a reference links to its schema below."""
    if not isinstance(schema, dict) or not schema:
        return "any"
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"<a href=\"#{_schema_anchor(name)}\">{_text(name)}</a>"
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return " | ".join(_type(s) for s in schema[key])
    kind = schema.get("type", "any")
    if isinstance(kind, list):
        return " | ".join(_text(k) for k in kind)
    if "enum" in schema:
        return "one of " + ", ".join(f"<code>{_text(v)}</code>" for v in schema["enum"])
    if kind == "array":
        if "prefixItems" in schema:
            return "[" + ", ".join(_type(s) for s in schema["prefixItems"]) + "]"
        items = schema.get("items")
        return f"array of {_type(items)}" if items else "array"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"object of {_type(schema['additionalProperties'])}"
    if kind == "string" and schema.get("format") == "binary":
        return "file"
    return _text(kind)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _paragraphs(text: str) -> str:
    """A docstring's text: its hard-wrapped lines joined, blank lines between paragraphs,
    `backticks` as code."""
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text or "") if p.strip()]
    return "".join(f"<p>{_code_spans(_text(p))}</p>" for p in paragraphs)


def _code_spans(escaped: str) -> str:
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", escaped)


def _badge(method: str) -> str:
    return f"<span class=\"method {method}\">{method.upper()}</span>"


def _anchor(method: str, path: str) -> str:
    return f"{method}-" + re.sub(r"[^A-Za-z0-9]+", "-", path).strip("-")


def _schema_anchor(name: str) -> str:
    return "schema-" + re.sub(r"[^A-Za-z0-9_]+", "-", name)


def _text(value: Any) -> str:
    return html.escape(str(value), quote=True)
