"""Cost of idle slots: one running request in engines of 1, 2 and 8 slots (row buckets on / off).

    PYTHONPATH=. python experiments/serving/row_buckets.py
"""

import time

from dspine_jax.drafters.io import load_draft
from dspine_jax.models.target import load_target
from dspine_jax.serve.engine import EngineCore, SlotParams

target = load_target("smollm2-135m-instruct")
drafter = load_draft("init:dspine", target)
prompt = list(range(100, 160))
for name, slots, bucket in [("1 slot", 1, True), ("2 slots, rows bucket 1", 2, True),
                            ("8 slots, rows bucket 1", 8, True), ("8 slots, all rows stepped", 8, False)]:
    core = EngineCore(target, drafter, num_slots=slots, context_length=512, verify_len=8, bucket_rows=bucket)
    core.add(0, prompt, 200, SlotParams())
    core.step()  # compile
    times = []
    for _ in range(6):
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    print(f"{name}: ms/step {sorted(round(t * 1000) for t in times)}", flush=True)
