"""Bindings of hcache's caches into other frameworks (each optional: imported on use).

- :mod:`hcache.interop.jax`: zero-copy JAX views of every cache dtype, for jitted steps.
"""
