"""tierckpt's face: ``ckpt.Checkpointer`` for training loops, the DCP storage plug-in (``ckpt.DcpWriter``,
``ckpt.DcpStager``, ``ckpt.DcpReader``) for ``dcp.save`` / ``dcp.async_save`` / ``dcp.load``, ``ckpt`` the CLI.

``import ckpt`` does not import torch; the first use of ``ckpt.Checkpointer``
does, so ``ckpt agent``, ``ckpt list`` and ``ckpt verify`` start fast and run
where torch is not installed.
"""

from __future__ import annotations

__all__ = ["Checkpointer", "SaveFuture", "RestoreReport", "CheckpointError", "StateMismatchError", "StateError",
           "StepNotFoundError", "JobNotFoundError", "RestoreError",
           "Settings", "DcpWriter", "DcpStager", "DcpReader", "__version__"]
__version__ = "0.1.0"

from agents.config import Settings


def __getattr__(name: str):
    if name in ("Checkpointer", "SaveFuture", "RestoreReport", "CheckpointError", "StateMismatchError"):
        from . import checkpointer

        return getattr(checkpointer, name)
    if name in ("StepNotFoundError", "JobNotFoundError", "RestoreError"):
        import recovery

        return getattr(recovery, name)
    if name in ("DcpWriter", "DcpStager", "DcpReader"):
        from . import _dcp

        return getattr(_dcp, name)
    if name == "StateError":
        from ._flatten import StateError

        return StateError
    raise AttributeError(f"module 'ckpt' has no attribute {name!r}")
