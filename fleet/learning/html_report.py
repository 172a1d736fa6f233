"""``fleet learn report --html``: the report as one self-contained page.

``render_html(report)`` takes what ``fleet learn report --json`` prints (so
the page and the JSON show the same numbers) and returns an HTML document
with its CSS inline and its plots as inline SVG: no script, no font, no
stylesheet or image from anywhere else, so it opens offline and can be mailed
or attached to a review as it is.

The page: the logging policies; the estimates of every estimator side by side
(one row per target policy); the intervals drawn as a plot (one line per
target, a mark per estimator, the logged value dashed); each target's
importance-weight distribution with its effective sample size.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any

#: One colour per estimator (the plot's legend and the table's headers).
COLOURS = {"ips": "#8c564b", "snips": "#1f77b4", "dr": "#2ca02c", "sndr": "#17becf",
           "pdis": "#9467bd", "snpdis": "#d62728"}
NAMES = {"ips": "IPS", "snips": "SNIPS", "dr": "DR", "sndr": "SNDR", "pdis": "PDIS",
         "snpdis": "SNPDIS"}

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px auto;
max-width:1180px;color:#1d2327;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px}
.muted{color:#5f6b73}table{border-collapse:collapse;margin:6px 0 12px}
th,td{border-bottom:1px solid #dde3e7;padding:5px 8px;text-align:right;white-space:nowrap}
.scroll{overflow-x:auto}.ci{font-size:12px}
th:first-child,td:first-child{text-align:left}th{background:#f3f6f8;font-weight:600}
li.pass{color:#1a7f37}li.fail{color:#b42318}
.err{color:#b42318;font-size:12px}.key{display:inline-block;width:10px;height:10px;
margin:0 4px 0 12px;border-radius:2px}.weights{display:inline-block;margin:0 24px 16px 0;
vertical-align:top}svg text{font:12px system-ui,sans-serif;fill:#1d2327}
"""


def render_html(report: dict[str, Any]) -> str:
    """The page for ``report`` (``fleet learn report --json``'s document)."""
    targets = report.get("targets") or []
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(str(report.get('title', 'fleet policy evaluation')))}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{escape(str(report.get('title', 'fleet policy evaluation')))}</h1>",
        f'<p class="muted">{escape(_subtitle(report))}</p>',
        "<h2>Logging policies</h2>", _logged_table(report.get("policies") or [])]
    if targets:
        estimators = [e for e in COLOURS if any(e in t["estimates"] or e in t["errors"]
                                                for t in targets)]
        parts += ["<h2>Estimates</h2>", _estimates_table(targets, estimators, report),
                  "<h2>Intervals</h2>", _legend(estimators),
                  _interval_plot(targets, estimators),
                  "<h2>Importance weights</h2>",
                  '<p class="muted">w = the target\'s probability of the logged choice / '
                  "its logged propensity; bins double in width. ESS = sum(w)&sup2; / "
                  "sum(w&sup2;): how many decisions made by the target itself the "
                  "estimate is worth.</p>",
                  *(_weights(t) for t in targets)]
    else:
        parts.append('<p class="muted">No target policy given: <code>fleet learn report '
                     "--policy module:function</code> compares one (repeat it for more).</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _subtitle(report: dict[str, Any]) -> str:
    bits = [f"{report.get('executions', 0)} finished executions"]
    if report.get("source"):
        bits.append(f"in {report['source']}")
    filters = report.get("filters") or {}
    bits += [f"{k} {v}" for k, v in filters.items() if v is not None]
    if report.get("confidence"):
        bits.append(f"{float(report['confidence']):.0%} intervals")
    if report.get("compactedUnread"):
        bits.append(f"{len(report['compactedUnread'])} compacted execution(s) not read")
    return "; ".join(bits)


def _num(value: Any, digits: int = 4) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.{digits}f}" if math.isfinite(value) else str(value)
    return escape(str(value))


