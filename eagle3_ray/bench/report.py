"""``report.md`` from a benchmark's results.json (and the training metrics.jsonl), next to its plots
(``bench/plots.py``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import eagle3_ray

from eagle3_ray.atomic import write_text
from eagle3_ray.bench.plots import ACCEPT_PLOT, TAU_PLOT, THROUGHPUT_PLOT, TRAINING_PLOT, write_plots
from eagle3_ray.bench.report_format import (
    kind_entry,
    kind_label,
    md_table,
    number,
    result_kinds,
    train_tokens,
)
from eagle3_ray.bench.sglang_report import sglang_section
from eagle3_ray.errors import ConfigError, DataError

REPORT_NAME = "report.md"


def write_report(results: dict[str, Any], out_dir: str | Path, train_metrics_path: str | Path | None = None) -> Path:
    """Write ``report.md`` plus its plots into ``out_dir``; returns the report's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    training = read_train_metrics(train_metrics_path) if train_metrics_path else []
    sections = [
        _header(results, out),
        _summary_section(results),
        sglang_section(results),
        _parts_section(results),
        _divergence_section(results),
        _set_section(results),
        _turn_section(results),
        _category_section(results),
        _acceptance_section(results),
        _untrained_section(results),
        _training_section(training, results),
    ]
    write_plots(results, out, training)
    path = out / REPORT_NAME
    write_text(path, "\n\n".join(s for s in sections if s) + "\n")
    return path


def read_train_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Logged training rows sorted by step; a step logged twice (resumed run) keeps its last row."""
    file = Path(path)
    if not file.is_file():
        raise DataError(f"training metrics {file} does not exist; pass the metrics.jsonl of a training run")
    rows: dict[int, dict[str, Any]] = {}
    for lineno, line in enumerate(file.read_text(encoding="utf-8").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{file}:{lineno}: malformed JSON ({e.msg}); fix or delete the line") from e
        if not isinstance(row, dict) or "step" not in row or "loss" not in row:
            raise DataError(f"{file}:{lineno}: a metrics line needs 'step' and 'loss', got {line[:80]!r}")
        rows[int(row["step"])] = row
    return [rows[s] for s in sorted(rows)]


# --- sections ---------------------------------------------------------------------------------------


def headline(results: dict[str, Any]) -> str:
    """One sentence on speed: the modes slower than plain decoding first, said as such."""
    speedups = {k: (results.get("speedup") or {}).get(k) for k in results.get("tau", {})}
    slower = [(k, v) for k, v in speedups.items() if v is not None and v < 1.0]
    faster = [(k, v) for k, v in speedups.items() if v is not None and v >= 1.0]
    where = f"on `{results.get('device')}`"
    base = "CUDA-graphed plain decoding" if results.get("graphed_baseline") else "plain decoding"
    parts = []
    if slower:
        parts.append("**Slower than " + base + f" {where}: " +
                     ", ".join(f"{k} {v:.2f}x ({1 / v:.1f}x slower)" for k, v in sorted(slower, key=lambda x: x[1]))
                     + "**")
    if faster:
        parts.append(("Faster: " if slower else f"**Faster than {base} {where}: ") +
                     ", ".join(f"{k} {v:.2f}x" for k, v in sorted(faster, key=lambda x: x[1]))
                     + ("" if slower else "**"))
    if not parts:
        return "No speed figure (nothing was decoded)."
    c = results.get("summary_concurrency", 1)
    at = f", {c} requests in flight" if c != 1 else ""
    return ". ".join(parts) + f" (tokens/s over plain decoding of the same turns{at})." + _first_set_tau(results)


def lead(results: dict[str, Any]) -> str:
    """The report's first words: the fastest mode on this machine (the one to use here), its tau and
    speedup over plain decoding, and its share of outputs equal to plain decoding's; said as a loss
    when no mode beats plain decoding."""
    speedups = {k: v for k, v in (results.get("speedup") or {}).items() if v is not None}
    if not speedups:
        return ""
    best = max(speedups, key=speedups.get)
    b = (results.get("config") or {}).get("bench") or {}
    figures = f"tau {number((results.get('tau') or {}).get(best))}, {speedups[best]:.2f}x plain decoding on `{results.get('device')}`"
    if speedups[best] >= 1.0:
        first = f"**Use {kind_label(results, best)} here: {figures}**"
    else:
        first = f"**No mode beats plain decoding on `{results.get('device')}`; the fastest, {kind_label(results, best)}: {figures}**"
    same = ((results.get("modes") or {}).get(best) or {}).get("identical_to_baseline")
    length = f" of up to {b['max_new_tokens']} new tokens" if b.get("max_new_tokens") else ""
    return (first + f" ({results.get('num_turns', '?')} turns{length}"
            + (f"; {same:.0%} of its outputs equal plain decoding's" if same is not None else "") + ").")


def reference_record(path: str) -> Path:
    """``bench.reference.record``: relative to the working directory, else to the repository the
    package runs from (a checkout's benchmarks/results/); ``ConfigError`` when neither holds it."""
    here = Path(path).expanduser()
    for candidate in (here, Path(eagle3_ray.__file__).resolve().parents[1] / path):
        if candidate.is_file():
            return candidate.resolve()
    raise ConfigError(f"bench.reference.record={path!r} does not exist (here or in the repository); name a record "
                      "file such as benchmarks/results/records/product8.json, or set bench.reference=null")


def reference_sentence(reference: dict[str, Any], report_dir: str | Path) -> str:
    """``bench.reference``'s sentence, its ``{key}`` fields filled from the record's values (and its
    ``machine`` and ``date``), with a link to the record relative to the report's directory."""
    file = reference_record(reference["record"])
    record = json.loads(file.read_text(encoding="utf-8"))
    fields = {**(record.get("values") or {}), "machine": record.get("machine"), "date": record.get("date")}
    try:
        text = reference["text"].format(**fields)
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"bench.reference.text names {e} which {file} does not give in a usable form; use keys "
                          f"of its values ({', '.join(sorted(record.get('values') or {}))}), machine or date") from e
    link = os.path.relpath(file, Path(report_dir).resolve())
    return f"{text} ([{file.stem}]({link}))."


