"""`ray job submit ... -- python jobs/bench.py`: speculative-decoding benchmark: -c CONFIG --drafter DIR --out DIR (+ overrides)."""

from _entry import run

if __name__ == "__main__":
    run("bench")
