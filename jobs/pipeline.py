"""The whole pipeline as one Ray job, resumable stage by stage (same as `eagle3-ray run`).

    ray job submit --address http://127.0.0.1:8265 --working-dir . \
        --runtime-env cluster/runtime_env.yaml -- \
        python jobs/pipeline.py -c configs/demo-smollm2.yaml --out /shared/runs/demo [--stop-after train] \
        [section.field=value ...]

--out must be on storage the driver can reach again (resubmitting the same command resumes).
"""

from _entry import run

if __name__ == "__main__":
    run("run")
