"""Ray job entrypoint for `eagle3-ray export`: the SGLang/vLLM drafter directory from a checkpoint.

    ray job submit ... -- python jobs/export.py --checkpoint DIR --out DIR [--engine sglang|vllm]
"""

from _entry import run

if __name__ == "__main__":
    run("export")
