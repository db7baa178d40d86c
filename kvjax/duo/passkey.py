"""DuoAttention's training data, rebuilt offline: multi-passkey retrieval (the paper's
``multi_passkey10``) in natural text. Ten pass keys (5-digit numbers, unlike the evaluation's
6-digit magic numbers) sit at spread depths of the Python docs; the prompt asks for all of
them and the target answer lists them in order. Only the answer's tokens enter the loss.
"""

from __future__ import annotations

import zlib

import numpy as np

from kvjax.longctx.tasks import _Counter, _doc_text, _fill, _insert, _number, _sentences

INTRO = "There are pass keys hidden in the following text. Find and memorize them all."
QUESTION = "What are all the pass keys in the text above, in the order they appear?"


def passkey_sequence(tokenizer, length: int, index: int, *, n_keys: int = 10, seed: int = 0,
                     counter: _Counter | None = None) -> tuple[list[int], int]:
    """``(token ids, answer start)``: a chat prompt of about ``length`` tokens and its target
    answer; tokens from ``answer start`` on are the answer (the loss's positions)."""
    if length < 256:
        raise ValueError(f"passkey length {length} is too short (at least 256 tokens)")
    counter = counter or _Counter(tokenizer)
    rs = np.random.RandomState([seed, zlib.crc32(b"duo-passkey"), length, index])
    keys = [_number(rs, 5) for _ in range(n_keys)]
    needles = [f"The pass key is {k}. Remember it. {k} is the pass key." for k in keys]
    depths = sorted(float(d) for d in rs.uniform(0.02, 0.98, n_keys))
    answer = "The pass keys are " + ", ".join(keys) + "."
    room = length - 40 - sum(counter.n(t) for t in (INTRO, QUESTION, answer, *needles))
    units = _sentences(rs.randint(len(_doc_text())))
    context = " ".join(_insert(counter, _fill(counter, units, room), needles, depths))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"{INTRO}\n\n{context}\n\n{QUESTION}"}],
                                           tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return ids + tokenizer(answer, add_special_tokens=False)["input_ids"], len(ids)
