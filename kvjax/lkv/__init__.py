"""LKV: learned per-head budgets (LKV-H) and token selection (LKV-T), seed ``002``.

* :func:`soft_topk` -- the closed-form Soft-TopK ``ST_k`` (sums to ``k``, order preserving,
  translation invariant, hard top-k as the temperature goes to 0).
* :class:`LKVHeads` -- head embeddings -> shared MLP -> ``ST_{R L K}`` over all heads of
  all layers -> ratios ``r_lh`` and integer budgets ``b_lh = floor(r_lh t)``.
* :class:`LKVTokenScorer` -- a per-(layer, KV head) MLP on ``stop_gradient([k; v])``;
  Gumbel noise with an annealed temperature in training, hard top-k at inference.

Every LKV weight is an :class:`LKVParam`, so ``nnx.state(model, LKVParam)`` selects them
(a plain ``nnx.Param`` filter matches them too).
"""

from flax import nnx


class LKVParam(nnx.Param):
    """An LKV weight (head embeddings, head MLP, token scorers), selected apart from the backbone."""


# imported after LKVParam, which the modules below use
from kvjax.lkv.heads import LKVHeads, integer_budgets  # noqa: E402
from kvjax.lkv.soft_topk import laplace_cdf, soft_topk  # noqa: E402
from kvjax.lkv.token_scorer import LKVTokenScorer, gumbel_temperature, gumbel_topk_mask, noisy_scores  # noqa: E402

__all__ = ["LKVParam", "soft_topk", "laplace_cdf", "LKVHeads", "integer_budgets", "LKVTokenScorer",
           "gumbel_temperature", "noisy_scores", "gumbel_topk_mask"]
