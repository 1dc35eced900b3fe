"""Ray job entrypoint for `eagle3-ray train`: Ray Train + DeepSpeed drafter training.

    ray job submit ... -- python jobs/train.py -c CONFIG --features DIR [--vocab DIR] --out DIR [section.field=value ...]
"""

from _entry import run

if __name__ == "__main__":
    run("train")
