"""A model's own reasoning traces (the data KVpop's scorers learn from): ``python -m kvjax.traces``."""

from kvjax.traces.prompts import KINDS, Prompt, make_prompt, prompt_id
from kvjax.traces.run import TraceConfig, generate_traces

__all__ = ["KINDS", "Prompt", "make_prompt", "prompt_id", "TraceConfig", "generate_traces"]
