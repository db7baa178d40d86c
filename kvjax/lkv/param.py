"""``LKVParam``: the variable type of every LKV weight."""

from flax import nnx


class LKVParam(nnx.Param):
    """An LKV weight (head embeddings, head MLP, token scorers), selected apart from the backbone."""
