"""Text in, text out: chat templates, ragged batches, sampling, any eviction policy.

    gen = kvjax.TextGenerator(kvjax.real_model.ensure_model(), policy="snapkv", compression=0.75)
    gen("What is the capital of France?")                       # -> 'The capital of France is Paris.'
    gen.last_stats                                              # KV bytes held against dense
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


_PROMPT_TYPES = "a string, a list of strings, or chat messages (a list of {'role': ..., 'content': ...} dicts)"


def _check_text(text, where: str) -> None:
    if isinstance(text, (bytes, bytearray)):
        raise TypeError(f"{where} is bytes; decode it to a string first (e.g. data.decode('utf-8'))")
    if not isinstance(text, str):
        raise TypeError(f"{where} must be a string, got {type(text).__name__} ({text!r:.40})")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where} holds {text[e.start:e.end]!r} at character {e.start}, not valid text (a "
                         "surrogate escape, e.g. from bytes decoded with errors='surrogateescape'); decode the "
                         "bytes with the right encoding first") from None


def _check_messages(msgs, where: str) -> None:
    if not msgs:
        raise ValueError(f"{where} is an empty list of chat messages")
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise TypeError(f"{where}, message {j}: expected a dict with 'role' and 'content', got {m!r:.60}")
        _check_text(m["content"], f"{where}, message {j}'s content")


def split_prompts(prompts) -> tuple[list, bool]:
    """``(batch, single)``: the prompts as a list, and whether one prompt was given; refuses
    anything but a string, chat messages, or a list of either with a clear error."""
    if isinstance(prompts, str) or isinstance(prompts, (bytes, bytearray)):
        _check_text(prompts, "prompt")
        return [prompts], True
    if not isinstance(prompts, Sequence) or isinstance(prompts, dict):
        raise TypeError(f"prompts must be {_PROMPT_TYPES}; got {type(prompts).__name__} ({prompts!r:.40})")
    if not prompts:
        raise ValueError("prompts is empty")
    if isinstance(prompts[0], dict):
        _check_messages(prompts, "prompt")
        return [list(prompts)], True
    batch = list(prompts)
    for i, p in enumerate(batch):
        if isinstance(p, (list, tuple)) and p and isinstance(p[0], dict):
            _check_messages(p, f"prompt {i}")
        else:
            _check_text(p, f"prompt {i}")
    return batch, False


def generate_text(model, tokenizer, prompts: str | Sequence[str | Messages], max_new_tokens: int = 256, *,
                  policy=None, compression: float | None = None, chat: bool | None = None,
                  system: str | None = None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  seed: int = 0, skip_special_tokens: bool = True, max_cache_len: int | None = None, return_stats: bool = False):
    """Generate continuations of ``prompts`` and return them as strings (with ``return_stats``,
    also the :class:`kvjax.generate.GenerationStats` of the call: KV bytes held against dense).

    One string in gives one string out; a list gives a list (ragged prompts are batched
    together). Rows stop at the model's or the tokenizer's end-of-turn token, which is
    not part of the returned text. ``policy``, ``compression`` and ``max_cache_len`` are
    :func:`kvjax.generate`'s (how the prompt enters is the policy's ``EvictionConfig.prefill``).
    """
    from kvjax.generate import generate

    batch, single = split_prompts(prompts)
    ids = encode_prompts(tokenizer, batch, chat=chat, system=system)
    eos = stop_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    out, stats = generate(model, ids, max_new_tokens, policy=policy, compression=compression,
                          temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos,
                          pad_token_id=pad, max_cache_len=max_cache_len, return_stats=True)
    out = np.asarray(out)
    S = max(len(r) for r in ids)
    texts = []
    for row in out[:, S:]:
        hit = np.flatnonzero(np.isin(row, eos))
        texts.append(tokenizer.decode(row[: hit[0]] if hit.size else row, skip_special_tokens=skip_special_tokens))
    result = texts[0] if single else texts
    return (result, stats) if return_stats else result


class TextGenerator:
    """A model and its tokenizer, with a default eviction policy, as a text-to-text callable.

    ``model``: a Hugging Face folder (loaded with :func:`kvjax.load_hf` at ``dtype``) or a
    loaded model; ``tokenizer``: default, the folder's (or the loaded model's source folder's).
    ``policy`` and ``compression`` (the share of each prompt evicted) are the defaults of every
    call, which may override them and any other :func:`generate_text` argument. After a call,
    ``last_stats`` holds its :class:`kvjax.generate.GenerationStats` (the KV bytes held against
    dense).
    """

    def __init__(self, model, tokenizer=None, *, policy=None, compression: float | None = None, dtype="float32"):
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
        if compression is not None:
            from kvjax.eviction.config import check_compression

            check_compression(compression)
            if policy is None:
                raise ValueError("TextGenerator: compression needs a policy (policy=None is the dense cache)")
        self.model, self.tokenizer, self.policy, self.compression = model, tokenizer, policy, compression
        self.last_stats = None

    def __call__(self, prompts, max_new_tokens: int = 256, **kw):
        kw.setdefault("policy", self.policy)
        kw.setdefault("compression", self.compression)
        want_stats = kw.pop("return_stats", False)
        out, self.last_stats = generate_text(self.model, self.tokenizer, prompts, max_new_tokens, return_stats=True,
                                             **kw)
        return (out, self.last_stats) if want_stats else out
