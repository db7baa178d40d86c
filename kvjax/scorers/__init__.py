"""KVpop scorers: a per-head MLP and a stateful mLSTM with delayed readout.

All weights are :class:`ScorerParam` so a filter selects them for the optimizer,
checkpoints and export: ``nnx.state(model, ScorerParam)``.
"""

from kvjax.scorers.mlp import MLPScorer
from kvjax.scorers.mlstm import MLSTMScorer, MLSTMState, mlstm_chunkwise, mlstm_readout, mlstm_scan, mlstm_update
from kvjax.eviction.keep_rule import static_priority
from kvjax.scorers.params import ScorerParam

__all__ = ["ScorerParam", "static_priority", "MLPScorer", "MLSTMScorer", "MLSTMState",
           "mlstm_update", "mlstm_readout", "mlstm_scan", "mlstm_chunkwise"]
