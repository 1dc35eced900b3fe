"""Ray job entrypoint for `eagle3-ray bench`: speculative-decoding benchmark of a trained drafter.

    ray job submit ... -- python jobs/bench.py -c CONFIG --drafter DIR --out DIR [section.field=value ...]
"""

from _entry import run

if __name__ == "__main__":
    run("bench")
