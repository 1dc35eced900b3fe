"""`eagle3-ray verify --features DIR`: the capture audit of an existing feature store, on CPU or GPU.

Prints a progress line, a table of every shard's figures and, for a shard that fails, the audit's
one-line failure; exit status 2 when any shard fails (docs/feature-store.md, "Capture audit"). The
target and thresholds come from ``-c`` (and overrides), else from the store's own resolved config.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from eagle3_ray.progress import say

HELP = "audit an existing feature store with the target's lm_head (exit 2 on a failing shard)"


def add_verify_parser(sub) -> None:
    p = sub.add_parser("verify", help=HELP, description=HELP[0].upper() + HELP[1:] + ".",
                       epilog="Config sections read: target, extract (from -c, else the store's config.resolved.yaml; "
                              "no Ray).")
    p.add_argument("-c", "--config", help="pipeline YAML (default: the store's config.resolved.yaml)")
    p.add_argument("--features", required=True, help="feature store directory")
    p.add_argument("--device", default="auto", help="auto (a GPU where there is one), cpu or cuda[:N]")
    p.add_argument("--rows", type=float, default=None, metavar="SHARE",
                   help="share of each sample's rows to audit, 0..1 (default: extract.audit_rows)")
    p.add_argument("overrides", nargs="*", metavar="section.field=value", help="config overrides")


def verify_command(args: argparse.Namespace) -> int:
    from eagle3_ray.audit.verify import verify_store
    from eagle3_ray.config import RESOLVED_CONFIG_NAME, load_config
    from eagle3_ray.errors import ConfigError, require_dir

    root = require_dir(args.features, "--features", "pass the --out of `eagle3-ray extract`", ConfigError)
    stored = root / RESOLVED_CONFIG_NAME
    config = args.config or (str(stored) if stored.is_file() else None)
    if config is None:
        raise ConfigError(f"--features {root} has no {RESOLVED_CONFIG_NAME}; pass -c with the config it was "
                          "extracted with")
    if args.rows is not None and not 0.0 < args.rows <= 1.0:
        raise ConfigError(f"--rows {args.rows}: pass a share in (0, 1]")
    cfg = load_config(config, list(args.overrides or []))
    report = verify_store(root, cfg, share=args.rows, device=args.device, progress=say)
    for line in table(report):
        say(line)
    for shard in report.failed:
        say(shard.line)
    say(f"[verify] {len(report.shards) - len(report.failed)}/{len(report.shards)} shards pass ({report.share:g} of "
        f"the rows, {report.device}, {report.seconds}s)")
    return 2 if report.failed else 0


def table(report) -> list[str]:
    head = f"{'shard':<34} {'samples':>7} {'rows':>7} {'nll':>7} {'excess':>7} {'greedy':>7} {'agree':>7} " \
           f"{'unnormed':>8}  verdict"
    out = [head]
    for s in report.shards:
        f = s.figures
        out.append(f"{Path(s.name).stem:<34} {s.samples:>7} {f['rows']:>7} {_n(f['nll'], 3):>7} "
                   f"{_n(f['nll_excess'], 3):>7} {f['greedy_rows']:>7} {_n(f['agreement'], 3):>7} "
                   f"{_n(f['unnormed'], 4):>8}  {'FAIL ' + s.failing if s.failing else 'ok'}")
    return out


def _n(v, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"
