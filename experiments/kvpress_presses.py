"""Every kvpress 0.5.5 press that ``experiments/kvpress_compare.py`` runs, by name (runs inside .venv-kvpress).

Wrapper presses get the inner presses kvpress pairs them with in its own benchmark list
(``evaluation/evaluate_registry.py``); a press with a window, pooling kernel or sink count takes the
script's ``--window W``, ``--kernel K`` or ``--sinks S``; every other parameter keeps its default.
``docs/kvpress-presses.md`` lists every press class kvpress exports, these and the ones that cannot
run here (and why), with the seconds one 1k record takes.

=================================  ==========================================================
none                               no press (dense cache)
streaming_llm                      ``StreamingLLMPress(c, n_sink=S)``: the first S and the last
                                   ``n_kept - S`` context tokens; no re-rotation
snapkv                             ``SnapKVPress(c, window_size=W, kernel_size=K)``
tova / knorm / keydiff             ``TOVAPress(c)`` / ``KnormPress(c)`` / ``KeyDiffPress(c)``
pyramidkv                          ``PyramidKVPress(c, W, K)``, beta 20
adakv_snapkv                       ``AdaKVPress(SnapKVPress(c, W, K))``, alpha_safeguard 0.2
expected_attention                 ``ExpectedAttentionPress(c, n_sink=S)``, 512 future positions
kvzip / kvzip_plus                 ``KVzipPress(c)`` (n_sink 4, 2048-token chunks, global top-k) /
                                   with ``kvzip_plus_normalization=True``
random                             ``RandomPress(c)`` (torch seeded 0 before every record)
lagkv                              ``LagKVPress(c, n_sink=S)``, lag_size 128
cur                                ``CURPress(c, num_sinks=S)``, kv_product, local window 16
leverage                           ``LeverageScorePress(c)``, sketch 48
non_causal_attn                    ``NonCausalAttnPress(c)``, chunk 256
compactor / adakv_compactor        ``CompactorPress(c)`` (8 sinks + 4 recent, chunk 256,
                                   sketch 48, blending = c), bare / in ``AdaKVPress``
cap                                ``CapPress(c, n_sink=S)``, tau 5
observed_attention                 ``ObservedAttentionPress(c)``; the prefill runs eager
adakv_expected_attention           ``AdaKVPress(ExpectedAttentionPress(c, n_sink=S, epsilon=1e-2))``
criticalkv_snapkv                  ``CriticalKVPress(SnapKVPress(c, W, K))``
criticalkv_expected_attention      ``CriticalKVPress(ExpectedAttentionPress(c, n_sink=S, use_vnorm=False))``
critical_adakv_snapkv              ``CriticalAdaKVPress(SnapKVPress(c, W, K))``
critical_adakv_expected_attention  ``CriticalAdaKVPress(ExpectedAttentionPress(c, n_sink=S, use_vnorm=False))``
chunkkv_snapkv                     ``ChunkKVPress(SnapKVPress(c, W, K), chunk_length=20)``
entropy_gated_chunkkv_snapkv       ``EntropyGatedChunkKVPress(SnapKVPress(c, W, K))``, chunk 10
chunk_snapkv                       ``ChunkPress(SnapKVPress(c, W, K))``, chunk 1024 (= snapkv at 1k)
block_keydiff                      ``BlockPress(KeyDiffPress(c), block_size=128)``
finch                              ``FinchPress(c)`` with window_size W: the last W context tokens
                                   stand in for the question; keys re-rotated
keyrerotation_streaming_llm        ``KeyRerotationPress(StreamingLLMPress(c, n_sink=S))``
merging_knorm / _snapkv /          ``MergingPress(KnormPress(c))``, ``MergingPress(SnapKVPress(c, W,
_expected_attention                K))``, ``MergingPress(ExpectedAttentionPress(c, n_sink=S, epsilon=1e-2))``
kvgrad                             ``KVgradPress(c)``: KVzip replay plus one backward per 512 tokens
kvcompose / kvcompose_unstructured ``KVComposePress(c)`` / ``KVComposePress(c, structured=False)``
=================================  ==========================================================
"""
from __future__ import annotations


