"""Ray job entrypoint for `eagle3-ray prepare`: tokenize conversations with loss masks.

    ray job submit ... -- python jobs/prepare.py -c CONFIG [--data PATH] --out DIR [section.field=value ...]
"""

from _entry import run

if __name__ == "__main__":
    run("prepare")
