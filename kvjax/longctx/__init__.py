"""Long-context evaluation on a real model: RULER-style tasks (:mod:`kvjax.longctx.tasks`) answered
by every policy (:mod:`kvjax.longctx.run`, ``python -m kvjax.longctx``)."""