def _finch(kp, c, W, K, S):
    # Question-agnostic rule: FINCH's window (normally the question after its delimiter token) is the last W
    # context tokens. The delimiter id -1 never occurs, so the embedding hook never fires and the model's
    # vocabulary is not resized; keys are re-rotated (default), so the question starts at the cache length.
    press = kp.FinchPress(compression_ratio=c)
    press.window_size = W
    press.delimiter_token_id = -1
    return press


def _snap(kp, c, W, K):
    return kp.SnapKVPress(compression_ratio=c, window_size=W, kernel_size=K)


def _ea(kp, c, S, **kw):
    return kp.ExpectedAttentionPress(compression_ratio=c, n_sink=S, **kw)


# name -> builder(kvpress module, compression c, window W, kernel K, sinks S)
_BUILDERS = {
    "none": lambda kp, c, W, K, S: None,
    "streaming_llm": lambda kp, c, W, K, S: kp.StreamingLLMPress(compression_ratio=c, n_sink=S),
    "snapkv": lambda kp, c, W, K, S: _snap(kp, c, W, K),
    "tova": lambda kp, c, W, K, S: kp.TOVAPress(compression_ratio=c),
    "knorm": lambda kp, c, W, K, S: kp.KnormPress(compression_ratio=c),
    "pyramidkv": lambda kp, c, W, K, S: kp.PyramidKVPress(compression_ratio=c, window_size=W, kernel_size=K),
    "adakv_snapkv": lambda kp, c, W, K, S: kp.AdaKVPress(press=_snap(kp, c, W, K)),
    "keydiff": lambda kp, c, W, K, S: kp.KeyDiffPress(compression_ratio=c),
    "expected_attention": lambda kp, c, W, K, S: _ea(kp, c, S),
    "kvzip": lambda kp, c, W, K, S: kp.KVzipPress(compression_ratio=c),
    # ---- the rest of kvpress 0.5.5 (docs/kvpress-presses.md)
    "random": lambda kp, c, W, K, S: kp.RandomPress(compression_ratio=c),   # torch seeded per record (Runner.run)
    "lagkv": lambda kp, c, W, K, S: kp.LagKVPress(compression_ratio=c, n_sink=S),
    "cur": lambda kp, c, W, K, S: kp.CURPress(compression_ratio=c, num_sinks=S),
    "leverage": lambda kp, c, W, K, S: kp.LeverageScorePress(compression_ratio=c),
    "non_causal_attn": lambda kp, c, W, K, S: kp.NonCausalAttnPress(compression_ratio=c),
    "compactor": lambda kp, c, W, K, S: kp.CompactorPress(compression_ratio=c),
    "adakv_compactor": lambda kp, c, W, K, S: kp.AdaKVPress(press=kp.CompactorPress(compression_ratio=c)),
    "cap": lambda kp, c, W, K, S: kp.CapPress(compression_ratio=c, n_sink=S),
    "observed_attention": lambda kp, c, W, K, S: kp.ObservedAttentionPress(compression_ratio=c),  # eager prefill
    "adakv_expected_attention": lambda kp, c, W, K, S: kp.AdaKVPress(press=_ea(kp, c, S, epsilon=1e-2)),
    "criticalkv_snapkv": lambda kp, c, W, K, S: kp.CriticalKVPress(_snap(kp, c, W, K)),
    "criticalkv_expected_attention": lambda kp, c, W, K, S: kp.CriticalKVPress(_ea(kp, c, S, use_vnorm=False)),
    "critical_adakv_snapkv": lambda kp, c, W, K, S: kp.CriticalAdaKVPress(press=_snap(kp, c, W, K)),
    "critical_adakv_expected_attention":
        lambda kp, c, W, K, S: kp.CriticalAdaKVPress(press=_ea(kp, c, S, use_vnorm=False)),
    "chunkkv_snapkv": lambda kp, c, W, K, S: kp.ChunkKVPress(press=_snap(kp, c, W, K), chunk_length=20),
    "entropy_gated_chunkkv_snapkv": lambda kp, c, W, K, S: kp.EntropyGatedChunkKVPress(press=_snap(kp, c, W, K)),
    "chunk_snapkv": lambda kp, c, W, K, S: kp.ChunkPress(press=_snap(kp, c, W, K)),
    "block_keydiff": lambda kp, c, W, K, S: kp.BlockPress(press=kp.KeyDiffPress(compression_ratio=c), block_size=128),
    "finch": _finch,
    "keyrerotation_streaming_llm":
        lambda kp, c, W, K, S: kp.KeyRerotationPress(press=kp.StreamingLLMPress(compression_ratio=c, n_sink=S)),
    "merging_knorm": lambda kp, c, W, K, S: kp.MergingPress(press=kp.KnormPress(compression_ratio=c)),
    "merging_snapkv": lambda kp, c, W, K, S: kp.MergingPress(press=_snap(kp, c, W, K)),
    "merging_expected_attention": lambda kp, c, W, K, S: kp.MergingPress(press=_ea(kp, c, S, epsilon=1e-2)),
    "kvzip_plus": lambda kp, c, W, K, S: kp.KVzipPress(compression_ratio=c, kvzip_plus_normalization=True),
    "kvgrad": lambda kp, c, W, K, S: kp.KVgradPress(compression_ratio=c),
    "kvcompose": lambda kp, c, W, K, S: kp.KVComposePress(compression_ratio=c),
    "kvcompose_unstructured": lambda kp, c, W, K, S: kp.KVComposePress(compression_ratio=c, structured=False),
}
PRESSES = tuple(_BUILDERS)
# SnapKV (and Finch) assert len(context) > window
WINDOWED = ("snapkv", "pyramidkv", "adakv_snapkv", "criticalkv_snapkv", "critical_adakv_snapkv", "chunkkv_snapkv",
            "entropy_gated_chunkkv_snapkv", "chunk_snapkv", "merging_snapkv", "finch")
