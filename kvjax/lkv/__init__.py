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

from kvjax.lkv.heads import LKVHeads, integer_budgets
from kvjax.lkv.param import LKVParam
from kvjax.lkv.soft_topk import laplace_cdf, soft_topk
from kvjax.lkv.token_scorer import LKVTokenScorer, gumbel_temperature, gumbel_topk_mask, noisy_scores

__all__ = ["LKVParam", "soft_topk", "laplace_cdf", "LKVHeads", "integer_budgets", "LKVTokenScorer",
           "gumbel_temperature", "noisy_scores", "gumbel_topk_mask"]
