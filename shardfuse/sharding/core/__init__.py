"""The sharding core: flat shards and what runs them, with no knowledge of any tier above it.

A unit's settings (``_config``), its parameters flattened into flat shards (``_flatten``, ``_flat_param``), the
runtime of a training step (``_runtime``, ``_root``, ``_state``), gradient reduction and the collectives under it
(``_grad_reduce``, ``_collectives``, ``_hybrid``, ``_arrival``), the doorway to the kernels (``_data_path``) and
the process-wide hooks (``_process_hooks``). It imports no other sub-package of ``shardfuse.sharding``: the host
tier is seen only through the ``HostSide`` Protocol (``_host_protocol``), the SSD tier's settings are opaque
(``TierSettings``), and the checkpoint layer hands in its resume check as a callable.
"""
