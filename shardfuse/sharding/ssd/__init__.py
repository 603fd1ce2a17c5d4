"""The SSD tier: flat shards (and optionally their optimizer state) kept in files between uses.

Its settings and their rules (``OffloadConfig`` in ``_ssd_config``), the files and the I/O threads
(``_ssd_store``, ``_ssd_direct``), the residency policy (``_ssd_keep``) and the pages, shards and host shards that
read the files in and write them behind (``_ssd``). A backing store for the host tier's shards: it may import the
core and the host tier (``HostShard``), and implements the host tier's ``BackingStore`` Protocol; neither of them
imports it.
"""
