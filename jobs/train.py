"""`ray job submit ... -- python jobs/train.py`: Ray Train + DeepSpeed drafter training: -c CONFIG --features DIR [--vocab DIR] --out DIR (+ overrides)."""

from _entry import run

if __name__ == "__main__":
    run("train")