# presses given n_sink / num_sinks = --sinks (each needs len(context) > sinks)
SINKED = ("streaming_llm", "expected_attention", "lagkv", "cur", "cap", "adakv_expected_attention",
          "criticalkv_expected_attention", "critical_adakv_expected_attention", "keyrerotation_streaming_llm",
          "merging_expected_attention")


def make_press(name: str, compression: float, window: int, kernel: int, sinks: int):
    """The press called ``name`` at ``compression`` (None for ``none``)."""
    import kvpress as kp

    if name not in _BUILDERS:
        raise ValueError(f"unknown press {name!r}; one of {', '.join(PRESSES)}")
    return _BUILDERS[name](kp, float(compression), window, kernel, sinks)


def drop_kvcompose_replay(press, cache, n_ctx: int) -> None:
    """KVComposePress appends a replay of the context to the cache (a second pass over the context ids,
    ``new_forward`` in ``kvpress/presses/kvcompose_press.py``). The structured variant then rebuilds each layer
    from its first ``context_len`` entries; the unstructured one only masks evictions among those and leaves
    the replayed copy in the cache (kvpress 0.5.5), so decoding would see the whole context twice. Cut it
    here, as the structured variant does."""
    import kvpress as kp

    if isinstance(press, kp.KVComposePress) and not press.structured:
        for layer in cache.layers:
            layer.keys = layer.keys[:, :, :n_ctx].contiguous()
            layer.values = layer.values[:, :, :n_ctx].contiguous()


def question_start(press, n_ctx: int, cache) -> int:
    """Position of the first question token. As kvpress/pipeline.py ``_forward``: the uncompressed context
    length, except after key re-rotation (KeyRerotationPress, FinchPress with rerotate_keys), where the kept
    keys sit at positions 0..n_kept-1 and the question follows the compressed cache."""
    import kvpress as kp

    if isinstance(press, kp.KeyRerotationPress) or (isinstance(press, kp.FinchPress) and press.rerotate_keys):
        return cache.get_seq_length()
    return n_ctx
