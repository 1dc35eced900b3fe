"""The SGLang section of ``report.md``: speedup over SGLang's plain decoding at each concurrency,
where the curve crosses 1, tau and the acceptance histogram from SGLang's own counters."""

from __future__ import annotations

from typing import Any

from eagle3_ray.bench.report_format import md_table, number


def sglang_section(results: dict[str, Any]) -> str:
    s = results.get("sglang")
    if not s:
        return ""
    modes, conc = s["modes"], [str(c) for c in s["concurrency"]]
    graphs = all("disable_cuda_graph" not in (a or {}) for a in (s.get("server_args") or {}).values())
    lines = [
        "## SGLang: EAGLE-3 against SGLang's plain decoding",
        "",
        f"Engine: SGLang, CUDA graphs {'on' if graphs else 'off'} in every engine; each mode in one engine, "
        f"on the same {s['num_turns']} turns ({s['num_prompts']} prompts, the plain engine's own answers as "
        "history). Concurrency = requests in flight. tau and the histogram come from SGLang's per-request "
        "counters (`spec_verify_ct`, `spec_correct_drafts_histogram`).",
        "",
    ]
    rows = []
    for mode, by_c in modes.items():
        for c in conc:
            r = by_c.get(c) or {}
            speedup = 1.0 if mode == "plain" else (s["speedup"].get(mode) or {}).get(c)
            rows.append([mode, c, number(r.get("tokens_per_s"), "{:.1f}"), number(speedup, "{:.2f}x"),
                         number(r.get("tau")), number(r.get("accept_length")), number(r.get("ms_per_cycle"), "{:.2f}")])
    lines.append(md_table(["mode", "concurrency", "tokens/s", "speedup", "tau", "SGLang accept length",
                         "ms per verify cycle"], rows))
    lines.append("")
    for mode, where in (s.get("crossing") or {}).items():
        lines.append(f"- {mode}: the speedup {where}.")
    for mode, share in (s.get("identical_to_plain") or {}).items():
        lines.append(f"- {mode}: {number(share, '{:.0%}')} of turns (concurrency 1) equal plain decoding's output.")
    for mode, err in (s.get("errors") or {}).items():
        lines.append(f"- **{mode} failed**: {err}")
    hist_rows = []
    for mode, by_c in modes.items():
        h = (by_c.get(conc[0]) or {}).get("accept_histogram")
        if h:
            total = sum(h)
            hist_rows.append([mode] + [f"{x / total:.1%}" for x in h])
    if hist_rows:
        width = max(len(r) for r in hist_rows) - 1
        lines += ["", f"Acceptance histogram at concurrency {conc[0]} (share of verify steps accepting i drafts):",
                  "", md_table(["mode", *[str(i) for i in range(width)]],
                               [r + [""] * (width + 1 - len(r)) for r in hist_rows])]
    starts = s.get("start_seconds") or {}
    if starts:
        lines += ["", "Engine start (CUDA-graph capture included): " + ", ".join(
            f"{m} {v:.0f} s" for m, v in starts.items() if v is not None) + "."]
    summary = results.get("summary") or {}
    diffs = {k: v for k, v in summary.items() if k.startswith("sglang_vs_own_tau_diff_") and v is not None}
    if diffs:
        lines += ["", "SGLang's tau minus the project's own decoder's on the same prompts: " + ", ".join(
            f"{k.removeprefix('sglang_vs_own_tau_diff_')} {v:+.3f}" for k, v in diffs.items()) + "."]
    return "\n".join(lines)
