"""The training config schema (``train.py --config X.yaml --set a.b=v``)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal

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

    def __post_init__(self):
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
class EvictionSection:
    """Budget and scorers of the sparse student (``distill_kvpop``, ``distill_lkv``)."""

    sinks: int = 4                           # first tokens always kept
    window: int = 64                         # most recent tokens always kept (>= 1)
    topk: int = 64                   # long-range slots per head (LKV: the average over heads)
    k_max: int | None = None         # LKV: most long-range slots one head may fill (default 2 * topk)
    scorer: Literal["mlp", "mlstm"] = "mlp"  # KVpop token scorer: mlp | mlstm
    scorer_hidden: int = 64          # MLP width
    mlstm_qk_dim: int = 16           # mLSTM key/query width
    mlstm_chunk: int = 64                    # mLSTM chunk length (chunkwise-parallel form)
    mlstm_readout_norm: bool = True  # RMS-normalise the mLSTM read before its head (kvjax.scorers.mlstm)
    regression_weight: float = 1.0           # KVpop: weight of the scorer's regression loss
    regression_centred: bool = True  # fit r_hat up to a per-head offset (the keep rule ignores it)
    pairwise_weight: float = 1.0             # KVpop: weight of the boundary pairwise loss
    pairwise_frac: float = 0.25      # fraction of boundary query positions sampled per step
    kd_weight: float = 1.0                   # weight of the KL to the dense teacher
    kd_topk: int = 0                 # 0: KL over the full vocabulary
    kernel: str = "auto"             # sparse attention + target: auto | xla | tpu | gpu (pallas_kernels)
    kernel_interpret: bool = False   # run a kernel backend in Pallas interpret mode (CPU tests)
    lkv_embed_dim: int = 16          # LKV-H head embeddings
    lkv_head_hidden: int = 64        # LKV-H shared MLP width
    lkv_token_hidden: int = 64       # LKV-T per-head MLP width
    hidden_weight: float = 1.0       # LKV: beta of the per-layer hidden-state MSE
    gumbel_start: float = 1.0        # LKV-T Gumbel temperature, annealed geometrically ...
    gumbel_end: float = 0.05         # ... to this value ...
    gumbel_steps: int = 0            # ... over this many steps (0: the whole run)

    def __post_init__(self):
        for name, low in (("sinks", 0), ("window", 1), ("topk", 0), ("scorer_hidden", 1), ("mlstm_qk_dim", 1),
                          ("mlstm_chunk", 1), ("kd_topk", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"eviction.{name} must be >= {low}, got {getattr(self, name)}"
                                 + (" (the current token is always kept)" if name == "window" else ""))
        if not 0.0 < self.pairwise_frac <= 1.0:
            raise ValueError(f"eviction.pairwise_frac must be in (0, 1], got {self.pairwise_frac}")
        if self.k_max is not None and self.k_max <= self.topk:
            raise ValueError(f"eviction.k_max ({self.k_max}) must be > eviction.topk ({self.topk})")
        if self.kernel not in ("auto", "xla", "tpu", "gpu"):
            raise ValueError(f"eviction.kernel must be auto, xla, tpu or gpu, got {self.kernel!r}")
        if not (self.gumbel_start > 0 and self.gumbel_end > 0):
            raise ValueError("eviction.gumbel_start and eviction.gumbel_end must be > 0")

    @property
    def lkv_k_max(self) -> int:
        return 2 * self.topk if self.k_max is None else self.k_max


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
            budget = ev.sinks + ev.window + (ev.lkv_k_max if self.mode == "distill_lkv" else ev.topk)
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