def _logged_table(rows: list[dict[str, Any]]) -> str:
    head = ("<table><tr><th>policy</th><th>version</th><th>decisions</th>"
            "<th>with propensity</th><th>rewarded</th><th>mean propensity</th>"
            "<th>logged value</th></tr>")
    body = "".join(
        f"<tr><td>{escape(str(r['policy']))}</td><td>{escape(str(r['version']))}</td>"
        f"<td>{r['decisions']}</td><td>{r['with_propensity']}</td><td>{r['rewarded']}</td>"
        f"<td>{_num(r['mean_propensity'], 3)}</td><td>{_num(r['logged_value'])}</td></tr>"
        for r in rows)
    return head + body + "</table>"


def _estimates_table(targets: list[dict[str, Any]], estimators: list[str],
                     report: dict[str, Any]) -> str:
    head = "<table><tr><th>target policy</th><th>samples</th><th>logged</th>" + "".join(
        f'<th><span class="key" style="background:{COLOURS[e]}"></span>{NAMES[e]}</th>'
        for e in estimators) + "<th>ESS</th><th>max w</th></tr>"
    rows = []
    for t in targets:
        first = next(iter(t["estimates"].values()), None)
        cells = [f"<td>{escape(t['policy'])}</td>",
                 f"<td>{'' if first is None else first['samples']}</td>",
                 f"<td>{_num(None if first is None else first['logged_value'])}</td>"]
        for e in estimators:
            ev = t["estimates"].get(e)
            if ev is None:
                why = escape(t["errors"].get(e, "not asked"))
                cells.append(f'<td class="err" title="{why}">n/a</td>')
            else:
                low, high = ev["confidence_interval"]
                cells.append(f"<td>{_num(ev['estimated_value'])}<br>"
                             f'<span class="muted ci">[{_num(low, 3)}, {_num(high, 3)}]'
                             "</span></td>")
        weights = t.get("weights") or {}
        cells += [f"<td>{_num(weights.get('effective_sample_size'), 1)}</td>",
                  f"<td>{_num(weights.get('max'), 2)}</td>"]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    gates = []
    for t in targets:
        gate = t.get("gate")
        if gate is None:
            continue
        verdict = "pass" if gate["passed"] else "hold: " + "; ".join(gate["reasons"])
        gates.append(f'<li class="{"pass" if gate["passed"] else "fail"}">'
                     f"{escape(t['policy'])} ({escape(NAMES.get(gate['estimator'], ''))}): "
                     f"{escape(verdict)}</li>")
    errors = []
    for t in targets:  # one line per message, naming every estimator it stopped
        by_message: dict[str, list[str]] = {}
        for e, msg in t["errors"].items():
            by_message.setdefault(msg, []).append(NAMES.get(e, e))
        errors += [f'<p class="err">{escape(t["policy"])}: {escape(", ".join(names))}: '
                   f"{escape(msg)}</p>" for msg, names in by_message.items()]
    return ('<div class="scroll">' + head + "".join(rows) + "</table></div>"
            + "".join(errors)
            + (f"<p>Promotion gate</p><ul>{''.join(gates)}</ul>" if gates else ""))


def _legend(estimators: list[str]) -> str:
    return '<p class="muted">' + "".join(
        f'<span class="key" style="background:{COLOURS[e]}"></span>{NAMES[e]}'
        for e in estimators) + ' <span class="key" style="background:#777"></span>logged ' \
        "value (dashed)</p>"


