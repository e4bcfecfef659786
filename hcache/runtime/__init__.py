"""The device layer (docs/design.md §2, §9): everything between hcache's host logic and the GPU.

- :mod:`._cuda`: the device boundary, every CuPy / CUDA call of the package;
- :mod:`.device`: device selection, streams, launch scopes, uploads, aligned allocation;
- :mod:`.arrays`: the one coercion of arrays of any library onto the call's device;
- :mod:`.staging`: the pinned staging ring of host-to-device uploads;
- :mod:`.stream_order`: one chain of device work per owner, whatever streams its calls name.

The modules keep their first paths as aliases (``hcache.device``, ``hcache.arrays``, ...).
"""