def _first_set_tau(results: dict[str, Any]) -> str:
    """With several prompt sets, the first set's tau per mode (MT-bench's when it is listed first)."""
    per_set = results.get("per_set") or {}
    if len(per_set) < 2:
        return ""
    name, kinds = next(iter(per_set.items()))
    taus = [f"{k} {number((kinds.get(k) or {}).get('tau'))}" for k in results.get("tau", {})]
    return f" **tau on {name}** (first of {len(per_set)} prompt sets): " + ", ".join(taus) + "."


def _header(results: dict[str, Any], report_dir: Path) -> str:
    cfg = results.get("config") or {}
    b = cfg.get("bench") or {}
    opening = [x for x in [lead(results)] if x]
    if b.get("reference"):
        opening.append(reference_sentence(b["reference"], report_dir))
    lines = [
        "# EAGLE-3 speculative decoding benchmark",
        "",
        *([" ".join(opening), ""] if opening else []),
        headline(results),
        "",
        f"- target: `{results.get('target')}` on `{results.get('device')}`",
        f"- drafter: `{results.get('drafter')}`",
        f"- prompts: {_sources(cfg.get('prompts', '?'))}, {results.get('num_prompts', '?')} prompts, "
        f"{results.get('num_turns', '?')} turns",
    ]
    if b:
        lines.append(f"- max_new_tokens {b.get('max_new_tokens')}, temperature {b.get('temperature')}")
    if "graphed_baseline" in results:
        lines.append(f"- {results.get('dtype', '?')}; baseline {'CUDA-graphed' if results['graphed_baseline'] else 'eager'}"
                     f", drafter {'CUDA-graphed (static cache)' if results.get('draft_graphs') else 'eager'}")
    lines += [
        "",
        "tau = tokens per target verify forward, counting the bonus token (1 = no draft accepted). "
        "Speedup = tokens/s over plain target generation on the same turns in the same run "
        "(see docs/bench.md).",
    ]
    return "\n".join(lines)


