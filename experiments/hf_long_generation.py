"""One long-generation run of ``transformers`` (dense) or kvpress's decoding-time compression,
for ``kvjax.evaluation.long_generation``, which calls it in a fresh process per run:

    python experiments/hf_long_generation.py '{"impl": "kvpress-knorm", "batch": 1, ...}'

``transformers-dense`` needs torch + transformers (kvjax's test extra has them); the
``kvpress-*`` runs need kvpress 0.5.5's venv (``bash experiments/kvpress_venv.sh``). No kvjax
import, so either Python runs it. Prints one JSON record: the seconds from the start of
``generate`` to every ``segment``-th generated token (the first entry: the first token, after the
prefill), the peak resident memory of this process, the largest KV cache held (bytes).

kvpress's ``DecodingPress`` wraps a scorer press (``StreamingLLMPress`` or ``KnormPress``) and,
every ``interval`` decoding steps, compresses each layer's cache back to ``keep`` entries per KV
head, so the cache holds between ``keep`` and ``keep + interval`` entries.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def make_press(impl: str, keep: int, interval: int):
    from kvpress import DecodingPress, KnormPress, StreamingLLMPress

    base = {"kvpress-streaming_llm": lambda: StreamingLLMPress(n_sink=4), "kvpress-knorm": KnormPress}
    if impl not in base:
        raise SystemExit(f"unknown implementation {impl!r}; expected transformers-dense or one of {sorted(base)}")
    return DecodingPress(base_press=base[impl](), compression_interval=interval, target_size=keep)


def kv_bytes(cache) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None and hasattr(t, "numel"):
                total += t.numel() * t.element_size()
    return total


def run(spec: dict) -> dict:
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    B, N, seg = spec["batch"], spec["length"], spec["segment"]
    ids = torch.tensor([spec["prompt_ids"]] * B)
    keep = None
    press = contextlib.nullcontext()
    if spec["impl"] != "transformers-dense":
        keep = round((1 - spec["compression"]) * (ids.shape[1] + N))
        press = make_press(spec["impl"], keep, spec["interval"])(model)
    largest = [0]

    def watch(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        if cache is not None:
            largest[0] = max(largest[0], kv_bytes(cache))

    stamps = []

    class Stamp(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    hook = model.register_forward_pre_hook(watch, with_kwargs=True)
    with torch.no_grad(), press:
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, min_new_tokens=N,
                             do_sample=False, pad_token_id=0, eos_token_id=None,
                             stopping_criteria=StoppingCriteriaList([Stamp()]), return_dict_in_generate=True)
    hook.remove()
    largest[0] = max(largest[0], kv_bytes(out.past_key_values))
    new = out.sequences[:, ids.shape[1]:]
    assert new.shape[1] == N and len(stamps) == N, (new.shape, len(stamps))
    steps = [0] + list(range(seg, N + 1, seg))
    times = [stamps[0] - start] + [stamps[s - 1] - start for s in steps[1:]]
    return {"impl": spec["impl"], "batch": B, "length": N, "compression": spec["compression"], "keep": keep,
            "steps": steps, "times_s": times, "compile_s": 0.0, "kv_bytes": int(largest[0]),
            "peak_rss_bytes": peak_rss_bytes(), "head_tokens": new[0, :32].tolist()}


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
