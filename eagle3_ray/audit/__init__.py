"""The capture audit: every shard checked against the target's own next-token predictions.

``last_hidden`` is the lm_head input (docs/contracts.md), so ``lm_head(last_hidden[t])`` must predict
``input_ids[t + 1]`` the way the target does. ``rows.py`` computes that per row (torch only: the SGLang
hook imports it in every TP worker), ``figures.py`` sums rows into per-sample and per-shard figures and
judges them, ``weights.py`` reads just the lm_head and final norm of a target, ``verify.py`` audits an
existing store (``eagle3-ray verify``). docs/feature-store.md, "Capture audit". No Ray in here.
"""
