"""Continuous batching for trace sampling: ``B`` rows, each its own conversation, one token
per row per step, rows refilled as soon as their conversation stops.

Every step feeds each running row one token at its own position: the next token of the
row's *forced* queue (a prompt, or a follow-up user turn), else the token it sampled at
the previous step. A row *stalls* — stops advancing until the host looks at it — after
feeding a sampled end-of-turn token, when its cache is full, or when its current turn
reaches ``turn_cap`` sampled tokens. The host (:mod:`kvjax.traces.run`) then decides
what comes next (a follow-up, more of the same turn, or a new conversation) every
``chunk`` steps. Nothing is ever re-prefilled, and no row waits for the slowest one.

A sampled token at position ``t`` of the conversation with key id ``k`` draws with
``fold_in(fold_in(key(seed), k), t)``, so a conversation's tokens do not depend on which
row it ran in or what ran beside it: a resumed run regenerates it exactly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax import decode
from kvjax.cache import DenseKV, dense_cache_attention
from kvjax.sampling import bucket, sample_logits

# why a row stalled (host-visible ``reason``)
RUNNING, ENDED, FULL, TURN_CAP, IDLE = 0, 1, 2, 3, 4


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("steps", "eos_ids", "span"),
                   donate_argnums=(2,))
def _advance(graphdef, params, cache, small, seed_key, temperature, top_k, top_p, turn_cap, *,
             steps: int, eos_ids: tuple[int, ...], span: int):
    """Run ``steps`` steps attending over slots ``[0, span)``; returns ``(cache, small, fed
    int32 [B, steps])`` (``-1`` = stalled)."""
    model = nnx.merge(graphdef, params)
    attend = functools.partial(dense_cache_attention, span=span)   # no running row reaches past span
    B, F = small["force"].shape
    T = cache.k[0].shape[2]
    eos = jnp.asarray(eos_ids, jnp.int32)
    rows = jnp.arange(B)

    def row_key(key_id, pos):
        return jax.random.fold_in(jax.random.fold_in(seed_key, key_id), pos)

    def step(i, carry):
        st, s, fed = carry["decode"], carry["rows"], carry["fed"]
        running = s["reason"] == RUNNING
        forced = s["fptr"] < s["flen"]
        x = jnp.where(forced, s["force"][rows, jnp.minimum(s["fptr"], F - 1)], s["next"])
        pos = jnp.minimum(s["pos"], T - 1)
        logits, st = decode.decode_step(model, attend, st.replace(position=pos), x)
        keys = jax.vmap(row_key)(s["key_id"], pos + 1)
        y = sample_logits(logits, keys, temperature, top_k, top_p)
        sampled = running & ~forced
        new_pos = s["pos"] + running
        turn_gen = s["turn_gen"] + sampled
        reason = jnp.where(~running, s["reason"],
                           jnp.where(sampled & jnp.isin(x, eos), ENDED,
                                     jnp.where(new_pos >= T, FULL,
                                               jnp.where(sampled & (turn_gen >= turn_cap), TURN_CAP, RUNNING))))
        s = {**s, "pos": new_pos, "turn_gen": turn_gen, "reason": reason,
             "fptr": s["fptr"] + (running & forced), "next": jnp.where(running, y, s["next"])}
        return {"decode": st, "rows": s, "fed": fed.at[:, i].set(jnp.where(running, x, -1))}

    carry = {"decode": decode.start(cache, small["pos"]), "rows": small,
             "fed": jnp.full((B, steps), -1, jnp.int32)}
    carry = jax.lax.fori_loop(0, steps, step, carry)
    return carry["decode"].cache, carry["rows"], carry["fed"]


@dataclass
class StreamSampler:
    """Device side of continuous batching over ``batch`` rows of ``max_len`` positions.

    ``load(row, tokens, key_id, reset=True)`` starts a conversation in ``row`` (``reset=False``
    appends forced tokens, e.g. a follow-up turn, to the one it holds); ``resume(row)``
    lets a row stalled at ``turn_cap`` sample on; ``idle(row)`` parks it;
    ``run()`` advances ``chunk`` steps and returns each row's fed tokens.
    """

    model: object
    batch: int
    max_len: int
    eos_ids: tuple[int, ...]
    turn_cap: int
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    chunk: int = 16
    cache_dtype: str = "float32"

    def __post_init__(self):
        if not self.eos_ids:
            raise ValueError("StreamSampler needs at least one end-of-turn token id")
        if self.max_len > self.model.config.max_position_embeddings:
            raise ValueError(f"max_len {self.max_len} exceeds the model's max_position_embeddings="
                             f"{self.model.config.max_position_embeddings}")
        B = self.batch
        self._graphdef, self._params = nnx.split(self.model)
        self._cache = decode.open_cache(DenseKV(), None, self.model.config, B, self.max_len,
                                        jnp.dtype(self.cache_dtype), np.zeros(B, np.int32))
        self.small = {"pos": np.zeros(B, np.int32), "next": np.zeros(B, np.int32),
                      "force": np.zeros((B, self.max_len), np.int32), "fptr": np.zeros(B, np.int32),
                      "flen": np.zeros(B, np.int32), "turn_gen": np.zeros(B, np.int32),
                      "reason": np.full(B, IDLE, np.int32), "key_id": np.zeros(B, np.int32)}
        self._key = jax.random.key(self.seed)
        self.fed_tokens = 0                # all tokens fed so far (prompts, follow-ups and sampled)

    def load(self, row: int, tokens, key_id: int | None = None, *, reset: bool = True) -> None:
        s, n = self.small, len(tokens)
        start = 0 if reset else int(s["pos"][row])
        if n < 1 or start + n > self.max_len:
            raise ValueError(f"row {row}: {n} forced tokens from position {start} do not fit max_len {self.max_len}")
        s["force"][row, :n] = tokens
        s["fptr"][row], s["flen"][row], s["turn_gen"][row], s["reason"][row] = 0, n, 0, RUNNING
        if reset:
            s["pos"][row], s["key_id"][row] = 0, key_id

    def resume(self, row: int) -> None:
        self.small["turn_gen"][row], self.small["reason"][row] = 0, RUNNING

    def idle(self, row: int) -> None:
        self.small["reason"][row] = IDLE

    @property
    def any_running(self) -> bool:
        return bool((self.small["reason"] == RUNNING).any())

    def run(self) -> list[list[int]]:
        """Advance ``chunk`` steps; each row's tokens fed in this chunk (the conversation grows by them)."""
        running = self.small["reason"] == RUNNING
        reach = int(self.small["pos"][running].max()) + self.chunk if running.any() else 1
        span = min(self.max_len, bucket(reach, 256))     # few programs: 4 spans per octave
        small = {k: jnp.asarray(v) for k, v in self.small.items()}
        self._cache, small, fed = _advance(
            self._graphdef, self._params, self._cache, small, self._key, jnp.float32(self.temperature),
            jnp.int32(self.top_k), jnp.float32(self.top_p), jnp.int32(self.turn_cap), steps=self.chunk,
            eos_ids=tuple(int(e) for e in self.eos_ids), span=span)
        self.small = {k: np.array(v) for k, v in small.items()}
        fed = np.asarray(fed)
        self.fed_tokens += int((fed >= 0).sum())
        return [[int(t) for t in r[r >= 0]] for r in fed]
