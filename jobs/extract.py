"""Ray job entrypoint for `eagle3-ray extract`: capture target hidden states into the feature store.

    ray job submit ... -- python jobs/extract.py -c CONFIG --data PREPARED --out DIR [section.field=value ...]
"""

from _entry import run

if __name__ == "__main__":
    run("extract")
