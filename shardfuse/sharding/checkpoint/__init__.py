"""The checkpoint layer: everything that reads or writes a unit's parameters and optimizer state for saving.

Full and local state dicts (``_state_dict``), optimizer-state consolidation (``_optim_state``), sharded
checkpoints for ``torch.distributed.checkpoint`` (``_dcp``, ``_dcp_layout``, ``_dcp_optim``, ``_dcp_guard``,
``_dcp_load``), ``summon_full_params`` (``_summon``) and the guard against resuming on dropped optimizer state
(``_resume_guard``, handed to the core's process hooks at wrap time). It imports only the core. Nothing here is
imported by ``import shardfuse`` beyond what the wrapper needs (``torch.distributed.checkpoint`` loads on first
use).
"""
