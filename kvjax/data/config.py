"""`TestbedConfig`: every knob of the synthetic reasoning-trace generator.

Lengths are in tokens. `length` is a problem's budget (a problem fills
`[length - 6, length]`); the far threshold `far_frac * length` and every
reuse delay scale with it, so `cfg.scaled(2)` and `cfg.scaled(4)` are the same
task at 2x and 4x the length. A config is plain data: `TestbedConfig(**yaml_dict)`
works (lists become tuples).
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

from kvjax.data.vocab import MAX_NAMES, MAX_VALUES, OPERATORS

DERIVED_LEN = 11  # `keep n v + n v -> r n r ;`, the longest non-scratch line


def scratch_len(steps: int) -> int:
    """Tokens of a scratch line `work v (op v -> r)*steps ;`."""
    return 3 + 4 * steps


def answer_len(terms: int) -> int:
    """Tokens of `query n (op n)* ;` plus `answer n v -> r (op n v -> r)* ; <eos>`."""
    return (2 * terms + 1) + (1 + 4 * terms + (terms - 1) + 2)


@dataclass(frozen=True)
class TestbedConfig:
    """All knobs of the generator; a bad value raises ValueError naming its field.

    length         token budget of a problem; scales lines and delays.
    num_names      names are drawn from the first `num_names` of the vocabulary
                   (curriculum: few names first); no name is bound twice, and
                   once a problem runs out of names it only adds scratch and
                   `use` lines.
    num_defs       definitions in the prompt.
    num_values     numbers are 0..num_values-1, arithmetic is mod num_values.
    ops            operators used by scratch, derived and answer lines.
    scratch_prob   chance that a free line slot is scratch work (else a new fact).
    scratch_steps  (lo, hi) operations per scratch line.
    recall_prob    chance that a free line slot (once facts exist) is a recall line
                   `use NAME v ;` of a uniformly chosen fact: a pure lookup, no
                   arithmetic (curriculum: forms the copy circuit; 0 in the task).
    def_prob       chance that a new fact is a literal definition (else derived).
    keep_prob      chance that a new fact is marked `keep` (else `let`).
    keep_reuse, let_reuse   chance that a new keep/let fact is referenced later.
    reuse_again    chance that a referenced fact is referenced once more.
    bind_prob      chance that a line referencing facts binds a new fact (else `use`).
    min_delay      shortest planned reuse delay.
    far_prob       chance that a planned delay is far (beyond the far threshold).
    far_frac       far threshold as a fraction of `length`.
    answer_terms   (lo, hi) facts combined by the answer.
    seed           base seed; problem seeds are (seed, split, index).
    """

    __test__ = False  # keeps pytest from collecting this class by its name

    length: int = 1024
    num_names: int = MAX_NAMES
    num_defs: int = 6
    num_values: int = 10
    ops: tuple[str, ...] = ("+", "-")
    scratch_prob: float = 0.5
    scratch_steps: tuple[int, int] = (2, 6)
    recall_prob: float = 0.0
    def_prob: float = 0.4
    keep_prob: float = 0.5
    keep_reuse: float = 0.8
    let_reuse: float = 0.15
    reuse_again: float = 0.6
    bind_prob: float = 0.6
    min_delay: int = 8
    far_prob: float = 0.5
    far_frac: float = 0.25
    answer_terms: tuple[int, int] = (2, 4)
    seed: int = 0

    def __post_init__(self):
        for name in ("ops", "scratch_steps", "answer_terms"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("length", "num_names", "num_defs", "num_values", "min_delay", "seed"):
            value = getattr(self, name)
            _check(isinstance(value, numbers.Integral) and not isinstance(value, bool), name, "must be an int")
        _check(0 < self.far_frac < 1, "far_frac", "must be in (0, 1)")
        for name in ("scratch_prob", "recall_prob", "def_prob", "keep_prob", "keep_reuse", "let_reuse", "reuse_again",
                     "bind_prob", "far_prob"):
            _check(0.0 <= getattr(self, name) <= 1.0, name, "must be a probability in [0, 1]")
        _check(2 <= self.num_values <= MAX_VALUES, "num_values", f"must be in 2..{MAX_VALUES}")
        _check(len(self.ops) > 0 and set(self.ops) <= set(OPERATORS) and len(set(self.ops)) == len(self.ops),
               "ops", f"must be distinct operators from {OPERATORS}")
        _check(_is_range(self.scratch_steps, 1), "scratch_steps", "must be (lo, hi) with 1 <= lo <= hi")
        _check(_is_range(self.answer_terms, 2), "answer_terms", "must be (lo, hi) with 2 <= lo <= hi")
        _check(self.answer_terms[1] <= self.num_defs, "num_defs", "must be >= answer_terms[1]")
        _check(self.num_defs <= self.num_names <= MAX_NAMES, "num_names", f"must be in num_defs..{MAX_NAMES}")
        _check(0 <= self.seed < 2**32, "seed", "must be in 0..2**32-1")
        _check(self.length >= self.min_length, "length", f"must be >= {self.min_length} for these knobs")
        _check(1 <= self.min_delay < self.far_threshold, "min_delay", "must be in 1..far_frac*length-1")

    @property
    def far_threshold(self) -> int:
        """A lookup is `lookup_far` when it copies a value more than this many tokens back."""
        return int(self.far_frac * self.length)

    @property
    def prompt_length(self) -> int:
        return 3 + 4 * self.num_defs + 2  # `<bos> facts :` defs `trace :`

    @property
    def min_length(self) -> int:
        """Smallest `length` that fits the prompt, a few lines and the longest answer."""
        return self.prompt_length + 4 * DERIVED_LEN + answer_len(self.answer_terms[1])

    def scaled(self, factor: int) -> TestbedConfig:
        """The same task with `factor` times the length (evaluation at 2x, 4x)."""
        return dataclasses.replace(self, length=self.length * factor)


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"TestbedConfig.{field} {message}")


def _is_range(pair: tuple, lowest: int) -> bool:
    return len(pair) == 2 and all(isinstance(v, numbers.Integral) for v in pair) and lowest <= pair[0] <= pair[1]


def testbed_field(value, owner: str, length: int, what: str) -> TestbedConfig | None:
    """A config's optional ``testbed`` field as a ``TestbedConfig`` (a mapping is converted; YAML
    already gives one), refused when problems of its length would not fit ``length`` tokens
    (``what`` names that field in the error)."""
    if value is None:
        return None
    if isinstance(value, dict):
        value = TestbedConfig(**value)
    if not isinstance(value, TestbedConfig):
        raise ValueError(f"{owner}: testbed must be a mapping of TestbedConfig fields, got {value!r}")
    if length < value.length:
        raise ValueError(f"{owner}: {what} {length} is shorter than the testbed's problems ({value.length})")
    return value
