"""`ray job submit ... -- python jobs/extract.py`: capture hidden states into the feature store: -c CONFIG --data PREPARED --out DIR (+ overrides)."""

from _entry import run

if __name__ == "__main__":
    run("extract")
