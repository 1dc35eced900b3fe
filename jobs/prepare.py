"""`ray job submit ... -- python jobs/prepare.py`: tokenize conversations with loss masks: -c CONFIG [--data PATH] --out DIR (+ overrides)."""

from _entry import run

if __name__ == "__main__":
    run("prepare")