def _sources(prompts: Any) -> str:
    """``bench.prompts`` as given: one entry or a list (mappings as their path, name and cap)."""
    def one(entry: Any) -> str:
        if not isinstance(entry, dict):
            return f"`{entry}`"
        extra = [f"{k} {entry[k]}" for k in ("name", "max_prompts") if entry.get(k) is not None]
        return f"`{entry.get('path')}`" + (f" ({', '.join(extra)})" if extra else "")

    return ", ".join(one(e) for e in prompts) if isinstance(prompts, list) else one(prompts)


def _summary_section(results: dict[str, Any]) -> str:
    rows = []
    for kind in ["baseline", *result_kinds(results)]:
        e = kind_entry(results, kind)
        speedup = 1.0 if kind == "baseline" else e.get("speedup")
        identical = e.get("identical_to_baseline")
        rows.append([
            kind_label(results, kind),
            "–" if kind == "baseline" else number(e.get("tau")),
            number(e.get("tokens_per_s"), "{:.1f}"),
            number(speedup, "{:.2f}x"),
            "" if kind == "baseline" else number(identical, "{:.0%}"),
        ])
    table = md_table(["mode", "tau", "tokens/s", "speedup", "output = baseline"], rows)
    c = results.get("summary_concurrency", 1)
    at = f"At concurrency {c} (the lowest measured; the SGLang section has every one).\n\n" if c != 1 else ""
    return f"## Summary\n\n{at}{table}\n\n![throughput]({THROUGHPUT_PLOT})"


def _parts_section(results: dict[str, Any]) -> str:
    kinds = [k for k in ["baseline", *result_kinds(results)] if kind_entry(results, k).get("ms_per_cycle")]
    if not kinds:
        return ""
    cols = ["draft", "verify", "accept", "commit"]
    rows = []
    for kind in kinds:
        ms = kind_entry(results, kind)["ms_per_cycle"]
        cycle = sum(ms.get(c, 0.0) for c in cols)
        rows.append([kind_label(results, kind), *[number(ms.get(c), "{:.2f}") for c in cols], number(cycle, "{:.2f}"),
                     number(ms.get("prefill"), "{:.1f}")])
    intro = ("Milliseconds per verify cycle (baseline: per decoded token) by part: draft, the target's verify "
             "forward, acceptance and bookkeeping, the drafter's commit of the accepted states; and the "
             "prefill per turn. On CUDA measured with CUDA events at the part boundaries. With the graphed static "
             "drafter a commit runs inside the next draft's graph: its kernels count under draft.")
    table = md_table(["mode", "draft", "verify", "accept", "commit", "cycle", "prefill / turn"], rows)
    return f"## Where the time goes\n\n{intro}\n\n{table}"


def _divergence_section(results: dict[str, Any]) -> str:
    summary = results.get("summary") or {}
    items = results.get("divergences") or []
    if summary.get("bf16_divergent_turns") is None and not items:
        return ""
    lines = [
        "## Divergence from plain greedy decoding",
        "",
        f"{summary.get('bf16_divergent_turns')} turns of the speculative modes differ from the baseline; "
        f"{summary.get('bf16_unexplained_divergences')} are not explained by rounding "
        f"(bound: {summary.get('divergence_bound')}). A divergence inside the bound is a near-tie that the "
        "verify forward and the one-token decode round differently; one outside it is a bug.",
    ]
    if items:
        rows = [[d["kind"], d["category"], f"{d['prompt_id']}/{d['turn']}", str(d.get("position")),
                 number(d.get("gap"), "{:.4g}"), number(d.get("gap_ulps"), "{:.1f}"),
                 {True: "yes", False: "**no**", None: "–"}[d.get("explained")]] for d in items]
        lines += ["", md_table(["mode", "category", "prompt/turn", "first diff", "top-2 gap", "gap (ulp)",
                                "rounding"], rows)]
    return "\n".join(lines)


def _kind_table(first: str, groups: dict[str, dict[str, Any]], kinds: list[str], turns: bool = False) -> str:
    """One row per group (prompt set, category): turns, then tau and speedup of each kind."""
    header = [first] + (["turns"] if turns else []) + [f"{k} {col}" for k in kinds for col in ("tau", "speedup")]
    rows = []
    for group, by_kind in groups.items():
        row = [group] + ([str((by_kind.get("baseline") or {}).get("turns", "–"))] if turns else [])
        for k in kinds:
            e = by_kind.get(k) or {}
            row += [number(e.get("tau")), number(e.get("speedup"), "{:.2f}x")]
        rows.append(row)
    return md_table(header, rows)


