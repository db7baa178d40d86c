"""Text in, text out: chat templates, ragged batches, sampling, any eviction policy.

    gen = kvjax.TextGenerator(kvjax.real_model.ensure_model(), policy="snapkv")
    gen("What is the capital of France?")                       # -> 'The capital of France is Paris.'
    gen(["Tell me a joke.", "Name three rivers."], max_new_tokens=64, temperature=0.7, top_p=0.9, seed=1)

:func:`generate_text` is the same as a function of ``(model, tokenizer, prompts)``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

Messages = Sequence[dict]


def _load_tokenizer(folder: Path):
    import transformers

    if not (folder / "tokenizer.json").exists() and not (folder / "tokenizer_config.json").exists():
        raise FileNotFoundError(f"{folder}: no tokenizer (tokenizer.json); pass tokenizer= explicitly")
    return transformers.AutoTokenizer.from_pretrained(folder)


def encode_prompts(tokenizer, prompts, *, chat: bool | None = None, system: str | None = None) -> list[list[int]]:
    """Token ids of each prompt; with ``chat`` (default: when the tokenizer has a chat template)
    a string becomes one user message and a list of messages is used as it is."""
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
    out = []
    for p in prompts:
        if chat:
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError("chat=True but the tokenizer has no chat template")
            msgs = [{"role": "user", "content": p}] if isinstance(p, str) else list(p)
            if system is not None and (not msgs or msgs[0].get("role") != "system"):
                msgs = [{"role": "system", "content": system}] + msgs
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            if not isinstance(p, str):
                raise TypeError(f"chat=False needs string prompts, got {type(p).__name__}")
            ids = tokenizer(p)["input_ids"]
        if not len(ids):
            raise ValueError(f"prompt {p!r} encodes to no tokens")
        out.append([int(t) for t in ids])
    return out


def stop_token_ids(model, tokenizer) -> tuple[int, ...]:
    """The model's EOS ids plus the tokenizer's end-of-turn token."""
    vocab = tokenizer.get_vocab()
    ids = set(model.config.eos_ids)
    if tokenizer.eos_token in vocab:
        ids.add(vocab[tokenizer.eos_token])
    return tuple(sorted(int(i) for i in ids))


def generate_text(model, tokenizer, prompts: str | Sequence[str | Messages], max_new_tokens: int = 256, *,
                  policy=None, chat: bool | None = None, system: str | None = None, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0, seed: int = 0, skip_special_tokens: bool = True):
    """Generate continuations of ``prompts`` and return them as strings.

    One string in gives one string out; a list gives a list (ragged prompts are batched
    together). Rows stop at the model's or the tokenizer's end-of-turn token, which is
    not part of the returned text.
    """
    from kvjax.generate import generate

    single = isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and
                                          isinstance(prompts[0], dict))
    batch = [prompts] if single else list(prompts)
    if not batch:
        raise ValueError("prompts is empty")
    ids = encode_prompts(tokenizer, batch, chat=chat, system=system)
    eos = stop_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    out = np.asarray(generate(model, ids, max_new_tokens, policy=policy, temperature=temperature,
                                    top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos, pad_token_id=pad))
    S = max(len(r) for r in ids)
    texts = []
    for row in out[:, S:]:
        hit = np.flatnonzero(np.isin(row, eos))
        texts.append(tokenizer.decode(row[: hit[0]] if hit.size else row, skip_special_tokens=skip_special_tokens))
    return texts[0] if single else texts


class TextGenerator:
    """A model and its tokenizer, with a default eviction policy, as a text-to-text callable.

    ``model``: a Hugging Face folder (loaded with :func:`kvjax.load_hf` at ``dtype``) or a
    loaded model; ``tokenizer``: default, the folder's (or the loaded model's source folder's).
    """

    def __init__(self, model, tokenizer=None, *, policy=None, dtype="float32"):
        from kvjax.convert.hf_io import load_hf, source_folder

        if isinstance(model, (str, os.PathLike)):
            folder = Path(model)
            model = load_hf(folder, dtype=dtype)
        else:
            folder = source_folder(model)
        if tokenizer is None:
            if folder is None:
                raise ValueError("tokenizer is required for a model not loaded from a folder")
            tokenizer = _load_tokenizer(folder)
        self.model, self.tokenizer, self.policy = model, tokenizer, policy

    def __call__(self, prompts, max_new_tokens: int = 256, **kw):
        kw.setdefault("policy", self.policy)
        return generate_text(self.model, self.tokenizer, prompts, max_new_tokens, **kw)
