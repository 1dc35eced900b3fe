"""Shared body of the `ray job submit` entrypoints: run one `eagle3-ray` subcommand in-process.

The arguments go to the CLI's own parser as a list (never through a shell), so a job accepts exactly
what `eagle3-ray <command>` accepts: `-c CONFIG`, `--out`, stage inputs, `section.field=value`.
Inside a submitted job RAY_ADDRESS points at the cluster, so `init_ray` connects instead of starting
a local Ray. The job's working directory is the uploaded `--working-dir`: the package is imported
from it when the cluster image does not have it installed.

Like the CLI, a job checks every path and model argument before it connects to the cluster
(eagle3_ray/preflight.py; relative paths are relative to the working dir): a wrong one ends the job
with exit status 2 and one line, `eagle3-ray <command>: error: ...`, in `ray job logs`.
"""

from __future__ import annotations

import sys
from pathlib import Path


def run(command: str) -> None:
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:  # `python jobs/x.py` puts jobs/ first, not the working dir
        sys.path.insert(0, root)
    from eagle3_ray.cli import main

    sys.exit(main([command, *sys.argv[1:]]))