def _set_section(results: dict[str, Any]) -> str:
    """Per prompt set (only with several: one set's row would repeat the summary)."""
    per_set = results.get("per_set") or {}
    if len(per_set) < 2:
        return ""
    intro = ("Each prompt set's turns pooled as the summary pools all of them; speedup over plain decoding "
             "of that set's turns.")
    return f"## Per set\n\n{intro}\n\n{_kind_table('set', per_set, result_kinds(results), turns=True)}"


def _turn_section(results: dict[str, Any]) -> str:
    """Each multi-turn prompt set by turn index (results without ``per_turn`` have none)."""
    per_turn = results.get("per_turn") or {}
    rows = {f"{name} turn {t}": kinds for name, turns in per_turn.items() for t, kinds in turns.items()}
    if not rows:
        return ""
    intro = ("The turns at each index of their conversation pooled (turn 2 follows the target's own answer "
             "to turn 1); speedup over plain decoding of the same turns.")
    return f"## Per turn\n\n{intro}\n\n{_kind_table('turns of', rows, result_kinds(results), turns=True)}"


def _category_section(results: dict[str, Any]) -> str:
    per_cat = results.get("per_category") or {}
    if not per_cat:
        return ""
    table = _kind_table("category", per_cat, result_kinds(results))
    return f"## Per category\n\n{table}\n\n![tau by category]({TAU_PLOT})"


def _acceptance_section(results: dict[str, Any]) -> str:
    curves = {k: kind_entry(results, k).get("accept_by_position") or [] for k in result_kinds(results)}
    curves = {k: v for k, v in curves.items() if v}
    if not curves:
        return ""
    width = max(len(v) for v in curves.values())
    rows = [[kind_label(results, k)] + [number(v[i], "{:.0%}") if i < len(v) else "" for i in range(width)]
            for k, v in curves.items()]
    table = md_table(["mode"] + [f"≥{i + 1}" for i in range(width)], rows)
    intro = "Share of verify steps that accepted at least i draft tokens."
    return f"## Acceptance by draft position\n\n{intro}\n\n{table}\n\n![acceptance by position]({ACCEPT_PLOT})"


def _untrained_section(results: dict[str, Any]) -> str:
    untrained = results.get("untrained")
    trained = (results.get("modes") or {}).get("chain")
    if not untrained or not trained:
        return ""
    rows = [
        [name, number(e.get("tau")), number(e.get("tokens_per_s"), "{:.1f}"), number(e.get("speedup"), "{:.2f}x")]
        for name, e in (("trained", trained), ("untrained (seeded random)", untrained))
    ]
    gain = "–"
    if trained.get("tau") and untrained.get("tau"):
        gain = f"{trained['tau'] - untrained['tau']:+.2f}"
    table = md_table(["chain drafter", "tau", "tokens/s", "speedup"], rows)
    return f"## Trained vs untrained drafter\n\n{table}\n\nTraining changed tau by {gain}."


CURVE_ROWS = 12  # rows of the tau-against-training-tokens table at most (the last row always among them)


