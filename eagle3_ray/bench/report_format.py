"""How ``report.md`` and its plots name, colour and format the kinds of a results.json (the modes
of the trained drafter, the baseline, the peers) and their numbers."""

from __future__ import annotations

from typing import Any

PEERS = ("prompt_lookup", "untrained")  # compared with the modes but not modes of the trained drafter


def result_kinds(results: dict[str, Any]) -> list[str]:
    """Modes of the trained drafter, then the peers that were run."""
    return list(results.get("tau", {})) + [p for p in PEERS if results.get(p)]


def kind_entry(results: dict[str, Any], kind: str) -> dict[str, Any]:
    if kind in PEERS or kind == "baseline":
        return results.get(kind) or {}
    return (results.get("modes") or {}).get(kind) or {
        "tau": results["tau"].get(kind),
        "tokens_per_s": results["tokens_per_s"].get(kind),
        "speedup": results["speedup"].get(kind),
        "accept_by_position": (results.get("accept_by_position") or {}).get(kind, []),
    }


def kind_colors(results: dict[str, Any]) -> dict[str, str]:
    """One colour per kind, the same in every plot."""
    return {"baseline": "0.6", **{k: f"C{i}" for i, k in enumerate(result_kinds(results))}}


def kind_label(results: dict[str, Any], kind: str) -> str:
    b = (results.get("config") or {}).get("bench") or {}
    details = {
        "baseline": "target only",
        "chain": f"K={b['num_steps']}" if "num_steps" in b else "",
        "tree": f"top-{b['topk']}, depth {b['depth']}, {b['total_tokens']} tokens" if "topk" in b else "",
        "prompt_lookup": "peer, no drafter",
        "untrained": "chain, untrained drafter",
    }.get(kind, "")
    return f"{kind} ({details})" if details else kind


def number(value: Any, fmt: str = "{:.2f}") -> str:
    return "–" if value is None else fmt.format(value)


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def train_tokens(row: dict[str, Any]) -> int | None:
    """Training tokens seen by the optimizer up to this row (all workers); None in metrics written
    before the count was logged."""
    v = row.get("train_tokens")
    return None if v is None else int(v)
