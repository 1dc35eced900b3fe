"""`ray job submit ... -- python jobs/vocab.py`: draft vocab map: -c CONFIG --features DIR --out DIR (+ overrides)."""

from _entry import run

if __name__ == "__main__":
    run("vocab")
