"""Run a script with torch's sdpa backends restricted for the whole process, the product's own
per-call choices (``sdpa_for_growing_keys``: no cuDNN for growing keys) included:

    python3 benchmarks/device/with_sdpa.py nocudnn|math|efficient|default <script.py> [args ...]

nocudnn: flash, memory-efficient and math; math: the math kernel only; efficient: memory-efficient
and math; default: torch's choice (the product as shipped). The tool of the 2026-12-03 afternoon
session's check of the H200's aux states (benchmarks/device/tau_env_check.sh, sdpa_matrix.sh).
"""

from __future__ import annotations

import contextlib
import runpy
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

CHOICES = {
    "nocudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "math": [SDPBackend.MATH],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
}


def main() -> None:
    choice, script = sys.argv[1], sys.argv[2]
    sys.argv = sys.argv[2:]
    if choice != "default":
        backends = CHOICES[choice]
        ctx = sdpa_kernel(backends)
        ctx.__enter__()  # for the whole process

        import eagle3_ray.drafter.model as model
        import eagle3_ray.spec.static as static
        import eagle3_ray.spec.static_draft as static_draft
        import eagle3_ray.spec.target as target

        def same(device):  # the product's per-call choice would widen the set again
            return sdpa_kernel(backends) if device.type == "cuda" else contextlib.nullcontext()

        for mod in (model, static, static_draft, target):
            mod.sdpa_for_growing_keys = same
    print(f"[with_sdpa] {choice}: cudnn {torch.backends.cuda.cudnn_sdp_enabled()} flash "
          f"{torch.backends.cuda.flash_sdp_enabled()} efficient {torch.backends.cuda.mem_efficient_sdp_enabled()} "
          f"math {torch.backends.cuda.math_sdp_enabled()}", flush=True)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
