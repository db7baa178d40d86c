"""Word-level vocabulary of the synthetic reasoning-trace testbed.

The vocabulary is fixed (it does not depend on a `TestbedConfig`), so one
tokenizer serves every curriculum stage and every evaluation length:

    ids 0..3    special tokens   <pad> <bos> <eos> <unk>
    then        keywords         facts trace keep let use work query answer : -> ;
    then        operators        + - *
    then        numbers          0 .. MAX_VALUES-1   (one token each)
    then        variable names   a0 .. z0 a1 .. z9   (MAX_NAMES, one token each)

A problem's text is its tokens joined by single spaces, `<bos>` and `<eos>`
included, so `build_tokenizer().encode(text).ids` is exactly the problem's ids.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
KEYWORDS = ("facts", "trace", "keep", "let", "use", "work", "query", "answer", ":", "->", ";")
OPERATORS = ("+", "-", "*")
MAX_VALUES = 20
MAX_NAMES = 26 * 10
NUMBERS = tuple(str(v) for v in range(MAX_VALUES))
NAMES = tuple(f"{c}{d}" for d in range(10) for c in string.ascii_lowercase)

TOKENS = SPECIAL_TOKENS + KEYWORDS + OPERATORS + NUMBERS + NAMES
VOCAB_SIZE = len(TOKENS)
TOKEN_TO_ID = {tok: i for i, tok in enumerate(TOKENS)}
PAD_ID, BOS_ID, EOS_ID, UNK_ID = (TOKEN_TO_ID[t] for t in SPECIAL_TOKENS)
NUMBER_BASE = TOKEN_TO_ID["0"]
NAME_BASE = TOKEN_TO_ID[NAMES[0]]
OPERATOR_IDS = {op: TOKEN_TO_ID[op] for op in OPERATORS}


def tok(word: str) -> int:
    """Id of one vocabulary word (KeyError for a word outside the vocabulary)."""
    return TOKEN_TO_ID[word]


def number_id(value: int) -> int:
    """Token id of the number `value` (0 <= value < MAX_VALUES)."""
    if not 0 <= value < MAX_VALUES:
        raise ValueError(f"value {value} outside 0..{MAX_VALUES - 1}")
    return NUMBER_BASE + value


def id_to_number(token_id: int) -> int | None:
    """The number a token id stands for, or None if it is not a number token."""
    value = int(token_id) - NUMBER_BASE
    return value if 0 <= value < MAX_VALUES else None


def name_id(index: int) -> int:
    """Token id of the `index`-th variable name."""
    if not 0 <= index < MAX_NAMES:
        raise ValueError(f"name index {index} outside 0..{MAX_NAMES - 1}")
    return NAME_BASE + index


def is_name(token_id: int) -> bool:
    """Whether a token id is a variable name."""
    return NAME_BASE <= int(token_id) < NAME_BASE + MAX_NAMES


def decode(ids) -> str:
    """Space-joined text of token ids (special tokens kept)."""
    return " ".join(TOKENS[int(i)] for i in ids)


def build_tokenizer() -> Tokenizer:
    """WordLevel tokenizer over `TOKENS` with a whitespace pre-tokenizer.

    No post-processor: texts carry their own `<bos>`/`<eos>`, so encoding a
    problem's text returns its ids unchanged, and decoding joins words with
    spaces, which restores the text.
    """
    tokenizer = Tokenizer(models.WordLevel(vocab=dict(TOKEN_TO_ID), unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def save_tokenizer(directory: str | Path, *, model_max_length: int = 4096) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json.

    The folder then loads with `transformers.AutoTokenizer.from_pretrained`, so
    a teacher checkpoint written next to it is a complete Hugging Face model.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(directory / "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        **special,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return directory
