"""Long-context evaluation on a real model: RULER-style tasks (:mod:`kvjax.longctx.tasks`)."""