def _curve_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the tau curve table: the held-out evaluations (every logged row when there are
    none), thinned evenly to `CURVE_ROWS`, the last row always included."""
    picked = [r for r in rows if r.get("val_tau") is not None] or rows
    if picked[-1] is not rows[-1]:
        picked = [*picked, rows[-1]]
    if len(picked) > CURVE_ROWS:
        n = len(picked) - 1
        picked = [picked[round(i * n / (CURVE_ROWS - 1))] for i in range(CURVE_ROWS)]
    return picked


def _last_val(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((r for r in reversed(rows) if r.get("val_tau") is not None), None)


def _training_section(rows: list[dict[str, Any]], results: dict[str, Any] | None = None) -> str:
    if not rows:
        return ""
    last = rows[-1]
    accs = sorted((k for k in last if k.startswith("acc_")), key=lambda k: int(k.split("_")[1]))
    table = md_table(
        ["step", "training tokens", "loss", "simulated tau", *accs, "lr", "tokens/s"],
        [[str(last["step"]), number(train_tokens(last), "{:,}"), number(last.get("loss"), "{:.3f}"),
          number(last.get("tau")), *[number(last[a], "{:.2f}") for a in accs], number(last.get("lr"), "{:.2e}"),
          number(last.get("tokens_per_s"), "{:,.0f}")]],
    )
    intro = (
        f"The last of {len(rows)} logged steps. Simulated tau = 1 + Σ_k Π_(j≤k) acc_j from the training "
        "accuracies; compare it with the measured chain/tree tau above."
    )
    # chain(3) columns where the run logged them: held-out, and each train.val_groups group; the walked
    # chain (val_tau_walk3, the bench's counterpart) where the run has it, else the per-position mean
    walked = any("val_tau_walk3" in r for r in rows)
    prefix = "val_tau_walk3" if walked else "val_tau_chain3"
    chain3 = [k for k in (prefix,) if any(k in r for r in rows)] + sorted(
        {k for r in rows for k in r if k.startswith(prefix + "/")})
    curve = md_table(
        ["step", "training tokens", "train simulated tau", "held-out simulated tau",
         *[("held-out chain(3)" if k == prefix else f"{k.split('/', 1)[1]} chain(3)") for k in chain3]],
        [[str(r["step"]), number(train_tokens(r), "{:,}"), number(r.get("tau")), number(r.get("val_tau")),
          *[number(r.get(k)) for k in chain3]]
         for r in _curve_rows(rows)],
    )
    curve_intro = (
        "Simulated tau against the training tokens the optimizer has seen (sample tokens of the packs "
        "trained on, all workers); held-out: the samples `train.val_share` keeps out of training."
        + (" chain(3): chain decoding of three drafts replayed over each held-out answer "
           "(`val_tau_walk3`: tokens per verify cycle, the counterpart of a measured chain(3) tau on "
           "the target's greedy answers); per group of `train.val_groups` (eval-only groups are never "
           "trained on)." if chain3 and walked else "")
        + (" chain(3): the served simulated tau over the first three drafts, a mean over positions "
           "(`val_tau_chain3`), which reads above a measured chain(3) tau as the drafter gets better; "
           "per group of `train.val_groups` (eval-only groups are never trained on)."
           if chain3 and not walked else "")
    )
    parts = [f"## Training\n\n{intro}\n\n{table}", f"### Tau against training tokens\n\n{curve_intro}\n\n{curve}"]
    measured = _measured_section(rows, results or {})
    if measured:
        parts.append(measured)
    parts.append(f"![training curves]({TRAINING_PLOT})")
    return "\n\n".join(parts)


def _measured_section(rows: list[dict[str, Any]], results: dict[str, Any]) -> str:
    """The bench's measured tau per mode beside the final simulated tau (held-out and train)."""
    taus = {k: v for k, v in (results.get("tau") or {}).items() if v is not None}
    if not taus:
        return ""
    val, last = _last_val(rows), rows[-1]
    walked = val is not None and val.get("val_tau_walk3") is not None
    head = ["mode", "measured tau", "held-out simulated tau (final)", "train simulated tau (final)",
            *(["held-out chain(3) walked (final)"] if walked else [])]
    body = [[kind_label(results, k), number(v), number(val and val.get("val_tau")), number(last.get("tau")),
             *([number(val["val_tau_walk3"])] if walked else [])]
            for k, v in taus.items()]
    tokens = train_tokens(val) if val else None
    where = (f"held-out at step {val['step']}" + (f", {tokens:,} training tokens" if tokens else "")
             if val else "no held-out evaluation in this run (`train.val_share` 0)")
    intro = ("The tau the benchmark measured per mode beside the drafter's simulated tau at the end of "
             f"training ({where}). The simulation assumes a chain of ttt_steps drafts; a measured chain "
             "of fewer drafts, or a tree, differs from it by construction."
             + (" The walked chain(3) replays chain decoding of three drafts over the held-out answers: "
                "where those are the target's greedy answers to the benched prompts, it is the chain(3) "
                "tau the bench should measure." if walked else ""))
    return f"### Measured against simulated tau\n\n{intro}\n\n{md_table(head, body)}"
