"""Training haystacks: long-context problems, with seeds disjoint from the evaluation's, written
as trace splits so the teacher-feature pass (:mod:`kvjax.scorer_fit.features`) reads them.

Each row is one problem's context, tokenized exactly as :mod:`kvjax.longctx` feeds it in the
question-agnostic setting (:func:`kvjax.longctx.tasks.prompt_ids`: the chat template's head and
the context, without the question), so a scorer fitted on these rows learns what to keep of a
context before its question is known. The evaluation's problems are generated with
``LongCtxConfig.seed`` (0 unless set): the seeds here must differ from it and from each other,
and a problem of the same ``(task, length, index)`` under another seed shares no needle, key or
value with it (:meth:`kvjax.longctx.tasks.Generator.problem` seeds on all four).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

EVAL_SEED = 0      # kvjax.longctx.run.LongCtxConfig.seed's default: the committed tables' problems


@dataclass(frozen=True)
class HaystackConfig:
    out_dir: str = "runs/haystacks/smollm2"        # train.jsonl, valid.jsonl (trace rows)
    tasks: list[str] = field(default_factory=lambda: ["niah_noise", "niah_text", "niah_multikey", "niah_multivalue",
                                                      "niah_multiquery", "vt", "cwe", "fwe", "qa"])
    lengths: list[int] = field(default_factory=lambda: [1024])
    train: int = 12                                # problems per task and length
    valid: int = 2
    seeds: dict[str, int] = field(default_factory=lambda: {"train": 101, "valid": 102})
    eval_seed: int = EVAL_SEED                     # the evaluation's seed, refused here
    model_dir: str | None = None                   # its tokenizer; default: SmolLM2 via kvjax.real_model

    def __post_init__(self):
        from kvjax.longctx.tasks import TASKS

        bad = [t for t in self.tasks if t not in TASKS]
        if bad:
            raise ValueError(f"tasks: unknown task {bad[0]!r}; known: {', '.join(TASKS)}")
        if set(self.seeds) != {"train", "valid"}:
            raise ValueError(f"seeds: give one seed for each of train and valid, got {sorted(self.seeds)}")
        if self.eval_seed in self.seeds.values():
            raise ValueError(f"seeds: {self.seeds} reuses the evaluation's seed {self.eval_seed}; training "
                             "problems must be generated with seeds disjoint from the evaluation's")
        if self.seeds["train"] == self.seeds["valid"]:
            raise ValueError(f"seeds: train and valid share seed {self.seeds['train']}")
        if min(self.train, self.valid) < 1 or not self.lengths:
            raise ValueError("train and valid must be >= 1 and lengths non-empty")


def write_haystacks(cfg: HaystackConfig, *, tokenizer=None, progress: bool = True) -> dict:
    """Write ``train.jsonl`` and ``valid.jsonl`` under ``cfg.out_dir`` (each whole or not at all);
    returns ``{split: {"rows", "tokens"}}``."""
    from tqdm import tqdm

    from kvjax.longctx.tasks import Generator, prompt_ids

    if tokenizer is None:
        import transformers

        from kvjax.real_model import ensure_model

        tokenizer = transformers.AutoTokenizer.from_pretrained(cfg.model_dir or ensure_model())
    gen = Generator(tokenizer)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for split, n in (("train", cfg.train), ("valid", cfg.valid)):
        seed = cfg.seeds[split]
        jobs = [(length, task, i) for length in cfg.lengths for task in cfg.tasks for i in range(n)]
        path, tokens = out / f"{split}.jsonl", 0
        tmp = path.with_suffix(".jsonl.tmp")
        with open(tmp, "w") as f:
            for length, task, i in tqdm(jobs, desc=f"haystacks {split}", unit="problem", disable=not progress):
                ctx, _ = prompt_ids(tokenizer, gen.problem(task, length, i, seed))
                f.write(json.dumps({"id": f"{length}/{task}/{i}/seed{seed}", "kind": task, "split": split,
                                    "tokens": ctx, "prompt_len": len(ctx)}) + "\n")
                tokens += len(ctx)
        tmp.replace(path)
        summary[split] = {"rows": len(jobs), "tokens": tokens, "seed": seed}
    (out / "haystack_config.json").write_text(json.dumps({"tasks": cfg.tasks, "lengths": cfg.lengths,
                                                          "seeds": cfg.seeds, "summary": summary}, indent=1))
    return summary
