"""Ray job entrypoint for `eagle3-ray generate`: self-distillation: the target writes the assistant turns.

    ray job submit ... -- python jobs/generate.py -c CONFIG [--data PATH] --out DIR [section.field=value ...]
"""

from _entry import run

if __name__ == "__main__":
    run("generate")
