"""Ray job entrypoint for `eagle3-ray vocab`: draft vocabulary map from loss-masked token counts.

    ray job submit ... -- python jobs/vocab.py -c CONFIG --features DIR --out DIR [section.field=value ...]
"""

from _entry import run

if __name__ == "__main__":
    run("vocab")
