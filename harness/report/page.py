"""One self-contained HTML page (inline style, no scripts, no external resources)."""

from __future__ import annotations

import base64
import json
from html import escape
from pathlib import Path
from typing import Any

from harness.report.model import ICONS, TIMELINE_COLUMNS, FigureView, ReportView, StageView, build

_STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:2rem auto;max-width:70rem;color:#1b1f24;padding:0 1rem}
table{border-collapse:collapse;width:100%;margin:1rem 0}td,th{border:1px solid #d0d7de;padding:.35rem .6rem;
text-align:left;vertical-align:top}th{background:#f6f8fa}.PASSED{color:#1a7f37}.FAILED,.ERROR{color:#cf222e}
.NOT_RUN,.INCOMPLETE{color:#9a6700}code{background:#f6f8fa;padding:0 .2rem}details{margin:.3rem 0}
pre{background:#f6f8fa;padding:.5rem;overflow:auto}figure{margin:1rem 0}img{max-width:100%}
figcaption{color:#57606a;font-size:13px}
"""


def _figure(stage: str, f: FigureView) -> str:
    e = escape
    if f.data is None:
        return f"<p>{e(stage)}: figure {e(f.path)} is missing from the bundle</p>"
    # Inline as a data URI: the page stays one file with no external resource.
    uri = f"data:{f.media_type};base64,{base64.b64encode(f.data).decode()}"
    return f"<figure><img alt='{e(stage)}: {e(f.path)}' src='{uri}'><figcaption>{e(f.caption)}</figcaption></figure>"


def _timelines(s: StageView) -> str:
    e = escape
    out = []
    head = "".join(f"<th>{e(c)}</th>" for c in TIMELINE_COLUMNS)
    for t in s.timelines:
        rows = "".join("<tr>" + "".join(f"<td>{e(str(r[c]))}</td>" for c in TIMELINE_COLUMNS) + "</tr>" for r in t.rows)
        more = (
            f"<p>{t.left_out} more rows in the stage's evidence (stages/{e(s.stage)}/timeline.json).</p>"
            if t.left_out
            else ""
        )
        out.append(f"<h3>{e(s.stage)}: {e(t.title)}</h3><table><tr>{head}</tr>{rows}</table>{more}")
    return "".join(out)


def render_view(view: ReportView) -> str:
    e = escape
    rows = "".join(
        f"<tr><td>{e(s.stage)}</td><td>{'yes' if s.required else 'no'}</td>"
        f"<td class='{e(s.verdict)}'>{ICONS.get(s.verdict, '')} {e(s.verdict)}</td><td>{e(s.reason)}</td></tr>"
        for s in view.stages
    )
    details = "".join(
        f"<details><summary>{e(s.stage)}: {s.checks} checks, {len(s.failed_checks)} failed</summary>"
        f"<pre>{e(json.dumps({'failed': s.failed_checks, 'metrics': s.metrics, 'evidence': s.evidence}, indent=2))}"
        "</pre></details>"
        for s in view.stages
    )
    figures = "".join(_figure(s.stage, f) for s in view.stages for f in s.figures)
    not_run = "".join(f"<li><b>{e(s.stage)}</b> ({e(s.verdict)}): {e(s.reason)}</li>" for s in view.not_run)
    items = "".join(
        f"<li>{e(s.stage)}: <b>{e(i['name'])}</b>: {e(i['reason'])}</li>" for s in view.stages for i in s.not_run_items
    )
    timelines = "".join(_timelines(s) for s in view.stages)
    ident = (
        f"<p>Bundle <code>{e(view.bundle_id)}</code> · {e(view.signer or 'signature not checked')}</p>"
        if view.bundle_id
        else ""
    )
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>k3gate {e(view.outcome)}: {e(view.config)}</title><style>{_STYLE}</style></head><body>"
        f"<h1 class='{e(view.outcome)}'>{ICONS.get(view.outcome, '')} {e(view.outcome)}: {e(view.config)}</h1>"
        f"<p><b>{e(view.outcome_reason)}</b></p>"
        f"<p>Subject {e(view.subject)}, tier {e(view.tier)} · commit <code>{e(view.commit)}</code>"
        f"{e(view.dirty_note)} · {e(view.gpu)} · started {e(view.started)}</p>{ident}"
        "<table><tr><th>stage</th><th>required</th><th>verdict</th><th>reason</th></tr>"
        f"{rows}</table>"
        + (f"<h2>Did not run</h2><ul>{not_run}</ul>" if not_run else "")
        + (f"<h2>Not run inside stages (never counted as passed)</h2><ul>{items}</ul>" if items else "")
        + (f"<p>Not selected for this run: {e(', '.join(view.not_selected))}</p>" if view.not_selected else "")
        + (f"<h2>Dispatch timelines</h2>{timelines}" if timelines else "")
        + (f"<h2>Figures</h2>{figures}" if figures else "")
        + f"<h2>Records</h2>{details}</body></html>\n"
    )


def render(predicate: dict[str, Any], bundle_dir: Path, bundle_id: str | None = None, signer: str | None = None) -> str:
    return render_view(build(predicate, bundle_dir, bundle_id, signer))
