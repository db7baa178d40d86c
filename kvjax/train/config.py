"""The training config schema (``train.py --config X.yaml --set a.b=v``)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from kvjax.eviction.config import EvictionConfig

Mode = Literal["pretrain", "distill_kvpop", "distill_lkv"]


@dataclass(frozen=True)
class ModelSection:
    """Where the model comes from: an HF folder, a preset, or inline HF-style fields.

    ``hf_path`` may come with ``preset`` naming its shapes: ``--dry-run`` then works
    without the weights, and loading checks that the folder matches the preset.
    """

    hf_path: str | None = None               # Hugging Face folder with the starting weights (~ and $VARS expand)
    preset: str | None = None                # model shapes by name (kvjax.preset: qwen3-0.6b ... llama-3.1-8b)
    config: dict[str, Any] | None = None      # config.json-style fields (model_type, hidden_size, ...)
    param_dtype: str = "float32"             # parameter dtype (float32 | bfloat16)
    compute_dtype: str = "float32"           # activation dtype
    init_std: float = 0.02                   # normal init std of new weights (no hf_path)
    embed_init_std: float = 0.02             # normal init std of new embeddings
    qk_norm_init: float = 1.0                 # Qwen3 q/k RMSNorm weights at init (sharper early attention)
    remat: bool = False                      # recompute each block's activations in the backward pass (less memory)

    def __post_init__(self):
        given = [n for n in ("hf_path", "preset", "config") if getattr(self, n) is not None]
        if given not in (["hf_path"], ["preset"], ["config"], ["hf_path", "preset"]):
            raise ValueError(f"set one of model.hf_path (optionally with model.preset), model.preset, model.config "
                             f"(got {given or 'none'})")
        if self.hf_path is not None:
            object.__setattr__(self, "hf_path", os.path.expanduser(os.path.expandvars(self.hf_path)))


@dataclass(frozen=True)
class DataSection:
    source: Literal["testbed", "tokens"] = "testbed" # testbed (synthetic traces) | tokens (a JSONL of token ids)
    testbed: dict[str, Any] = field(default_factory=dict)   # TestbedConfig fields
    path: str | None = None                                 # token file(s) for source=tokens
    seq_len: int = 512                       # tokens per training sequence
    batch_size: int = 32                     # sequences per step (all processes together)
    loss_on: Literal["all", "trace"] = "all"                # 'trace': not on the prompt
    lookup_weight: float = 1.0                              # testbed: loss weight of lookup tokens
    eval_problems: int = 256                 # held-out testbed problems of each evaluation (0: none)
    seed: int = 0                            # data order seed
    teacher_cache: str | None = None         # distill_kvpop: folder of the teacher's top-k, computed once (kvjax.train.teacher_cache)
    teacher_topk: int = 64                   # ... how many of the teacher's most likely next tokens it keeps per position

    def __post_init__(self):
        if self.teacher_cache is not None and self.source != "tokens":
            raise ValueError("data.teacher_cache needs data.source 'tokens' (one cached row per line of data.path)")
        if self.teacher_topk < 1:
            raise ValueError(f"data.teacher_topk must be >= 1, got {self.teacher_topk}")
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len must be >= 2, got {self.seq_len}")
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {self.batch_size}")
        if self.eval_problems < 0:
            raise ValueError(f"data.eval_problems must be >= 0, got {self.eval_problems}")
        if self.source == "tokens" and not self.path:
            raise ValueError("data.path is required when data.source is 'tokens'")
        if self.lookup_weight <= 0:
            raise ValueError(f"data.lookup_weight must be > 0, got {self.lookup_weight}")
        if self.lookup_weight != 1.0 and self.source != "testbed":
            raise ValueError("data.lookup_weight needs data.source 'testbed' (token files have no lookup labels)")


@dataclass(frozen=True)
class OptimSection:
    lr: float = 3e-3                         # peak learning rate of the backbone (AdamW)
    lr_scorers: float = 1e-3                 # peak learning rate of KVpop's scorers
    lr_lkv: float = 1e-3                     # peak learning rate of LKV's budget and token networks
    warmup_steps: int = 50                   # linear warmup, then cosine decay
    min_lr_ratio: float = 0.1                # final learning rate / peak
    weight_decay: float = 0.0                # AdamW weight decay
    b1: float = 0.9                          # AdamW beta1
    b2: float = 0.98                         # AdamW beta2
    eps: float = 1e-8                        # AdamW epsilon
    clip_norm: float = 1.0                   # global gradient-norm clip (0: off)
    grad_accum: int = 1                      # micro-batches per step
    schedule_per_phase: bool = False   # restart warmup + cosine at every curriculum phase

    def __post_init__(self):
        if self.grad_accum < 1:
            raise ValueError(f"optim.grad_accum must be >= 1, got {self.grad_accum}")
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")


@dataclass(frozen=True)
class Phase:
    """One curriculum phase: its length, data knobs, and which parameters train."""

    steps: int
    data: dict[str, Any] = field(default_factory=dict)     # overrides of data.testbed / seq_len
    trainable: list[str] = field(default_factory=list)     # regexes on parameter paths; [] = all
    lr_scale: float = 1.0
    batch_size: int | None = None                          # default: data.batch_size
    key_dropout: float = 0.0          # pretrain: drop each key (outside the window) with this rate
    key_dropout_window: int = 16      # ... never the most recent keys of a query (kvjax.train.key_dropout)

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"phase steps must be >= 1, got {self.steps}")
        if not 0.0 <= self.key_dropout < 1.0:
            raise ValueError(f"phase key_dropout must be in [0, 1), got {self.key_dropout}")
        if self.key_dropout_window < 1:
            raise ValueError(f"phase key_dropout_window must be >= 1, got {self.key_dropout_window}")


@dataclass(frozen=True)
class MeshSection:
    data: int = 1                            # data-parallel mesh axis size
    fsdp: int = 1                            # fully-sharded data-parallel axis size
    tensor: int = 1                          # tensor-parallel axis size
    multi_host: bool = False                 # call jax.distributed.initialize (TPU pods, multi-node GPU)
    coordinator: str | None = None           # host:port of process 0 (multi_host without a launcher)
    num_processes: int | None = None         # with coordinator: number of processes
    process_id: int | None = None            # with coordinator: this process's index


@dataclass(frozen=True)
class CheckpointSection:
    every: int = 0            # steps between saves; 0 = only at the end and on preemption
    keep: int = 3                            # checkpoints kept on disk
    dir: str | None = None    # default: <out_dir>/checkpoints


@dataclass(frozen=True)
class LogSection:
    every: int = 10                          # steps between metrics.jsonl rows
    eval_every: int = 0       # steps between held-out evaluations; 0 = only at the end
    tensorboard: bool = True  # TensorBoard event files under out_dir/tensorboard (tensorboardX)

    def __post_init__(self):
        if self.every < 1 or self.eval_every < 0:
            raise ValueError(f"log.every must be >= 1 and log.eval_every >= 0, got {self.every} and {self.eval_every}")


@dataclass(frozen=True)
class KVpopSection:
    """KVpop's scorer and retention losses (``distill_kvpop``)."""

    scorer: Literal["mlp", "mlstm"] = "mlp"  # token scorer: mlp | mlstm
    hidden: int = 64                         # MLP width
    mlstm_qk_dim: int = 16                   # mLSTM key/query width
    mlstm_chunk: int = 64                    # mLSTM chunk length (chunkwise-parallel form)
    mlstm_readout_norm: bool = True          # RMS-normalise the mLSTM read before its head (kvjax.scorers.mlstm)
    regression_weight: float = 1.0           # weight of the scorer's regression loss
    regression_centred: bool = True          # fit r_hat up to a per-head offset (the keep rule ignores it)
    pairwise_weight: float = 1.0             # weight of the boundary pairwise loss
    pairwise_frac: float = 0.25              # fraction of boundary query positions sampled per step

    def __post_init__(self):
        for name in ("hidden", "mlstm_qk_dim", "mlstm_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"kvpop.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.pairwise_frac <= 1.0:
            raise ValueError(f"kvpop.pairwise_frac must be in (0, 1], got {self.pairwise_frac}")


@dataclass(frozen=True)
class LKVSection:
    """LKV's budget and token networks and its hidden-state loss (``distill_lkv``)."""

    embed_dim: int = 16                      # LKV-H head embeddings
    head_hidden: int = 64                    # LKV-H shared MLP width
    token_hidden: int = 64                   # LKV-T per-head MLP width
    hidden_weight: float = 1.0               # beta of the per-layer hidden-state MSE
    gumbel_start: float = 1.0                # LKV-T Gumbel temperature, annealed geometrically ...
    gumbel_end: float = 0.05                 # ... to this value ...
    gumbel_steps: int = 0                    # ... over this many steps (0: the whole run)

    def __post_init__(self):
        if not (self.gumbel_start > 0 and self.gumbel_end > 0):
            raise ValueError("lkv.gumbel_start and lkv.gumbel_end must be > 0")


_MOVED = {**{k: f"kvpop.{k}" for k in ("scorer", "mlstm_qk_dim", "mlstm_chunk", "mlstm_readout_norm",
                                       "regression_weight", "regression_centred", "pairwise_weight",
                                       "pairwise_frac")},
          "scorer_hidden": "kvpop.hidden", "lkv_embed_dim": "lkv.embed_dim", "lkv_head_hidden": "lkv.head_hidden",
          "lkv_token_hidden": "lkv.token_hidden",
          **{k: f"lkv.{k}" for k in ("hidden_weight", "gumbel_start", "gumbel_end", "gumbel_steps")}}


@dataclass(frozen=True)
class EvictionSection(EvictionConfig):
    """The sparse student's eviction config: the bounded cache's budget (every field of
    :class:`kvjax.EvictionConfig`: ``sinks``, ``window``, ``topk``, ``k_max``, ``kernel``, ...,
    validated there), the distillation's KL, and the ``kvpop:`` / ``lkv:`` sub-sections.
    ``distill_lkv`` needs ``k_max > topk`` (the most long-range slots one head may fill)."""

    MOVED: ClassVar[dict[str, str]] = _MOVED
    label: ClassVar[str] = "eviction"

    kd_weight: float = 1.0                   # weight of the KL to the dense teacher
    kd_topk: int = 0                         # 0: KL over the full vocabulary
    kvpop: KVpopSection = field(default_factory=KVpopSection)
    lkv: LKVSection = field(default_factory=LKVSection)

    def __post_init__(self):
        super().__post_init__()
        if self.kd_topk < 0:
            raise ValueError(f"eviction.kd_topk must be >= 0, got {self.kd_topk}")


@dataclass(frozen=True)
class TrainConfig:
    mode: Mode = "pretrain"                  # pretrain | distill_kvpop | distill_lkv
    out_dir: str = "runs/default"            # config.json, metrics.jsonl, eval.jsonl, checkpoints/ (one run at a time)
    seed: int = 0                            # parameter init and dropout seed
    steps: int = 0            # used when phases is empty
    model: ModelSection = field(default_factory=lambda: ModelSection(preset="qwen3-0.6b"))
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    phases: list[Phase] = field(default_factory=list)   # curriculum: [{steps, data, trainable, lr_scale, ...}]
    mesh: MeshSection = field(default_factory=MeshSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)
    eviction: EvictionSection = field(default_factory=EvictionSection)
    teacher_hf_path: str | None = None     # distillation teacher (default: model.hf_path)
    save_hf: str | None = None             # write the trained model here as an HF folder

    def __post_init__(self):
        if not self.phases and self.steps < 1:
            raise ValueError("set steps >= 1 or give phases")
        ev = self.eviction
        if self.data.teacher_cache is not None and self.mode != "distill_kvpop":
            raise ValueError(f"data.teacher_cache is for mode distill_kvpop, not {self.mode}")
        if self.data.teacher_cache is not None and ev.kd_topk:
            raise ValueError("eviction.kd_topk renormalises a live teacher's top-k; with data.teacher_cache the KL "
                             "runs over the cached top data.teacher_topk plus one bucket for the rest: set one")
        if self.data.teacher_cache is not None and any("seq_len" in p.data for p in self.phases):
            raise ValueError("data.teacher_cache holds rows of data.seq_len tokens: phases may not change seq_len")
        if self.mode == "distill_lkv" and (ev.k_max is None or ev.k_max <= ev.topk):
            raise ValueError(f"eviction.k_max ({ev.k_max}) must be > eviction.topk ({ev.topk}) for distill_lkv: the "
                             f"most long-range slots one head may fill (e.g. k_max: {2 * ev.topk})")
        if self.data.source == "testbed":       # the generator's knobs, checked now rather than at step 0
            from kvjax.data import TestbedConfig

            known = {f.name for f in dataclasses.fields(TestbedConfig)}
            for where, knobs in [("data.testbed", self.data.testbed)] + [
                    (f"phases[{i}].data", {k: v for k, v in p.data.items() if k != "seq_len"})
                    for i, p in enumerate(self.phases)]:
                bad = sorted(set(knobs) - known)
                if bad:
                    raise ValueError(f"unknown config key '{where}.{bad[0]}'; known keys here: "
                                     f"{', '.join(sorted(known))}")
            for i, p in enumerate(self.all_phases()):
                knobs = {**self.data.testbed, **{k: v for k, v in p.data.items() if k != "seq_len"}}
                try:
                    TestbedConfig(**knobs)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"data.testbed (phase {i}): {e}") from None

    def warnings(self) -> list[str]:
        """Settings that are legal but probably not meant."""
        out = []
        if self.mode != "pretrain":
            ev = self.eviction
            budget = ev.sinks + ev.window + ev.slots
            seq = max(int(p.data.get("seq_len", self.data.seq_len)) for p in self.all_phases())
            if budget >= seq:
                out.append(f"the eviction budget sinks + window + topk = {budget} is >= the sequence length {seq}: "
                           "nothing is ever evicted, so the scorers learn nothing useful")
        return out

    def all_phases(self) -> list[Phase]:
        return list(self.phases) if self.phases else [Phase(steps=self.steps)]

    @property
    def total_steps(self) -> int:
        return sum(p.steps for p in self.all_phases())

    def replace(self, **kw) -> "TrainConfig":
        return dataclasses.replace(self, **kw)
