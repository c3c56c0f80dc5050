"""The target model as the engine runs it, one job a place.

- :mod:`~draftwise.backend.target`: the :class:`~draftwise.backend.target.Target` interface (a forward over blocks of
  new rows, a KV cache per sequence) and :class:`~draftwise.backend.target.TransformersTarget`, which runs any
  transformers causal LM through its public forward with explicit masks and position ids.
- :mod:`~draftwise.backend.rows`: a forward's new rows (tokens, parents, depths).
- :mod:`~draftwise.backend.cache`: the KV caches, where rejecting rows is a cheap rollback.
- :mod:`~draftwise.backend.weights`: the lean forward's weights: fusing (:mod:`~draftwise.backend.weights.fusing`),
  the products and their storage (:mod:`~draftwise.backend.weights.products`), page placement
  (:mod:`~draftwise.backend.weights.pages`). A weight format plugs in here.
- :mod:`~draftwise.backend.forward`: the engine's own forward for the families it supports:
  :mod:`~draftwise.backend.forward.lean` (CPUs; its table of paths is
  :data:`~draftwise.backend.forward.lean.FORWARD_PATHS`), :mod:`~draftwise.backend.forward.graphed` (CUDA),
  :mod:`~draftwise.backend.forward.attention` (the library attention path).
- :mod:`~draftwise.backend.native`: the kernels compiled on the running machine.
- :mod:`~draftwise.backend.calibration`: what is measured on the running machine: machine facts and the store of
  measurements (:mod:`~draftwise.backend.calibration.machine`), row plans and the bitwise check
  (:mod:`~draftwise.backend.calibration.invariance`), cost curves (:mod:`~draftwise.backend.calibration.costs`).
- :mod:`~draftwise.backend.transformers_patches`: the transformers backend's faster few-row linear layers and
  grouped-query attention, through transformers' public interfaces.
"""
