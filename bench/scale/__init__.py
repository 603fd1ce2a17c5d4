"""Scale model: predicted flat vs hybrid sharding step time to 512 GPUs (``python -m bench.scale``)."""