def _interval_plot(targets: list[dict[str, Any]], estimators: list[str]) -> str:
    ends: list[float] = []
    for t in targets:
        for ev in t["estimates"].values():
            ends += [*ev["confidence_interval"], ev["logged_value"]]
    finite = [x for x in ends if math.isfinite(x)] or [0.0, 1.0]
    low, high = min(finite), max(finite)
    pad = (high - low) * 0.05 or 0.05
    low, high = low - pad, high + pad
    label_w, plot_w, band = 260, 820, 14 * max(len(estimators), 1) + 16
    height = band * len(targets) + 40

    def x(value: float) -> float:
        return label_w + (value - low) / (high - low) * plot_w

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{label_w + plot_w + 20}" '
           f'height="{height}" role="img" aria-label="confidence intervals per policy">']
    for i in range(6):  # the axis
        value = low + (high - low) * i / 5
        out.append(f'<line x1="{x(value):.1f}" y1="8" x2="{x(value):.1f}" '
                   f'y2="{height - 24}" stroke="#e3e8eb"/>'
                   f'<text x="{x(value):.1f}" y="{height - 8}" text-anchor="middle">'
                   f"{value:.3f}</text>")
    for row, t in enumerate(targets):
        top = 10 + row * band
        out.append(f'<text x="4" y="{top + band / 2:.1f}" class="policy">'
                   f"{escape(_short(t['policy']))}</text>")
        first = next(iter(t["estimates"].values()), None)
        if first is not None:
            lx = x(first["logged_value"])
            out.append(f'<line x1="{lx:.1f}" y1="{top}" x2="{lx:.1f}" y2="{top + band - 8}" '
                       'stroke="#777" stroke-dasharray="4 3"/>')
        for k, e in enumerate(estimators):
            ev = t["estimates"].get(e)
            if ev is None:
                continue
            y = top + 7 + 14 * k
            a, b = ev["confidence_interval"]
            out.append(f'<line x1="{x(a):.1f}" y1="{y}" x2="{x(b):.1f}" y2="{y}" '
                       f'stroke="{COLOURS[e]}" stroke-width="3" data-estimator="{e}"/>'
                       f'<circle cx="{x(ev["estimated_value"]):.1f}" cy="{y}" r="4.5" '
                       f'fill="{COLOURS[e]}"><title>{NAMES[e]} '
                       f'{ev["estimated_value"]:.4f} [{a:.4f}, {b:.4f}]</title></circle>')
    out.append("</svg>")
    return "".join(out)


def _weights(t: dict[str, Any]) -> str:
    w = t.get("weights")
    if not w:
        return ""
    bins = w["bins"]
    most = max((b[2] for b in bins), default=1) or 1
    bar_w, plot_h = 34, 120  # the bars start 18 px down: room for the tallest's count
    width = 40 + bar_w * len(bins)
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{plot_h + 54}" '
           f'role="img" aria-label="importance weights of {escape(t["policy"])}">']
    for i, (lo, hi, count) in enumerate(bins):
        h = plot_h * count / most
        x0 = 30 + i * bar_w
        label = "0" if hi == 0 else f"&le;{_edge(hi)}"
        svg.append(f'<rect x="{x0}" y="{18 + plot_h - h:.1f}" width="{bar_w - 4}" '
                   f'height="{h:.1f}" fill="#1f77b4"><title>({_edge(lo)}, {_edge(hi)}]: '
                   f"{count}</title></rect>"
                   f'<text x="{x0 + (bar_w - 4) / 2:.1f}" y="{plot_h + 34}" '
                   f'text-anchor="middle">{label}</text>'
                   + (f'<text x="{x0 + (bar_w - 4) / 2:.1f}" y="{14 + plot_h - h:.1f}" '
                      f'text-anchor="middle" class="count">{count}</text>' if count else ""))
    svg.append("</svg>")
    facts = (f"{w['count']} decisions; ESS {w['effective_sample_size']:.1f}; mean "
             f"{w['mean']:.3f}; median {w['median']:.3f}; p99 {w['p99']:.3f}; max "
             f"{w['max']:.3f}; {w['zero']} at 0")
    return (f'<div class="weights"><strong>{escape(_short(t["policy"]))}</strong>'
            f'<br><span class="muted">{escape(facts)}</span><br>{"".join(svg)}</div>')


def _edge(value: float) -> str:
    return f"{value:g}" if value >= 1 else f"1/{round(1 / value):d}" if value else "0"


def _short(name: str) -> str:
    return name if len(name) <= 36 else "…" + name[-35:]
