"""`ray job submit ... -- python jobs/generate.py`: self-distillation (the target writes the answers): -c CONFIG [--data PATH] --out DIR (+ overrides)."""

from _entry import run

if __name__ == "__main__":
    run("generate")
