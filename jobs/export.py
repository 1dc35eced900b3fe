"""`ray job submit ... -- python jobs/export.py`: SGLang/vLLM drafter directory: --checkpoint DIR --out DIR [--engine sglang|vllm] (+ overrides)."""

from _entry import run

if __name__ == "__main__":
    run("export")
