"""The host tier: ``OffloadOptimizer`` and the overlapped host step over shards kept in pinned host memory.

A ``HostShard`` per offloaded flat parameter (``_host_shard``), the worker that runs the per-shard updates
overlapped with the next forward (``_host_step``, ``_host_fused``, ``_host_tiles``, ``_host_trace``), the GPU's share
of those updates (``_gpu_assist``) and the optimizer that drives them (``_offload_optim``, its settings checked by
``_offload_settings``); and the activations chosen units save for backward, kept in pinned host memory between
forward and backward (``_activations``, ``offload_activations``). It imports only the core; a store below
host memory (the SSD tier) reaches it through the ``BackingStore`` Protocol of ``_backing``, which that store
implements and registers.
"""
