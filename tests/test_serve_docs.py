"""serve.py's /docs works offline: one page rendered by the server from /openapi.json, with no
script and no external asset (FastAPI's Swagger UI page, loaded from a CDN, was blank without
internet). A real server on 127.0.0.1, as tests/test_serve.py starts them."""
from __future__ import annotations

import re

from test_serve import serving

from ttc.online.docs_page import docs_page

EXTERNAL = re.compile(r"(?:https?:)?//[A-Za-z0-9.-]+\.[A-Za-z]|<script|\bsrc=", re.IGNORECASE)


def test_docs_page_lists_every_endpoint_without_an_external_url(digits_bundle, tmp_path):
    with serving(digits_bundle["model"], logs=tmp_path) as server:
        page = server.get("/docs")
        spec = server.get("/openapi.json")
        redoc = server.get("/redoc")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert EXTERNAL.findall(page.text) == [], EXTERNAL.findall(page.text)
    assert spec.status_code == 200 and redoc.status_code == 404
    assert 'href="openapi.json"' in page.text  # the description it renders, relative to /docs
    paths = spec.json()["paths"]
    assert "/predict" in paths and "/predict/image" in paths
    for path, item in paths.items():
        for method in item:
            assert f'id="{method}-' in page.text and f"<code>{path}</code>" in page.text, path
    assert 'href="#schema-PredictResponse"' in page.text  # a response's schema, linked
    assert 'id="schema-PredictResponse"' in page.text


def test_docs_page_escapes_what_it_shows():
    spec = {"info": {"title": "<b>t</b>", "description": "uses `--top_k`\nwrapped\n\nnext"},
            "paths": {"/x": {"get": {"summary": "<script>alert(1)</script>",
                                     "responses": {"200": {"description": "ok"}}}}}}
    page = docs_page(spec)
    assert "<script>" not in page and "&lt;b&gt;t&lt;/b&gt;" in page
    assert "<p>uses <code>--top_k</code> wrapped</p><p>next</p>" in page
