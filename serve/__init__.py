"""HTTP serving on top of :func:`eagle3_jax.generate` and budget controllers.

Not implemented yet: no issue has asked for it.  The layout keeps its place.
"""
